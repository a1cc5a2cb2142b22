"""Fused linear layers for decode and verify forwards (few rows): RMSNorm in the prologue, RoPE, SiLU*up or
the residual add in the epilogue. One kernel replaces a norm, a matmul and a pointwise kernel of the layer.

    decode_linear(x, w, b=None, norm_w=None, eps=0.0, residual=None, sync=None)  -> [..., N]
        y = residual + rmsnorm(x) @ w.T + b           (each part optional)
    decode_gate_up(x, w, b=None, norm_w=None, eps=0.0, sync=None)                 -> [..., I], w: [2I, H]
        g, u = split(rmsnorm(x) @ w.T + b);  y = silu(g) * u
    decode_qkv_rope(x, w, b, norm_w, eps, cos, sin, rope_heads, head_dim, sync=None) -> [..., N]
        y = rmsnorm(x) @ w.T + b, then rotate-half RoPE on the first rope_heads heads of head_dim columns

- x: [..., H] with M = prod(leading dims) rows (M <= MAX_ROWS); w: [N, H] row-major (nn.Linear's);
  cos, sin: [..., D] broadcast per row as models/llama.py builds them.
- sync (each op's last argument, None for none; the ops take every argument, as some torch versions drop a
  trailing default before indexing the mutated ones): an int32 buffer of split-K counters (counters.new_sync),
  zeros between launches. With it a narrow product splits its K over several programs; without it each column
  block is one program. Every launch on a stream may share one buffer.
- Rounding follows the modules they replace in x's dtype: the norm rounds x * rstd, then norm_w * h; the
  matmul accumulates in fp32 and rounds once (bias added before); SiLU*up, RoPE and the residual add are
  computed in fp32 from the rounded matmul output and rounded once (as inductor fuses them).

The `*_ref` functions are the plain-torch math, which the CPU path runs. linear_launch.py picks each launch's
tiles, cores and split from the static shapes.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true
from ._triton import tl, triton

from .. import platform
from .contracts import check, linear_problem
from .counters import arrive_last, rearm
from .greedy_head import MERGE_BLOCK, _argmax_merge, _argmax_part, head_argmax_ref
from . import linear_launch as launch
from .linear_epilogue import _finish, _rnd, _split_sum
from .rng import block_for, use_kernel, wrap_triton

MAX_ROWS = 16  # rows (batch x positions) up to which the fused kernels run; above, cuBLAS matmuls do better
# epilogue modes (the kernel spells them as literals: Triton reads globals as constexprs only)
PLAIN, SILU_MUL, ROPE = 0, 1, 2


# ------------------------------------------------------------------ torch references
def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as models/llama.py's module computes it (it calls this): fp32 statistics, x's dtype out."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _normed(x, norm_w, eps):
    return x if norm_w is None else rms_norm_ref(x, norm_w, eps)


def decode_linear_ref(x, w, b=None, norm_w=None, eps: float = 0.0, residual=None):
    y = F.linear(_normed(x, norm_w, eps), w, b)
    return y if residual is None else residual + y


def decode_gate_up_ref(x, w, b=None, norm_w=None, eps: float = 0.0):
    gate, up = F.linear(_normed(x, norm_w, eps), w, b).chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_ref(x, cos, sin):
    """Rotate-half RoPE: x [..., H, D], cos/sin [..., 1, D] (models/llama.py's apply_rope)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def decode_qkv_rope_ref(x, w, b, norm_w, eps: float, cos, sin, rope_heads: int, head_dim: int):
    y = F.linear(_normed(x, norm_w, eps), w, b)
    lead = y.shape[:-1]
    heads = y.view(*lead, -1, head_dim)
    roped = rope_ref(heads[..., :rope_heads, :], cos.unsqueeze(-2), sin.unsqueeze(-2))
    return torch.cat((roped, heads[..., rope_heads:, :]), dim=-2).view(*lead, -1)


# ------------------------------------------------------------------ Triton kernel
@triton.jit
def _dot_t(x, w, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """x [BM, BK] @ w[BN, BK].T in fp32 (IEEE: no TF32 for fp32; UPCAST: fp32 operands for the interpreter)."""
    if UPCAST:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    elif IEEE:
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w))


