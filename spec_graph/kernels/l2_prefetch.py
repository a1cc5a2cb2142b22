"""Weights asked into L2 ahead of the kernel that reads them, by a kernel that leaves the memory bus idle.

A decode layer's products are short kernels whose first loads wait on DRAM; attention between them moves
little. So attention (kernels/attention.py) asks L2 for the bytes of the layer's next products while it runs
(sm90's `cp.async.bulk.prefetch.L2`: one instruction per chunk, no registers, nothing to wait for), and those
products then read from L2.

    per lane l of all lanes L = programs x LANES:
        chunk = ceil(nbytes / L) rounded up to 16 bytes
        prefetch [base + l * chunk, base + min((l + 1) * chunk, nbytes))      (nothing where that is empty)

A prefetch is a hint: it changes no value, so the kernels' references ignore it.
"""
from __future__ import annotations

import torch

from ._triton import tl, triton

ALIGN = 16  # the bulk prefetch's address and size unit (bytes)


@triton.jit
def l2_prefetch(base, nbytes, pid, nprog, LANES: tl.constexpr):
    """This program's share (lanes pid * LANES + [0, LANES) of nprog * LANES) of bytes [0, nbytes) of base."""
    lane = (pid * LANES + tl.arange(0, LANES)).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(nbytes, nprog * LANES), 16) * 16
    off = lane * chunk
    size = tl.maximum(tl.minimum(nbytes - off, chunk), 0).to(tl.int32)
    ptrs = base.to(tl.pointer_type(tl.int8)) + off
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_bytes(t: torch.Tensor | None, limit: int = -1) -> int:
    """Bytes of t a prefetch may ask for: its contiguous storage from its first element, whole 16-byte units,
    at most limit (-1: all); 0 for None, a non-contiguous tensor or one that starts off a 16-byte unit of its
    storage (whose own start torch's allocators align)."""
    if t is None or not t.is_contiguous() or (t.storage_offset() * t.element_size()) % ALIGN:
        return 0
    n = t.numel() * t.element_size()
    if limit >= 0:
        n = min(n, limit)
    return n - n % ALIGN
