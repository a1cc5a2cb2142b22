"""prefill_attention: the Triton kernel against its torch reference, and the exported prefill that takes it.

Same interpreter arrangement as test_attention.py: on a CPU machine the kernel runs under TRITON_INTERPRET=1
(set before triton's import, or in a fresh process); on a GPU machine the compiled kernel runs.
"""
from helpers import interpreter_before_triton

_ENV_BEFORE = interpreter_before_triton()  # before anything below imports triton

import contextlib  # noqa: E402
import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from helpers import interpreter_while_testing, kernel_setting, require_kernel, run_module_in_fresh_process  # noqa: E402

from spec_graph import platform  # noqa: E402
from spec_graph.kernels import decode_attention_ref, prefill_attention  # noqa: E402

_pa = importlib.import_module("spec_graph.kernels.prefill_attention")

COMPILED, INTERPRETER_BUILDS, DEV, NEEDS_FRESH_PROCESS = kernel_setting(_pa._prefill_attention_kernel, _ENV_BEFORE)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on_while_testing():
    with interpreter_while_testing(DEV.type == "cpu" and INTERPRETER_BUILDS, _ENV_BEFORE):
        yield


@contextlib.contextmanager
def block_n(n):
    saved, _pa.BLOCK_N = _pa.BLOCK_N, n
    try:
        yield
    finally:
        _pa.BLOCK_N = saved


def _require_kernel():
    require_kernel(_pa, _pa._prefill_attention_kernel, DEV, NEEDS_FRESH_PROCESS,
                   "test_prefill_attention_suite_in_a_fresh_process")


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernels run in this process")
def test_prefill_attention_suite_in_a_fresh_process():
    run_module_in_fresh_process(__file__)


def _build(B, T, Hq, Hkv, D, Lc, n_slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(2, n_slots, Hkv, Lc, D, generator=g).to(dtype)
    v = torch.randn(2, n_slots, Hkv, Lc, D, generator=g).to(dtype)
    return q, k, v, g


def _close(a, b, dtype) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **TOL[dtype])


@st.composite
def prefill_case(draw):
    D = draw(st.sampled_from([16, 32]))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3, 4, 8]))
    T = draw(st.integers(1, 90))
    B = draw(st.integers(1, 3))
    start = draw(st.sampled_from([0, 0, 1, 17, 40]))  # a prompt's first position: 0, or a chunk after cached keys
    Lc = draw(st.integers(start + T, start + T + 40))
    window = draw(st.sampled_from([0, 0, 1, 5, 33, 1000]))
    use_slots = draw(st.booleans())
    block = draw(st.sampled_from([16, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    return D, Hkv, G, T, B, start, Lc, window, use_slots, block, dtype, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=25, **SETTINGS)
@given(prefill_case())
def test_matches_reference(case):
    """Query tiles of every size (G heads x positions), key blocks, windows and slots; exact in fp32 up to the
    order of the sums (1e-5), bf16 within 3e-2."""
    _require_kernel()
    D, Hkv, G, T, B, start, Lc, window, use_slots, block, dtype, seed = case
    n_slots = B + 2 if use_slots else B
    q, k, v, g = _build(B, T, Hkv * G, Hkv, D, Lc, n_slots, dtype, seed)
    pos = (start + torch.arange(T)).expand(B, T).contiguous()
    slots = torch.randperm(n_slots, generator=g)[:B] if use_slots else None
    args = [x.to(DEV) if isinstance(x, torch.Tensor) else x for x in (q, k, v, 1, slots, pos, window)]
    with block_n(block):
        got = prefill_attention(*args)
    ref = decode_attention_ref(*args)
    assert _close(got, ref, dtype), (got.float() - ref.float()).abs().max()


def test_a_shifted_position_is_caught():
    """The comparison can fail: one query's position off by one (either way) changes that query alone."""
    _require_kernel()
    B, T, Lc = 2, 40, 64
    q, k, v, _ = _build(B, T, 4, 2, 16, Lc, B, torch.float32, 3)
    q, k, v = q.to(DEV), k.to(DEV), v.to(DEV)
    pos = torch.arange(T, device=DEV).expand(B, T).contiguous()
    ref = decode_attention_ref(q, k, v, 0, None, pos)
    assert _close(prefill_attention(q, k, v, 0, None, pos), ref, torch.float32)
    moved = torch.arange(T, device=DEV) == 21
    for delta in (-1, 1):
        got = prefill_attention(q, k, v, 0, None, pos + delta * moved)
        assert not _close(got, ref, torch.float32), delta
        assert torch.allclose(got[:, ~moved], ref[:, ~moved], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 7])
def test_never_reads_outside_each_rows_keys(window):
    """NaN wherever a prompt must not read: past its last position, before its window, other slots, other layers."""
    _require_kernel()
    B, T, Hkv, D, Lc, n_slots = 2, 50, 2, 16, 96, 4
    q, k, v, _ = _build(B, T, 4, Hkv, D, Lc, n_slots, torch.float32, 5)
    pos = torch.arange(T).expand(B, T).contiguous()
    slots = torch.tensor([3, 1])
    ref = decode_attention_ref(q, k, v, 1, slots, pos, window)
    bad_k, bad_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for s in slots:
        bad_k[1, s, :, :T], bad_v[1, s, :, :T] = k[1, s, :, :T], v[1, s, :, :T]
    with block_n(16):
        got = prefill_attention(q.to(DEV), bad_k.to(DEV), bad_v.to(DEV), 1, slots.to(DEV), pos.to(DEV), window).cpu()
    assert torch.isfinite(got).all() and _close(got, ref, torch.float32)


def test_export_keeps_one_op_for_every_length():
    """A prefill exported with a symbolic length takes the op (no guard on the length) and serves other lengths."""
    q, k, v, _ = _build(2, 12, 4, 2, 16, 48, 3, torch.float32, 9)
    q, k, v = q.to(DEV), k.to(DEV), v.to(DEV)

    class M(torch.nn.Module):
        def forward(self, q, k, v, slots, pos):
            return prefill_attention(q, k, v, 0, slots, pos)

    slots = torch.tensor([2, 0], device=DEV)
    T = torch.export.Dim("T", min=1, max=47)
    ep = torch.export.export(M(), (q, k, v, slots, torch.arange(12, device=DEV).expand(2, 12).contiguous()),
                             dynamic_shapes=({1: T}, None, None, None, {1: T}))
    assert "spec_graph.prefill_attention.default" in {str(n.target) for n in ep.graph.nodes}
    for n in (5, 30):
        pos = torch.arange(n, device=DEV).expand(2, n).contiguous()
        qn = torch.randn(2, n, 4, 16, device=DEV)
        assert torch.allclose(ep.module()(qn, k, v, slots, pos), decode_attention_ref(qn, k, v, 0, slots, pos),
                              atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 24])
