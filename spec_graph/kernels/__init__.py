"""Triton kernels of the speculative step, each beside its plain-torch reference.

The ops (`torch.ops.spec_graph.*`) run the Triton kernel where
`platform.use_triton(device)` says so and the reference otherwise; both are
visible to torch.compile and torch.export.
"""
import functools
import hashlib
import importlib
import pkgutil
from pathlib import Path

from .attention import decode_attention, decode_attention_ref
from .block_verify import block_verify, block_verify_ref
from .greedy_accept import PLACEHOLDER, greedy_accept_prepare, greedy_accept_prepare_ref
from .prefill_attention import prefill_attention
from .prepare_next import prepare_next, prepare_next_ref
from .rejection_sample import rejection_sample, rejection_sample_ref
from .rng import ACCEPT_COL, DRAFT_POS_BASE, REQUEST_ROW, hash_uniform, race_sample


# Inductor options for the engine's step and the vLLM drafter's chain (passed as the backend's "inductor"
# option; the backend alone keeps inductor's defaults). By default inductor copies each kernel input that is
# not yet a buffer into a buffer of its own, at every launch: a step's positions and RoPE tables, computed once
# per forward, were computed again before every layer's kernels (about two extra kernels per layer). Flexible
# layouts make such an input one buffer that all its kernels read. The launchers read strides from the traced
# tensors, so this holds only where inductor lays the buffer out with those strides: row-major, unpadded
# (padding is off), and not re-homed into a later torch.cat's output (a cat of a kernel input would get the
# cat's row stride). tests/test_step_lowering.py checks every kernel input of these graphs.
INDUCTOR_CONFIGS = {"triton_kernel_default_layout_constraint": "flexible_layout", "comprehensive_padding": False}


_PLAIN = (bool, int, float, str, tuple, list, dict, type(None))


def _kernel_modules() -> list:
    return [importlib.import_module(f"{__name__}.{info.name}")
            for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name)]


@functools.lru_cache(maxsize=None)
def _sources_digest() -> bytes:
    """The kernel modules' sources, read once: the code this process runs."""
    h = hashlib.sha256()
    for module in _kernel_modules():
        h.update(module.__name__.encode() + Path(module.__file__).read_bytes())
    return h.digest()


def launch_key() -> str:
    """Digest of what the ops decide in Python when a graph is traced: every kernel module's source and the
    current values of its upper-case settings (tiles, row limits, LAUNCH overrides). The compiled graph bakes
    those decisions into its kernel launches, but inductor's caches key a custom op's Triton kernels by their
    source alone, so a changed launch rule (or a setting changed at run time) would be served the launches
    compiled before it. PassManager.uuid() holds this key."""
    h = hashlib.sha256(_sources_digest())
    for module in _kernel_modules():
        for key in sorted(k for k in vars(module) if k.isupper()):
            value = vars(module)[key]
            if isinstance(value, _PLAIN):
                h.update(f"|{module.__name__}.{key}={value!r}".encode())
    return h.hexdigest()


__all__ = [
    "INDUCTOR_CONFIGS",
    "launch_key",
    "ACCEPT_COL",
    "block_verify",
    "block_verify_ref",
    "DRAFT_POS_BASE",
    "PLACEHOLDER",
    "REQUEST_ROW",
    "decode_attention",
    "decode_attention_ref",
    "greedy_accept_prepare",
    "greedy_accept_prepare_ref",
    "hash_uniform",
    "prefill_attention",
    "prepare_next",
    "prepare_next_ref",
    "race_sample",
    "rejection_sample",
    "rejection_sample_ref",
]