@triton.jit
def _pair_rows(offs_n, N, MODE: tl.constexpr, HALF: tl.constexpr):
    """Weight rows (ra, rb) of output columns n, and d (the RoPE pair index; unused elsewhere)."""
    if MODE == 2:  # ROPE
        d = offs_n % HALF
        ra = (offs_n // HALF) * (2 * HALF) + d
        return ra, ra + HALF, d
    else:
        return offs_n, offs_n + N, offs_n


@triton.jit
def _row_rstd(x_ptr, offs_m, m_ok, sxm, K, eps, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """rsqrt(mean_k x[m, k]^2 + eps) per row m, in fp32 (UNROLL: K steps whose loads go out together)."""
    eps = tl.cast(eps, tl.float32)  # inductor passes Python floats as fp64
    offs_k = tl.arange(0, BLOCK_K)
    ss2 = tl.zeros([offs_m.shape[0], BLOCK_K], tl.float32)  # per-thread partial sums: one reduction at the end
    for k0 in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):  # independent loads, issued before their sums wait on them
            kk = k0 + u * BLOCK_K + offs_k
            xk = tl.load(x_ptr + offs_m[:, None] * sxm + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :],
                         other=0.0).to(tl.float32)
            ss2 += xk * xk
    ss = tl.sum(ss2, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _x_tile(x_ptr, nw_ptr, offs_m, m_ok, kk, k_ok, sxm, rstd, HAS_NORM: tl.constexpr, UPCAST: tl.constexpr):
    """x[m, kk] in x's dtype, RMS-normed as RMSNorm rounds it when HAS_NORM (_normed_tile)."""
    xk = tl.load(x_ptr + offs_m[:, None] * sxm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    return _normed_tile(xk, nw_ptr, kk, k_ok, rstd, HAS_NORM, UPCAST)


@triton.jit
def _normed_tile(xk, nw_ptr, kk, k_ok, rstd, HAS_NORM: tl.constexpr, UPCAST: tl.constexpr):
    """x's tile xk (columns kk) as RMSNorm rounds it (x * rstd, then weight * h) when HAS_NORM; else xk."""
    if HAS_NORM:
        dt = xk.dtype
        h = _rnd(xk.to(tl.float32) * rstd[:, None], dt, UPCAST)
        nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0)
        xk = _rnd(nw.to(tl.float32)[None, :] * h, dt, UPCAST).to(dt)
    return xk


@triton.jit
def _one_step_sums(wa_ptr, wb_ptr, x_ptr, nw_ptr, offs_m, m_ok, n_ok, offs_k, sxm, M, K, eps, MODE: tl.constexpr,
                   HAS_NORM: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 sums [BLOCK_M, BLOCK_N] over all of K (<= BLOCK_K) on CUDA cores in one step: the weight tiles and x
    load together, and the norm's statistics come from the same x tile, so that a program waits on memory once
    (a loop waits once per K step, and the norm's own pass over x once more before the weights go out)."""
    k_ok = offs_k < K
    w_ok = n_ok[:, None] & k_ok[None, :]
    wa = tl.load(wa_ptr + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32)
    wb = wa
    if MODE != 0:  # paired: a second row block
        wb = tl.load(wb_ptr + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        acc_a, acc_b = _one_row_sums(wa, wb, x_ptr, nw_ptr, offs_k, k_ok, m_ok, K, eps, MODE, HAS_NORM, UPCAST)
    else:  # a row at a time, each x row in the weight tile's layout (a 3-D product would not fit the registers)
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for m in tl.static_range(BLOCK_M):
            if m < M:  # the padding rows of the block skip their reductions
                ra_m, rb_m = _one_row_sums(wa, wb, x_ptr + m * sxm, nw_ptr, offs_k, k_ok, True, K, eps, MODE,
                                           HAS_NORM, UPCAST)
                mine = (offs_m == m)[:, None]
                acc_a = tl.where(mine, ra_m, acc_a)
                acc_b = tl.where(mine, rb_m, acc_b)
    return acc_a, acc_b


@triton.jit
def _one_row_sums(wa, wb, x_ptr, nw_ptr, offs_k, k_ok, row_ok, K, eps, MODE: tl.constexpr, HAS_NORM: tl.constexpr,
                  UPCAST: tl.constexpr):
    """[1, BLOCK_N] sums of one x row (at x_ptr; zeros unless row_ok) with the fp32 weight tiles wa, wb (wb's
    only when paired), the row RMS-normed from its own statistics when HAS_NORM."""
    xk = tl.load(x_ptr + offs_k[None, :], mask=row_ok & k_ok[None, :], other=0.0)
    if HAS_NORM:
        xs = xk.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xs * xs, axis=1) / K + tl.cast(eps, tl.float32))
    else:
        rstd = tl.zeros([1], tl.float32)
    xf = _normed_tile(xk, nw_ptr, offs_k, k_ok, rstd, HAS_NORM, UPCAST).to(tl.float32)  # broadcast over the rows
    acc_a = tl.sum(xf * wa, axis=1)[None, :]
    acc_b = acc_a  # unpaired: unused
    if MODE != 0:
        acc_b = tl.sum(xf * wb, axis=1)[None, :]
    return acc_a, acc_b


@triton.jit
def _decode_linear_kernel(
        x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, cos_ptr, sin_ptr, out_ptr,
        M, N, K, eps, ROPE_COLS, sxm, swn, srm, scm, som,
        kc_ptr, vc_ptr, pos_ptr, slots_ptr, T, QC, k_off, v_off, sks, skh, skl, svs, svh, svl, spb, spt, LC,
        ws_ptr, sync_ptr, K_SPLIT, ids_ptr, ai_ptr,
        MODE: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
        HAS_RES: tl.constexpr, WRITE_KV: tl.constexpr, HAS_SLOTS: tl.constexpr, DOT: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_UNROLL: tl.constexpr,
        ONE_STEP: tl.constexpr,
        CHOOSE: tl.constexpr, MERGE: tl.constexpr):
    """Columns n of program pid: n = (pid // SPLIT_K) * BLOCK_N + [0, BLOCK_N) < N; every row m < M (one row
    block); the sums over k in [s * K_SPLIT, (s + 1) * K_SPLIT) for s = pid % SPLIT_K.

        xn[m]   = x[m]                                             (no norm)
                = rnd(nw * rnd(x[m] * rsqrt(mean_k x[m,k]^2 + eps)))  (norm; rnd: to x's dtype)
        a[m, n] = rnd(xn[m] . w[ra(n)] + b[ra(n)]),  c[m, n] = same with row rb(n)     (fp32 sums)
    PLAIN:    ra = n;                       out[m, n] = rnd(r[m, n] + a)  (or rnd(a) with no residual)
    SILU_MUL: ra = n, rb = n + N;           out[m, n] = rnd(silu(a) * c)
    ROPE:     ra = h*2*HALF + d, rb = ra + HALF for n = h*HALF + d;  where ra < ROPE_COLS:
              out[m, ra] = rnd(a cos[m, d] - c sin[m, d]), out[m, rb] = rnd(c cos[m, d+HALF] + a sin[m, d+HALF]);
              other heads: out[m, ra] = a, out[m, rb] = c
    WRITE_KV (ROPE): row m = b * T + t; columns n < QC go to out [M, QC]; the k columns (QC .. ROPE_COLS) to
              k_cache[layer, slot_b, head, positions[b, t], :] and the v columns to v_cache likewise
              (k_off / v_off: the layer's offset; slot_b = slots[b], or b without slots); a position outside
              [0, LC) writes nothing (the caches of other rows stay intact)
    SPLIT_K > 1 (split-K: more programs than column blocks, so that a narrow product still keeps every SM
    reading): each program stores its fp32 partial sums to ws[s, m, n] (c's at n + N), then counts itself in
    sync[column block]; the last of the SPLIT_K to arrive adds the partials in the order s = 0, 1, ... (the
    same sums whichever arrives last), resets the count to 0 for the next launch and runs the epilogue.
    DOT: the sums on tensor cores (tl.dot; every block dim >= 16); else on CUDA cores, each thread keeping
    partial products over K until one reduction at the end (few rows: the weight tile is read once and
    multiplied by every row, and small BLOCK_N gives enough programs to keep every SM reading). ONE_STEP (CUDA
    cores, K <= BLOCK_K, no split): no loop; every load of the program goes out at once (see _one_step_sums).
    CHOOSE (PLAIN, unsplit, no bias or residual): no out; ids[m] = (argmax_n rnd(a[m, n]), all finite) [M, 2],
    by greedy_head.py's parts (ws [M, NB] fp32, ai [2, M, NB] int32) and their merge in sync[0]'s last program.
    """
    pid = tl.program_id(0)
    pid_n = pid // SPLIT_K
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    ra, rb, d = _pair_rows(offs_n, N, MODE, HALF)
    wa_ptr = w_ptr + ra.to(tl.int64)[:, None] * swn  # 64-bit: a vocabulary head can pass 2^31 elements
    wb_ptr = w_ptr + rb.to(tl.int64)[:, None] * swn
    if ONE_STEP:
        acc_a, acc_b = _one_step_sums(wa_ptr, wb_ptr, x_ptr, nw_ptr, offs_m, m_ok, n_ok, offs_k, sxm, M, K, eps,
                                      MODE, HAS_NORM, UPCAST, BLOCK_M, BLOCK_N)
    else:
        if HAS_NORM:
            rstd = _row_rstd(x_ptr, offs_m, m_ok, sxm, K, eps, NORM_BLOCK, NORM_UNROLL)
        else:
            rstd = tl.zeros([BLOCK_M], tl.float32)

        if DOT:
            acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        elif BLOCK_M == 1:  # one row: a 2-D [BLOCK_N, BLOCK_K] accumulator in the weight tile's own (loaded) layout
            acc2_a = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            acc2_b = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        else:
            acc3_a = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            acc3_b = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        k_lo = (pid % SPLIT_K) * K_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            xk = _x_tile(x_ptr, nw_ptr, offs_m, m_ok, kk, k_ok, sxm, rstd, HAS_NORM, UPCAST)
            wa = tl.load(wa_ptr + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT:
                acc_a += _dot_t(xk, wa, IEEE, UPCAST)
            elif BLOCK_M == 1:
                xf = xk.to(tl.float32)  # [1, BLOCK_K], broadcast over the BLOCK_N weight rows
                acc2_a += xf * wa.to(tl.float32)
            else:
                xf = xk.to(tl.float32)[:, None, :]
                acc3_a += xf * wa.to(tl.float32)[None, :, :]
            if MODE != 0:  # paired: a second row block
                wb = tl.load(wb_ptr + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if DOT:
                    acc_b += _dot_t(xk, wb, IEEE, UPCAST)
                elif BLOCK_M == 1:
                    acc2_b += xf * wb.to(tl.float32)
                else:
                    acc3_b += xf * wb.to(tl.float32)[None, :, :]
        if not DOT:
            if BLOCK_M == 1:
                acc_a = tl.sum(acc2_a, axis=1)[None, :]
                acc_b = tl.sum(acc2_b, axis=1)[None, :]
            else:
                acc_a = tl.sum(acc3_a, axis=2)
                acc_b = tl.sum(acc3_b, axis=2)
    if CHOOSE:
        nb = tl.cdiv(N, BLOCK_N)
        v = _rnd(acc_a, x_ptr.dtype.element_ty, UPCAST)  # the logits as the head would store them
        _argmax_part(v, offs_m, offs_n, m_ok[:, None] & n_ok[None, :], m_ok, ws_ptr, ai_ptr, ai_ptr + M * nb,
                     pid_n, nb)
        if arrive_last(sync_ptr, 0, nb):
            _argmax_merge(offs_m, m_ok, ws_ptr, ai_ptr, ai_ptr + M * nb, ids_ptr, nb, MERGE)
            rearm(sync_ptr, 0)
    else:
        last = True
        if SPLIT_K > 1:
            acc_a, acc_b, last = _split_sum(acc_a, acc_b, ws_ptr, sync_ptr, pid_n, pid % SPLIT_K, offs_m, offs_n,
                                            m_ok[:, None] & n_ok[None, :], M, N, MODE, SPLIT_K)
        if last:
            _finish(acc_a, acc_b, offs_m, offs_n, ra, rb, d, m_ok, n_ok, b_ptr, r_ptr, cos_ptr, sin_ptr, out_ptr,
                    ROPE_COLS, srm, scm, som, kc_ptr, vc_ptr, pos_ptr, slots_ptr, T, QC, k_off, v_off, sks, skh, skl,
                    svs, svh, svl, spb, spt, LC, MODE, HALF, HAS_BIAS, HAS_RES, WRITE_KV, HAS_SLOTS, UPCAST, BLOCK_M)


# ------------------------------------------------------------------ launch
def fused_rows_ok(x: torch.Tensor) -> bool:
    """Whether x's rows fit the fused kernels' one row block. With a symbolic row count (torch.compile's shared
    graph for every batch bucket above 1, an export's dynamic batch) only where its range proves it: asking
    would put a guard on the batch, and buckets on either side of MAX_ROWS would each need a compile."""
    return bool(statically_known_true(x.numel() // max(x.shape[-1], 1) <= MAX_ROWS))


def _launch(mode, x, w, b, norm_w, eps, residual, cos, sin, rope_cols, half, n_out, n_prog, kv=None, sync=None,
            choose=False):
    """kv: (k_cache, v_cache, layer, slots, positions, q_cols) to write k and v into the caches (ROPE only);
    out then holds the q columns alone. sync: split-K's counters (counters.new_sync), or None (or an empty buffer,
    as the wrappers pass None) for no split. choose (PLAIN; sync required): (ids, finite) of each row's logits
    in place of them (the kernel's CHOOSE)."""
    if sync is not None and sync.numel() == 0:
        sync = None
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if not fused_rows_ok(x2):
        raise ValueError(f"the fused decode kernels take at most {MAX_ROWS} rows (got {M}); use F.linear")
    w = w if w.stride(-1) == 1 else w.contiguous()
    b = b.contiguous() if b is not None else None  # the kernel reads them with unit stride
    norm_w = norm_w.contiguous() if norm_w is not None else None
    out = torch.empty((M, 1 if choose else n_out if kv is None else kv[5]), dtype=x.dtype, device=x.device)
    r2 = residual.reshape(M, -1) if residual is not None else out
    if residual is not None and r2.stride(-1) != 1:
        r2 = r2.contiguous()
    c2 = cos.reshape(M, -1).contiguous() if cos is not None else out
    s2 = sin.reshape(M, -1).contiguous() if sin is not None else out
    rows = M if isinstance(M, int) else MAX_ROWS  # a symbolic M (<= MAX_ROWS) gets the tile of the most rows
    sms = platform.multiprocessors(x.device) if sync is not None else 0
    dot, block_n, block_k, warps, stages, split = launch.launch_config(rows, n_prog, K, mode != PLAIN,
                                                                       x.element_size(), sms, rope=mode == ROPE)
    blocks = triton.cdiv(n_prog, block_n)
    if sync is None or blocks > sync.numel() or choose:
        split = 1
    k_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, k_split)  # no program without K tiles
    grid = (blocks * split,)
    if choose:  # each column block's part of the choice (greedy_head.py), then the ids and finite flags
        ws = torch.empty((M, blocks), dtype=torch.float32, device=x.device)
        ai = torch.empty((2, M, blocks), dtype=torch.int32, device=x.device)
        ids = torch.empty((M, 2), dtype=torch.int64, device=x.device)
    else:
        ws = torch.empty((split, M, 2 * n_prog) if split > 1 else (1,), dtype=torch.float32, device=x.device)
        ai, ids = ws, ws
    if kv is None:
        kv_args = (out, out, out, out, 1, n_out, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        slots = None
    else:
        kc, vc, layer, slots, pos, q_cols = kv
        sk, sv = kc.stride(), vc.stride()
        kv_args = (kc, vc, pos, slots if slots is not None else pos, x.shape[-2], q_cols, layer * sk[0],
                   layer * sv[0], sk[1], sk[2], sk[3], sv[1], sv[2], sv[3], pos.stride(0), pos.stride(1),
                   kc.shape[3])
    wrap_triton(_decode_linear_kernel)[grid](
        x2, w, b if b is not None else w, norm_w if norm_w is not None else w, r2, c2, s2, out,
        M, n_prog, K, float(eps), rope_cols, x2.stride(0), w.stride(0), r2.stride(0), c2.stride(0), out.stride(0),
        *kv_args, ws, sync if split > 1 or choose else ws, k_split, ids, ai,
        MODE=mode, HALF=half, HAS_BIAS=b is not None, HAS_NORM=norm_w is not None, HAS_RES=residual is not None,
        WRITE_KV=kv is not None, HAS_SLOTS=slots is not None, DOT=dot, IEEE=x.dtype == torch.float32,
        UPCAST=x.device.type == "cpu",
        BLOCK_M=max(16, block_for(rows)) if dot else block_for(rows), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages, SPLIT_K=split,
        NORM_BLOCK=block_for(min(launch.NORM_BLOCK_K, K)) if launch.NORM_BLOCK_K > 0 else block_k,
        NORM_UNROLL=max(1, launch.NORM_UNROLL),
        ONE_STEP=launch.one_step(dot, split, K, block_k), CHOOSE=choose, MERGE=MERGE_BLOCK)
    if choose:
        return ids.view(*x.shape[:-1], 2)
    return out.view(*x.shape[:-1], out.shape[-1])


@torch.library.triton_op("spec_graph::decode_linear", mutates_args=("sync",))
def _decode_linear_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], norm_w: Optional[torch.Tensor],
                      eps: float, residual: Optional[torch.Tensor], sync: Optional[torch.Tensor]) -> torch.Tensor:
    check("decode_linear", linear_problem(x, w, b, norm_w, residual))
    if not use_kernel(_decode_linear_kernel, x):
        return decode_linear_ref(x, w, b, norm_w, eps, residual)
    N = w.shape[0]
    return _launch(PLAIN, x, w, b, norm_w, eps, residual, None, None, 0, 1, N, N, sync=sync)


@torch.library.triton_op("spec_graph::decode_gate_up", mutates_args=("sync",))
def _decode_gate_up_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], norm_w: Optional[torch.Tensor],
                       eps: float, sync: Optional[torch.Tensor]) -> torch.Tensor:
    check("decode_gate_up", linear_problem(x, w, b, norm_w, even_out=True))
    if not use_kernel(_decode_linear_kernel, x):
        return decode_gate_up_ref(x, w, b, norm_w, eps)
    inter = w.shape[0] // 2
    return _launch(SILU_MUL, x, w, b, norm_w, eps, None, None, None, 0, 1, inter, inter, sync=sync)


@torch.library.triton_op("spec_graph::decode_qkv_rope", mutates_args=("sync",))
def _decode_qkv_rope_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], norm_w: Optional[torch.Tensor],
                        eps: float, cos: torch.Tensor, sin: torch.Tensor, rope_heads: int,
                        head_dim: int, sync: Optional[torch.Tensor]) -> torch.Tensor:
    check("decode_qkv_rope", linear_problem(x, w, b, norm_w))
    if not use_kernel(_decode_linear_kernel, x):
        return decode_qkv_rope_ref(x, w, b, norm_w, eps, cos, sin, rope_heads, head_dim)
    N = w.shape[0]
    if head_dim % 2 or N % head_dim:
        raise ValueError(f"decode_qkv_rope needs an even head_dim dividing the output width (N={N}, D={head_dim})")
    return _launch(ROPE, x, w, b, norm_w, eps, None, cos, sin, rope_heads * head_dim, head_dim // 2, N, N // 2,
                   sync=sync)


