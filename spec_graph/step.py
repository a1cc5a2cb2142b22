"""THE speculative step, as one pure tensor function with static shapes and no host sync.

Committed length ``c`` per row; ``tail = (x[c-2], x[c-1])`` and the last
committed token has been fed to neither model yet.

1. draft catch-up: feed ``tail`` at positions ``[c-2, c-1]`` (two slots keep the
   shape static whether or not the last step accepted every draft), then K-1
   single-token draft forwards -> ``draft_token_ids [B, K]``;
2. target verify: ``[x[c-1], d1..dK]`` at ``c-1 .. c+K-1`` -> logits ``[B, K+1, V]``;
3. rejection: greedy (accept while draft == target argmax) or Leviathan/Chen;
4. next-input preparation, counting and the output append, on the device.

Row ``b`` is cache slot ``b``. Rows with ``active == False`` (batch padding,
finished requests) change no state but their own scratch cache entries.
"""
from __future__ import annotations

import torch

from . import kernels
from .kernels import (DRAFT_POS_BASE, PLACEHOLDER, REQUEST_ROW, greedy_accept_prepare, greedy_accept_prepare_ref,
                      prepare_next, prepare_next_ref, race_sample)
from .sampling import logits_to_probs

# Module-level so that tests can swap in deliberately broken samplers.
rejection_sample = kernels.rejection_sample
block_verify = kernels.block_verify

STATE_FIELDS = ("tail", "seq_lens", "n_out", "max_new", "active", "error", "seeds", "steps",
                "temperature", "top_k", "top_p")


def speculative_step(draft, target, draft_kv, target_kv, state: dict, out_buf: torch.Tensor,
                     acc_log: torch.Tensor, stop_ids: torch.Tensor, K: int, greedy: bool,
                     fused: bool = True, verification: str = "token", kv_len: int | None = None) -> dict:
    """One speculative step over ``B = state["tail"].shape[0]`` rows.

    ``state`` holds ``[B]``-leading tensors (see ``STATE_FIELDS``); the new
    values come back in a dict. ``out_buf [B, L]`` (generated tokens) and
    ``acc_log [B, L]`` (accepted drafts per step) and the KV caches are
    updated in place. ``fused=False`` writes acceptance, counting and input
    preparation in their plain-torch reference formulation, which the
    ``spec_graph`` backend's fusion passes turn back into the fused ops.
    ``verification`` ("token" or "block") picks the sampling rule. ``kv_len``: every live row's positions
    stay below it (an eager step's span): attention that covers the cache reads that much of it alone.
    """
    tail, c, active = state["tail"], state["seq_lens"], state["active"]
    seeds, steps = state["seeds"], state["steps"]
    B = tail.shape[0]
    dev = tail.device
    rows = torch.arange(B, device=dev)
    last_pos = draft_kv[0].shape[3] - 1
    sample = lambda lg: logits_to_probs(lg, state["temperature"], state["top_k"], state["top_p"])  # noqa: E731

    # 1. draft: 2-token catch-up, then K-1 single-token forwards
    pos = torch.stack((c - 2, c - 1), dim=1).clamp(0, last_pos)
    # Non-finite draft logits do not end a request: the target decides. Greedy: a draft from NaN logits is an
    # ordinary token id that the target accepts only where it equals its own argmax. Sampling: such a draft
    # is proposed with q = one-hot(d) (d ~ q holds trivially), so the rejection rule accepts it with
    # probability p(d) and otherwise resamples from p without d: still exactly the target's distribution.
    # Greedy forwards return (argmax, finite) alone (choose=True): the fused head folds them into its kernel.
    span = {} if kv_len is None else {"kv_len": kv_len}
    head = {"choose": True} if greedy else {}

    def draft_last(tokens, positions):
        out = draft(tokens, positions, *draft_kv, **span, **head)
        return out[0][:, -1] if greedy else out[:, -1]  # greedy: the argmax; else the logits

    logits = draft_last(tail, pos)
    drafts, draft_probs = [], []
    for j in range(K):
        if j > 0:
            logits = draft_last(drafts[-1][:, None], (c - 1 + j).clamp(0, last_pos)[:, None])
        if greedy:
            d = logits
        else:
            q = sample(logits)
            d = race_sample(q, seeds, steps, REQUEST_ROW, DRAFT_POS_BASE + j)
            one_hot = torch.zeros_like(q).scatter(-1, d[:, None], 1.0)
            draft_probs.append(torch.where(torch.isfinite(logits).all(-1, keepdim=True), q, one_hot))
        drafts.append(d)
    draft_ids = torch.stack(drafts, dim=1)  # [B, K]

    # 2. target verify over K+1 positions
    vtok = torch.cat((tail[:, 1:], draft_ids), dim=1)
    vpos = (c[:, None] - 1 + torch.arange(K + 1, device=dev)[None]).clamp(0, last_pos)
    tlogits = target(vtok, vpos, *target_kv, **span, **head)  # [B, K+1, V]; greedy: (argmax, finite) [B, K+1]
    finite = tlogits[1] if greedy else torch.isfinite(tlogits).all(-1)  # [B, K+1]
    # The target's logits decide, at the positions whose tokens the row commits: a non-finite position after a
    # rejected draft (the draft's token drove the target there) is one a decode of the committed tokens never
    # reaches. Every row runs the rule; one that would commit a token from a non-finite position fails and
    # commits the tokens of the finite positions before it, as a decode of them would (whatever K is).
    n_out = state["n_out"]
    leading = finite.long().cumprod(1).sum(1)

    # 3 + 4. rejection, counting, next inputs, output append
    args = (active, tail, c, n_out, state["max_new"], stop_ids, out_buf)
    if greedy:
        accept = greedy_accept_prepare if fused else greedy_accept_prepare_ref
        _, num_acc, _, new_tail, new_c, new_n, done = accept(draft_ids, tlogits[0], *args)
    else:
        probs = sample(tlogits)  # a non-finite position's: uniform, so that the rule's arithmetic stays finite
        probs = torch.where(finite[..., None], probs, torch.full_like(probs, 1.0 / probs.shape[-1]))
        verify = block_verify if verification == "block" else rejection_sample
        sampled, _ = verify(draft_ids, torch.stack(draft_probs, 1), probs, seeds, steps, active)
        prep = prepare_next if fused else prepare_next_ref
        num_acc, _, new_tail, new_c, new_n, done = prep(sampled, *args)
    failed = active & (leading < new_n - n_out)  # (an appended token past n_out is never read)
    ok = active & ~failed
    # A failing row ends: its tail and length stay; it keeps its first `leading` tokens, all accepted drafts
    # (each committed token comes from its own position, and a correction or bonus only from the last).
    stepped = ok | (failed & (leading > 0))
    num_acc = torch.where(failed, leading, num_acc)
    new_tail = torch.where(failed[:, None], tail, new_tail)
    new_c, new_n = torch.where(failed, c, new_c), torch.where(failed, n_out + leading, new_n)

    col = (steps - 1).clamp(0, acc_log.shape[1] - 1)
    acc_log.index_put_((rows, col), torch.where(stepped, num_acc, acc_log[rows, col]))
    return {
        "tail": new_tail,
        "seq_lens": new_c,
        "n_out": new_n,
        "active": ok & ~done,
        "error": state["error"] | failed,
        "steps": steps + stepped.long(),
        "accepted": torch.where(stepped, num_acc, PLACEHOLDER),  # drafts accepted; PLACEHOLDER: no step taken
    }
