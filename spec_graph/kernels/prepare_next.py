"""Counting + next-input prep + output append from an already-sampled [B, K+1] (random path).

The per-row logic is `tl_prep_append` / `prep_append_ref` from greedy_accept.py;
this file only derives `valid` from the PLACEHOLDER padding of `sampled`.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

from .contracts import check, prepare_next_problem
from .greedy_accept import _TL_PLACEHOLDER, PLACEHOLDER, prep_append_ref, tl_prep_append
from .rng import block_for, num_programs, use_kernel, wrap_triton


@triton.jit
def _prepare_next_kernel(sampled_ptr, active_ptr, tail_ptr, seq_lens_ptr, n_out_ptr, max_new_ptr, stop_ptr,
                         out_buf_ptr, num_acc_ptr, num_rej_ptr, new_tail_ptr, new_seq_lens_ptr, new_n_out_ptr,
                         done_ptr, B, K1, S, L, out_stride, BLOCK_K1: tl.constexpr, BLOCK_S: tl.constexpr):
    """Prep for rows b = pid, pid + nprog, ... (grid-stride).

    Per row b:
        valid = active ? number of leading entries of sampled[b] != PLACEHOLDER : 0
        num_accepted = max(valid - 1, 0), then `tl_prep_append` exactly as kernel 1.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_K1)
    for b32 in range(pid, B, nprog):
        b = tl.cast(b32, tl.int64)
        is_active = tl.load(active_ptr + b) != 0
        sampled = tl.load(sampled_ptr + b * K1 + offs, mask=offs < K1, other=_TL_PLACEHOLDER)
        lead = tl.min(tl.where(sampled == _TL_PLACEHOLDER, offs, K1), axis=0)
        valid = tl.where(is_active, lead, 0)
        tl_prep_append(b, is_active, sampled, offs, valid, K1, tail_ptr, seq_lens_ptr, n_out_ptr, max_new_ptr,
                       stop_ptr, S, out_buf_ptr, L, out_stride, num_acc_ptr, num_rej_ptr, new_tail_ptr,
                       new_seq_lens_ptr, new_n_out_ptr, done_ptr, BLOCK_S)


def leading_valid(sampled: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Number of leading non-PLACEHOLDER entries per row (0 on inactive rows)."""
    lead = torch.cumprod((sampled != PLACEHOLDER).to(torch.int64), dim=1).sum(dim=1)
    return torch.where(active, lead, torch.zeros_like(lead))


def prepare_next_ref(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf):
    """Torch reference of `prepare_next` (same outputs, same in-place append)."""
    return prep_append_ref(sampled, leading_valid(sampled, active), active, tail, seq_lens, n_out, max_new,
                           stop_ids, out_buf)


@torch.library.triton_op("spec_graph::prepare_next", mutates_args={"out_buf"})
def _prepare_next_op(
    sampled: torch.Tensor, active: torch.Tensor, tail: torch.Tensor, seq_lens: torch.Tensor, n_out: torch.Tensor,
    max_new: torch.Tensor, stop_ids: torch.Tensor, out_buf: torch.Tensor, max_programs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check("prepare_next", prepare_next_problem(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf))
    dev = sampled.device
    if not use_kernel(_prepare_next_kernel, sampled):
        return prepare_next_ref(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf)
    B, K1 = sampled.shape
    S = stop_ids.shape[0]
    i64 = dict(dtype=torch.int64, device=dev)
    outs = (torch.empty(B, **i64), torch.empty(B, **i64), torch.empty((B, 2), **i64), torch.empty(B, **i64),
            torch.empty(B, **i64), torch.empty(B, dtype=torch.bool, device=dev))
    grid = (num_programs(B, max_programs, dev),)
    wrap_triton(_prepare_next_kernel)[grid](
        sampled.contiguous(), active.contiguous(), tail.contiguous(), seq_lens.contiguous(), n_out.contiguous(),
        max_new.contiguous(), stop_ids.contiguous(), out_buf, *outs,
        B, K1, S, out_buf.shape[1], out_buf.stride(0),
        BLOCK_K1=block_for(K1), BLOCK_S=block_for(S))
    return outs


def prepare_next(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf, max_programs: int = 0):
    """Counting + prep + append from `sampled` [B, K+1] (op `spec_graph::prepare_next`); `out_buf` is mutated.

    Returns (num_accepted, num_rejected, new_tail [B,2], new_seq_lens, new_n_out, done).
    Requires out_buf.stride(1) == 1.
    """
    return torch.ops.spec_graph.prepare_next(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf,
                                             max_programs)
