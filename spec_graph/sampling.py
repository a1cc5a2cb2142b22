"""Greedy / temperature / top-k / top-p, as pure tensor functions.

Randomness never comes from an RNG op: seeds and step counters are inputs and
the counter-based hash in ``kernels.rng`` turns them into uniforms, so the
same code runs eagerly, compiled and inside captured graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import is_int, is_real

# Block length of the two-level cumsum below. Inductor lowers a cumsum over a long row with few rows
# (a 32000-token vocab at small batch) to a split scan, whose Triton codegen fails on torch 2.11 CUDA;
# rows of SCAN_BLOCK stay below its split threshold (8192), and the block totals stay short.
SCAN_BLOCK = 1024
# The largest temperature the per-row float32 state can hold (beyond it every distribution is uniform anyway).
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        # Checked before any arithmetic: a bool, a string, None, inf or nan is a ValueError naming the
        # parameter, not a TypeError / OverflowError from deep inside torch. Stored as Python floats.
        t, p, k = self.temperature, self.top_p, self.top_k
        if not is_real(t) or not 0.0 <= float(t) <= FLOAT32_MAX:
            raise ValueError(f"temperature must be a finite number in [0, {FLOAT32_MAX:.1e}] (0 = greedy), got {t!r}")
        if not is_real(p) or not 0.0 < float(p) <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if not is_int(k) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _rows(t: torch.Tensor, ndim: int) -> torch.Tensor:
    # per-row [B] parameter -> [B, 1, ..., 1] to broadcast against [B, ..., V]
    return t.view(t.shape[0], *([1] * (ndim - 1)))


def cumsum_last(x: torch.Tensor) -> torch.Tensor:
    """``torch.cumsum(x, -1)`` as a scan within blocks of SCAN_BLOCK plus a scan over block totals."""
    V = x.shape[-1]
    if V <= SCAN_BLOCK:
        return torch.cumsum(x, dim=-1)
    nb = -(-V // SCAN_BLOCK)
    blocks = F.pad(x, (0, nb * SCAN_BLOCK - V)).view(*x.shape[:-1], nb, SCAN_BLOCK)
    inner = torch.cumsum(blocks, dim=-1)
    offset = torch.cumsum(inner[..., -1], dim=-1) - inner[..., -1]  # mass of the blocks before each block
    return (inner + offset.unsqueeze(-1)).view(*x.shape[:-1], nb * SCAN_BLOCK)[..., :V]


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """float32 probabilities from logits ``[B, ..., V]`` with per-row ``[B]`` temperature, top-k, top-p.

    top_k == 0 and top_p == 1 disable their filters. Draft and target go
    through this same function, so both distributions are filtered alike.
    """
    x = logits.float() / _rows(temperature.float(), logits.dim())
    V = x.shape[-1]
    srt, idx = torch.sort(x, dim=-1, descending=True)
    k = _rows(top_k, logits.dim()).clamp(min=0)
    k = torch.where(k == 0, torch.full_like(k, V), k.clamp(max=V))
    rank = torch.arange(V, device=x.device)
    keep = rank < k
    p_sorted = torch.softmax(srt.masked_fill(~keep, float("-inf")), dim=-1)
    before = cumsum_last(p_sorted) - p_sorted  # mass strictly before each token
    keep = keep & ((before < _rows(top_p.float(), logits.dim())) | (rank == 0))
    keep_orig = torch.zeros_like(keep).scatter(-1, idx, keep)
    return torch.softmax(x.masked_fill(~keep_orig, float("-inf")), dim=-1)
