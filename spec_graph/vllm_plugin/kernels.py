"""Rejection counting for vLLM's padded drafter path: one launch, no host loop, backup tokens on the device.

Input is vLLM's sampler output ``sampled [R, S]`` int32 (``S = max_spec_len + 1``)
whose rejected / missing entries are ``PLACEHOLDER`` (-1); rows may carry
fewer than ``S - 1`` drafts (trailing placeholders) or none (prefill rows: one
sampled token). ``table`` holds each cache slot's last known token (the
request's token at ``num_tokens_no_spec - 1``, vLLM's "backup" token) and row
``r`` owns slot ``slots[r]``. Per row ``r``, with ``backup[r] = table[slots[r]]``:

    valid[r] = #{j : sampled[r, j] != -1 and 0 <= sampled[r, j] < vocab}, 0 if discard[r]
    next[r]  = sampled[r, last valid j] if valid[r] > 0 else backup[r]
    table[slots[r]] = next[r]          (in place: the next step's backup)

``discard`` marks partial-prefill rows whose sampled token is thrown away; their
next token is the backup. Outputs are int32, like vLLM's. Triton kernel
(grid-stride over rows) beside its torch reference; the op picks one through
``platform.use_triton``.
"""
from __future__ import annotations

import torch

from ..kernels._triton import tl, triton
from ..kernels.greedy_accept import PLACEHOLDER
from ..kernels.rng import block_for, num_programs, use_kernel

_TL_PLACEHOLDER = tl.constexpr(PLACEHOLDER)


def count_valid_ref(sampled: torch.Tensor, discard: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
                    vocab_size: int):
    """Torch reference: returns (next_token_ids int32 [R], valid_count int32 [R]) and updates ``table``."""
    R, S = sampled.shape
    ok = (sampled >= 0) & (sampled < vocab_size)  # PLACEHOLDER is negative
    valid = ok.sum(dim=1).masked_fill_(discard, 0)
    last = (ok * torch.arange(1, S + 1, device=sampled.device)).argmax(dim=1, keepdim=True)  # 0 if none valid
    nxt = torch.where(valid > 0, sampled.gather(1, last)[:, 0], table[slots].to(sampled.dtype)).to(torch.int32)
    table[slots] = nxt
    return nxt, valid.to(torch.int32)


@triton.jit
def _count_valid_kernel(sampled_ptr, discard_ptr, table_ptr, slots_ptr, next_ptr, valid_ptr, R, S, stride,
                        vocab_size, BLOCK_S: tl.constexpr):
    """Rows r = pid, pid + nprog, ...: the formulas of `count_valid_ref` (each row reads and writes only its slot)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_S)
    for r32 in range(pid, R, nprog):
        r = tl.cast(r32, tl.int64)
        toks = tl.load(sampled_ptr + r * stride + offs, mask=offs < S, other=_TL_PLACEHOLDER)
        ok = (offs < S) & (toks != _TL_PLACEHOLDER) & (toks >= 0) & (toks < vocab_size)
        discard = tl.load(discard_ptr + r) != 0
        valid = tl.where(discard, 0, tl.sum(ok.to(tl.int32), axis=0))
        last = tl.max(tl.where(ok, offs, -1), axis=0)
        last_tok = tl.sum(tl.where(offs == last, toks, 0), axis=0)
        slot = tl.load(slots_ptr + r)
        backup = tl.load(table_ptr + slot)
        nxt = tl.where(valid > 0, last_tok, backup).to(tl.int32)
        tl.store(table_ptr + slot, nxt)
        tl.store(next_ptr + r, nxt)
        tl.store(valid_ptr + r, valid.to(tl.int32))


def count_valid(sampled: torch.Tensor, discard: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
                vocab_size: int, max_programs: int = 0):
    """(next_token_ids, valid_count), both int32 [R], and ``table[slots] = next``; the Triton kernel where the
    platform runs Triton. ``table`` is int32 and contiguous; ``slots`` int64 [R], distinct."""
    if table.dtype != torch.int32 or not table.is_contiguous():
        raise ValueError(f"the backup-token table must be a contiguous int32 tensor, got {table.dtype}")
    R, S = sampled.shape
    if not use_kernel(_count_valid_kernel, sampled) or R == 0:
        return count_valid_ref(sampled, discard, table, slots, vocab_size)
    dev = sampled.device
    nxt = torch.empty(R, dtype=torch.int32, device=dev)
    valid = torch.empty(R, dtype=torch.int32, device=dev)
    sampled = sampled if sampled.stride(1) == 1 else sampled.contiguous()
    grid = (num_programs(R, max_programs, dev),)
    _count_valid_kernel[grid](sampled, discard.contiguous(), table, slots.contiguous(), nxt, valid,
                              R, S, sampled.stride(0), int(vocab_size), BLOCK_S=block_for(S))
    return nxt, valid
