"""Epilogues of the fused decode linear kernels (decode_linear.py): split-K's meeting point, then bias, rounding
and the mode's pointwise tail (the residual add, SiLU*up or RoPE with the k / v cache writes), on a program's fp32
sums. The per-element math is in _decode_linear_kernel's docstring.
"""
from __future__ import annotations

from ._triton import tl, triton
from .counters import arrive_last, rearm


@triton.jit
def _rnd(x, dt: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 x rounded to dt (to nearest, ties to even) and back to fp32. The interpreter truncates fp32 to bf16,
    so there the rounding is done on the bits (UPCAST)."""
    if UPCAST and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dt).to(tl.float32)


@triton.jit
def _epilogue(acc_a, acc_b, offs_m, offs_n, ra, rb, d, m_ok, n_ok, b_ptr, r_ptr, cos_ptr, sin_ptr, out_ptr,
              ROPE_COLS, srm, scm, som, kc_ptr, vc_ptr, row_k, row_v, kv_m_ok, QC, skh, svh,
              MODE: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              WRITE_KV: tl.constexpr, UPCAST: tl.constexpr):
    """Bias, rounding, then the mode's epilogue on fp32 sums [BLOCK_M, BLOCK_N] (see _decode_linear_kernel)."""
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + ra, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if MODE != 0:
            acc_b += tl.load(b_ptr + rb, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    a = _rnd(acc_a, dt, UPCAST)
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if MODE == 0:  # PLAIN
        if HAS_RES:
            a += tl.load(r_ptr + offs_m[:, None] * srm + offs_n[None, :], mask=mn_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * som + offs_n[None, :], _rnd(a, dt, UPCAST).to(dt), mask=mn_ok)
    elif MODE == 1:  # SILU_MUL
        c = _rnd(acc_b, dt, UPCAST)
        y = a / (1.0 + tl.exp(-a)) * c
        tl.store(out_ptr + offs_m[:, None] * som + offs_n[None, :], _rnd(y, dt, UPCAST).to(dt), mask=mn_ok)
    else:  # ROPE
        c = _rnd(acc_b, dt, UPCAST)
        rot = (ra < ROPE_COLS)[None, :]
        cs_ok = mn_ok & rot
        cos_a = tl.load(cos_ptr + offs_m[:, None] * scm + d[None, :], mask=cs_ok, other=1.0).to(tl.float32)
        sin_a = tl.load(sin_ptr + offs_m[:, None] * scm + d[None, :], mask=cs_ok, other=0.0).to(tl.float32)
        cos_b = tl.load(cos_ptr + offs_m[:, None] * scm + (d + HALF)[None, :], mask=cs_ok, other=1.0).to(tl.float32)
        sin_b = tl.load(sin_ptr + offs_m[:, None] * scm + (d + HALF)[None, :], mask=cs_ok, other=0.0).to(tl.float32)
        ya = _rnd(tl.where(rot, a * cos_a - c * sin_a, a), dt, UPCAST).to(dt)
        yb = _rnd(tl.where(rot, c * cos_b + a * sin_b, c), dt, UPCAST).to(dt)
        if WRITE_KV:  # q to out ([M, QC]); k and v columns into the caches at each row's slot and position
            kv_ok = kv_m_ok[:, None] & n_ok[None, :]
            _store_qkv(ya, ra, offs_m, mn_ok, kv_ok, out_ptr, som, kc_ptr, vc_ptr, row_k, row_v, QC, ROPE_COLS,
                       skh, svh, 2 * HALF)
            _store_qkv(yb, rb, offs_m, mn_ok, kv_ok, out_ptr, som, kc_ptr, vc_ptr, row_k, row_v, QC, ROPE_COLS,
                       skh, svh, 2 * HALF)
        else:
            tl.store(out_ptr + offs_m[:, None] * som + ra[None, :], ya, mask=mn_ok)
            tl.store(out_ptr + offs_m[:, None] * som + rb[None, :], yb, mask=mn_ok)


@triton.jit
def _store_qkv(y, col, offs_m, mn_ok, kv_ok, out_ptr, som, kc_ptr, vc_ptr, row_k, row_v, QC, KC_END, skh, svh, D):
    """Columns col of y [BLOCK_M, BLOCK_N]: q (col < QC) to out[m, col]; k (QC <= col < KC_END) to the key cache
    at row_k[m] + head * skh + dim, v (col >= KC_END) to the value cache likewise (head dim stride 1); k and v
    only where kv_ok (a position inside the cache)."""
    is_q = col < QC
    is_k = (col >= QC) & (col < KC_END)
    kcol = tl.where(is_k, col - QC, 0)
    vcol = tl.where(col >= KC_END, col - KC_END, 0)
    tl.store(out_ptr + offs_m[:, None] * som + col[None, :], y, mask=mn_ok & is_q[None, :])
    tl.store(kc_ptr + row_k[:, None] + ((kcol // D) * skh + kcol % D)[None, :], y, mask=kv_ok & is_k[None, :])
    tl.store(vc_ptr + row_v[:, None] + ((vcol // D) * svh + vcol % D)[None, :], y,
             mask=kv_ok & (col >= KC_END)[None, :])


@triton.jit
def _split_sum(acc_a, acc_b, ws_ptr, sync_ptr, pid_n, s, offs_m, offs_n, mn_ok, M, N, MODE: tl.constexpr,
               SPLIT_K: tl.constexpr):
    """Split-K's meeting point (see _decode_linear_kernel): (sums over all of K, whether this program is the
    last of its column block to arrive)."""
    ws = ws_ptr + (s * M + offs_m)[:, None] * (2 * N) + offs_n[None, :]
    tl.store(ws, acc_a, mask=mn_ok)
    if MODE != 0:
        tl.store(ws + N, acc_b, mask=mn_ok)
    last = arrive_last(sync_ptr, pid_n, SPLIT_K)
    if last:
        acc_a = tl.zeros(acc_a.shape, tl.float32)
        acc_b = tl.zeros(acc_b.shape, tl.float32)
        for i in tl.static_range(SPLIT_K):  # a fixed order: the sums do not depend on which program is last
            wi = ws_ptr + (i * M + offs_m)[:, None] * (2 * N) + offs_n[None, :]
            acc_a += tl.load(wi, mask=mn_ok, other=0.0, cache_modifier=".cg")
            if MODE != 0:
                acc_b += tl.load(wi + N, mask=mn_ok, other=0.0, cache_modifier=".cg")
        rearm(sync_ptr, pid_n)
    return acc_a, acc_b, last


@triton.jit
def _finish(acc_a, acc_b, offs_m, offs_n, ra, rb, d, m_ok, n_ok, b_ptr, r_ptr, cos_ptr, sin_ptr, out_ptr,
            ROPE_COLS, srm, scm, som, kc_ptr, vc_ptr, pos_ptr, slots_ptr, T, QC, k_off, v_off, sks, skh, skl,
            svs, svh, svl, spb, spt, LC, MODE: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, WRITE_KV: tl.constexpr, HAS_SLOTS: tl.constexpr, UPCAST: tl.constexpr,
            BLOCK_M: tl.constexpr):
    """The cache rows of each query row (WRITE_KV), then the mode's epilogue."""
    if WRITE_KV:
        rb_ = offs_m // T
        pos = tl.load(pos_ptr + rb_ * spb + (offs_m % T) * spt, mask=m_ok, other=0).to(tl.int64)
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + rb_, mask=m_ok, other=0).to(tl.int64)
        else:
            slot = rb_.to(tl.int64)
        row_k = k_off + slot * sks + pos * skl
        row_v = v_off + slot * svs + pos * svl
        kv_m_ok = m_ok & (pos >= 0) & (pos < LC)
    else:
        row_k = tl.zeros([BLOCK_M], tl.int64)
        row_v = row_k
        kv_m_ok = m_ok
    _epilogue(acc_a, acc_b, offs_m, offs_n, ra, rb, d, m_ok, n_ok, b_ptr, r_ptr, cos_ptr, sin_ptr, out_ptr,
              ROPE_COLS, srm, scm, som, kc_ptr, vc_ptr, row_k, row_v, kv_m_ok, QC, skh, svh,
              MODE, HALF, HAS_BIAS, HAS_RES, WRITE_KV, UPCAST)
