"""Model hyper-parameters read from a Hugging Face ``config.json``.

Every field is checked where it is read: a malformed value (``null``, a string
where a number belongs, zero heads, a partial ``rope_scaling``) is a
``ValueError`` naming the file and the field, never a traceback from the
arithmetic that would use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The window checks live beside SpecGraphConfig (the runtime and the exported runner import no model code);
# they are exported here too, next to ModelArgs.window and pair_window, for the export and the vLLM drafter.
from ..config import beyond_window_warning, check_window  # noqa: F401

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
# The MLP's activation (Hugging Face's ACT2FN names for SiLU); anything else would give wrong tokens.
SUPPORTED_ACTIVATIONS = ("silu", "swish")
# Where transformers reads use_sliding_window (with max_window_layers or layer_types); Llama reads no window at all
SLIDING_SWITCHED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")
# What Hugging Face's Llama config assumes when config.json states no max_position_embeddings.
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048
# What each architecture's Hugging Face config class assumes for the fields config.json leaves out (transformers
# 5.19's configuration_{llama,mistral,qwen2,qwen3}.py; a static table: the runtime does not import transformers).
# None is computed as the class's __post_init__ (or Qwen2's attention, which has no head_dim field) does:
# num_key_value_heads = num_attention_heads, head_dim = hidden_size // num_attention_heads. A field given as null is
# null: no sliding window. The fields not here default alike for all four (rms_norm_eps 1e-6, rope_theta 10000,
# no biases or tied embeddings). eos_token_id is not here: Llama's and Mistral's classes say 2, but transformers'
# generate() does not stop at it (its generation config, built without generation_config.json, has no EOS).
_QWEN_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None,
                  "max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28}
HF_DEFAULTS = {
    "LlamaForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
                         "head_dim": None, "max_position_embeddings": DEFAULT_MAX_POSITION_EMBEDDINGS},
    "MistralForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "head_dim": None, "max_position_embeddings": 131072, "sliding_window": 4096},
    "Qwen2ForCausalLM": _QWEN_DEFAULTS,
    "Qwen3ForCausalLM": {**_QWEN_DEFAULTS, "head_dim": 128},
}
# The architecture a config.json without 'architectures' has, by its model_type (as transformers' Auto classes)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedModelError(ValueError):
    """A well-formed config.json that describes a model spec-graph does not implement (its architecture, MLP
    activation or rope type); vLLM's drafter falls back to its own on it."""


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # One entry per layer; 0 means full causal attention.
    sliding_windows: tuple[int, ...] = ()
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def window(self) -> int:
        """Positions the model was built for: ``max_position_embeddings``. Hugging Face configs state the
        window a rope scaling (llama3) reaches there, so nothing is added for ``rope_scaling``."""
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str = "config.json") -> "ModelArgs":
        archs = cfg.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        if not isinstance(archs, list):
            raise ValueError(f"{where}: field 'architectures' must be a list of class names such as "
                             f"[\"LlamaForCausalLM\"], got {archs!r}")
        model_type = cfg.get("model_type")
        if archs:
            arch = archs[0]
        elif isinstance(model_type, str) and model_type in MODEL_TYPES:
            arch = MODEL_TYPES[model_type]
        else:
            raise UnsupportedModelError(
                f"{where} names no architecture: it has no 'architectures' field and its 'model_type' is "
                f"{model_type!r}; spec-graph supports {', '.join(SUPPORTED_ARCHITECTURES)} (model_type "
                f"{', '.join(map(repr, MODEL_TYPES))})")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r} in {where}; spec-graph supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        defaults = HF_DEFAULTS[arch]
        given, cfg = cfg, {**defaults, **cfg}  # a field left out takes HF's value; null stays null
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"{where}: field 'hidden_act' is {act!r}; spec-graph's MLP computes "
                                        f"SiLU(gate) * up, so it supports "
                                        f"{' and '.join(map(repr, SUPPORTED_ACTIVATIONS))} only")
        get_int = lambda name, **kw: _int_field(cfg, name, where, **kw)  # noqa: E731
        hidden = get_int("hidden_size")
        heads = get_int("num_attention_heads")
        layers = get_int("num_hidden_layers")
        vocab = get_int("vocab_size")
        inter = get_int("intermediate_size")
        kv_heads = get_int("num_key_value_heads", default=heads)
        head_dim = get_int("head_dim", default=hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}{_left_out(given, arch, 'num_key_value_heads')}")
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"{where}: field 'head_dim' (or hidden_size / num_attention_heads) must be an even "
                             f"integer >= 2 for rotary embeddings, got {head_dim}{_left_out(given, arch, 'head_dim')}")
        window = get_int("max_position_embeddings", minimum=2)  # a prompt token and a new one at least

        theta, rope_scaling = _rope(cfg, where)

        attention_bias = _bool_field(cfg, "attention_bias", where)
        qkv_bias = attention_bias
        o_bias = attention_bias
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "MistralForCausalLM":
            qkv_bias = o_bias = False

        sliding = get_int("sliding_window", default=0, minimum=0)
        if arch == "MistralForCausalLM":
            windows = tuple(sliding for _ in range(layers))
        elif arch in SLIDING_SWITCHED and _bool_field(cfg, "use_sliding_window", where) and sliding:
            types = cfg.get("layer_types")
            if not types:
                mwl = get_int("max_window_layers", default=defaults.get("max_window_layers", layers), minimum=0)
                types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
            elif not isinstance(types, list) or len(types) != layers or not all(t in LAYER_TYPES for t in types):
                raise ValueError(f"{where}: field 'layer_types' must list one of {', '.join(LAYER_TYPES)} per layer "
                                 f"(num_hidden_layers={layers}), got {types!r}")
            windows = tuple(sliding if t == "sliding_attention" else 0 for t in types)
        else:
            windows = tuple(0 for _ in range(layers))

        eos_list = eos_token_ids(cfg.get("eos_token_id"), where)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            rms_norm_eps=_float_field(cfg, "rms_norm_eps", where, 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_bool_field(cfg, "tie_word_embeddings", where),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=_bool_field(cfg, "mlp_bias", where) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=windows,
            max_position_embeddings=window,
            eos_token_ids=tuple(eos_list),
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )


