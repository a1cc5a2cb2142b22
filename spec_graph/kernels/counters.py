"""Counters for "the last program to arrive finishes the work" (split-K in decode_linear.py).

A `sync` buffer (new_sync) holds int32 zeros. Programs that each wrote a part count themselves into one slot;
the one that brings it to n reads every part (with `.cg` loads: other multiprocessors wrote them), finishes,
and sets the slot back to 0, so each launch leaves the buffer as it found it and every launch on a stream may
share it. Nothing waits, so any grid size is safe.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

SYNC_SLOTS = 1024  # counters in a `sync` buffer: column blocks one launch splits


def new_sync(device=None) -> torch.Tensor:
    """A counter buffer for the kernels' `sync` argument: zeros, and each launch leaves it zeros."""
    return torch.zeros(SYNC_SLOTS, dtype=torch.int32, device=device)


@triton.jit
def arrive_last(sync_ptr, slot, n):
    """Count this program into sync[slot], after every thread's stores of its part; whether it is the n-th."""
    tl.debug_barrier()  # every thread's part is written before the count releases it
    return tl.atomic_add(sync_ptr + slot, 1, sem="acq_rel", scope="gpu") == n - 1


@triton.jit
def rearm(sync_ptr, slot):
    """sync[slot] back to 0 for the next launch (by the last program, once it has read the parts)."""
    tl.atomic_xchg(sync_ptr + slot, 0, sem="relaxed", scope="gpu")
