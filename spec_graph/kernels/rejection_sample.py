"""Kernel 2: random rejection sampling with residual resampling (Leviathan et al. / Chen et al.).

All randomness comes from `hash_uniform(seed, step, row, pos, col)`, so the
kernel and its torch reference draw the very same numbers and agree exactly.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

from .contracts import check, verifier_problem
from .greedy_accept import _TL_PLACEHOLDER, PLACEHOLDER
from .rng import (_TL_REQUEST_ROW, ACCEPT_COL, REQUEST_ROW, block_for, hash_uniform, num_programs, race_sample,
                  tl_hash_uniform, tl_race_key,
                  use_kernel, wrap_triton)

MAX_BLOCK_V = 1024  # vocabulary chunk per loop iteration

_TL_ACCEPT_COL = tl.constexpr(ACCEPT_COL)


@triton.jit
def tl_draft_probs(b, k_lim, offs, draft_ptr, draft_probs_ptr, target_probs_ptr, K, K1, V):
    """Row b's drafts d (lanes offs < K) and, at each draft token, q = draft_probs[b, j, d_j] and
    p = target_probs[b, j, d_j]; ok_id marks lanes j < k_lim (0 on inactive rows) whose d_j is in [0, V).
    The twin of `draft_token_probs`."""
    d = tl.load(draft_ptr + b * K + offs, mask=offs < K, other=0)
    ok_id = (offs < k_lim) & (d >= 0) & (d < V)
    d_safe = tl.where(ok_id, d, 0)
    q = tl.load(draft_probs_ptr + (b * K + offs) * V + d_safe, mask=ok_id, other=0.0)
    p = tl.load(target_probs_ptr + (b * K1 + offs) * V + d_safe, mask=ok_id, other=0.0)
    return d, ok_id, q, p


def draft_token_probs(draft_token_ids, draft_probs, target_probs, active):
    """(ok_id, q, p) [B, K]: drafts in [0, V) on active rows, and q / p at each draft token (read at token 0
    where not ok_id: callers mask with it)."""
    K = draft_token_ids.shape[1]
    V = target_probs.shape[-1]
    ok_id = (draft_token_ids >= 0) & (draft_token_ids < V) & active[:, None]
    d_safe = torch.where(ok_id, draft_token_ids, 0)[:, :, None]
    return ok_id, draft_probs.gather(2, d_safe)[:, :, 0], target_probs[:, :K].gather(2, d_safe)[:, :, 0]


@triton.jit
def tl_residual_race(tp_row, dp_row, scale, v_lim, vd_lim, seed, step, pos, BLOCK_V: tl.constexpr):
    """Token from the race over r_v = max(scale * tp_row[v] - dp_row[v], 0) at `pos` (v < v_lim; dp_row read
    for v < vd_lim, else 0), or over tp_row where every r_v is 0: one pass over the vocabulary in BLOCK_V
    chunks. The twin of `residual_race`."""
    # typed scalars: loop-carried values must keep one type
    best_r = tl.full([], -2.0, tl.float32)
    best_t = tl.full([], -2.0, tl.float32)
    idx_r = tl.full([], 0, tl.int32)
    idx_t = tl.full([], 0, tl.int32)
    r_max = tl.full([], 0.0, tl.float32)
    for v0 in range(0, v_lim, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        vm = offs_v < v_lim
        pt = tl.load(tp_row + offs_v, mask=vm, other=0.0)
        pd = tl.load(dp_row + offs_v, mask=offs_v < vd_lim, other=0.0)
        r = tl.maximum(scale * pt - pd, 0.0)
        uv = tl_hash_uniform(seed, step, _TL_REQUEST_ROW, pos.to(tl.int64), offs_v.to(tl.int64))
        key_r = tl.where(vm, tl_race_key(r, uv), -1.0)
        key_t = tl.where(vm, tl_race_key(pt, uv), -1.0)
        # strict '>' keeps the earliest chunk on ties; argmax keeps the earliest lane
        m_r = tl.max(key_r, axis=0)
        m_t = tl.max(key_t, axis=0)
        i_r = tl.argmax(key_r, axis=0) + v0
        i_t = tl.argmax(key_t, axis=0) + v0
        idx_r = tl.where(m_r > best_r, i_r, idx_r)
        idx_t = tl.where(m_t > best_t, i_t, idx_t)
        best_r = tl.maximum(best_r, m_r)
        best_t = tl.maximum(best_t, m_t)
        r_max = tl.maximum(r_max, tl.max(r, axis=0))
    return tl.where(r_max > 0, idx_r, idx_t).to(tl.int64)


def residual_race(p_n, q_n, scale, seeds, steps, pos):
    """Torch twin of `tl_residual_race`: rows of p_n / q_n [B, V] (q_n all 0 where there is no draft row),
    scale and pos per row ([B] or scalars) -> int64 [B]."""
    resid = (scale * p_n - q_n).clamp(min=0)
    tok_resid = race_sample(resid, seeds, steps, REQUEST_ROW, pos)
    tok_target = race_sample(p_n, seeds, steps, REQUEST_ROW, pos)
    return torch.where(resid.amax(dim=1) > 0, tok_resid, tok_target)


@triton.jit
def _rejection_sample_kernel(draft_ptr, draft_probs_ptr, target_probs_ptr, seeds_ptr, steps_ptr, active_ptr,
                             sampled_ptr, num_acc_ptr, B, K, V, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr):
    """Rejection sampling for rows b = pid, pid + nprog, ... (grid-stride).

    Per active row b (u(pos, col) = hash_uniform(seeds[b], steps[b], REQUEST_ROW, pos, col)):
        j < K: d = draft[b, j], q = draft_probs[b, j, d], p = target_probs[b, j, d]
               accept iff q > 0 and u(j, ACCEPT_COL) * q <= p    (d outside [0, V): reject)
        n = first rejected j, else K;  sampled[b, j] = d_j for j < n;  num_accepted = n
        sampled[b, n] = race over r_v = max(target_probs[b, n, v] - draft_probs[b, n, v], 0) at pos n
                        if max_v r_v > 0, else race over target_probs[b, n] at pos n
                        (n == K: draft probs count as 0, so r = target_probs[b, K]: the bonus token)
        race over w at pos: argmax_v w_v / (-log u(pos, v)), first index on ties
        sampled[b, j > n] = PLACEHOLDER
    Inactive rows: sampled all PLACEHOLDER, num_accepted = 0.
    The vocabulary is walked once in BLOCK_V chunks, racing r and target together.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_K1)
    K1 = K + 1
    for b32 in range(pid, B, nprog):
        b = tl.cast(b32, tl.int64)
        is_active = tl.load(active_ptr + b) != 0
        seed = tl.load(seeds_ptr + b)
        step = tl.load(steps_ptr + b)

        # acceptance of all K drafts at once; n = first rejection
        # masks come from per-row limits (0 on inactive rows), not `block & scalar_bool`,
        # whose broadcast the Triton interpreter mis-types
        k_lim = tl.where(is_active, K, 0)
        d, ok_id, q, p = tl_draft_probs(b, k_lim, offs, draft_ptr, draft_probs_ptr, target_probs_ptr, K, K1, V)
        u = tl_hash_uniform(seed, step, _TL_REQUEST_ROW, offs.to(tl.int64), _TL_ACCEPT_COL)
        accept = ok_id & (q > 0) & (u * q <= p)
        n = tl.min(tl.where((offs < K) & (accept == 0), offs, K), axis=0)

        # resample at n: residual race and plain target race in one pass over V
        v_lim = tl.where(is_active, V, 0)
        vd_lim = tl.where(n < K, v_lim, 0)  # n == K (bonus): no draft row
        token = tl_residual_race(target_probs_ptr + (b * K1 + n) * V, draft_probs_ptr + (b * K + n) * V, 1.0,
                                 v_lim, vd_lim, seed, step, n, BLOCK_V)

        sampled = tl.where(offs < n, d, tl.where(offs == n, token, _TL_PLACEHOLDER))
        sampled = tl.where(is_active, sampled, _TL_PLACEHOLDER)
        tl.store(sampled_ptr + b * K1 + offs, sampled, mask=offs < K1)
        tl.store(num_acc_ptr + b, tl.where(is_active, n, 0).to(tl.int64))


def rejection_sample_ref(draft_token_ids, draft_probs, target_probs, seeds, steps, active):
    """Torch reference of kernel 2 -> (sampled [B, K+1], num_accepted [B])."""
    K = draft_token_ids.shape[1]
    j = torch.arange(K, device=draft_token_ids.device)[None, :]
    ok_id, q, p = draft_token_probs(draft_token_ids, draft_probs, target_probs, active)
    u = hash_uniform(seeds[:, None], steps[:, None], REQUEST_ROW, j, ACCEPT_COL)
    accept = ok_id & (q > 0) & (u * q <= p)
    n = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # first rejection, or K

    sampled = commit_at(draft_token_ids, draft_probs, target_probs, seeds, steps, active, n, 1.0)
    return sampled, torch.where(active, n, torch.zeros_like(n))


def commit_at(draft_token_ids, draft_probs, target_probs, seeds, steps, active, n, scale):
    """The tokens a step commits with `n` [B] drafts accepted (both references' last part): drafts 0..n-1, then
    the race at position n over max(scale * p[n] - q[n], 0) (q = 0 at n == K: the bonus token, from the
    target), PLACEHOLDER after it and in inactive rows. A [B, V] gather; no per-row Python branching."""
    B, K = draft_token_ids.shape
    V = target_probs.shape[-1]
    p_n = target_probs.gather(1, n[:, None, None].expand(B, 1, V))[:, 0]
    q_n = draft_probs.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, V))[:, 0]
    q_n = torch.where((n < K)[:, None], q_n, torch.zeros_like(q_n))
    token = residual_race(p_n, q_n, scale, seeds, steps, n)
    jj = torch.arange(K + 1, device=draft_token_ids.device)[None, :]
    d_pad = torch.cat((draft_token_ids, torch.full_like(draft_token_ids[:, :1], PLACEHOLDER)), dim=1)
    sampled = torch.where(jj < n[:, None], d_pad, torch.where(jj == n[:, None], token[:, None], PLACEHOLDER))
    return torch.where(active[:, None], sampled, PLACEHOLDER)


@torch.library.triton_op("spec_graph::rejection_sample", mutates_args={})
def _rejection_sample_op(
    draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, seeds: torch.Tensor,
    steps: torch.Tensor, active: torch.Tensor, max_programs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (draft_token_ids, draft_probs, target_probs, seeds, steps, active)
    check("rejection_sample", verifier_problem(*args))
    if not use_kernel(_rejection_sample_kernel, draft_token_ids):
        return rejection_sample_ref(*args)
    return launch_verifier(_rejection_sample_kernel, *args, max_programs)


def launch_verifier(kernel, draft_token_ids, draft_probs, target_probs, seeds, steps, active, max_programs: int):
    """Run a verification kernel (the token-level or the block rule: the same arguments and outputs) over a
    grid-stride 1-D grid -> (sampled [B, K+1], num_accepted [B])."""
    dev = draft_token_ids.device
    B, K = draft_token_ids.shape
    V = target_probs.shape[-1]
    sampled = torch.empty((B, K + 1), dtype=torch.int64, device=dev)
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    wrap_triton(kernel)[(num_programs(B, max_programs, dev),)](
        draft_token_ids.contiguous(), draft_probs.contiguous(), target_probs.contiguous(), seeds.contiguous(),
        steps.contiguous(), active.contiguous(), sampled, num_acc, B, K, V,
        BLOCK_K1=block_for(K + 1), BLOCK_V=min(block_for(V), MAX_BLOCK_V))
    return sampled, num_acc


def rejection_sample(draft_token_ids, draft_probs, target_probs, seeds, steps, active, max_programs: int = 0):
    """Random rejection sampling (op `spec_graph::rejection_sample`).

    draft_token_ids [B,K] int64, draft_probs [B,K,V] f32, target_probs [B,K+1,V] f32, seeds/steps [B] int64,
    active [B] bool -> (sampled int64 [B,K+1], num_accepted int64 [B]).
    """
    return torch.ops.spec_graph.rejection_sample(draft_token_ids, draft_probs, target_probs, seeds, steps, active,
                                                 max_programs)
