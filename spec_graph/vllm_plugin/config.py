"""spec-graph's settings inside vLLM's ``additional_config`` (no vLLM import here).

``additional_config["enable_spec_graph"]`` (bool) turns the plugin on;
``additional_config["spec_graph"]`` (dict) tunes it. With the flag on, unknown
keys and bad values are refused. With the flag off (or unset) the section is
ignored, whatever it holds, with one warning on logger ``spec_graph``: vLLM then
behaves exactly as without spec-graph. A flag that is not a bool is always refused.

- ``batch_buckets``: padded batch sizes that get a captured draft graph each
  (CUDA/NPU); a decode batch runs in the smallest bucket >= its size, a larger
  one runs uncaptured. Default: 1, 2, 4, ... up to ``max_num_seqs``; none may exceed it.
- ``steps_per_graph``: accepted for symmetry with ``SpecGraphConfig`` but must
  be 1. vLLM's runner calls the drafter once per step and runs the target's
  verify and the rejection sampler itself between two calls, so a draft graph
  cannot span several steps (spec-graph's own engine, which owns the verify,
  can: ``SpecGraphConfig(steps_per_graph=N)``).
"""
from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass

from ..config import checked_buckets, checked_steps_per_graph

log = logging.getLogger("spec_graph")

FLAG = "enable_spec_graph"
SECTION = "spec_graph"
KNOWN_KEYS = ("batch_buckets", "steps_per_graph")


@dataclass(frozen=True)
class PluginSettings:
    enabled: bool = False
    batch_buckets: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to max_num_seqs
    steps_per_graph: int = 1


def parse(additional_config) -> PluginSettings:
    """Validate ``additional_config``; raise ValueError naming the offending key.

    With the flag off the ``spec_graph`` section is not validated: it is ignored (one warning per distinct
    section and process), so it cannot change what vLLM does.
    """
    extra = dict(additional_config or {})
    _warn_near_misses(extra)
    flag = extra.get(FLAG, False)
    if not isinstance(flag, bool):
        quoted = isinstance(flag, str) and flag.strip().lower() in ("true", "false")
        how = (f"{{\"{FLAG}\": {flag.strip().lower()}}}, the JSON boolean unquoted" if quoted else
               f"{{\"{FLAG}\": true}} (a JSON boolean)")
        raise ValueError(f"additional_config[{FLAG!r}] must be true or false, got {flag!r}: write {how}")
    section = extra.get(SECTION)
    if section is None:
        return PluginSettings(enabled=flag)
    if not flag:
        _warn_ignored(section)
        return PluginSettings(enabled=False)
    if not isinstance(section, dict):
        raise ValueError(f"additional_config[{SECTION!r}] must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in additional_config[{SECTION!r}]; known keys: "
                         f"{list(KNOWN_KEYS)}")
    buckets = section.get("batch_buckets")
    if buckets is not None:
        buckets = checked_buckets(buckets, f"additional_config[{SECTION!r}]['batch_buckets']")
    steps = section.get("steps_per_graph")
    steps = checked_steps_per_graph(1 if steps is None else steps,
                                    f"additional_config[{SECTION!r}]['steps_per_graph']")
    if steps != 1:
        raise ValueError(
            f"additional_config[{SECTION!r}]['steps_per_graph'] must be 1 inside vLLM, got {steps}: vLLM's runner "
            f"calls the drafter once per step and runs the target verify and rejection sampling itself between "
            f"calls, so one draft graph cannot cover several steps (steps_per_graph > 1 is for spec-graph's own "
            f"engine, SpecGraphConfig)")
    return PluginSettings(enabled=flag, batch_buckets=buckets, steps_per_graph=steps)


_warned_ignored: set[str] = set()  # sections already warned about (parse runs several times per engine)
_warned_keys: set[str] = set()


def _warn_near_misses(extra: dict) -> None:
    """One warning per key of ``additional_config`` that looks like a misspelling of spec-graph's two keys (the
    dict is free-form and shared with other plugins, so nothing else about unknown keys can be said)."""
    for key in extra:
        if not isinstance(key, str) or key in (FLAG, SECTION) or key in _warned_keys:
            continue
        near = difflib.get_close_matches(key.lower(), (FLAG, SECTION), n=1, cutoff=0.85)
        if near:
            _warned_keys.add(key)
            log.warning("spec-graph: additional_config key %r is not one of spec-graph's and is ignored; did you "
                        "mean %r?", key, near[0])


