"""What the sampling-side ops and the decode linears take (the attention ops check theirs in
``attention.attention_shapes``): each op refuses other inputs with one ValueError naming the argument, and the
fusion passes rewrite a graph into an op only where its inputs meet the same contract (else they leave it be).

Shape and dtype checks only: they read no values, so they cost a captured or compiled step nothing.
"""
from __future__ import annotations

import torch

I64 = torch.int64


def _is(t, dtype, shape) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == dtype and tuple(t.shape) == tuple(shape)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _got(t) -> str:
    return f"{_name(t.dtype)} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _first_wrong(specs) -> str | None:
    """The first of ``(name, tensor, dtype, shape)`` that is not a tensor of that dtype and shape, described."""
    for name, t, dtype, shape in specs:
        if not _is(t, dtype, shape):
            want = str(list(shape)).replace("'", "")
            return f"{name} must be {_name(dtype)} {want}; got {_got(t)}"
    return None


def _devices(*ts) -> str | None:
    devs = {t.device for t in ts if isinstance(t, torch.Tensor)}
    return None if len(devs) <= 1 else f"every input must be on one device; got {sorted(map(str, devs))}"


def _drafts_problem(d) -> str | None:
    if not isinstance(d, torch.Tensor) or d.dim() != 2 or d.dtype != I64 or d.shape[1] < 1:
        return f"draft_token_ids must be int64 [B, K] with K >= 1; got {_got(d)}"
    return None


def state_problem(active, tail, seq_lens, n_out, max_new, stop_ids, out_buf, B) -> str | None:
    """The per-row state both prep ops take, for a batch of B rows."""
    if not isinstance(stop_ids, torch.Tensor) or stop_ids.dim() != 1 or stop_ids.dtype != I64:
        return f"stop_ids must be int64 [S]; got {_got(stop_ids)}"
    if not isinstance(out_buf, torch.Tensor) or out_buf.dim() != 2 or out_buf.dtype != I64 \
            or out_buf.shape[0] != B:
        return f"out_buf must be int64 [{B}, L] (a row per batch row); got {_got(out_buf)}"
    if out_buf.shape[1] > 1 and out_buf.stride(1) != 1:
        return "out_buf rows must be contiguous (stride(1) == 1)"
    return _first_wrong((("active", active, torch.bool, (B,)), ("tail", tail, I64, (B, 2)),
                         ("seq_lens", seq_lens, I64, (B,)), ("n_out", n_out, I64, (B,)),
                         ("max_new", max_new, I64, (B,))))


def greedy_accept_problem(draft_token_ids, target_argmax, active, tail, seq_lens, n_out, max_new, stop_ids,
                          out_buf) -> str | None:
    """spec_graph::greedy_accept_prepare: draft_token_ids int64 [B, K] (K >= 1), target_argmax int64 [B, K+1], then
    the state (``state_problem``)."""
    d = draft_token_ids
    if (wrong := _drafts_problem(d)) is not None:
        return wrong
    B, K = d.shape
    return (_first_wrong((("target_argmax", target_argmax, I64, (B, K + 1)),))
            or state_problem(active, tail, seq_lens, n_out, max_new, stop_ids, out_buf, B)
            or _devices(d, target_argmax, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf))


def prepare_next_problem(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf) -> str | None:
    """spec_graph::prepare_next: sampled int64 [B, K+1] (K+1 >= 1), then the state."""
    if not isinstance(sampled, torch.Tensor) or sampled.dim() != 2 or sampled.dtype != I64 or sampled.shape[1] < 1:
        return f"sampled must be int64 [B, K+1]; got {_got(sampled)}"
    return (state_problem(active, tail, seq_lens, n_out, max_new, stop_ids, out_buf, sampled.shape[0])
            or _devices(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf))


def verifier_problem(draft_token_ids, draft_probs, target_probs, seeds, steps, active) -> str | None:
    """spec_graph::rejection_sample and spec_graph::block_verify: draft_token_ids int64 [B, K] (K >= 1), draft_probs
    float32 [B, K, V], target_probs float32 [B, K+1, V], seeds and steps int64 [B], active bool [B]."""
    d, q = draft_token_ids, draft_probs
    if (wrong := _drafts_problem(d)) is not None:
        return wrong
    B, K = d.shape
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] < 1:
        return f"draft_probs must be float32 [{B}, {K}, V]; got {_got(q)}"
    V = q.shape[2]
    return (_first_wrong((("draft_probs", q, torch.float32, (B, K, V)),
                          ("target_probs", target_probs, torch.float32, (B, K + 1, V)),
                          ("seeds", seeds, I64, (B,)), ("steps", steps, I64, (B,)),
                          ("active", active, torch.bool, (B,))))
            or _devices(d, q, target_probs, seeds, steps, active))


def check(op: str, problem: str | None) -> None:
    if problem is not None:
        raise ValueError(f"spec_graph::{op}: {problem}")


def linear_problem(x, w, b=None, norm_w=None, residual=None, even_out: bool = False) -> str | None:
    """The fused decode linears: x [..., K] floating, w [N, K] of x's dtype (N even where the op splits it in two),
    b [N] and norm_w [K] where given, residual of the output's shape [..., N] where given. (Eager forwards call
    these ops per layer: the checks stay a few attribute reads.)"""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        return f"x must be a floating tensor [..., K]; got {_got(x)}"
    K = x.shape[-1]
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != x.dtype or w.shape[1] != K:
        return f"w must be {_name(x.dtype)} [N, {K}] (x's dtype and width); got {_got(w)}"
    N = w.shape[0]
    if even_out and N % 2:
        return f"w must have an even number of rows (gate and up halves); got {N}"
    for name, t, n in (("b", b, N), ("norm_w", norm_w, K)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 1
                                  and t.shape[0] == n):
            return f"{name} must be None or floating [{n}]; got {_got(t)}"
    r = residual
    if r is not None and not (isinstance(r, torch.Tensor) and r.is_floating_point() and r.dim() == x.dim()
                              and r.shape[-1] == N and r.shape[:-1] == x.shape[:-1]):
        return f"residual must be None or floating {[*x.shape[:-1], N]}; got {_got(r)}"
    return _devices(x, w, b, norm_w, residual)
