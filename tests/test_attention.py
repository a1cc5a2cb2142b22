"""decode_attention: the Triton kernel against its torch reference, and the reference against llama.py.

Same interpreter arrangement as test_kernels.py: on a CPU machine, if nothing has
imported triton yet, TRITON_INTERPRET=1 is set for the kernels' import and while
these tests run; if triton was imported earlier without it, the kernel tests run
in a fresh process (`test_attention_suite_in_a_fresh_process`), never silently
skipped. On a GPU machine the same tests run the compiled kernels.
"""
from helpers import interpreter_before_triton

_ENV_BEFORE = interpreter_before_triton()  # before anything below imports triton

import contextlib  # noqa: E402
import importlib  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from helpers import (interpreter_while_testing, kernel_setting, require_kernel, run_compiled_script,  # noqa: E402
                     run_module_in_fresh_process, strided_copy)

from spec_graph import platform  # noqa: E402
from spec_graph.kernels import decode_attention, decode_attention_ref  # noqa: E402

_att = importlib.import_module("spec_graph.kernels.attention")

COMPILED, INTERPRETER_BUILDS, DEV, NEEDS_FRESH_PROCESS = kernel_setting(_att._decode_attention_kernel, _ENV_BEFORE)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on_while_testing():
    with interpreter_while_testing(DEV.type == "cpu" and INTERPRETER_BUILDS, _ENV_BEFORE):
        yield


@contextlib.contextmanager
def block_n(n):
    """The kernel's key block set to n (small blocks walk more of the loop), restored afterwards."""
    saved, _att.BLOCK_N = _att.BLOCK_N, n
    try:
        yield
    finally:
        _att.BLOCK_N = saved


def _require_kernel():
    require_kernel(_att, _att._decode_attention_kernel, DEV, NEEDS_FRESH_PROCESS,
                   "test_attention_suite_in_a_fresh_process")


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernels run in this process")
def test_attention_suite_in_a_fresh_process():
    """Something imported triton before TRITON_INTERPRET=1 could be set: run this module afresh."""
    run_module_in_fresh_process(__file__)


def test_triton_path_really_runs():
    _require_kernel()


# ------------------------------------------------------------------ inputs
def _positions(lives, T, odd=False, gen=None):
    """[B, T] positions whose max per row is live - 1: consecutive (a verify step), or scattered/repeated."""
    lives_t = torch.tensor(lives)
    pos = (lives_t[:, None] - T + torch.arange(T)[None, :]).clamp(min=0)
    if odd:
        pos = (torch.rand(len(lives), T, generator=gen) * lives_t[:, None]).long()
        pos[torch.arange(len(lives)), torch.randint(0, T, (len(lives),), generator=gen)] = lives_t - 1
    return pos


def _build(B, T, Hq, Hkv, D, Lc, n_slots, layers, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(layers, n_slots, Hkv, Lc, D, generator=g).to(dtype)
    v = torch.randn(layers, n_slots, Hkv, Lc, D, generator=g).to(dtype)
    return q, k, v, g


def _close(a, b, dtype) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **TOL[dtype])


@st.composite
def attention_case(draw):
    D = draw(st.sampled_from([16, 32, 64]))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3, 4]))
    T = draw(st.integers(1, 6))
    B = draw(st.integers(1, 3))
    block = draw(st.sampled_from([16, 32, 64]))
    Lc = draw(st.integers(max(T, 8), 160))
    special = [1, block, 2 * block, Lc - 1, Lc]
    lives = draw(st.lists(st.one_of(st.sampled_from([x for x in special if 1 <= x <= Lc]), st.integers(1, Lc)),
                          min_size=B, max_size=B))
    window = draw(st.sampled_from([0, 0, 1, 5, 17, 40, 1000]))
    splits = draw(st.sampled_from([1, 2, 3, 7, 0]))
    odd = draw(st.booleans())
    use_slots = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return D, Hkv, G, T, B, block, Lc, lives, window, splits, odd, use_slots, dtype, seed