@torch.library.triton_op("spec_graph::decode_head_argmax", mutates_args=("sync",))
def _decode_head_argmax_op(x: torch.Tensor, w: torch.Tensor, norm_w: Optional[torch.Tensor], eps: float,
                           sync: torch.Tensor) -> torch.Tensor:
    check("decode_head_argmax", linear_problem(x, w, None, norm_w))
    if not use_kernel(_decode_linear_kernel, x) or sync.numel() == 0:
        return head_argmax_ref(x, w, norm_w, eps)
    return _launch(PLAIN, x, w, None, norm_w, eps, None, None, None, 0, 1, w.shape[0], w.shape[0], sync=sync,
                   choose=True)


def write_kv_ref(k_cache, v_cache, layer: int, slots, positions, k, v) -> None:
    """k, v [B, T, Hkv, D] into the caches at [layer, slot of row b, head, positions[b, t]], as models/llama.py's
    Attention writes them (indexing the whole 5-D buffer)."""
    B = k.shape[0]
    rows = (torch.arange(B, device=k.device) if slots is None else slots)[:, None, None]
    heads = torch.arange(k.shape[2], device=k.device)[None, None, :]
    idx = (torch.full_like(rows, layer), rows, heads, positions[:, :, None])
    k_cache.index_put_(idx, k)
    v_cache.index_put_(idx, v)