# ---------------------------------------------------------------- field readers
def _left_out(given: dict, arch: str, name: str) -> str:
    """For an error on a value config.json does not state: where it came from."""
    if name in given:
        return ""
    return f" (config.json leaves out {name!r}; Hugging Face's {arch.replace('ForCausalLM', 'Config')} assumes this)"


def eos_token_ids(eos, where: str) -> list[int]:
    """An 'eos_token_id' field (of config.json or generation_config.json): a token id, a list of them, or null."""
    eos_list = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(_json_int(e) and 0 <= e < 2**63 for e in eos_list):
        raise ValueError(f"{where}: field 'eos_token_id' must be a token id or a list of token ids, got {eos!r} "
                         f"(each id 0 <= id < 2**63)")
    return [int(e) for e in eos_list]


def _bool_field(cfg: dict, name: str, where: str, default: bool = False) -> bool:
    """cfg[name] as JSON's true or false (`default` when absent or null); a string such as "false" is refused, as
    Hugging Face's config classes refuse it (bool("false") would be True)."""
    v = cfg.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{where}: field {name!r} must be true or false (a JSON boolean), got {v!r}")
    return v


def _json_int(v) -> bool:
    """An integer as JSON writes it: 2048 or 2048.0 (a bool is not one)."""
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _int_field(cfg: dict, name: str, where: str, default: int | None = None, minimum: int = 1) -> int:
    """cfg[name] as an int >= minimum; `default` when absent or null (required when default is None)."""
    v = cfg.get(name)
    if v is None:
        if default is not None:
            return default
        if name in cfg:
            raise ValueError(f"{where}: field {name!r} is null; it must be an integer >= {minimum}")
        raise ValueError(f"{where} lacks the required field {name!r}")
    if not _json_int(v) or int(v) < minimum:
        raise ValueError(f"{where}: field {name!r} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _float_field(cfg: dict, name: str, where: str, default: float, label: str | None = None) -> float:
    """cfg[name] as a finite float > 0 (`default` when absent or null)."""
    v = cfg.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: field {label or name!r} must be a positive number, got {v!r}")
    return float(v)


def _rope(cfg: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling parameters or None) from rope_parameters / rope_scaling / rope_theta."""
    rope, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    for name, v in (("rope_parameters", rope), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"{where}: field {name!r} must be an object such as {{\"rope_type\": \"llama3\", "
                             f"\"factor\": 8.0, ...}} or null, got {v!r}")
    rope = dict(rope or {})
    theta = _float_field(rope if "rope_theta" in rope else cfg, "rope_theta", where, 10000.0,
                         "rope_parameters.rope_theta" if "rope_theta" in rope else "rope_theta")
    src = "rope_parameters"
    rope_type = rope.get("rope_type") or rope.get("type")
    if scaling:
        src = "rope_scaling"
        rope_type = scaling.get("rope_type") or scaling.get("type")
        rope = {**rope, **scaling}
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"{where}: rope type {rope_type!r} (field {src!r}) is not supported (default and "
                                    f"llama3 are)")
    missing = [k for k in LLAMA3_ROPE_FIELDS if rope.get(k) is None]
    if missing:
        raise ValueError(f"{where}: field {src!r} (llama3) lacks {', '.join(map(repr, missing))}; a llama3 rope "
                         f"scaling needs {', '.join(LLAMA3_ROPE_FIELDS)}")
    out = {k: _float_field(rope, k, where, 0.0, f"{src}.{k}") for k in LLAMA3_ROPE_FIELDS}
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"{where}: field {src!r}: high_freq_factor ({out['high_freq_factor']}) must be greater "
                         f"than low_freq_factor ({out['low_freq_factor']})")
    return theta, out


# ---------------------------------------------------------------- the context window
def pair_window(*args: ModelArgs) -> int:
    """The window a pair shares: the smallest ``max_position_embeddings`` (rope scaling extends nothing: Hugging
    Face configs state the scaled window there)."""
    return min(a.window for a in args)


def window_source(target: ModelArgs, draft: ModelArgs, target_dir=None, draft_dir=None) -> str:
    """Where the pair's window comes from, for its errors: the model whose config.json sets it."""
    def where(name, d):
        return f"the {name}'s max_position_embeddings in " + (f"{d}/config.json" if d else "its config.json")
    if target.window == draft.window:
        return "max_position_embeddings in both models' config.json"
    return where("target", target_dir) if target.window < draft.window else where("draft", draft_dir)