@settings(max_examples=30, **SETTINGS)
@given(attention_case())
def test_matches_reference(case):
    _require_kernel()
    D, Hkv, G, T, B, block, Lc, lives, window, splits, odd, use_slots, dtype, seed = case
    n_slots = B + 2 if use_slots else B
    q, k, v, g = _build(B, T, Hkv * G, Hkv, D, Lc, n_slots, 2, dtype, seed)
    pos = _positions(lives, T, odd, g)
    slots = torch.randperm(n_slots, generator=g)[:B] if use_slots else None
    args = [x.to(DEV) if isinstance(x, torch.Tensor) else x for x in (q, k, v, 1, slots, pos.to(DEV), window)]
    with block_n(block):
        got = decode_attention(*args, num_splits=splits)
    ref = decode_attention_ref(*args)
    assert _close(got, ref, dtype), (got.float() - ref.float()).abs().max()


def test_strided_inputs_read_through_their_strides():
    """q, the positions and the slots as strided views give the result of their contiguous copies, bit for bit."""
    _require_kernel()
    q, k, v, g = _build(2, 3, 4, 2, 16, 40, 4, 2, torch.float32, 5)
    pos = _positions([17, 33], 3)
    slots = torch.tensor([3, 1])
    args = [x.to(DEV) for x in (q, k, v)]
    want = decode_attention(*args, 1, slots.to(DEV), pos.to(DEV), num_splits=2)
    got = decode_attention(strided_copy(args[0]), *args[1:], 1, strided_copy(slots.to(DEV)),
                           strided_copy(pos.to(DEV)), num_splits=2)
    assert torch.equal(got, want)
    assert not torch.equal(decode_attention(*args, 1, slots.to(DEV), pos.to(DEV) - 1, num_splits=2), want)


def test_off_by_one_live_length_is_caught():
    """The comparison can fail: the kernel run with every row's live length off by one (either way) differs."""
    _require_kernel()
    B, T, Lc = 3, 4, 96
    q, k, v, _ = _build(B, T, 4, 2, 32, Lc, B, 1, torch.float32, 7)
    lives = [1 + T, 40, Lc - 1]
    pos = _positions(lives, T).to(DEV)
    ref = decode_attention_ref(q.to(DEV), k.to(DEV), v.to(DEV), 0, None, pos)
    assert _close(decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), 0, None, pos, num_splits=2), ref, torch.float32)
    last = torch.arange(T, device=DEV) == T - 1
    for delta in (-1, 1):
        bad = pos + delta * last  # the last query (and so the live length) moves by one
        got = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), 0, None, bad, num_splits=2)
        assert not _close(got, ref, torch.float32), delta
        assert torch.allclose(got[:, :-1], ref[:, :-1], atol=1e-5, rtol=1e-5)  # only the moved query differs


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_reaches_only_the_rows_that_count_it(splits, bad):
    """A verify whose query at position p_2 wrote a non-finite value into kv head 1 (a draft's token drove the
    model there): queries before it equal attention over a cache without that key, in the kernel and in the
    reference; the query heads of kv head 1 from p_2 on are NaN, the others finite. The control is the plain
    masked product (0 * NaN), which spreads the value to the rows before it."""
    _require_kernel()
    B, T, Hkv, G, D, Lc = 2, 4, 2, 2, 16, 80
    q, k, v, _ = _build(B, T, Hkv * G, Hkv, D, Lc, B, 1, torch.float32, 13)
    pos = _positions([37, 70], T)
    poisoned = v.clone()
    for b in range(B):
        poisoned[0, b, 1, pos[b, 2], 3] = bad
    clean = decode_attention_ref(q, k, v, 0, None, pos)
    heads_of_1 = torch.arange(Hkv * G) // G == 1
    with block_n(16):
        got = decode_attention(q.to(DEV), k.to(DEV), poisoned.to(DEV), 0, None, pos.to(DEV), num_splits=splits).cpu()
    for out in (got, decode_attention_ref(q, k, poisoned, 0, None, pos)):
        assert _close(out[:, :2], clean[:, :2], torch.float32)
        assert out[:, 2:, heads_of_1].isnan().all() and _close(out[:, 2:, ~heads_of_1], clean[:, 2:, ~heads_of_1],
                                                               torch.float32)
    scores = torch.einsum("btgd,bld->btgl", q.view(B, T, Hkv, G, D)[:, :, 1], k[0, :, 1]) / math.sqrt(D)
    masked = torch.arange(Lc)[None, None, None, :] > pos[:, :, None, None]
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), -1)
    assert (probs @ poisoned[0, :, 1][:, None])[:, :2].isnan().any(-1).all()  # the control: every row NaN


