"""Model hyper-parameters read from a Hugging Face ``config.json``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


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
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str = "config.json") -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in {where}; spec-graph supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"{where} lacks the required field {e.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")

        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type") or rope.get("type")
        if scaling:
            rope_type = scaling.get("rope_type") or scaling.get("type")
            rope = {**rope, **scaling}
        if rope_type in (None, "default"):
            rope_scaling = None
        elif rope_type == "llama3":
            rope_scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")}
        else:
            raise ValueError(f"{where}: rope type {rope_type!r} is not supported (default and llama3 are)")

        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = attention_bias
        o_bias = attention_bias
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "MistralForCausalLM":
            qkv_bias = o_bias = False

        window = cfg.get("sliding_window")
        if arch == "MistralForCausalLM":
            windows = tuple(int(window or 0) for _ in range(layers))
        elif cfg.get("use_sliding_window") and window:
            types = cfg.get("layer_types")
            if not types:
                mwl = int(cfg.get("max_window_layers", layers))
                types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
            windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
        else:
            windows = tuple(0 for _ in range(layers))

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=windows,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )
