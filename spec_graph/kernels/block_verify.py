"""Kernel 3: block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025).

Lossless like token-by-token rejection sampling (`rejection_sample.py`), and never accepts fewer drafts in
expectation: the drafts are judged as one block, so a late draft whose target probability makes up for an
early shortfall keeps the whole prefix. Same inputs, outputs and counter-based uniforms as kernel 2: the
acceptance uniform of draft position j is u(j, ACCEPT_COL), the correction or bonus race runs at pos tau.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

from .contracts import check, verifier_problem
from .greedy_accept import _TL_PLACEHOLDER
from .rejection_sample import commit_at, draft_token_probs, launch_verifier, tl_draft_probs, tl_residual_race
from .rng import _TL_REQUEST_ROW, ACCEPT_COL, REQUEST_ROW, hash_uniform, tl_hash_uniform, use_kernel

_TL_ACCEPT_COL = tl.constexpr(ACCEPT_COL)


@triton.jit
def _block_verify_kernel(draft_ptr, draft_probs_ptr, target_probs_ptr, seeds_ptr, steps_ptr, active_ptr,
                         sampled_ptr, num_acc_ptr, B, K, V, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr):
    """Block verification for rows b = pid, pid + nprog, ... (grid-stride).

    Per active row b, with draft d_j (j < K), p = target_probs[b], q = draft_probs[b], u as in kernel 2:
        r_j = p[j, d_j] / q[j, d_j]  (0 where q is 0 or d_j is outside [0, V))
        w_0 = 1;  w_i = min(w_{i-1} * r_{i-1}, 1)                                   i = 1..K
        s_i = sum_v max(w_i * p[i, v] - q[i, v], 0);  h_i = s_i / (s_i + 1 - w_i)   i = 1..K-1 (1 if 0 / 0)
        h_K = w_K
        tau = the largest i with u(i - 1, ACCEPT_COL) <= h_i, else 0;  num_accepted = tau
        sampled[b, j] = d_j for j < tau;  sampled[b, tau] = the race at pos tau over
            max(w_tau * p[tau] - q[tau], 0) when tau < K and that is not all 0, else over p[tau]
            (tau == K: the bonus token from p[K]);  sampled[b, j > tau] = PLACEHOLDER
    Inactive rows: sampled all PLACEHOLDER, num_accepted = 0.
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
        k_lim = tl.where(is_active, K, 0)
        d, ok_id, q, p = tl_draft_probs(b, k_lim, offs, draft_ptr, draft_probs_ptr, target_probs_ptr, K, K1, V)
        ratio = tl.where(ok_id & (q > 0), tl.math.div_rn(p, tl.where(q > 0, q, 1.0)), 0.0)  # IEEE, as torch
        u = tl_hash_uniform(seed, step, _TL_REQUEST_ROW, offs.to(tl.int64), _TL_ACCEPT_COL)

        # walk i = 1..K: w_i, h_i, and tau = the last accepted i (w_tau kept for the residual)
        w = tl.full([], 1.0, tl.float32)
        tau = tl.full([], 0, tl.int32)
        w_tau = tl.full([], 1.0, tl.float32)
        for i in range(1, k_lim + 1):
            w = tl.minimum(w * tl.sum(tl.where(offs == i - 1, ratio, 0.0), axis=0), 1.0)
            h = w
            if i < K:
                s = tl.full([], 0.0, tl.float32)
                for v0 in range(0, V, BLOCK_V):
                    offs_v = v0 + tl.arange(0, BLOCK_V)
                    vm = offs_v < V
                    pt = tl.load(target_probs_ptr + (b * K1 + i) * V + offs_v, mask=vm, other=0.0)
                    pd = tl.load(draft_probs_ptr + (b * K + i) * V + offs_v, mask=vm, other=0.0)
                    s += tl.sum(tl.maximum(w * pt - pd, 0.0), axis=0)
                den = s + (1.0 - w)
                h = tl.where(den > 0, tl.math.div_rn(s, tl.where(den > 0, den, 1.0)), 1.0)
            u_i = tl.sum(tl.where(offs == i - 1, u, 0.0), axis=0)
            hit = u_i <= h
            tau = tl.where(hit, i, tau)
            w_tau = tl.where(hit, w, w_tau)

        v_lim = tl.where(is_active, V, 0)
        vd_lim = tl.where(tau < K, v_lim, 0)  # tau == K (bonus): no draft row
        token = tl_residual_race(target_probs_ptr + (b * K1 + tau) * V, draft_probs_ptr + (b * K + tau) * V,
                                 w_tau, v_lim, vd_lim, seed, step, tau, BLOCK_V)
        sampled = tl.where(offs < tau, d, tl.where(offs == tau, token, _TL_PLACEHOLDER))
        sampled = tl.where(is_active, sampled, _TL_PLACEHOLDER)
        tl.store(sampled_ptr + b * K1 + offs, sampled, mask=offs < K1)
        tl.store(num_acc_ptr + b, tl.where(is_active, tau, 0).to(tl.int64))