_SM90_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spec_graph.kernels import attention as att

fn = att._decode_attention_kernel
out = {}
for dtype, direct, block_m in (("bf16", True, 16), ("bf16", False, 32), ("fp32", False, 16)):
    const = dict(HAS_SLOTS=True, DIRECT=direct, IEEE=dtype == "fp32", UPCAST=False, BLOCK_M=block_m,
                 BLOCK_N=att.BLOCK_N, BLOCK_D=128)
    types = {"slots_ptr": "*i64", "pos_ptr": "*i64", "ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32", "qk_scale": "fp32"}
    sig = {n: "constexpr" if n in const else types.get(n, f"*{dtype}" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    out[f"{dtype} direct={direct}"] = k.metadata.shared
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90():
    """The split kernel compiles for an H100/H200 on any machine (the interpreter accepts what the compiler may
    refuse), one split and several, bf16 and fp32, within an sm90 program's shared memory."""
    shared = run_compiled_script(_SM90_SCRIPT, skip_without_ptxas=True)
    assert len(shared) == 3 and max(shared.values()) <= 232448, shared


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("splits", [1, 3])
def test_never_reads_outside_the_live_range(window, splits):
    """NaN everywhere a row must not read (past its live length, before its window, other slots and layers)."""
    _require_kernel()
    B, T, Hkv, D, Lc, n_slots = 3, 3, 2, 16, 80, 5
    q, k, v, _ = _build(B, T, 4, Hkv, D, Lc, n_slots, 2, torch.float32, 11)
    lives = [T, 37, Lc - 2]  # 37: mid-block
    pos = _positions(lives, T)
    slots = torch.tensor([4, 0, 2])
    ref = decode_attention_ref(q, k, v, 1, slots, pos, window)
    kpos = torch.arange(Lc)
    bad_k, bad_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for b in range(B):
        lo = max(int(pos[b].min()) - window + 1, 0) if window else 0
        keep = (kpos >= lo) & (kpos < lives[b])
        bad_k[1, slots[b], :, keep] = k[1, slots[b], :, keep]
        bad_v[1, slots[b], :, keep] = v[1, slots[b], :, keep]
    with block_n(16):
        got = decode_attention(q.to(DEV), bad_k.to(DEV), bad_v.to(DEV), 1, slots.to(DEV), pos.to(DEV), window,
                               num_splits=splits).cpu()
    assert torch.isfinite(got).all()
    assert _close(got, ref, torch.float32)


def test_scale_and_fp16():
    _require_kernel()
    q, k, v, _ = _build(2, 2, 6, 3, 32, 70, 2, 1, torch.float16, 3)
    pos = _positions([5, 70], 2).to(DEV)
    args = [x.to(DEV) for x in (q, k, v)]
    got = decode_attention(*args, 0, None, pos, scale=0.3, num_splits=3)
    assert _close(got, decode_attention_ref(*args, 0, None, pos, scale=0.3), torch.float16)


# ------------------------------------------------------------ reference == llama.py
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,use_slots", [(0, False), (6, True)])
def test_reference_is_llama_attention_bitwise(dtype, window, use_slots, monkeypatch):
    """The CPU path: llama.py's masked attention (no Triton) and the reference agree bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the model takes its masked path on CPU
    from spec_graph.models.config import ModelArgs
    from spec_graph.models.llama import Attention, apply_rope, rope_inv_freq

    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=64, num_layers=2, num_heads=8,
                     num_kv_heads=2, head_dim=16, intermediate_size=32, sliding_windows=(0, window))
    torch.manual_seed(0)
    attn = Attention(args, layer=1).to(dtype)
    B, T, Lc = 3, 5, 40
    x = torch.randn(B, T, 64).to(dtype)
    pos = _positions([5, 23, 40], T)
    freqs = pos[..., None].float() * rope_inv_freq(args).float()
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    kc = torch.randn(2, 4, 2, Lc, 16).to(dtype)
    vc = torch.randn_like(kc)
    slots = torch.tensor([2, 0, 3]) if use_slots else None
    want = attn(x, cos, sin, pos, kc, vc, slots)  # writes this step's keys into kc / vc
    q = attn.qkv_proj(x).split(attn.qkv_split, dim=-1)[0].reshape(B, T, 8, 16)
    o = decode_attention_ref(apply_rope(q, cos, sin), kc, vc, 1, slots, pos, window)
    assert torch.equal(attn.o_proj(o.reshape(B, T, -1)), want)


# ------------------------------------------------------------ registration / tracing
def _small():
    q, k, v, _ = _build(2, 3, 4, 2, 16, 24, 3, 1, torch.float32, 5)
    return q, k, v, torch.tensor([1, 2]), _positions([7, 24], 3)


def test_op_registered_and_functional():
    schema = str(torch.ops.spec_graph.decode_attention.default._schema)
    assert "!" not in schema and "Tensor? slots" in schema, schema
    m = dict(device="meta")
    out = decode_attention(torch.empty(2, 5, 8, 16, **m), torch.empty(1, 3, 2, 64, 16, **m),
                           torch.empty(1, 3, 2, 64, 16, **m), 0, None, torch.empty(2, 5, dtype=torch.long, **m))
    assert out.shape == (2, 5, 8, 16) and out.device.type == "meta"


def test_torch_compile_and_export_keep_the_op(monkeypatch):
    if DEV.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # traced CPU graphs take the torch reference
    q, k, v, slots, pos = (x.to(DEV) for x in _small())

    def f(q, k, v, slots, pos):
        return decode_attention(q, k, v, 0, slots, pos, window=4, num_splits=2)

    torch._dynamo.reset()
    eager = f(q, k, v, slots, pos)
    backend = "inductor" if DEV.type == "cuda" else "aot_eager"  # inductor launches the kernel itself on CUDA
    assert torch.allclose(torch.compile(f, fullgraph=True, backend=backend)(q, k, v, slots, pos), eager,
                          atol=1e-5, rtol=1e-5)

    class M(torch.nn.Module):
        def forward(self, q, k, v, slots, pos):
            return f(q, k, v, slots, pos)

    ep = torch.export.export(M(), (q, k, v, slots, pos))
    assert "spec_graph.decode_attention.default" in {str(n.target) for n in ep.graph.nodes}
    assert torch.allclose(ep.module()(q, k, v, slots, pos), eager, atol=1e-5, rtol=1e-5)


def test_auto_num_splits_uses_static_shapes_only():
    cpu = torch.device("cpu")
    assert _att.auto_num_splits(1, 8, 640, cpu) == math.ceil(640 / _att.MIN_SPLIT_KEYS)
    assert _att.auto_num_splits(1, 8, 32768, cpu) == _att.MAX_SPLITS
    assert _att.auto_num_splits(4096, 8, 32768, cpu) == 1


@pytest.mark.parametrize("rows, kv_heads", [(1, 4), (8, 4), (32, 4), (3, 5), (100, 8), (200, 5)])
def test_auto_num_splits_gives_each_program_one_item(rows, kv_heads):
    """Splits x rows x kv heads stay within the programs the launch caps its grid at (a grid-stride program
    would walk two items one after the other), wherever one split per (row, kv head) fits."""
    cpu = torch.device("cpu")
    cap = platform.max_programs(cpu)
    splits = _att.auto_num_splits(rows, kv_heads, 32768, cpu)
    assert rows * kv_heads * splits <= cap
    assert rows * kv_heads * (splits + 1) > cap or splits == _att.MAX_SPLITS


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_long_contexts_and_graph_replay(dtype):
    """Compiled kernel vs reference at Lc up to 32768, then one captured graph replayed at two live lengths."""
    from spec_graph.capture import GraphSet

    plat = platform.current()
    dev = plat.device
    _require_kernel()
    for (Hq, Hkv, D, Lc, T, lives, slots) in (
            (32, 8, 64, 32768, 5, [1 + 5, 300, 32768], None),
            (12, 4, 64, 32768, 1, [1, 4097, 20000], [2, 0, 1]),
            (32, 8, 128, 8192, 6, [64, 8192], None)):
        B = len(lives)
        q, k, v, _ = _build(B, T, Hq, Hkv, D, Lc, B, 1, dtype, 1)
        q, k, v = q.to(dev), k.to(dev), v.to(dev)
        s = None if slots is None else torch.tensor(slots, device=dev)
        for window in (0, 1000):
            pos = _positions(lives, T).to(dev)
            for splits in (0, 1, 5):
                got = decode_attention(q, k, v, 0, s, pos, window, num_splits=splits)
                ref = decode_attention_ref(q, k, v, 0, s, pos, window)
                assert _close(got, ref, dtype), (Lc, lives, window, splits, (got.float() - ref.float()).abs().max())

    B, T, Lc = 2, 5, 32768
    q, k, v, _ = _build(B, T, 32, 8, 64, Lc, B, 1, dtype, 2)
    q, k, v = q.to(dev), k.to(dev), v.to(dev)
    pos = _positions([600, 900], T).to(dev)
    graphs = GraphSet(plat)
    assert graphs.capture("attn", lambda: decode_attention(q, k, v, 0, None, pos)), graphs.failed
    for lives in ([700, 31000], [Lc, T]):
        pos.copy_(_positions(lives, T).to(dev))
        out = graphs.replay("attn")
        plat.synchronize()
        assert _close(out, decode_attention_ref(q, k, v, 0, None, pos), dtype), lives


def _bad_inputs():
    """(what is wrong, the call's arguments): each a misuse of the attention ops' contract."""
    B, T, Hq, Hkv, D, Lc = 2, 3, 4, 2, 16, 32
    q, kc = torch.randn(B, T, Hq, D), torch.randn(2, 3, Hkv, Lc, D)
    pos, slots = torch.arange(T).repeat(B, 1), torch.tensor([0, 2])
    return [
        ("heads", (torch.randn(B, T, 3, D), kc, kc, 0, slots, pos)),
        ("dtype", (q, kc.bfloat16(), kc.bfloat16(), 0, slots, pos)),
        ("head dim", (torch.randn(B, T, Hq, 24), torch.randn(2, 3, Hkv, Lc, 24), torch.randn(2, 3, Hkv, Lc, 24),
                      0, slots, pos)),
        ("q's head dim", (torch.randn(B, T, Hq, 32), kc, kc, 0, slots, pos)),
        ("v_cache", (q, kc, torch.randn(2, 3, Hkv, Lc + 16, D), 0, slots, pos)),
        ("layer", (q, kc, kc, 2, slots, pos)),
        ("positions shape", (q, kc, kc, 0, slots, torch.arange(T + 1).repeat(B, 1))),
        ("positions dtype", (q, kc, kc, 0, slots, pos.float())),
        ("positions past the cache", (q, kc, kc, 0, slots, pos + Lc - 2)),
        ("negative position", (q, kc, kc, 0, slots, pos - 1)),
        ("slots shape", (q, kc, kc, 0, slots[:1], pos)),
        ("slot past the caches", (q, kc, kc, 0, torch.tensor([0, 3]), pos)),
        ("rows past the slots", (torch.randn(4, T, Hq, D), kc, kc, 0, None, torch.arange(T).repeat(4, 1))),
    ]


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("op", ["decode_attention", "prefill_attention"])
def test_inputs_outside_the_contract_are_refused_on_every_path(op, broken, monkeypatch):
    """Each misuse is one ValueError naming it, before the op picks its kernel or its reference (on CPU without
    the interpreter the reference runs, which would otherwise fail deep in torch or answer from garbage). Control:
    with the shapes taken unchecked, misuses pass or fail otherwise."""
    import spec_graph.kernels as kernels

    if broken:
        def unchecked(name, q, k_cache, v_cache, *rest):
            B, T, Hq, D = q.shape
            return B, T, Hq, D, k_cache.shape[2], k_cache.shape[3], Hq // k_cache.shape[2]
        monkeypatch.setattr(_att, "attention_shapes", unchecked)
        monkeypatch.setattr(importlib.import_module("spec_graph.kernels.prefill_attention"), "attention_shapes",
                            unchecked)
    fn = getattr(kernels, op) if hasattr(kernels, op) else getattr(
        importlib.import_module("spec_graph.kernels.prefill_attention"), op)
    refused = []
    for what, args in _bad_inputs():
        try:
            fn(*args)
        except ValueError:
            refused.append(what)
        except Exception:  # noqa: BLE001 - the control's failures from deep inside torch
            pass
    if broken:
        assert len(refused) < len(_bad_inputs()) // 2, refused
    else:
        assert refused == [what for what, _ in _bad_inputs()]
