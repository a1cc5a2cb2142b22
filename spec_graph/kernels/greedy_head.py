"""A greedy choice folded into the vocabulary head's kernel: each row's argmax of the logits, and whether they are
all finite, without writing the logits or running a reduction kernel after the head.

    head_argmax_ref(x, w, norm_w, eps) -> int64 [..., 2]: (ids, finite) per row
        logits = rnd(rmsnorm(x) @ w.T)                 (decode_linear's head, x's dtype)
        ids = logits.float().argmax(-1),  finite = isfinite(logits).all(-1)   (0 / 1)

torch.argmax's rules hold: the first index of the maximum, and where a row holds a NaN, its first NaN.

decode_linear.py's kernel runs the head's sums as for any product; with its CHOOSE epilogue each column block
stores its part of each row's choice (_argmax_part), and the last block to arrive (counters.py) merges the parts
in block order (_argmax_merge). The op is decode_linear.decode_head_argmax: one int64 [..., 2] output, which
its wrapper splits into the ids and the finite flags.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

# a part's flags, and "no column yet" (above every column index); the kernels spell them as literals, as Triton
# reads module globals only as constexprs
NAN_SEEN, NONFINITE_SEEN = 1, 2
NO_INDEX = 2**31 - 1
MERGE_BLOCK = 256  # parts per step of the merge


def head_argmax_ref(x, w, norm_w, eps: float):
    from .decode_linear import decode_linear_ref

    logits = decode_linear_ref(x, w, None, norm_w, eps)
    return torch.stack((logits.float().argmax(-1), torch.isfinite(logits).all(-1).long()), dim=-1)


@triton.jit
def _argmax_part(v, offs_m, offs_n, mn_ok, m_ok, part_ptr, idx_ptr, flag_ptr, blk, NB):
    """Column block blk's part of each row m's choice, from v [BLOCK_M, BLOCK_N]: the block's rounded logits (fp32),
    mn_ok: the valid (row, column) pairs.

        nan[m]   = any_n isnan(v[m, n])
        best[m]  = max_n v[m, n] over the columns that are not NaN (-inf for none)
        idx[m]   = the first n with isnan(v[m, n]) if nan[m], else the first n with v[m, n] == best[m]
        flags[m] = NAN_SEEN * nan[m] + NONFINITE_SEEN * any_n !isfinite(v[m, n])
    stored at [m, blk] of part (fp32), idx and flags (int32), each [M, NB]."""
    is_nan = (v != v) & mn_ok
    bad = ((tl.abs(v) == float("inf")) | is_nan) & mn_ok
    vv = tl.where(mn_ok & ~is_nan, v, float("-inf"))
    best = tl.max(vv, axis=1)
    has_nan = tl.max(is_nan.to(tl.int32), axis=1)
    cand = tl.where((has_nan > 0)[:, None], is_nan, mn_ok & (vv == best[:, None]))
    idx = tl.min(tl.where(cand, offs_n[None, :], 2147483647), axis=1)
    flags = has_nan + 2 * tl.max(bad.to(tl.int32), axis=1)
    at = offs_m * NB + blk
    tl.store(part_ptr + at, best, mask=m_ok)
    tl.store(idx_ptr + at, idx, mask=m_ok)
    tl.store(flag_ptr + at, flags, mask=m_ok)


@triton.jit
def _argmax_merge(offs_m, m_ok, part_ptr, idx_ptr, flag_ptr, out_ptr, NB, MERGE: tl.constexpr):
    """Each row's choice from the NB parts (_argmax_part), read in block order by the last block to arrive:

        ids[m] = min over blocks j with nan[m, j] of idx[m, j]                 if any block saw a NaN
               = idx[m, j*], j* the first block with best[m, j] == max_j best[m, j]   otherwise
        fin[m] = no block's flags hold NONFINITE_SEEN
    stored as out[m] = (ids[m], fin[m]) (int64 [M, 2]). Block j's columns precede block j+1's, so these are the
    row's first NaN and first maximum."""
    nan_idx = tl.full(offs_m.shape, 2147483647, tl.int32)
    best = tl.full(offs_m.shape, float("-inf"), tl.float32)
    best_idx = tl.full(offs_m.shape, 2147483647, tl.int32)
    bad = tl.zeros(offs_m.shape, tl.int32)
    offs_j = tl.arange(0, MERGE)
    for j0 in range(0, NB, MERGE):
        jj = j0 + offs_j
        ok = m_ok[:, None] & (jj < NB)[None, :]
        at = offs_m[:, None] * NB + jj[None, :]
        b = tl.load(part_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
        i = tl.load(idx_ptr + at, mask=ok, other=2147483647, cache_modifier=".cg")
        f = tl.load(flag_ptr + at, mask=ok, other=0, cache_modifier=".cg")
        nan_idx = tl.minimum(nan_idx, tl.min(tl.where((f & 1) > 0, i, 2147483647), axis=1))
        c_best = tl.max(b, axis=1)
        c_idx = tl.min(tl.where(ok & (b == c_best[:, None]), i, 2147483647), axis=1)
        take = (c_best > best) | (best_idx == 2147483647)  # ties keep the earlier blocks' column
        best_idx = tl.where(take, c_idx, best_idx)
        best = tl.maximum(best, c_best)
        bad = tl.maximum(bad, tl.max(f & 2, axis=1))
    ids = tl.where(nan_idx != 2147483647, nan_idx, best_idx)
    tl.store(out_ptr + 2 * offs_m, ids.to(tl.int64), mask=m_ok)
    tl.store(out_ptr + 2 * offs_m + 1, (bad == 0).to(tl.int64), mask=m_ok)
