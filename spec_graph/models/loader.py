"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a Transformer."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from .config import ModelArgs
from ..kernels.counters import new_sync
from .llama import Transformer, rope_inv_freq

log = logging.getLogger("spec_graph")

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The model's concatenated projections and the checkpoint tensors they are made of, in order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_layout(model: Transformer) -> dict[str, tuple[str, list[tuple[str, tuple]]]]:
    """model tensor name -> [(checkpoint tensor name, shape), ...] it is concatenated from (dim 0)."""
    layout = {}
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj == "qkv_proj":
            sizes = model.model.layers[0].self_attn.qkv_split
        elif proj == "gate_up_proj":
            sizes = (t.shape[0] // 2,) * 2
        else:
            layout[name] = [(name, tuple(t.shape))]
            continue
        layout[name] = [(f"{parent}.{part}.{leaf}", (n, *t.shape[1:])) for part, n in zip(_FUSED[proj], sizes)]
    return layout


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the fix."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of float32, bfloat16, float16") from None


def read_config(path: str | os.PathLike) -> tuple[dict, ModelArgs]:
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {str(d)!r} does not exist or is not a directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{d} has no config.json: pass a Hugging Face checkpoint directory")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); re-save the checkpoint") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} does not hold a JSON object")
    return cfg, ModelArgs.from_hf_config(cfg, where=str(cfg_file))


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is corrupt ({e!r}); re-save the checkpoint") from None
        files = sorted({d / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors weights in {d}; spec-graph reads safetensors only "
            "(re-save with save_pretrained(..., safe_serialization=True))"
        )
    return files


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{f} is corrupt or truncated ({e}); re-download or re-save it") from None
    return state


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> Transformer:
    """Build the model for ``path`` and load its weights, checking every name and shape."""
    _, args = read_config(path)
    dtype, device = parse_dtype(dtype), torch.device(device)
    state = read_state_dict(path)
    if args.tie_word_embeddings and "lm_head.weight" in state:
        head, emb = state["lm_head.weight"], state.get("model.embed_tokens.weight")
        if emb is not None and head.shape == emb.shape and not torch.equal(head, emb):
            # as transformers (5.x) loads it: a head stored apart, with other values, is not tied to the embedding
            log.warning("spec-graph: %s: config.json ties the head to the embedding, but the checkpoint stores a "
                        "head with other values; using that head, as transformers does (set tie_word_embeddings "
                        "to false to silence this)", path)
            args = dataclasses.replace(args, tie_word_embeddings=False)
        else:
            state.pop("lm_head.weight")
    with torch.device("meta"):
        model = Transformer(args)
    layout = _checkpoint_layout(model)
    expected = {hf: shape for parts in layout.values() for hf, shape in parts}
    unexpected = [k for k in state if k not in expected and not k.endswith(_IGNORED_SUFFIXES)]
    missing = [k for k in expected if k not in state]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        raise CheckpointError(f"{path}: weights do not match config.json ({args.architecture}): " + "; ".join(parts))
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(state[name].shape)} in the checkpoint but "
                f"config.json implies {list(shape)}"
            )
    weights = {name: torch.cat([state[hf] for hf, _ in parts]).to(device=device, dtype=dtype)
               for name, parts in layout.items()}
    model.load_state_dict(weights, assign=True)
    model.inv_freq = rope_inv_freq(args).to(device)
    model.linear_sync = new_sync(device)
    model.checkpoint_dir = str(path)  # named in errors about its config
    return model.eval().requires_grad_(False)
