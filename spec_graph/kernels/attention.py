"""Fused decode/verify attention over the static KV cache, with work that follows each row's live length.

    out = decode_attention(q, k_cache, v_cache, layer, slots, positions, window=0, scale=None, num_splits=0)

- q: [B, T, Hq, D] (T = 1 .. K+2 query positions per row; fp32, bf16 or fp16), RoPE already applied.
- k_cache, v_cache: the whole static buffers [layers, slots, Hkv, Lc, D] in q's dtype; `layer` an int.
  The keys/values of these T positions are already written into the cache by the caller.
- slots: int64 [B], the cache slot of each row (None: row b is slot b).
- positions: int64 [B, T], each query's absolute position, always in [0, Lc). Query (b, t) attends
  to key positions kpos <= positions[b, t] and, if window > 0, kpos > positions[b, t] - window.
  Row b's live length, max_t positions[b, t] + 1, is read on the device: one captured graph serves
  every length, and the kernel reads no key or value outside [first window start, live length).
- scale: default 1/sqrt(D). Query head h reads kv head h // (Hq // Hkv) (GQA).
- Returns [B, T, Hq, D] in q's dtype; the softmax accumulates in fp32.
- num_splits: key-range splits per (row, kv head) (flash-decoding); 0 picks one on the host from
  static shapes and the device's SM count, so the choice is capturable.
- Inputs outside this contract raise one ValueError on every path (`attention_shapes`); the values of
  positions and slots are checked on CPU tensors in eager calls, and on a device they are the caller's to keep
  (reading them there would sync).

`decode_attention_ref` is the math of models/llama.py's Attention (masked attention over the whole
buffer, fp32 softmax, probabilities cast to q's dtype before p @ v), so the CPU path is unchanged.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from ._triton import tl, triton

from .. import platform
from .rng import block_for, use_kernel, wrap_triton

BLOCK_N = 64  # keys per inner-loop block (tests lower it to walk more blocks)
# auto splits keep at least this many cache positions per split: at short contexts each split then walks one
# key block, and a program's loads wait on memory once (the H200's B=1 step: attention and its combine 0.228 ->
# 0.187 ms of kernel time at 256 -> 64 keys, 128 in between; 32 keys on 32-key blocks no faster)
MIN_SPLIT_KEYS = 64
MAX_SPLITS = 64
LOG2E = 1.4426950408889634
# Extra launch options of the split kernel (num_warps, num_stages). Triton's defaults (4 warps, 3 stages on
# CUDA) with BLOCK_N 64 were the best of BLOCK_N 32/64/128 x warps 2/4/8 x stages 2/3/4 on an H200.
LAUNCH: dict = {}

# The kernels write -inf as float("-inf"): torch.compile re-emits a constexpr global holding it as `inf`,
# which does not parse.


# ------------------------------------------------------------------ torch reference
def decode_attention_ref(q, k_cache, v_cache, layer: int, slots, positions, window: int = 0,
                         scale: Optional[float] = None):
    """Masked attention over every cache position, as models/llama.py's Attention computes it."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    kc, vc = k_cache[layer], v_cache[layer]
    keys, values = (kc[:B], vc[:B]) if slots is None else (kc[slots], vc[slots])  # [B, Hkv, L, D]
    L = keys.shape[2]
    kpos = torch.arange(L, device=q.device)
    mask = kpos[None, None, :] <= positions[:, :, None]  # [B, T, L]
    if window:
        mask = mask & (kpos[None, None, :] > positions[:, :, None] - window)
    g = Hq // Hkv
    qg = q.reshape(B, T, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * T, D)
    scores = (qg @ keys.transpose(-1, -2)).view(B, Hkv, g, T, L)
    scores = scores / math.sqrt(D) if scale is None else scores * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(B, Hkv, g * T, L)
    out = masked_values_product(probs, values, mask).view(B, Hkv, g, T, D).permute(0, 3, 1, 2, 4)
    return out.reshape(B, T, Hq, D)


