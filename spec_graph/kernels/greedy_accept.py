"""Kernel 1: fused greedy acceptance + counting + next-input prep + output append.

Also home of the prep/append logic shared with `prepare_next` (the random
path): `tl_prep_append` in Triton and `prep_append_ref` in torch. Both take a
row's sampled tokens plus its `valid` count and produce every per-row output.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

from .contracts import check, greedy_accept_problem
from .rng import block_for, num_programs, use_kernel, wrap_triton

PLACEHOLDER = -1  # "no token" in sampled rows and in the padding of stop_ids
NO_STOP = 1 << 30  # first_stop when no stop token was sampled (any value > K+1 works)

_TL_PLACEHOLDER = tl.constexpr(PLACEHOLDER)
_TL_NO_STOP = tl.constexpr(NO_STOP)


# ------------------------------------------------------------ shared: torch
def prep_append_ref(sampled, valid, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf):
    """Counting, next inputs and the output append from `sampled` [B, K+1] and `valid` [B].

    `valid` = tokens produced this step (0 on inactive rows); entries of
    `sampled` at j >= valid are ignored. Mutates `out_buf`; returns
    (num_accepted, num_rejected, new_tail, new_seq_lens, new_n_out, done).
    Vectorised with static shapes: no host sync, no data-dependent branches.
    """
    B, K1 = sampled.shape
    L = out_buf.shape[1]
    dev = sampled.device
    j = torch.arange(K1, device=dev)[None, :]
    valid = torch.where(active, valid, torch.zeros_like(valid))
    in_valid = j < valid[:, None]

    num_accepted = (valid - 1).clamp(min=0)
    num_rejected = torch.where(active, K1 - valid, torch.zeros_like(valid))

    # new tail = last two tokens of the stream (tail0, tail1, s0, .., s_{valid-1})
    last = sampled.gather(1, (valid - 1).clamp(min=0)[:, None])[:, 0]
    prev = sampled.gather(1, (valid - 2).clamp(min=0)[:, None])[:, 0]
    new_t1 = torch.where(valid >= 1, last, tail[:, 1])
    new_t0 = torch.where(valid >= 2, prev, torch.where(valid == 1, tail[:, 1], tail[:, 0]))
    new_tail = torch.stack((new_t0, new_t1), dim=1)
    new_seq_lens = seq_lens + valid

    stop_ok = stop_ids != PLACEHOLDER
    is_stop = ((sampled[:, :, None] == stop_ids[None, None, :]) & stop_ok[None, None, :]).any(dim=2)
    first_stop = torch.where(is_stop & in_valid, j, NO_STOP).amin(dim=1)
    budget = (max_new - n_out).clamp(min=0)
    e = torch.minimum(torch.minimum(valid, budget), first_stop + 1)

    # Append: column c of row b receives sampled[b, c - n_out[b]] when that index is < e.
    # A masked full-row select instead of a scatter: no duplicate-index races, no nonzero().
    col = torch.arange(L, device=dev)[None, :]
    i = col - n_out[:, None]
    write = (i >= 0) & (i < e[:, None])
    vals = sampled.gather(1, i.clamp(0, K1 - 1))
    out_buf.copy_(torch.where(write, vals, out_buf))

    new_n_out = n_out + e
    done = active & ((first_stop < e) | (new_n_out >= max_new))
    return num_accepted, num_rejected, new_tail, new_seq_lens, new_n_out, done


# ----------------------------------------------------------- shared: triton
@triton.jit
def tl_prep_append(b, is_active, sampled, offs, valid, K1, tail_ptr, seq_lens_ptr, n_out_ptr, max_new_ptr,
                   stop_ptr, S, out_buf_ptr, L, out_stride, num_acc_ptr, num_rej_ptr, new_tail_ptr,
                   new_seq_lens_ptr, new_n_out_ptr, done_ptr, BLOCK_S: tl.constexpr):
    """Triton twin of `prep_append_ref` for one row `b` (int64).

    sampled: [BLOCK_K1] int64 block (lanes >= K1 ignored), offs = arange(BLOCK_K1),
    valid: scalar, already 0 for inactive rows.
        num_accepted = max(valid - 1, 0); num_rejected = active ? K1 - valid : 0
        new_tail = last two of (tail0, tail1, sampled[:valid]); new_seq_lens = seq_lens + valid
        first_stop = first j < valid with sampled[j] in stop_ids (PLACEHOLDER entries ignored)
        e = min(valid, max(max_new - n_out, 0), first_stop + 1)
        out_buf[b, n_out + i] = sampled[i] for i < e (0 <= n_out + i < L); new_n_out = n_out + e
        done = active and (first_stop < e or new_n_out >= max_new)
    """
    t0 = tl.load(tail_ptr + 2 * b)
    t1 = tl.load(tail_ptr + 2 * b + 1)
    last = tl.sum(tl.where(offs == valid - 1, sampled, 0), axis=0)
    prev = tl.sum(tl.where(offs == valid - 2, sampled, 0), axis=0)
    new_t1 = tl.where(valid >= 1, last, t1)
    new_t0 = tl.where(valid >= 2, prev, tl.where(valid == 1, t1, t0))
    tl.store(new_tail_ptr + 2 * b, new_t0)
    tl.store(new_tail_ptr + 2 * b + 1, new_t1)
    tl.store(new_seq_lens_ptr + b, tl.load(seq_lens_ptr + b) + valid)
    tl.store(num_acc_ptr + b, tl.maximum(valid - 1, 0).to(tl.int64))
    tl.store(num_rej_ptr + b, tl.where(is_active, K1 - valid, 0).to(tl.int64))

    offs_s = tl.arange(0, BLOCK_S)
    stop = tl.load(stop_ptr + offs_s, mask=offs_s < S, other=_TL_PLACEHOLDER)
    hit = (sampled[:, None] == stop[None, :]) & (stop[None, :] != _TL_PLACEHOLDER)
    is_stop = tl.max(hit.to(tl.int32), axis=1) > 0
    first_stop = tl.min(tl.where(is_stop & (offs < valid), offs, _TL_NO_STOP), axis=0)

    n_out = tl.load(n_out_ptr + b)
    max_new = tl.load(max_new_ptr + b)
    budget = tl.maximum(max_new - n_out, 0)
    e = tl.minimum(tl.minimum(budget, valid), first_stop + 1)
    dst = n_out + offs
    tl.store(out_buf_ptr + b * out_stride + dst, sampled, mask=(offs < e) & (dst >= 0) & (dst < L))
    new_n_out = n_out + e
    tl.store(new_n_out_ptr + b, new_n_out)
    tl.store(done_ptr + b, is_active & ((first_stop < e) | (new_n_out >= max_new)))


# ---------------------------------------------------------------- kernel 1
@triton.jit
def _greedy_accept_prepare_kernel(draft_ptr, target_ptr, active_ptr, tail_ptr, seq_lens_ptr, n_out_ptr,
                                  max_new_ptr, stop_ptr, out_buf_ptr, sampled_ptr, num_acc_ptr, num_rej_ptr,
                                  new_tail_ptr, new_seq_lens_ptr, new_n_out_ptr, done_ptr, B, K, S, L,
                                  out_stride, BLOCK_K1: tl.constexpr, BLOCK_S: tl.constexpr):
    """Greedy acceptance for rows b = pid, pid + nprog, ... (grid-stride).

    Per active row b:
        n = first j < K with draft[b, j] != target_argmax[b, j], else K   (num_accepted)
        valid = n + 1; sampled[b, j] = target_argmax[b, j] if j <= n else PLACEHOLDER
        then `tl_prep_append` (tail, lengths, stop/budget cut, out_buf append, done).
    Inactive rows: sampled all PLACEHOLDER, valid = 0 (state passes through, out_buf untouched).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_K1)
    K1 = K + 1
    for b32 in range(pid, B, nprog):
        b = tl.cast(b32, tl.int64)
        is_active = tl.load(active_ptr + b) != 0
        draft = tl.load(draft_ptr + b * K + offs, mask=offs < K, other=_TL_PLACEHOLDER)
        target = tl.load(target_ptr + b * K1 + offs, mask=offs < K1, other=_TL_PLACEHOLDER)
        mismatch = (offs < K) & (draft != target)
        n = tl.min(tl.where(mismatch, offs, K), axis=0)
        valid = tl.where(is_active, n + 1, 0)
        sampled = tl.where(offs < valid, target, _TL_PLACEHOLDER)
        tl.store(sampled_ptr + b * K1 + offs, sampled, mask=offs < K1)
        tl_prep_append(b, is_active, sampled, offs, valid, K1, tail_ptr, seq_lens_ptr, n_out_ptr, max_new_ptr,
                       stop_ptr, S, out_buf_ptr, L, out_stride, num_acc_ptr, num_rej_ptr, new_tail_ptr,
                       new_seq_lens_ptr, new_n_out_ptr, done_ptr, BLOCK_S)


