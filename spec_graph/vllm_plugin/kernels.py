"""Rejection counting for vLLM's padded drafter path: one launch, no host loop.

Input is vLLM's sampler output ``sampled [R, S]`` int32 (``S = max_spec_len + 1``)
whose rejected / missing entries are ``PLACEHOLDER`` (-1); rows may carry
fewer than ``S - 1`` drafts (trailing placeholders) or none (prefill rows: one
sampled token). Per row ``r``:

    valid[r] = #{j : sampled[r, j] != -1 and 0 <= sampled[r, j] < vocab}, 0 if discard[r]
    next[r]  = sampled[r, last valid j] if valid[r] > 0 else backup[r]

``discard`` marks partial-prefill rows whose sampled token is thrown away; their
next token is the backup (the request's own last known token). Both outputs
are int32, like vLLM's. Triton kernel (grid-stride over rows) beside its torch
reference; the op picks one through ``platform.use_triton``.
"""
from __future__ import annotations

import torch

from ..kernels._triton import tl, triton
from ..kernels.greedy_accept import PLACEHOLDER
from ..kernels.rng import block_for, num_programs, use_kernel

_TL_PLACEHOLDER = tl.constexpr(PLACEHOLDER)


def count_valid_ref(sampled: torch.Tensor, discard: torch.Tensor, backup: torch.Tensor, vocab_size: int):
    """Torch reference: returns (next_token_ids int32 [R], valid_count int32 [R])."""
    R, S = sampled.shape
    j = torch.arange(S, device=sampled.device)[None, :]
    ok = (sampled != PLACEHOLDER) & (sampled >= 0) & (sampled < vocab_size)
    valid = ok.sum(dim=1)
    last = torch.where(ok, j, -1).amax(dim=1)
    last_tok = sampled.gather(1, last.clamp(min=0)[:, None])[:, 0]
    nxt = torch.where(valid > 0, last_tok, backup.to(sampled.dtype))
    nxt = torch.where(discard, backup.to(sampled.dtype), nxt)
    valid = torch.where(discard, torch.zeros_like(valid), valid)
    return nxt.to(torch.int32), valid.to(torch.int32)


@triton.jit
def _count_valid_kernel(sampled_ptr, discard_ptr, backup_ptr, next_ptr, valid_ptr, R, S, stride, vocab_size,
                        BLOCK_S: tl.constexpr):
    """Rows r = pid, pid + nprog, ...: the formulas of `count_valid_ref`."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_S)
    for r32 in range(pid, R, nprog):
        r = tl.cast(r32, tl.int64)
        toks = tl.load(sampled_ptr + r * stride + offs, mask=offs < S, other=_TL_PLACEHOLDER)
        ok = (offs < S) & (toks != _TL_PLACEHOLDER) & (toks >= 0) & (toks < vocab_size)
        valid = tl.sum(ok.to(tl.int32), axis=0)
        last = tl.max(tl.where(ok, offs, -1), axis=0)
        last_tok = tl.sum(tl.where(offs == last, toks, 0), axis=0)
        backup = tl.load(backup_ptr + r)
        discard = tl.load(discard_ptr + r) != 0
        nxt = tl.where((valid > 0) & (~discard), last_tok, backup)
        tl.store(next_ptr + r, nxt.to(tl.int32))
        tl.store(valid_ptr + r, tl.where(discard, 0, valid).to(tl.int32))


def count_valid(sampled: torch.Tensor, discard: torch.Tensor, backup: torch.Tensor, vocab_size: int,
                max_programs: int = 0):
    """(next_token_ids, valid_count), both int32 [R]; the Triton kernel where the platform runs Triton."""
    R, S = sampled.shape
    if not use_kernel(_count_valid_kernel, sampled) or R == 0:
        return count_valid_ref(sampled, discard, backup, vocab_size)
    dev = sampled.device
    nxt = torch.empty(R, dtype=torch.int32, device=dev)
    valid = torch.empty(R, dtype=torch.int32, device=dev)
    sampled = sampled if sampled.stride(1) == 1 else sampled.contiguous()
    grid = (num_programs(R, max_programs, dev),)
    _count_valid_kernel[grid](sampled, discard.contiguous(), backup.to(torch.int32).contiguous(), nxt, valid,
                              R, S, sampled.stride(0), int(vocab_size), BLOCK_S=block_for(S))
    return nxt, valid
