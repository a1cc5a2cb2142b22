"""spec-graph's settings inside vLLM's ``additional_config`` (no vLLM import here).

``additional_config["enable_spec_graph"]`` (bool) turns the plugin on;
``additional_config["spec_graph"]`` (dict) tunes it. Unknown keys are refused.
"""
from __future__ import annotations

from dataclasses import dataclass

FLAG = "enable_spec_graph"
SECTION = "spec_graph"
# batch_buckets: padded batch sizes that get a captured draft graph each (CUDA/NPU);
# a decode batch runs in the smallest bucket >= its size, a larger one runs uncaptured.
KNOWN_KEYS = ("batch_buckets",)


@dataclass(frozen=True)
class PluginSettings:
    enabled: bool = False
    batch_buckets: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to max_num_seqs


def parse(additional_config) -> PluginSettings:
    """Validate ``additional_config``; raise ValueError naming the offending key."""
    extra = dict(additional_config or {})
    flag = extra.get(FLAG, False)
    if not isinstance(flag, bool):
        raise ValueError(f"additional_config[{FLAG!r}] must be true or false, got {flag!r}")
    section = extra.get(SECTION)
    if section is None:
        return PluginSettings(enabled=flag)
    if not isinstance(section, dict):
        raise ValueError(f"additional_config[{SECTION!r}] must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in additional_config[{SECTION!r}]; known keys: "
                         f"{list(KNOWN_KEYS)}")
    buckets = section.get("batch_buckets")
    if buckets is not None:
        if (not isinstance(buckets, (list, tuple)) or not buckets
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets)):
            raise ValueError(f"additional_config[{SECTION!r}]['batch_buckets'] must be a non-empty list of "
                             f"positive ints, got {buckets!r}")
        buckets = tuple(sorted(set(buckets)))
    return PluginSettings(enabled=flag, batch_buckets=buckets)


def check_vllm_config(vllm_config) -> PluginSettings:
    """Config-time checks of a VllmConfig with the flag on (duck-typed: vLLM's own objects or stand-ins)."""
    settings = parse(getattr(vllm_config, "additional_config", None))
    if not settings.enabled:
        return settings
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if method != "draft_model":
        raise ValueError(f"additional_config[{FLAG!r}] needs speculative_config method 'draft_model' "
                         f"(got {method!r}); spec-graph drafts with a separate draft model only")
    target_vocab = spec.target_model_config.get_vocab_size()
    draft_vocab = spec.draft_model_config.get_vocab_size()
    if target_vocab != draft_vocab:
        raise ValueError(f"additional_config[{FLAG!r}]: the draft's vocab size ({draft_vocab}) differs from the "
                         f"target's ({target_vocab}); spec-graph needs one shared vocabulary")
    return settings