def _warn_ignored(section) -> None:
    key = repr(section)
    if key in _warned_ignored:
        return
    _warned_ignored.add(key)
    log.warning("spec-graph: additional_config[%r] is ignored (%s): it takes effect only with "
                "additional_config[%r] true", SECTION, key if len(key) <= 200 else key[:197] + "...", FLAG)


def check_vllm_config(vllm_config) -> PluginSettings:
    """Config-time checks of a VllmConfig with the flag on (duck-typed: vLLM's own objects or stand-ins)."""
    settings = parse(getattr(vllm_config, "additional_config", None))
    if not settings.enabled:
        return settings
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if spec is None:
        raise ValueError(f"additional_config[{FLAG!r}] needs speculative_config method 'draft_model', and no "
                         "speculative config was given: add --speculative-config '{\"method\": \"draft_model\", "
                         "\"model\": DRAFT, \"num_speculative_tokens\": K}' (speculative_config={...} in Python), or "
                         "drop the flag")
    if method != "draft_model":
        raise ValueError(f"additional_config[{FLAG!r}] needs speculative_config method 'draft_model' "
                         f"(got {method!r}); spec-graph drafts with a separate draft model only")
    par = getattr(vllm_config, "parallel_config", None)
    for name, what in (("pipeline_parallel_size", "pipeline parallelism"), ("data_parallel_size", "data parallelism")):
        size = int(getattr(par, name, 1) or 1)
        if size > 1:
            raise ValueError(f"additional_config[{FLAG!r}] does not support {what} yet ({name}={size}): use "
                             "tensor parallelism, or turn the flag off for vLLM's own drafter")
    max_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if settings.batch_buckets and max_seqs and max(settings.batch_buckets) > max_seqs:
        above = [b for b in settings.batch_buckets if b > max_seqs]
        raise ValueError(f"additional_config[{SECTION!r}]['batch_buckets'] has {above} above max_num_seqs="
                         f"{max_seqs}: a decode batch never holds more rows, and each bucket's graph costs memory "
                         f"and capture time; drop those buckets or raise max_num_seqs")
    target_vocab = spec.target_model_config.get_vocab_size()
    draft_vocab = spec.draft_model_config.get_vocab_size()
    if target_vocab != draft_vocab:
        raise ValueError(f"additional_config[{FLAG!r}]: the draft's vocab size ({draft_vocab}) differs from the "
                         f"target's ({target_vocab}); spec-graph needs one shared vocabulary")
    return settings


_warned_windows: set[tuple] = set()


def warn_past_window(max_model_len: int, window: int, path) -> None:
    """One warning per (max_model_len, window, draft). vLLM serves such a pair with its own drafter too: it runs
    no drafter for a step whose longest sequence would pass the draft's window (its drafts there are zeros)."""
    key = (max_model_len, window, str(path))
    if key in _warned_windows:
        return
    _warned_windows.add(key)
    log.warning("spec-graph: max_model_len=%d is past the draft's window of %d positions (max_position_embeddings "
                "in %s/config.json): vLLM runs no drafter for a step whose longest sequence reaches past it (its K "
                "drafts are placeholders, verified, rejected and counted in vLLM's draft-token metrics), so such "
                "steps gain nothing from speculation (the output stays the target's); lower --max-model-len to %d "
                "or use a draft with a longer window to avoid that", max_model_len, window, path, window)


def check_covered_draft(vllm_config, args) -> None:
    """Config-time checks of a draft spec-graph drafts with (``args``: its ModelArgs, None where unread): the
    drafts are greedy, as spec-graph's are; a max_model_len past the draft's window gets one warning."""
    spec = vllm_config.speculative_config
    method = getattr(spec, "draft_sample_method", "greedy")
    if method != "greedy":
        raise ValueError(f"additional_config[{FLAG!r}]: spec-graph drafts greedily (the draft's argmax, which vLLM's "
                         f"rejection sampler takes as one-hot: sampling stays lossless), so draft_sample_method="
                         f"{method!r} cannot take effect; set draft_sample_method='greedy' (the default) or omit "
                         f"it, or turn the flag off for vLLM's own drafter")
    max_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    if args is not None and max_len is not None and max_len > args.window:
        warn_past_window(max_len, args.window, spec.draft_model_config.model)
