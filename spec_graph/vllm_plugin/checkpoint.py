"""Where the draft's checkpoint lives, for spec-graph's loader (no vLLM import here).

vLLM takes a draft as a local directory or a Hugging Face hub id, in safetensors or
``pytorch_model.bin`` form. spec-graph's loader reads a local directory of
safetensors: a hub id is read from its snapshot in the HF cache (downloaded
there first unless ``HF_HUB_OFFLINE``), and a draft with no safetensors is left
to vLLM's own drafter.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..models import UnsupportedModelError

SNAPSHOT_FILES = ["*.json", "*.safetensors"]  # config, safetensors index and shards: what the loader reads


def draft_dir(model_config, cache_dir: str | None = None) -> str:
    """The local directory of the draft that ``model_config`` (vLLM's draft ModelConfig) names: its ``model``
    where that is a directory, else the hub snapshot of that id at its ``revision``."""
    name = str(model_config.model)
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, revision=getattr(model_config, "revision", None), cache_dir=cache_dir,
                                 allow_patterns=SNAPSHOT_FILES)
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; each is named in the message
        raise ValueError(
            f"spec-graph: the draft {name!r} is not a local directory and its Hugging Face snapshot could not be "
            f"read ({type(e).__name__}: {e}); download it first (`huggingface-cli download {name}`), pass its "
            f"local directory, or turn enable_spec_graph off") from None


def check_readable(path: str) -> None:
    """Raise UnsupportedModelError (the draft falls back to vLLM's drafter) if ``path`` has no safetensors."""
    if not any(Path(path).glob("*.safetensors")):
        raise UnsupportedModelError(f"the draft {path} has no *.safetensors weights (spec-graph reads safetensors "
                                    "only; save_pretrained(..., safe_serialization=True) writes them)")