def greedy_accept_prepare_ref(draft_token_ids, target_argmax, active, tail, seq_lens, n_out, max_new, stop_ids,
                              out_buf):
    """Torch reference of kernel 1 (same outputs, same in-place append)."""
    B, K = draft_token_ids.shape
    j = torch.arange(K + 1, device=draft_token_ids.device)[None, :]
    match = (draft_token_ids == target_argmax[:, :K]).to(torch.int64)
    n = torch.cumprod(match, dim=1).sum(dim=1)  # length of the matching prefix
    valid = torch.where(active, n + 1, torch.zeros_like(n))
    sampled = torch.where(j < valid[:, None], target_argmax, PLACEHOLDER)
    outs = prep_append_ref(sampled, valid, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf)
    return (sampled, *outs)


def _new_outputs(B: int, K1: int, dev: torch.device):
    i64 = dict(dtype=torch.int64, device=dev)
    return (torch.empty((B, K1), **i64), torch.empty(B, **i64), torch.empty(B, **i64), torch.empty((B, 2), **i64),
            torch.empty(B, **i64), torch.empty(B, **i64), torch.empty(B, dtype=torch.bool, device=dev))


@torch.library.triton_op("spec_graph::greedy_accept_prepare", mutates_args={"out_buf"})
def _greedy_accept_prepare_op(
    draft_token_ids: torch.Tensor, target_argmax: torch.Tensor, active: torch.Tensor, tail: torch.Tensor,
    seq_lens: torch.Tensor, n_out: torch.Tensor, max_new: torch.Tensor, stop_ids: torch.Tensor,
    out_buf: torch.Tensor, max_programs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check("greedy_accept_prepare", greedy_accept_problem(draft_token_ids, target_argmax, active, tail, seq_lens,
                                                         n_out, max_new, stop_ids, out_buf))
    dev = draft_token_ids.device
    if not use_kernel(_greedy_accept_prepare_kernel, draft_token_ids):
        return greedy_accept_prepare_ref(draft_token_ids, target_argmax, active, tail, seq_lens, n_out, max_new,
                                         stop_ids, out_buf)
    B, K = draft_token_ids.shape
    S = stop_ids.shape[0]
    outs = _new_outputs(B, K + 1, dev)
    grid = (num_programs(B, max_programs, dev),)
    wrap_triton(_greedy_accept_prepare_kernel)[grid](
        draft_token_ids.contiguous(), target_argmax.contiguous(), active.contiguous(), tail.contiguous(),
        seq_lens.contiguous(), n_out.contiguous(), max_new.contiguous(), stop_ids.contiguous(), out_buf, *outs,
        B, K, S, out_buf.shape[1], out_buf.stride(0),
        BLOCK_K1=block_for(K + 1), BLOCK_S=block_for(S))
    return outs


def greedy_accept_prepare(draft_token_ids, target_argmax, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf,
                          max_programs: int = 0):
    """Greedy acceptance + prep + append (op `spec_graph::greedy_accept_prepare`); `out_buf` is mutated.

    Returns (sampled [B,K+1], num_accepted, num_rejected, new_tail [B,2], new_seq_lens, new_n_out, done).
    Requires out_buf.stride(1) == 1.
    """
    return torch.ops.spec_graph.greedy_accept_prepare(draft_token_ids, target_argmax, active, tail, seq_lens, n_out,
                                                      max_new, stop_ids, out_buf, max_programs)