def block_weights(draft_token_ids, draft_probs, target_probs, active):
    """(w [B, K+1], h [B, K]) of the kernel docstring, in torch (float32, h_i at index i - 1)."""
    B, K = draft_token_ids.shape
    ok_id, q, p = draft_token_probs(draft_token_ids, draft_probs, target_probs, active)
    ratio = torch.where(ok_id & (q > 0), p / torch.where(q > 0, q, torch.ones_like(q)), torch.zeros_like(q))
    w = [torch.ones(B, dtype=torch.float32, device=ratio.device)]
    for j in range(K):
        w.append(torch.minimum(w[-1] * ratio[:, j], torch.ones_like(w[-1])))
    w = torch.stack(w, dim=1)
    s = (w[:, 1:K, None] * target_probs[:, 1:K] - draft_probs[:, 1:K]).clamp(min=0).sum(-1)
    den = s + (1.0 - w[:, 1:K])
    h_mid = torch.where(den > 0, s / torch.where(den > 0, den, torch.ones_like(den)), torch.ones_like(den))
    return w, torch.cat((h_mid, w[:, K:]), dim=1)


def block_verify_ref(draft_token_ids, draft_probs, target_probs, seeds, steps, active):
    """Torch reference of kernel 3 -> (sampled [B, K+1], num_accepted [B]).

    Sums over the vocabulary may round differently from the kernel's, so the two can disagree where a
    uniform lies within rounding of h_i; tests allow exactly that."""
    K = draft_token_ids.shape[1]
    dev = draft_token_ids.device
    w, h = block_weights(draft_token_ids, draft_probs, target_probs, active)
    j = torch.arange(K, device=dev)[None, :]
    u = hash_uniform(seeds[:, None], steps[:, None], REQUEST_ROW, j, ACCEPT_COL)
    tau = torch.where(u <= h, j + 1, 0).amax(dim=1)
    tau = torch.where(active, tau, torch.zeros_like(tau))
    scale = w.gather(1, tau[:, None])
    return commit_at(draft_token_ids, draft_probs, target_probs, seeds, steps, active, tau, scale), tau


@torch.library.triton_op("spec_graph::block_verify", mutates_args={})
def _block_verify_op(
    draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, seeds: torch.Tensor,
    steps: torch.Tensor, active: torch.Tensor, max_programs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (draft_token_ids, draft_probs, target_probs, seeds, steps, active)
    check("block_verify", verifier_problem(*args))
    if not use_kernel(_block_verify_kernel, draft_token_ids):
        return block_verify_ref(*args)
    return launch_verifier(_block_verify_kernel, *args, max_programs)


def block_verify(draft_token_ids, draft_probs, target_probs, seeds, steps, active, max_programs: int = 0):
    """Block verification (op `spec_graph::block_verify`); the signature and outputs of `rejection_sample`."""
    return torch.ops.spec_graph.block_verify(draft_token_ids, draft_probs, target_probs, seeds, steps, active,
                                             max_programs)