@torch.library.triton_op("spec_graph::decode_qkv_rope_cache", mutates_args=("k_cache", "v_cache", "sync"))
def _decode_qkv_rope_cache_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                              norm_w: Optional[torch.Tensor], eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              n_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                              slots: Optional[torch.Tensor], positions: torch.Tensor,
                              sync: Optional[torch.Tensor]) -> torch.Tensor:
    check("decode_qkv_rope_cache", linear_problem(x, w, b, norm_w))
    n_kv = k_cache.shape[2]
    q_cols = n_heads * head_dim
    if not use_kernel(_decode_linear_kernel, x):
        y = decode_qkv_rope_ref(x, w, b, norm_w, eps, cos, sin, n_heads + n_kv, head_dim)
        q, k, v = y.split([q_cols, n_kv * head_dim, n_kv * head_dim], dim=-1)
        B, T = x.shape[:2]
        write_kv_ref(k_cache, v_cache, layer, slots, positions, k.reshape(B, T, n_kv, head_dim),
                     v.reshape(B, T, n_kv, head_dim))
        return q.contiguous()
    N = w.shape[0]
    if head_dim % 2 or N != (n_heads + 2 * n_kv) * head_dim or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"decode_qkv_rope_cache needs an even head_dim, w of (n_heads + 2 kv heads) x head_dim rows "
                         f"and caches with a unit last stride (N={N}, D={head_dim}, heads {n_heads}/{n_kv})")
    return _launch(ROPE, x, w, b, norm_w, eps, None, cos, sin, (n_heads + n_kv) * head_dim, head_dim // 2, N, N // 2,
                   kv=(k_cache, v_cache, layer, slots if slots is None else slots.contiguous(),
                       positions.contiguous(), q_cols), sync=sync)


