"""A compact static-KV decoder for the Llama family (llama, qwen2, qwen3, mistral).

Module names mirror Hugging Face's, except that q/k/v and gate/up projections
are stored concatenated (``qkv_proj``, ``gate_up_proj``): fewer, larger matmuls.
The KV cache is a plain preallocated buffer ``[layers, slots, kv_heads,
cache_len, head_dim]``: a forward writes its new keys at absolute positions
with ``index_put_`` (``scatter_`` would make inductor copy the whole cache).
Decode and verify forwards (few query positions) attend through the fused
``spec_graph::decode_attention`` op, whose work follows each row's live length
(read from ``positions`` on the device); where the Triton kernels do not run
(CPU), attention covers the whole buffer under a position mask, and a prefill
its own first positions (``kv_len``). Shapes stay static either way. Those forwards also run each layer's
products as fused kernels (kernels/decode_linear.py: the norms, RoPE, SiLU*up
and the residual adds folded in) where the rows fit (FUSED_LAYERS).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import platform
from ..kernels import decode_attention, prefill_attention
from ..kernels.attention import masked_values_product
from ..kernels.counters import new_sync
from ..kernels.decode_linear import (decode_gate_up, decode_head_argmax, decode_linear, decode_qkv_rope_cache,
                                     fused_rows_ok, rms_norm_ref, rope_ref)
from .config import ModelArgs

# Query rows (query heads per KV head x positions) up to which a forward uses the fused decode attention:
# decode and verify steps; a prefill's many rows take the matmul path.
DECODE_ATTENTION_ROWS = 64
# Prefills of at least this many positions attend through torch's fused attention (SDPA): the matmul path's
# [B, heads, T, T] fp32 scores grow with the square of the prompt (137 GB at 32k positions and 32 heads).
PREFILL_SDPA_POSITIONS = 128
# Decode and verify forwards run each layer as four fused linear kernels (kernels/decode_linear.py) beside the
# attention op, where that op runs and the rows fit; False keeps nn.Linear (benchmarks compare the two).
FUSED_LAYERS = True
# A forward asked only for its greedy choice (choose=True) folds the argmax into the fused head's kernel
# (kernels/greedy_head.py) when True; False: the head's logits, then torch's argmax and isfinite. Off: the step
# with the fold measured no faster on an H100 (benchmarks set it with --set llama.FUSED_CHOICE=True).
FUSED_CHOICE = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = args.rope_scaling
    if s is None:
        return inv
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


apply_rope = rope_ref  # x [B, T, H, D]; cos/sin [B, T, 1, D]: the fused qkv kernel's reference is the model's RoPE


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.window = args.sliding_windows[layer] if args.sliding_windows else 0
        h = args.hidden_size
        # q, k and v in one matmul (one kernel instead of three per layer in a decode step);
        # the loader concatenates the checkpoint's q_proj / k_proj / v_proj into it.
        self.qkv_split = (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
        self.qkv_proj = nn.Linear(h, sum(self.qkv_split), bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=args.o_bias)
        self.fused_decode = self.head_dim >= 16 and self.head_dim & (self.head_dim - 1) == 0  # the kernel's tiles
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, positions, k_cache, v_cache, slots, kv_len=None, any_len=False, causal=False):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = q.reshape(B, T, self.n_heads, self.head_dim)
        k = k.reshape(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, positions, k_cache, v_cache, slots, kv_len, any_len, causal)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))

    def uses_decode_attention(self, x, any_len: bool = False) -> bool:
        return not any_len and self.decode_attention_for(x.shape[1], x.device)

    def decode_attention_for(self, T, device) -> bool:
        """Whether forwards of T positions per row on `device` attend through the live-length kernel."""
        # a symbolic T (an export's dynamic prefill length) takes the matmul path: no guard on T
        return (self.fused_decode and isinstance(T, int) and self.n_heads // self.n_kv * T <= DECODE_ATTENTION_ROWS
                and platform.use_triton(device))

    def _mask(self, L, positions) -> torch.Tensor:
        """[B, T, L]: the keys 0..L-1 each query at ``positions`` [B, T] sees (its own and earlier ones, within the
        sliding window where the model has one)."""
        kpos = torch.arange(L, device=positions.device)
        mask = kpos[None, None, :] <= positions[:, :, None]
        if self.window:
            mask = mask & (kpos[None, None, :] > positions[:, :, None] - self.window)
        return mask

    def attend(self, q, k, v, positions, k_cache, v_cache, slots, kv_len=None, any_len=False, causal=False):
        """Write this forward's k, v ([B, T, Hkv, D]) into the cache and attend: [B, T, Hq, D]. ``kv_len``: every
        position is below it (a prefill's length), so the matmul path reads that much of the cache alone.
        ``any_len``: a prefill compiled for every length (dynamo shows its symbolic T as an int): the path of a
        symbolic T, with no branch on T's value. ``causal``: every row's positions are 0..T-1 (a prefill from the
        start), so that a prefill's fused attention needs no mask of its own."""
        B, T = q.shape[:2]
        v = v.reshape(B, T, self.n_kv, self.head_dim)
        rows = (torch.arange(B, device=q.device) if slots is None else slots)[:, None, None]
        heads = torch.arange(self.n_kv, device=q.device)[None, None, :]
        pos = positions[:, :, None]
        # Index the whole 5-D buffer, not a per-layer view of it: a mutated view makes
        # functionalization (and so inductor) copy the entire cache at every layer.
        idx = (torch.full_like(rows, self.layer), rows, heads, pos)
        k_cache.index_put_(idx, k)
        v_cache.index_put_(idx, v)
        if self.uses_decode_attention(q, any_len):
            return decode_attention(q, k_cache, v_cache, self.layer, slots, positions, self.window)
        symbolic = any_len or not isinstance(T, int)
        if self.fused_decode and kv_len is not None and symbolic and platform.use_triton(q.device):
            # an export's prefill, any length: the kernel reads the caches whole (a slice of symbolic length
            # fed to SDPA makes export guard on its strides)
            return prefill_attention(q, k_cache, v_cache, self.layer, slots, positions, self.window)
        g = self.n_heads // self.n_kv
        kc, vc = k_cache[self.layer], v_cache[self.layer]  # [slots, Hkv, L, D] views, read only
        if kv_len is not None:
            kc, vc = kc[:, :, :kv_len], vc[:, :, :kv_len]
        # Rows 0..B-1 are slots 0..B-1 in the step: a slice reads the cache without a gather copy.
        keys, values = (kc[:B], vc[:B]) if slots is None else (kc[slots], vc[slots])  # [B, Hkv, L, D]

        L = keys.shape[2]
        if kv_len is not None and (symbolic or T >= PREFILL_SDPA_POSITIONS):
            # a prefill (each query sees its own key; T symbolic: an export's, of any length): fused attention,
            # with memory linear in the scores' rows
            kh, vh = (t.repeat_interleave(g, dim=1) for t in (keys, values))  # query head h reads kv head h // g
            if causal and not self.window:
                # the mask is then the causal one: built, it would cost B * T * L bytes and keep SDPA off its fused
                # kernels (on a CPU a 16k-token prompt took 10x as long)
                out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh,
                                                     attn_mask=self._mask(L, positions)[:, None])
            return out.transpose(1, 2)
        mask = self._mask(L, positions)

        # Grouped attention without repeating K/V: query heads of one KV head share a matmul.
        qg = q.view(B, T, self.n_kv, g, self.head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(B, self.n_kv, g * T, self.head_dim)
        scores = (qg @ keys.transpose(-1, -2)).view(B, self.n_kv, g, T, L) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(B, self.n_kv, g * T, L)
        out = masked_values_product(probs, values, mask).view(B, self.n_kv, g, T, self.head_dim)
        out = out.permute(0, 3, 1, 2, 4)
        return out.reshape(B, T, self.n_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=b)  # gate_proj and up_proj, concatenated
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)
        self.fused = None  # None: FUSED_LAYERS decides; Transformer.fused_layers sets it per model

    def forward(self, x, cos, sin, positions, k_cache, v_cache, slots, sync=None, kv_len=None, any_len=False,
                causal=False):
        fused = FUSED_LAYERS if self.fused is None else self.fused
        if (fused and self.self_attn.q_norm is None and self.self_attn.uses_decode_attention(x, any_len)
                and platform.use_fused_linear(x.device) and fused_rows_ok(x)):
            return self.forward_fused(x, cos, sin, positions, k_cache, v_cache, slots, sync)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, k_cache, v_cache, slots, kv_len,
                               any_len, causal)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, cos, sin, positions, k_cache, v_cache, slots, sync=None):
        """The same layer in four linear kernels with the norms, RoPE, SiLU*up and residual adds folded in
        (sync: split-K counters, kernels/counters.py's new_sync)."""
        B, T, _ = x.shape
        attn, mlp, ln1, ln2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        q = decode_qkv_rope_cache(x, attn.qkv_proj.weight, attn.qkv_proj.bias, ln1.weight, ln1.eps, cos[:, :, 0],
                                  sin[:, :, 0], attn.n_heads, attn.head_dim, k_cache, v_cache, attn.layer,
                                  slots, positions, sync)
        out = decode_attention(q.view(B, T, attn.n_heads, attn.head_dim), k_cache, v_cache, attn.layer, slots,
                               positions, attn.window)
        x = decode_linear(out.reshape(B, T, -1), attn.o_proj.weight, attn.o_proj.bias, residual=x, sync=sync)
        h = decode_gate_up(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, ln2.weight, ln2.eps, sync=sync)
        return decode_linear(h, mlp.down_proj.weight, mlp.down_proj.bias, residual=x, sync=sync)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