def masked_values_product(probs, values, mask):
    """probs [B, Hkv, g * T, L] @ values [B, Hkv, L, D], where a value that is not finite enters no row that masks
    it (mask [B, T, L]: False) and makes NaN the rows that count it. A plain product would spread a masked NaN to
    every row (0 * NaN): a verify's rejected draft that drives the target to NaN would then end the rows before
    it, which a decode of the committed tokens alone never sees."""
    B, Hkv, GT, L = probs.shape
    T = mask.shape[1]
    finite = torch.isfinite(values)
    out = probs @ torch.where(finite, values, torch.zeros((), dtype=values.dtype, device=values.device))
    key_bad = ~finite.all(-1)  # [B, Hkv, L]
    row_bad = (mask[:, None, :, :] & key_bad[:, :, None, :]).any(-1)  # [B, Hkv, T]
    row_bad = row_bad[:, :, None, :].expand(B, Hkv, GT // T, T).reshape(B, Hkv, GT, 1)
    return torch.where(row_bad, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


# ------------------------------------------------------------------ Triton kernels
@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in fp32. IEEE: no TF32 for fp32 inputs. UPCAST: fp32 operands (the interpreter multiplies
    bf16 as its raw uint16 storage; the upcast is exact)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_block(q, k_base, v_base, kp, end, qpos, q_lo, m_i, l_i, acc, bad, qk_scale, skl, skd, svl, svd, offs_d,
                  IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One block of keys at positions kp (those below `end` exist) into the online softmax of query rows at
    positions qpos: key k counts where q_lo < k <= qpos. Returns the new (m, l, acc, bad): bad flags the rows that
    counted a key whose value is not finite; such values enter no sum (0 * NaN would reach the rows masking them)."""
    kv_ok = kp < end
    kt = tl.load(k_base + kp[None, :] * skl + offs_d[:, None] * skd, mask=kv_ok[None, :], other=0.0)
    sc = _dot(q, kt, IEEE, UPCAST)
    ok = (kp[None, :] <= qpos[:, None]) & (kp[None, :] > q_lo[:, None]) & kv_ok[None, :]
    sc = tl.where(ok, sc * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep exp2 finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(sc - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + kp[:, None] * svl + offs_d[None, :] * svd, mask=kv_ok[:, None], other=0.0)
    v_fin = tl.abs(v.to(tl.float32)) < float("inf")  # false for NaN and +-inf
    key_bad = tl.max(tl.where(v_fin, 0, 1), axis=1)
    bad = tl.maximum(bad, tl.max(tl.where(ok, key_bad[None, :], 0), axis=1))
    v = tl.where(v_fin, v, 0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
    return m_new, l_i, acc, bad


@triton.jit
def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
        B, T, HKV, G, LC, WINDOW, NUM_SPLITS, qk_scale,
        sqb, sqt, sqh, sqd, sks, skh, skl, skd, svs, svh, svl, svd, spb, spt, sob, sot, soh, sod,
        HAS_SLOTS: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Split s of (row b, kv head j) for work items w = pid, pid + nprog, ... (grid-stride).

    Query rows r = g * T + t (r < G * T) are head j * G + g at position p_r = positions[b, t].
        live = max_t p + 1;  lo = max(min_t p - WINDOW + 1, 0)   (WINDOW = LC when there is no window)
        chunk = ceil((live - lo) / NUM_SPLITS) rounded up to BLOCK_N
        keys of split s: [lo + s * chunk, min(lo + (s + 1) * chunk, live))   (empty: nothing is read)
        s_rk = qk_scale * q_r . k_k (log2 units) where p_r - WINDOW < k <= p_r, else -inf
        m_r = max_k s_rk,  l_r = sum_k 2^(s_rk - m_r),  acc_r = sum_k 2^(s_rk - m_r) v_k   (fp32, online)
        acc_r = NaN where a counted v_k is not finite; a masked one counts as 0 (as if it were not in the cache)
    DIRECT (one split): out = acc / l; else (acc, m, l) go to the workspace for the combine kernel.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    qk_scale = tl.cast(qk_scale, tl.float32)  # inductor passes Python floats as fp64
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    GT = G * T
    m_ok = offs_m < GT
    n_work = B * HKV * NUM_SPLITS
    for w32 in range(pid, n_work, nprog):
        w = tl.cast(w32, tl.int64)
        s = w32 % NUM_SPLITS
        j = (w // NUM_SPLITS) % HKV
        b = w // (NUM_SPLITS * HKV)
        g = offs_m // T
        t = offs_m % T
        qpos = tl.load(pos_ptr + b * spb + t * spt, mask=m_ok, other=-1).to(tl.int32)
        live = tl.max(qpos, axis=0) + 1
        lo = tl.maximum(tl.min(tl.where(m_ok, qpos, LC), axis=0) - WINDOW + 1, 0)
        chunk = tl.cdiv(tl.cdiv(live - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + s * chunk
        end = tl.minimum(start + chunk, live)

        if HAS_SLOTS:
            slot = tl.load(slots_ptr + b).to(tl.int64)
        else:
            slot = b
        k_base = k_ptr + slot * sks + j * skh
        v_base = v_ptr + slot * svs + j * svh
        head = j * G + g
        q_rows = tl.where(end > start, GT, 0)  # an empty split reads nothing
        q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + head[:, None] * sqh + offs_d[None, :] * sqd,
                    mask=(offs_m < q_rows)[:, None], other=0.0)
        q_lo = qpos - WINDOW  # keys must lie in (q_lo, qpos]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bad = tl.zeros([BLOCK_M], tl.int32)
        for n in range(start, end, BLOCK_N):
            m_i, l_i, acc, bad = _attend_block(q, k_base, v_base, n + offs_n, end, qpos, q_lo, m_i, l_i, acc, bad,
                                               qk_scale, skl, skd, svl, svd, offs_d, IEEE, UPCAST)
        acc = tl.where(bad[:, None] > 0, float("nan"), acc)  # NaN through the combine's sums too

        if DIRECT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + b * sob + t[:, None] * sot + head[:, None] * soh + offs_d[None, :] * sod,
                     o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
        else:
            tl.store(ws_acc_ptr + (w * GT + offs_m[:, None]) * BLOCK_D + offs_d[None, :], acc, mask=m_ok[:, None])
            tl.store(ws_ml_ptr + (w * 2) * GT + offs_m, m_i, mask=m_ok)
            tl.store(ws_ml_ptr + (w * 2 + 1) * GT + offs_m, l_i, mask=m_ok)


@triton.jit
def _combine_kernel(ws_acc_ptr, ws_ml_ptr, out_ptr, B, T, HKV, G, NUM_SPLITS, sob, sot, soh, sod,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the splits of query row r of (row b, kv head j), for items w = pid, pid + nprog, ... (grid-stride).

        M = max_s m_s;  out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s   (empty splits: l_s = 0, unread)
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    GT = G * T
    for w32 in range(pid, B * HKV * GT, nprog):
        w = tl.cast(w32, tl.int64)
        r = w % GT
        bj = w // GT
        ws = bj * NUM_SPLITS + offs_s
        m_s = tl.load(ws_ml_ptr + (ws * 2) * GT + r, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ws_ml_ptr + (ws * 2 + 1) * GT + r, mask=s_ok, other=0.0)
        m = tl.max(m_s, axis=0)
        wgt = tl.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))
        a_s = tl.load(ws_acc_ptr + (ws[:, None] * GT + r) * BLOCK_D + offs_d[None, :], mask=(l_s > 0)[:, None],
                      other=0.0)
        l = tl.sum(l_s * wgt, axis=0)
        o = tl.sum(a_s * wgt[:, None], axis=0) / tl.where(l > 0, l, 1.0)
        b = bj // HKV
        head = (bj % HKV) * G + r // T
        tl.store(out_ptr + b * sob + (r % T) * sot + head * soh + offs_d * sod, o.to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------------ launch
def attention_shapes(op: str, q, k_cache, v_cache, layer: int, slots, positions) -> tuple:
    """(B, T, Hq, D, Hkv, Lc, G) of an attention op's inputs, once they are checked against its contract (one
    ValueError naming the problem, on every device and path). Values (positions within the cache, slots that exist)
    are checked where reading them costs no device sync: eager calls on CPU tensors."""
    if q.dim() != 4 or k_cache.dim() != 5:
        raise ValueError(f"{op} takes q [B, T, Hq, D] and caches [layers, slots, Hkv, Lc, D]; got q of "
                         f"{tuple(q.shape)} and k_cache of {tuple(k_cache.shape)}")
    B, T, Hq, D = q.shape
    layers, n_slots, Hkv, Lc, Dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or Dk != D:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share one "
                         f"shape whose last dim is q's head dim {D}")
    if Hq % Hkv or D != block_for(D) or D < 16:
        raise ValueError(f"{op} needs Hq % Hkv == 0 and D a power of two >= 16 (Hq={Hq}, Hkv={Hkv}, D={D})")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{op}: q, k_cache and v_cache must share one dtype (got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype})")
    if not 0 <= layer < layers:
        raise ValueError(f"{op}: layer {layer} is not in the caches' {layers} layers")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or tuple(positions.shape) != (B, T):
        raise ValueError(f"{op}: positions must be integer [B, T] = [{B}, {T}], one per query; got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if slots is None and B > n_slots:
        raise ValueError(f"{op}: without slots row b reads slot b, and the caches hold {n_slots} slots for {B} rows; "
                         "pass slots")
    if slots is not None and (slots.dtype.is_floating_point or slots.dtype == torch.bool
                              or tuple(slots.shape) != (B,)):
        raise ValueError(f"{op}: slots must be None or integer [B] = [{B}]; got {slots.dtype} {tuple(slots.shape)}")
    if _concrete_cpu(positions) and positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < Lc:
        raise ValueError(f"{op}: positions must lie in [0, {Lc}) (the cache's length); got "
                         f"{int(positions.min())}..{int(positions.max())}")
    if slots is not None and _concrete_cpu(slots) and slots.numel() and \
            not 0 <= int(slots.min()) <= int(slots.max()) < n_slots:
        raise ValueError(f"{op}: slots must lie in [0, {n_slots}) (the caches' slots); got "
                         f"{int(slots.min())}..{int(slots.max())}")
    return B, T, Hq, D, Hkv, Lc, Hq // Hkv


def _concrete_cpu(t: torch.Tensor) -> bool:
    """A plain CPU tensor in an eager call: its values can be read without a sync or a trace."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and not torch.compiler.is_compiling()


def auto_num_splits(batch: int, kv_heads: int, cache_len: int, device: torch.device) -> int:
    """Splits per (row, kv head) from static shapes only: at most max_programs (4 per SM on CUDA) items in all
    (a program then takes one item, not two in turn), at most MAX_SPLITS, and no more than one per MIN_SPLIT_KEYS
    cache positions."""
    target = platform.max_programs(device)
    want = target // max(batch * kv_heads, 1)
    return max(1, min(want, MAX_SPLITS, triton.cdiv(cache_len, MIN_SPLIT_KEYS)))


@torch.library.triton_op("spec_graph::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                         slots: Optional[torch.Tensor], positions: torch.Tensor, window: int = 0,
                         scale: Optional[float] = None, num_splits: int = 0) -> torch.Tensor:
    B, T, Hq, D, Hkv, Lc, G = attention_shapes("decode_attention", q, k_cache, v_cache, layer, slots, positions)
    if not use_kernel(_decode_attention_kernel, q):
        return decode_attention_ref(q, k_cache, v_cache, layer, slots, positions, window, scale)
    dev = q.device
    splits = num_splits if num_splits > 0 else auto_num_splits(B, Hkv, Lc, dev)
    kc, vc = k_cache[layer], v_cache[layer]  # [slots, Hkv, Lc, D] views
    pos = positions.contiguous()
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=dev)
    direct = splits == 1
    items = B * Hkv * splits
    if direct:
        ws_acc = ws_ml = out  # unused
    else:
        ws_acc = torch.empty((items * G * T * D,), dtype=torch.float32, device=dev)
        ws_ml = torch.empty((items * 2 * G * T,), dtype=torch.float32, device=dev)
    block_m = max(16, block_for(G * T))
    cap = platform.max_programs(dev)
    s_q, s_k, s_v, s_o = q.stride(), kc.stride(), vc.stride(), out.stride()
    qk_scale = (1.0 / math.sqrt(D) if scale is None else float(scale)) * LOG2E
    wrap_triton(_decode_attention_kernel)[(max(1, min(items, cap)),)](
        q, kc, vc, pos if slots is None else slots.contiguous(), pos, out, ws_acc, ws_ml,
        B, T, Hkv, G, Lc, window if window > 0 else Lc, splits, qk_scale,
        *s_q, *s_k, *s_v, pos.stride(0), pos.stride(1), *s_o,
        HAS_SLOTS=slots is not None, DIRECT=direct, IEEE=q.dtype == torch.float32, UPCAST=dev.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=D, **LAUNCH)
    if not direct:
        wrap_triton(_combine_kernel)[(max(1, min(B * Hkv * G * T, cap)),)](
            ws_acc, ws_ml, out, B, T, Hkv, G, splits, *s_o, BLOCK_S=block_for(splits), BLOCK_D=D)
    return out


def decode_attention(q, k_cache, v_cache, layer: int, slots, positions, window: int = 0,
                     scale: Optional[float] = None, num_splits: int = 0) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] over cache slot `slots[b]` of `layer`, up to each row's live length
    (op `spec_graph::decode_attention`; the module docstring has the contract)."""
    return torch.ops.spec_graph.decode_attention(q, k_cache, v_cache, int(layer), slots, positions, int(window),
                                                 scale, int(num_splits))