def decode_qkv_rope_cache(x, w, b, norm_w, eps: float, cos, sin, n_heads: int, head_dim: int, k_cache, v_cache,
                          layer: int, slots, positions, sync=None) -> torch.Tensor:
    """decode_qkv_rope whose k and v go straight into the caches (op `spec_graph::decode_qkv_rope_cache`): x is
    [B, T, H]; writes k_cache / v_cache [layer, slot, head, positions[b, t], :] and returns q [B, T, n_heads * D]."""
    return torch.ops.spec_graph.decode_qkv_rope_cache(x, w, b, norm_w, float(eps), cos, sin, int(n_heads),
                                                      int(head_dim), k_cache, v_cache, int(layer), slots, positions,
                                                      _counters(sync, x))


def _counters(sync, x: torch.Tensor) -> torch.Tensor:
    """sync, or for None an empty buffer (no split): a mutated input that is None is one that inductor cannot hand
    an op it keeps whole (the backend's opaque_kernels)."""
    return sync if sync is not None else x.new_empty(0, dtype=torch.int32)


def decode_linear(x, w, b=None, norm_w=None, eps: float = 0.0, residual=None, sync=None) -> torch.Tensor:
    """residual + rmsnorm(x) @ w.T + b for a few rows (op `spec_graph::decode_linear`; see the module docstring)."""
    return torch.ops.spec_graph.decode_linear(x, w, b, norm_w, float(eps), residual, _counters(sync, x))


