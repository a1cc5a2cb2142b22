"""Causal prefill attention over the static KV cache, tiled over queries (flash attention).

    out = prefill_attention(q, k_cache, v_cache, layer, slots, positions, window=0, scale=None)

The contract is decode_attention's (kernels/attention.py) for any number of query positions T: q [B, T, Hq, D],
the whole caches [layers, slots, Hkv, Lc, D] (this forward's keys already written), positions [B, T] in [0, Lc);
query (b, t) attends to key positions p - window < kpos <= p of slot slots[b]. The reference is
`decode_attention_ref`.

It serves forwards whose length is symbolic (an exported prefill, any T in one artifact): it takes the caches
whole and reads its key range from the positions on the device, so no shape depends on T but q's and the
output's. (Slicing and gathering the caches to T positions for fused SDPA makes torch.export guard on the
slice's strides, which it cannot prove for every T.)
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from ._triton import tl, triton

from .. import platform
from .attention import LOG2E, _attend_block, attention_shapes, decode_attention_ref
from .rng import block_for, use_kernel, wrap_triton

BLOCK_ROWS = 64  # query rows (heads of one kv head x positions) per tile
BLOCK_N = 64  # keys per inner-loop block (tests lower it to walk more blocks)


@triton.jit
def _prefill_attention_kernel(
        q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, out_ptr,
        B, T, HKV, G, LC, WINDOW, N_TILES, qk_scale,
        sqb, sqt, sqh, sqd, sks, skh, skl, skd, svs, svh, svl, svd, spb, spt, sob, sot, soh, sod,
        HAS_SLOTS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile i of (row b, kv head j) for work items w = pid, pid + nprog, ... (grid-stride).

    Tile rows r = g * BLOCK_T + u (r < G * BLOCK_T) are head j * G + g at position t = i * BLOCK_T + u < T,
    p_r = positions[b, t]. Keys k in [lo, hi): hi = max_r p_r + 1, lo = max(min_r p_r - WINDOW + 1, 0)
    (WINDOW = LC when there is no window):
        s_rk = qk_scale * q_r . k_k (log2 units) where p_r - WINDOW < k <= p_r, else -inf
        m_r = max_k s_rk,  l_r = sum_k 2^(s_rk - m_r),  out_r = sum_k 2^(s_rk - m_r) v_k / l_r   (fp32, online)
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    qk_scale = tl.cast(qk_scale, tl.float32)  # inductor passes Python floats as fp64
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g = offs_m // BLOCK_T
    u = offs_m % BLOCK_T
    n_work = B * HKV * N_TILES
    for w32 in range(pid, n_work, nprog):
        w = tl.cast(w32, tl.int64)
        i = w32 % N_TILES
        j = (w // N_TILES) % HKV
        b = w // (N_TILES * HKV)
        t = i * BLOCK_T + u
        m_ok = (g < G) & (t < T)
        qpos = tl.load(pos_ptr + b * spb + t * spt, mask=m_ok, other=-1).to(tl.int32)
        hi = tl.max(qpos, axis=0) + 1
        lo = tl.maximum(tl.min(tl.where(m_ok, qpos, LC), axis=0) - WINDOW + 1, 0)
        lo = lo // BLOCK_N * BLOCK_N  # aligned blocks; the mask drops keys below each row's window

        if HAS_SLOTS:
            slot = tl.load(slots_ptr + b).to(tl.int64)
        else:
            slot = b
        k_base = k_ptr + slot * sks + j * skh
        v_base = v_ptr + slot * svs + j * svh
        head = j * G + g
        q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + head[:, None] * sqh + offs_d[None, :] * sqd,
                    mask=m_ok[:, None], other=0.0)
        q_lo = qpos - WINDOW  # keys must lie in (q_lo, qpos]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bad = tl.zeros([BLOCK_M], tl.int32)
        for n in range(lo, hi, BLOCK_N):
            m_i, l_i, acc, bad = _attend_block(q, k_base, v_base, n + offs_n, hi, qpos, q_lo, m_i, l_i, acc, bad,
                                               qk_scale, skl, skd, svl, svd, offs_d, IEEE, UPCAST)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o = tl.where(bad[:, None] > 0, float("nan"), o)  # a counted value that is not finite (as decode_attention)
        tl.store(out_ptr + b * sob + t[:, None] * sot + head[:, None] * soh + offs_d[None, :] * sod,
                 o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def positions_per_tile(group: int) -> int:
    """Query positions per tile: BLOCK_ROWS rows shared by the `group` query heads of one kv head."""
    return max(1, BLOCK_ROWS // block_for(group))


@torch.library.triton_op("spec_graph::prefill_attention", mutates_args=())
def _prefill_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                          slots: Optional[torch.Tensor], positions: torch.Tensor, window: int = 0,
                          scale: Optional[float] = None) -> torch.Tensor:
    B, T, Hq, D, Hkv, Lc, G = attention_shapes("prefill_attention", q, k_cache, v_cache, layer, slots, positions)
    if not use_kernel(_prefill_attention_kernel, q):
        return decode_attention_ref(q, k_cache, v_cache, layer, slots, positions, window, scale)
    dev = q.device
    kc, vc = k_cache[layer], v_cache[layer]  # [slots, Hkv, Lc, D] views
    pos = positions.contiguous()
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=dev)
    block_t = positions_per_tile(G)
    n_tiles = triton.cdiv(T, block_t)
    items = B * Hkv * n_tiles
    s_q, s_k, s_v, s_o = q.stride(), kc.stride(), vc.stride(), out.stride()
    qk_scale = (1.0 / math.sqrt(D) if scale is None else float(scale)) * LOG2E
    grid = torch.sym_max(1, torch.sym_min(items, platform.max_programs(dev)))  # T symbolic: no guard on items
    wrap_triton(_prefill_attention_kernel)[(grid,)](
        q, kc, vc, pos if slots is None else slots.contiguous(), pos, out,
        B, T, Hkv, G, Lc, window if window > 0 else Lc, n_tiles, qk_scale,
        *s_q, *s_k, *s_v, pos.stride(0), pos.stride(1), *s_o,
        HAS_SLOTS=slots is not None, IEEE=q.dtype == torch.float32, UPCAST=dev.type == "cpu",
        BLOCK_T=block_t, BLOCK_M=block_for(G) * block_t, BLOCK_N=BLOCK_N, BLOCK_D=D)
    return out


def prefill_attention(q, k_cache, v_cache, layer: int, slots, positions, window: int = 0,
                      scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of q [B, T, Hq, D] over cache slot `slots[b]` of `layer`, any T (op
    `spec_graph::prefill_attention`; the module docstring has the contract)."""
    return torch.ops.spec_graph.prefill_attention(q, k_cache, v_cache, int(layer), slots, positions, int(window),
                                                  scale)