def test_the_model_takes_the_op_at_a_symbolic_length_on_triton_platforms(monkeypatch, head_dim):
    """llama.py's Attention: a prefill of symbolic length (an export's) takes prefill_attention where Triton runs
    and its tiles fit the head size (a power of two; else SDPA), and its output equals the eager prefill's."""
    from spec_graph.models import llama
    from spec_graph.models.config import ModelArgs

    if DEV.type == "cpu":  # where the interpreter does not run, the op's reference stands in
        monkeypatch.setattr(llama.platform, "use_triton", lambda device: True)
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=head_dim, intermediate_size=64)
    torch.manual_seed(0)
    model = llama.Transformer(args).to(DEV).eval()
    model.fused_layers = False
    kc, vc = model.new_kv_cache(3, 64)

    class Prefill(torch.nn.Module):
        def forward(self, toks, pos, slots, kc, vc):
            return model(toks, pos, kc, vc, slots=slots, kv_len=toks.shape[1])

    toks = torch.randint(0, 32, (2, 10), device=DEV)
    pos = torch.arange(10, device=DEV).expand(2, 10).contiguous()
    slots = torch.tensor([2, 0], device=DEV)
    T = torch.export.Dim("T", min=1, max=63)
    with torch.no_grad():
        ep = torch.export.export(Prefill(), (toks, pos, slots, kc, vc), dynamic_shapes=({1: T}, {1: T}, None, None,
                                                                                         None))
        targets = {str(n.target) for n in ep.graph.nodes}
        assert ("spec_graph.prefill_attention.default" in targets) == (head_dim == 16)
        toks = torch.randint(0, 32, (2, 25), device=DEV)
        pos = torch.arange(25, device=DEV).expand(2, 25).contiguous()
        want = model(toks, pos, *model.new_kv_cache(3, 64), slots=slots, kv_len=25)
        got = ep.module()(toks, pos, slots, *model.new_kv_cache(3, 64))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_long_prompts(dtype):
    """Compiled kernel vs reference at prompts up to 8k in a 16k cache, GQA 4 and 1, with and without a window."""
    _require_kernel()
    dev = platform.current().device
    cases = ((32, 8, 64, 16384, 8191, 1), (12, 12, 64, 4096, 1500, 2), (16, 4, 128, 2048, 700, 3))
    for (Hq, Hkv, D, Lc, T, B) in cases:
        q, k, v, _ = _build(B, T, Hq, Hkv, D, Lc, B, dtype, 1)
        q, k, v = q.to(dev), k.to(dev), v.to(dev)
        pos = torch.arange(T, device=dev).expand(B, T).contiguous()
        for window in (0, 1000):
            got = prefill_attention(q, k, v, 1, None, pos, window)
            ref = torch.cat([decode_attention_ref(q[:, i:i + 512], k, v, 1, None, pos[:, i:i + 512], window)
                             for i in range(0, T, 512)], dim=1)  # in chunks: the reference's scores are [T, Lc]
            assert _close(got, ref, dtype), (Hq, Lc, T, window, (got.float() - ref.float()).abs().max())