def decode_gate_up(x, w, b=None, norm_w=None, eps: float = 0.0, sync=None) -> torch.Tensor:
    """silu(gate) * up of rmsnorm(x) @ w.T + b, w = [gate; up] (op `spec_graph::decode_gate_up`)."""
    return torch.ops.spec_graph.decode_gate_up(x, w, b, norm_w, float(eps), _counters(sync, x))


def decode_qkv_rope(x, w, b, norm_w, eps: float, cos, sin, rope_heads: int, head_dim: int,
                    sync=None) -> torch.Tensor:
    """rmsnorm(x) @ w.T + b with RoPE on the first `rope_heads` heads (op `spec_graph::decode_qkv_rope`)."""
    return torch.ops.spec_graph.decode_qkv_rope(x, w, b, norm_w, float(eps), cos, sin, int(rope_heads),
                                                int(head_dim), _counters(sync, x))


def decode_head_argmax(x, w, norm_w=None, eps: float = 0.0, sync=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax int64, all finite bool) of each row of rmsnorm(x) @ w.T as decode_linear rounds it, without the
    logits (op `spec_graph::decode_head_argmax`, which returns them as one [..., 2] tensor; greedy_head.py).
    Without split-K counters (sync) it runs the reference."""
    both = torch.ops.spec_graph.decode_head_argmax(x, w, norm_w, float(eps), _counters(sync, x))
    return both[..., 0], both[..., 1].bool()