def kv_cache_bytes(args: ModelArgs, slots: int, cache_len: int, itemsize: int) -> int:
    """Bytes of a model's k and v caches (Transformer.new_kv_cache) for this many slots and positions."""
    return 2 * args.num_layers * slots * args.num_kv_heads * cache_len * args.head_dim * itemsize


class Transformer(nn.Module):
    """``forward(tokens [B,T], positions [B,T], k_cache, v_cache, slots=None) -> float32 logits [B,T,V]``, or
    [B,V] at index ``logits_at[b]`` of each row's T positions (a prefill's last prompt token: its logits alone).

    Row ``b`` reads and writes cache slot ``slots[b]`` (slot ``b`` when ``slots`` is None). Keys at positions above
    a query's own are masked, so stale cache entries past a request's length
    are never read before they are overwritten. ``kv_len`` (a prefill's length, every position below it): attention
    reads the caches' first ``kv_len`` positions alone, so that a prefill's work follows the prompt, not max_len.
    ``any_len``: the forward takes no branch on T (one compile of a prefill with T symbolic serves every length).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        # split-K counters of the fused linear kernels, shared by every layer (each launch leaves them zero)
        self.register_buffer("linear_sync", new_sync(), persistent=False)

    @property
    def fused_layers(self):
        return self.model.layers[0].fused

    @fused_layers.setter
    def fused_layers(self, on):
        """Fused decode linear kernels for this model (True / False), or as FUSED_LAYERS says (None)."""
        for layer in self.model.layers:
            layer.fused = on

    def new_kv_cache(self, slots: int, cache_len: int, dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache), zeros of [layers, slots, kv_heads, cache_len, head_dim] (kv_cache_bytes each pair)."""
        a = self.args
        ref = self.model.embed_tokens.weight
        shape = (a.num_layers, slots, a.num_kv_heads, cache_len, a.head_dim)
        # zeros, not empty: masked probabilities are 0, and 0 * NaN garbage would still be NaN.
        make = lambda: torch.zeros(shape, dtype=dtype or ref.dtype, device=device or ref.device)  # noqa: E731
        return make(), make()

    def forward(self, tokens, positions, k_cache, v_cache, slots=None, kv_len=None, logits_at=None, any_len=False,
                choose=False, causal=False):
        """fp32 logits [B, T, V]; with choose, (argmax ids [B, T], all-finite flags [B, T]) of those logits.
        causal: every row's positions are 0..T-1 (a prefill from the start)."""
        x = self.model.embed_tokens(tokens)
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, k_cache, v_cache, slots, self.linear_sync, kv_len, any_len, causal)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if logits_at is not None:
            # the norm and head at one position per row: a long prompt's [B, T, V] fp32 logits would not fit
            # (a 128k vocabulary at 32k positions is 16 GiB)
            x = x[torch.arange(x.shape[0], device=x.device), logits_at]
            return _chosen(F.linear(self.model.norm(x), w).float(), choose)
        fused = FUSED_LAYERS if self.fused_layers is None else self.fused_layers
        if (fused and self.model.layers[0].self_attn.uses_decode_attention(x, any_len)
                and platform.use_fused_linear(x.device)
                and fused_rows_ok(x)):
            norm = self.model.norm
            if choose and FUSED_CHOICE:
                return decode_head_argmax(x, w, norm.weight, norm.eps, sync=self.linear_sync)
            return _chosen(decode_linear(x, w, None, norm.weight, norm.eps, sync=self.linear_sync).float(), choose)
        return _chosen(F.linear(self.model.norm(x), w).float(), choose)


def _chosen(logits, choose: bool):
    """logits, or with choose their (argmax, all finite) over the vocabulary."""
    return (logits.argmax(-1), torch.isfinite(logits).all(-1)) if choose else logits
