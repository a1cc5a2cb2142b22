"""L2 prefetch of a layer's next weights while attention runs: a separate prefetch kernel or the attention kernel itself (an experiment)."""
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from spec_graph.models.config import ModelArgs  # noqa: E402
from spec_graph.models.llama import Transformer  # noqa: E402
from spec_graph.kernels import decode_attention  # noqa: E402
from spec_graph.kernels.decode_linear import decode_gate_up, decode_linear, decode_qkv_rope_cache  # noqa: E402

TARGET = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
              intermediate_size=5632, vocab_size=32000)
DRAFT = dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=32000)


@triton.jit
def _pf_kernel(p0, n0, p1, n1, CHUNK: tl.constexpr, PER: tl.constexpr, LINE: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * PER + tl.arange(0, PER)
    off = i.to(tl.int64) * CHUNK
    for which in tl.static_range(2):
        if which == 0:
            base, n = p0.to(tl.pointer_type(tl.int8)), n0
        else:
            base, n = p1.to(tl.pointer_type(tl.int8)), n1
        size = tl.where(off < n, tl.minimum(n - off, CHUNK), 0).to(tl.int32)
        ptrs = base + off
        if LINE:
            for j in tl.static_range(CHUNK // 128):
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [ptrs + j * 128, size - j * 128], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


CHUNK, PER = 16384, 32
LINE = False


def prefetch(a=None, na=0, b=None, nb=0):
    a = a if a is not None else torch.empty(16, dtype=torch.int8, device="cuda")
    b = b if b is not None else a
    na = min(na, a.numel() * a.element_size())
    nb = min(nb, b.numel() * b.element_size())
    progs = max(1, triton.cdiv(max(na, nb), CHUNK * PER))
    chunk = 2048 if LINE else CHUNK
    progs = max(1, triton.cdiv(max(na, nb), chunk * PER))
    _pf_kernel[(progs,)](a, na, b, nb, CHUNK=chunk, PER=PER, LINE=LINE, num_warps=1)


def nbytes(t):
    return t.numel() * t.element_size()


def layer_chain(model, x, cos, sin, positions, kc, vc, sync, variant, gmb):
    layers = model.model.layers
    for i, layer in enumerate(layers):
        B, T, _ = x.shape
        attn, mlp, ln1, ln2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        q = decode_qkv_rope_cache(x, attn.qkv_proj.weight, attn.qkv_proj.bias, ln1.weight, ln1.eps, cos, sin,
                                  attn.n_heads, attn.head_dim, kc, vc, attn.layer, None, positions, sync)
        ow, gw, dw = attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight
        if variant == "pf0":
            prefetch()
        elif variant == "pfO":
            prefetch(ow, nbytes(ow))
        elif variant == "pfOG":
            prefetch(ow, nbytes(ow), gw, gmb)
        elif variant == "pfOGd":  # gate_up's head before attention; down's head before gate_up
            prefetch(ow, nbytes(ow), gw, gmb)
        pf = [ow, gw] if variant == "int" else None
        out = decode_attention(q.view(B, T, attn.n_heads, attn.head_dim), kc, vc, attn.layer, None, positions, 0,
                               prefetch=pf)
        x = decode_linear(out.reshape(B, T, -1), ow, attn.o_proj.bias, residual=x, sync=sync)
        if variant == "pfOGd":
            prefetch(dw, gmb)
        h = decode_gate_up(x, gw, mlp.gate_up_proj.bias, ln2.weight, ln2.eps, sync=sync)
        x = decode_linear(h, dw, mlp.down_proj.bias, residual=x, sync=sync)
    return x


def build(dims, T, ctx=512, cache=640):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0,
               max_position_embeddings=40960, tie_word_embeddings=False, **dims)
    args = ModelArgs.from_hf_config(cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Transformer(args).to(torch.bfloat16).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    kc, vc = m.new_kv_cache(1, cache)
    kc.normal_(std=0.5)
    vc.normal_(std=0.5)
    positions = torch.arange(ctx - T, ctx, device="cuda")[None]
    freqs = positions[..., None].float() * m.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = emb.cos().to(torch.bfloat16)[:, :, 0], emb.sin().to(torch.bfloat16)[:, :, 0]
    x = torch.randn(1, T, dims["hidden_size"], device="cuda", dtype=torch.bfloat16)
    return m, x, cos, sin, positions, kc, vc


def graph_of(fn, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            out = fn()
    return g, out


def time_graph(g, iters=50):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def per_slot(g, n_layers, reps):
    from torch.profiler import ProfilerActivity, profile
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    per = len(evs) // (5 * reps * n_layers)
    slots = [[] for _ in range(per)]
    for j, e in enumerate(evs):
        slots[j % per].append(e.time_range.elapsed_us())
    names = [evs[j].name[:22] for j in range(per)]
    return [(names[j], statistics.mean(s)) for j, s in enumerate(slots)]


def main():
    global LINE
    which = sys.argv[1] if len(sys.argv) > 1 else "target"
    dims, T, reps = (TARGET, 5, 1) if which == "target" else (DRAFT, 1, 4)
    m, x, cos, sin, positions, kc, vc = build(dims, T)
    sync = m.linear_sync
    gmb = int(float(sys.argv[2]) * 2**20) if len(sys.argv) > 2 else 16 * 2**20
    import spec_graph.kernels.attention as att
    ob = nbytes(m.model.layers[0].self_attn.o_proj.weight)
    variants = ["base", "pf0", "pfO", "pfOG", "pfOGd", "pfO_line", "int_O", "int_8", "int_16", "int_24", "int_32"]
    graphs, outs = {}, {}
    for v in variants:
        LINE = v.endswith("_line")
        vv = v.replace("_line", "")
        if v.startswith("int_"):
            vv = "int"
            att.L2_PREFETCH_BYTES = ob if v == "int_O" else int(v[4:]) << 20
        graphs[v], outs[v] = graph_of(lambda: layer_chain(m, x, cos, sin, positions, kc, vc, sync, vv, gmb), reps)
    LINE = False
    for v in variants:
        graphs[v].replay()
    torch.cuda.synchronize()
    for v in variants:
        print(v, "equal to base:", torch.equal(outs[v], outs["base"]))
    res = {v: [] for v in variants}
    for r in range(7):
        for v in variants:
            res[v].append(time_graph(graphs[v]))
    base = statistics.median(res["base"])
    for v in variants:
        med = statistics.median(res[v])
        print(f"{which} {v}: {med:.1f} us per chain ({reps} x {len(m.model.layers)} layers) "
              f"range {min(res[v]):.1f}-{max(res[v]):.1f}  vs base {med / base:.3f}x")
    for v in ("base", "pfO", "int_O", "int_16"):
        print(v, [(n, round(t, 2)) for n, t in per_slot(graphs[v], len(m.model.layers), reps)])


if __name__ == "__main__":
    main()
