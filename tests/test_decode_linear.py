"""decode_linear / decode_gate_up / decode_qkv_rope: the Triton kernel against its torch references, and the
fused decoder layer against the module path.

Same interpreter arrangement as test_attention.py: on a CPU machine the kernels run under
TRITON_INTERPRET=1 (in a fresh process if triton was imported too early); on a GPU the compiled kernels run.
"""
from helpers import interpreter_before_triton

_ENV_BEFORE = interpreter_before_triton()  # before anything below imports triton

import contextlib  # noqa: E402
import importlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from helpers import (interpreter_while_testing, kernel_setting, require_kernel, rows_apart,  # noqa: E402
                     run_compiled_script, run_module_in_fresh_process, strided_copy)

_dl = importlib.import_module("spec_graph.kernels.decode_linear")
_ll = importlib.import_module("spec_graph.kernels.linear_launch")
from spec_graph import platform  # noqa: E402
from spec_graph.kernels.decode_linear import (  # noqa: E402
    decode_gate_up, decode_gate_up_ref, decode_linear, decode_linear_ref, decode_qkv_rope, decode_qkv_rope_ref,
    rope_ref)
from spec_graph.kernels.counters import SYNC_SLOTS, new_sync  # noqa: E402

COMPILED, INTERPRETER_BUILDS, DEV, NEEDS_FRESH_PROCESS = kernel_setting(_dl._decode_linear_kernel, _ENV_BEFORE)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# bf16: one rounding of the output apart (fp32 sums in another order can round the other way)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on_while_testing():
    with interpreter_while_testing(DEV.type == "cpu" and INTERPRETER_BUILDS, _ENV_BEFORE):
        yield


@contextlib.contextmanager
def launch(dot, block_n, block_k, split=1):
    """The kernels' launch configuration set (tensor-core or CUDA-core sums, tile sizes, programs per column
    block), restored afterwards."""
    saved = dict(_ll.LAUNCH)
    _ll.LAUNCH.update(DOT=dot, BLOCK_N=block_n if dot else block_n // 4, BLOCK_K=block_k, SPLIT_K=split)
    try:
        yield
    finally:
        _ll.LAUNCH.clear()
        _ll.LAUNCH.update(saved)


def _require_kernel():
    require_kernel(_dl, _dl._decode_linear_kernel, DEV, NEEDS_FRESH_PROCESS,
                   "test_decode_linear_suite_in_a_fresh_process")


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernels run in this process")
def test_decode_linear_suite_in_a_fresh_process():
    run_module_in_fresh_process(__file__)


def _close(a, b, dtype) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **TOL[dtype])


def _rope_tables(B, T, D, dtype, g):
    pos = torch.randint(0, 4096, (B, T), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = pos[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@st.composite
def linear_case(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 5))
    dot = draw(st.booleans())
    K = draw(st.sampled_from([16, 24, 48, 64, 100, 128]))
    block_n = draw(st.sampled_from([16, 32]))
    block_k = draw(st.sampled_from([16, 32, 64]))
    split = draw(st.sampled_from([1, 2, 3, 4, 8]))  # split-K; with K's tiles, uneven or fewer splits too
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    bias, norm = draw(st.booleans()), draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return B, T, K, (dot, block_n, block_k, split), dtype, bias, norm, seed


def _inputs(B, T, K, N, dtype, bias, norm, g):
    x = torch.randn(B, T, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype) if norm else None
    return x, w, b, nw


def _dev(*xs):
    return [x.to(DEV) if isinstance(x, torch.Tensor) else x for x in xs]


@settings(max_examples=25, **SETTINGS)
@given(linear_case(), st.integers(1, 70), st.booleans())
def test_linear_matches_reference(case, N, residual):
    _require_kernel()
    B, T, K, conf, dtype, bias, norm, seed = case
    g = torch.Generator().manual_seed(seed)
    x, w, b, nw = _inputs(B, T, K, N, dtype, bias, norm, g)
    r = torch.randn(B, T, N, generator=g).to(dtype) if residual else None
    args = _dev(x, w, b, nw, 1e-5, r)
    sync = new_sync(DEV)
    with launch(*conf):
        got = decode_linear(*args, sync=sync)
    ref = decode_linear_ref(*args)
    assert _close(got, ref, dtype), (got.float() - ref.float()).abs().max()
    assert not sync.any()  # every split launch leaves its counters at zero


@settings(max_examples=20, **SETTINGS)
@given(linear_case(), st.integers(1, 40))
def test_gate_up_matches_reference(case, inter):
    _require_kernel()
    B, T, K, conf, dtype, bias, norm, seed = case
    g = torch.Generator().manual_seed(seed)
    x, w, b, nw = _inputs(B, T, K, 2 * inter, dtype, bias, norm, g)
    args = _dev(x, w, b, nw, 1e-6)
    sync = new_sync(DEV)
    with launch(*conf):
        got = decode_gate_up(*args, sync=sync)
    ref = decode_gate_up_ref(*args)
    assert _close(got, ref, dtype), (got.float() - ref.float()).abs().max()
    assert not sync.any()


@settings(max_examples=20, **SETTINGS)
@given(linear_case(), st.sampled_from([4, 8, 16, 32]), st.integers(1, 4), st.integers(1, 2), st.integers(1, 3))
def test_qkv_rope_matches_reference(case, D, groups, kv, extra):
    """q heads and k heads roped, v heads not; `extra` trailing unroped heads stand for v."""
    _require_kernel()
    B, T, K, conf, dtype, bias, norm, seed = case
    g = torch.Generator().manual_seed(seed)
    rope_heads = kv * groups + kv
    x, w, b, nw = _inputs(B, T, K, (rope_heads + extra) * D, dtype, bias, norm, g)
    cos, sin = _rope_tables(B, T, D, dtype, g)
    args = _dev(x, w, b, nw, 1e-6, cos, sin, rope_heads, D)
    sync = new_sync(DEV)
    with launch(*conf):
        got = decode_qkv_rope(*args, sync=sync)
    ref = decode_qkv_rope_ref(*args)
    if dtype == torch.bfloat16:  # a product rounded the other way (one bf16 step of it) moves through RoPE's mix
        bound = 2 ** -7 * decode_linear_ref(*args[:5]).float().abs().max().item() + 1e-2
        assert (got.float() - ref.float()).abs().max().item() <= bound
    else:
        assert _close(got, ref, dtype), (got.float() - ref.float()).abs().max()
    assert not sync.any()


def test_split_k_meets_once_per_column_block():
    """Split-K: each of a column block's programs counts itself once; the last adds every partial and resets the
    count, so a second launch reuses the counters. The control: a counter left stale (100) by an earlier launch
    never reaches the last count, so that block is never finished or reset (it ends at 104), while the other
    blocks still equal the reference."""
    _require_kernel()
    g = torch.Generator().manual_seed(11)
    x, w, b, nw = _dev(*_inputs(2, 3, 128, 48, torch.float32, True, True, g))
    ref = decode_linear_ref(x, w, b, nw, 1e-6)
    with launch(True, 16, 16, split=4):
        sync = new_sync(DEV)
        got = [decode_linear(x, w, b, nw, 1e-6, sync=sync) for _ in range(2)]  # a second launch reuses the counts
        assert all(_close(y, ref, torch.float32) for y in got) and not sync.any()
        sync[0] = 100
        stale = decode_linear(x, w, b, nw, 1e-6, sync=sync)
    assert sync[0].item() == 104 and not sync[1:].any()
    assert _close(stale[..., 16:], ref[..., 16:], torch.float32)  # the other column blocks met as they should


def _record_launches(monkeypatch, *keys) -> list:
    """The list that each later kernel launch appends its `keys` constexprs to (a tuple per launch)."""
    seen, real = [], _dl.wrap_triton

    def spy(kernel):
        launcher = real(kernel)

        class Grid:
            def __getitem__(self, grid):
                return lambda *a, **kw: (seen.append(tuple(kw[k] for k in keys)), launcher[grid](*a, **kw))[1]
        return Grid()
    monkeypatch.setattr(_dl, "wrap_triton", spy)
    return seen


@pytest.mark.parametrize("norm_block, unroll", [(16, 1), (64, 1), (256, 1), (16, 4), (32, 2), (16, 8)])
def test_norm_sums_any_block(norm_block, unroll, monkeypatch):
    """The norm's sum of squares read in steps of NORM_BLOCK_K columns (K = 96: a partial last step at 64; 256
    rounds down to one masked step of 128), NORM_UNROLL steps at a time (16 x 4 and 32 x 2: a last group with
    masked steps; 16 x 8: one group, its last two steps empty), equals the reference, and the launch hands the
    kernel that step. The control: with eps taken as 1.0 instead the outputs differ (the norm's statistics
    reach the output)."""
    _require_kernel()
    monkeypatch.setattr(_ll, "NORM_BLOCK_K", norm_block)
    monkeypatch.setattr(_ll, "NORM_UNROLL", unroll)
    steps = _record_launches(monkeypatch, "NORM_BLOCK", "NORM_UNROLL")
    g = torch.Generator().manual_seed(5)
    x, w, b, nw = _dev(*_inputs(1, 3, 96, 40, torch.float32, False, True, g))
    x = x * 0.05  # sums of squares near eps: a wrong one shows
    with launch(True, 16, 32):
        got = decode_gate_up(x, w, b, nw, 1e-3)
    assert steps == [(min(norm_block, 128), unroll)]
    assert _close(got, decode_gate_up_ref(x, w, b, nw, 1e-3), torch.float32)
    assert not _close(got, decode_gate_up_ref(x, w, b, nw, 1.0), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [1100, 2100])
def test_one_row_default_launch_sums_on_cuda_cores(dtype, K, monkeypatch):
    """With no launch override, one row takes CUDA-core sums, unsplit, for every layer's kind, and equals the
    references, the k/v cache writes included: K = 1100 in one step (a 2048 tile, masked: the norm's mean must
    divide by K, not the tile), K = 2100 in a loop over 2 x 1024 tiles (two full, then a masked one). Two rows
    and a vocabulary head (not a gate_up as wide) take tensor cores. The control: the last of x's columns
    changed, the output changes (the masked tile is read)."""
    _require_kernel()
    assert _ll.launch_config(1, 2048, 2048, False, 2, 132) == (False, 2, 2048, 8, 2, 1)  # one step, 8 warps
    assert _ll.launch_config(1, 2048, 5632, False, 2, 132) == (False, 2, 1024, 4, 2, 1)
    assert _ll.launch_config(1, 1536, 2048, True, 4, 132, rope=True)[:3] == (False, 2, 2048)  # fp32 too
    assert _ll.launch_config(2, 2048, 2048, False, 2, 132)[0]
    assert _ll.launch_config(1, _ll.VOCAB_COLS, 2048, False)[0] and not _ll.launch_config(1, _ll.VOCAB_COLS - 1,
                                                                                          2048, False)[0]
    assert not _ll.launch_config(1, _ll.VOCAB_COLS, 2048, True)[0]
    tiles = _record_launches(monkeypatch, "DOT", "BLOCK_N", "BLOCK_K", "SPLIT_K", "ONE_STEP")
    g = torch.Generator().manual_seed(5)
    D, Hq, Hkv, Lc = 16, 4, 1, 12
    x, w, b, nw = _dev(*_inputs(1, 1, K, (Hq + 2 * Hkv) * D, dtype, True, True, g))
    r = _dev(torch.randn(1, 1, (Hq + 2 * Hkv) * D, generator=g).to(dtype))[0]
    cos, sin = _dev(*_rope_tables(1, 1, D, dtype, g))
    caches = [torch.randn(2, 3, Hkv, Lc, D, generator=g).to(dtype).to(DEV) for _ in range(2)]
    kc, vc = (c.clone() for c in caches)
    slots, positions = torch.tensor([2], device=DEV), torch.tensor([[5]], device=DEV)
    sync = new_sync(DEV)
    got = [decode_linear(x, w, b, residual=r, sync=sync), decode_gate_up(x, w, b, nw, 1e-6, sync=sync),
           decode_qkv_rope(x, w, b, nw, 1e-6, cos, sin, Hq + Hkv, D, sync=sync),
           _dl.decode_qkv_rope_cache(x, w, b, nw, 1e-6, cos, sin, Hq, D, kc, vc, 1, slots, positions, sync=sync)]
    qkv = decode_qkv_rope_ref(x, w, b, nw, 1e-6, cos, sin, Hq + Hkv, D)
    want = [decode_linear_ref(x, w, b, residual=r), decode_gate_up_ref(x, w, b, nw, 1e-6), qkv,
            qkv[..., :Hq * D].contiguous()]
    one_step = K <= _ll.ONE_STEP_K
    assert tiles == [(False, 2, 2048 if one_step else 1024, 1, one_step)] * 4 and not sync.any()

    def close(a, c):  # bf16: within a rounding of the largest output (a product rounded the other way moves)
        bound = 1e-4 if dtype == torch.float32 else 2 ** -7 * c.float().abs().max().item() + 1e-2
        return a.shape == c.shape and (a.float() - c.float()).abs().max().item() <= bound
    assert all(close(a, c) for a, c in zip(got, want))
    want_k, want_v = (c.clone() for c in caches)
    k, v = qkv[..., Hq * D:].split(Hkv * D, dim=-1)
    _dl.write_kv_ref(want_k, want_v, 1, slots, positions, k.reshape(1, 1, Hkv, D), v.reshape(1, 1, Hkv, D))
    assert close(kc, want_k) and close(vc, want_v) and torch.equal(kc[:, :2], caches[0][:, :2])
    x2 = x.clone()
    x2[..., -1] += 1.0
    assert not close(decode_linear(x2, w, b, residual=r, sync=sync), want[0])


def test_few_rows_sum_in_one_step_when_set(monkeypatch):
    """ONE_STEP_ROWS raised to 5: five rows (one row block of 8, its 3 padding rows skipped) sum on CUDA cores in
    one step, a row at a time, each normed from its own statistics, and equal the references; K past ONE_STEP_K
    and six rows stay on tensor cores. The default keeps five rows on tensor cores."""
    _require_kernel()
    assert _ll.launch_config(5, 2048, 2048, False, 2, 132)[0]
    monkeypatch.setattr(_ll, "ONE_STEP_ROWS", 5)
    monkeypatch.setattr(_ll, "ONE_STEP_ROWS_WEIGHTS", float("inf"))
    assert _ll.launch_config(5, 2048, 2048, False, 2, 132) == (False, 2, 2048, 8, 2, 1)
    assert _ll.launch_config(5, 2048, 5632, False, 2, 132)[0] and _ll.launch_config(6, 2048, 2048, False, 2, 132)[0]
    tiles = _record_launches(monkeypatch, "DOT", "BLOCK_M", "ONE_STEP")
    g = torch.Generator().manual_seed(7)
    K, D, heads = 300, 16, 3
    x, w, b, nw = _dev(*_inputs(1, 5, K, heads * D, torch.float32, True, True, g))
    x = x * torch.arange(1, 6, device=DEV, dtype=x.dtype)[None, :, None]  # rows of other scales: per-row norms
    r = _dev(torch.randn(1, 5, heads * D, generator=g))[0]
    cos, sin = _dev(*_rope_tables(1, 5, D, torch.float32, g))
    got = [decode_linear(x, w, b, residual=r), decode_gate_up(x, w, b, nw, 1e-6),
           decode_qkv_rope(x, w, b, nw, 1e-6, cos, sin, heads, D)]
    want = [decode_linear_ref(x, w, b, residual=r), decode_gate_up_ref(x, w, b, nw, 1e-6),
            decode_qkv_rope_ref(x, w, b, nw, 1e-6, cos, sin, heads, D)]
    assert tiles == [(False, 8, True)] * 3
    assert all(_close(a, c, torch.float32) for a, c in zip(got, want))


def test_two_rows_of_small_products_sum_on_cuda_cores_by_default():
    """The default rule (bench_step's pair at two rows: the draft's 2-token forward on CUDA cores, the target's
    products on tensor cores): up to ONE_STEP_ROWS rows, K within ONE_STEP_K and fewer weight elements than
    ONE_STEP_ROWS_WEIGHTS."""
    cfg = lambda rows, cols, k, paired=False: _ll.launch_config(rows, cols, k, paired, 2, 132)  # noqa: E731
    for cols, k, paired in ((640, 768, True), (768, 768, False), (2048, 768, True), (768, 2048, False)):  # draft
        assert not cfg(2, cols, k, paired)[0] and cfg(3, cols, k, paired)[0], (cols, k, paired)
    for cols, k, paired in ((1536, 2048, True), (2048, 2048, False), (5632, 2048, True), (2048, 5632, False)):
        assert cfg(2, cols, k, paired)[0] and not cfg(1, cols, k, paired)[0] or k > _ll.ONE_STEP_K, (cols, k)


def test_split_tiles_by_kind():
    """Tensor-core launches at 2-9 rows split K on each kind's SPLIT_TILES: a 1B target's qkv on (64, 128), 8
    warps, 4 programs of 4 K tiles; its o_proj (K = N) on (32, 128) split 4; down_proj (K >= 2N) on (32, 64). The
    draft's qkv is too short for 4 tiles of 128 per program and takes the next tiles; its o_proj stays unsplit.
    No multiprocessor count, no split."""
    cfg = lambda rows, cols, k, paired=False, sms=132: _ll.launch_config(rows, cols, k, paired, 2, sms,  # noqa: E731
                                                                         rope=paired and cols < 2 * k)
    for rows in (2, 5, 9):
        assert cfg(rows, 1536, 2048, True) == (True, 64, 128, 8, 3, 4)
        assert cfg(rows, 2048, 2048) == (True, 32, 128, 4, 4, 4)
        assert cfg(rows, 2048, 5632) == (True, 32, 64, 4, 4, 8)
        assert cfg(rows, 1536, 2048, True, sms=0)[-1] == 1
        if rows > _ll.ONE_STEP_ROWS:  # the draft's 2 rows sum on CUDA cores
            assert cfg(rows, 640, 768, True) == (True, 32, 64, 4, 3, 4) and cfg(rows, 768, 768)[::5] == (True, 1)
    assert cfg(1, 1536, 2048, True) == (False, 2, 2048, 8, 2, 1)  # one row: CUDA cores, unsplit


def test_broken_epilogues_are_caught():
    """The comparisons can fail: each reference with one part of its math changed differs from the kernel."""
    _require_kernel()
    g = torch.Generator().manual_seed(3)
    B, T, K, D, dtype = 2, 5, 64, 16, torch.float32
    x, w, b, nw = _dev(*_inputs(B, T, K, 5 * D, dtype, True, True, g))
    cos, sin = _dev(*_rope_tables(B, T, D, dtype, g))
    got = decode_qkv_rope(x, w, b, nw, 1e-6, cos, sin, 4, D)
    assert _close(got, decode_qkv_rope_ref(x, w, b, nw, 1e-6, cos, sin, 4, D), dtype)
    assert not _close(got, decode_qkv_rope_ref(x, w, b, nw, 1e-6, cos, sin, 5, D), dtype)  # v roped too
    assert not _close(got, decode_qkv_rope_ref(x, w, b, nw, 1e-6, cos, sin, 3, D), dtype)  # a k head not roped
    assert not _close(got, decode_qkv_rope_ref(x, w, b, nw, 1e-6, sin, cos, 4, D), dtype)  # cos/sin swapped
    assert not _close(got, decode_qkv_rope_ref(x, w, b, None, 1e-6, cos, sin, 4, D), dtype)  # norm left out

    w2 = torch.randn(w.shape, generator=g).to(DEV) / K**0.5
    gu = decode_gate_up(x, torch.cat((w, w2)), None, nw, 1e-6)
    assert _close(gu, decode_gate_up_ref(x, torch.cat((w, w2)), None, nw, 1e-6), dtype)
    assert not _close(gu, decode_gate_up_ref(x, torch.cat((w2, w)), None, nw, 1e-6), dtype)  # silu on up, not gate

    r = torch.randn(B, T, 5 * D, generator=g).to(DEV)
    y = decode_linear(x, w, b, nw, 1e-6, r)
    assert _close(y, decode_linear_ref(x, w, b, nw, 1e-6, r), dtype)
    assert not _close(y, decode_linear_ref(x, w, b, nw, 1e-6, None), dtype)  # residual dropped
    assert not _close(y, decode_linear_ref(x, w, b, nw, 1.0, r), dtype)  # eps ignored or wrong


def test_bf16_rounds_like_the_modules():
    """bf16: the fused norm rounds where RMSNorm does (x * rstd, then weight * h), and the kernel stays within
    about one output rounding of the module math; a norm weight 5% off (the control) is well outside that."""
    _require_kernel()
    g = torch.Generator().manual_seed(5)
    x, w, b, nw = _dev(*_inputs(3, 2, 128, 48, torch.bfloat16, False, True, g))
    got = decode_linear(x, w, None, nw, 1e-6)
    ref = decode_linear_ref(x, w, None, nw, 1e-6)
    assert _close(got, ref, torch.bfloat16)
    bound = 2 ** -6 * ref.float().abs().max().item()
    assert (got.float() - ref.float()).abs().max().item() <= bound
    off = decode_linear_ref(x, w, None, nw * 1.05, 1e-6)
    assert (got.float() - off.float()).abs().max().item() > bound


def test_qkv_cache_write_skips_positions_outside_the_cache():
    """decode_qkv_rope_cache writes k and v at each row's slot and position, as write_kv_ref does, and writes
    nothing for a position outside the cache (here Lc, whose slot-0 address is head 1's position 0: a write
    that ignored the bound would change that entry). q comes back either way."""
    _require_kernel()
    g = torch.Generator().manual_seed(21)
    B, T, H, D, Hq, Hkv, Lc = 2, 3, 64, 16, 4, 2, 12
    x, w, b, nw = _dev(*_inputs(B, T, H, (Hq + 2 * Hkv) * D, torch.float32, True, True, g))
    cos, sin = _dev(*_rope_tables(B, T, D, torch.float32, g))
    caches = [torch.randn(2, 3, Hkv, Lc, D, generator=g).to(DEV) for _ in range(2)]
    slots = torch.tensor([0, 2], device=DEV)
    positions = torch.tensor([[9, 10, Lc], [4, 5, 6]], device=DEV)
    kc, vc = (c.clone() for c in caches)
    q = _dl.decode_qkv_rope_cache(x, w, b, nw, 1e-6, cos, sin, Hq, D, kc, vc, 1, slots, positions)
    y = decode_qkv_rope_ref(x, w, b, nw, 1e-6, cos, sin, Hq + Hkv, D)
    q_ref, k, v = y.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    assert _close(q, q_ref.contiguous(), torch.float32)
    want_k, want_v = (c.clone() for c in caches)
    # row 0's last position is out of range: only its first two are written
    _dl.write_kv_ref(want_k, want_v, 1, slots[:1], positions[:1, :2], k[:1, :2].reshape(1, 2, Hkv, D),
                     v[:1, :2].reshape(1, 2, Hkv, D))
    _dl.write_kv_ref(want_k, want_v, 1, slots[1:], positions[1:], k[1:].reshape(1, T, Hkv, D),
                     v[1:].reshape(1, T, Hkv, D))
    assert torch.allclose(kc, want_k, atol=1e-5) and torch.allclose(vc, want_v, atol=1e-5)


def test_rows_above_the_limit_are_refused():
    _require_kernel()
    x = torch.zeros(_dl.MAX_ROWS + 1, 16, device=DEV)
    with pytest.raises(ValueError, match="at most"):
        decode_linear(x, torch.zeros(16, 16, device=DEV))


def test_rope_ref_is_llama_apply_rope():
    from spec_graph.models.llama import apply_rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 16, generator=g)
    cos, sin = _rope_tables(2, 3, 16, torch.float32, g)
    assert torch.equal(rope_ref(x, cos[:, :, None], sin[:, :, None]), apply_rope(x, cos[:, :, None], sin[:, :, None]))


def test_ops_registered_and_functional():
    """The ops mutate nothing but their split-K counters (`sync`), which they leave as they found them."""
    for name in ("decode_linear", "decode_gate_up", "decode_qkv_rope"):
        schema = str(getattr(torch.ops.spec_graph, name).default._schema)
        assert schema.count("!") == 1 and "!)? sync)" in schema and "=" not in schema, schema
    m = dict(device="meta")
    out = decode_qkv_rope(torch.empty(2, 5, 32, **m), torch.empty(96, 32, **m), None, torch.empty(32, **m), 1e-6,
                          torch.empty(2, 5, 16, **m), torch.empty(2, 5, 16, **m), 4, 16)
    assert out.shape == (2, 5, 96) and out.device.type == "meta"


# ------------------------------------------------------------ the fused decoder layer
def _layer_model(dtype, arch="LlamaForCausalLM", bias=False):
    from spec_graph.models.config import ModelArgs
    from spec_graph.models.llama import Transformer

    args = ModelArgs(architecture=arch, vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=96, qkv_bias=bias)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        for layer in model.model.layers:  # RMSNorm weights away from 1, so a dropped norm weight shows
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return model.to(dtype).to(DEV)


def _forward(model, fused: bool, monkeypatch, tokens, positions, cache, slots=None):
    from spec_graph.models import llama

    monkeypatch.setattr(llama, "FUSED_LAYERS", fused)
    kc, vc = (c.clone() for c in cache)
    with torch.no_grad():
        return model(tokens, positions, kc, vc, slots), kc, vc


@pytest.mark.parametrize("dtype,bias,T,slotted,split,B", [
    (torch.float32, False, 5, False, False, 2), (torch.float32, True, 3, False, False, 2),
    (torch.bfloat16, False, 5, False, False, 2), (torch.bfloat16, True, 1, False, False, 2),
    (torch.float32, False, 3, True, False, 2), (torch.float32, True, 5, True, True, 2),
    (torch.bfloat16, False, 1, False, True, 2), (torch.float32, True, 1, True, False, 1),
    (torch.bfloat16, False, 1, False, False, 1), (torch.float32, True, 1, True, False, 2)])
def test_fused_layers_equal_module_path(dtype, bias, T, slotted, split, B, monkeypatch):
    """A verify (T=5: 10 rows) or draft forward (T=1, 3: 2 and 6 rows) of two batch rows at
    different lengths, or a one-row forward (B=1, T=1: the CUDA-core launches; 2 rows of these small products
    take them too, a row at a time):
    logits and the written cache agree with FUSED_LAYERS off; with the fused kernels
    broken (residual dropped) they do not. Slotted: the rows live in cache slots 2 and 0 of 3 (the k/v
    writes follow `slots`; slot 1 stays as it was). Split: every product split-K over 4 programs per column
    block (3 for down_proj, whose 6 K tiles round to 3 ranges), through the model's shared counters (left at
    zero), and attention over 6 key ranges."""
    _require_kernel()
    model = _layer_model(dtype, bias=bias)
    if split:
        monkeypatch.setattr(_ll, "LAUNCH", dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=4))
        monkeypatch.setattr(importlib.import_module("spec_graph.kernels.attention"), "MIN_SPLIT_KEYS", 8)
    Lc = 48
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (B, T), generator=g).to(DEV)
    positions = (torch.tensor([[7], [30]])[:B] + torch.arange(T)).to(DEV)
    n_slots, slots = (3, torch.tensor([2, 0])[:B].to(DEV)) if slotted else (B, None)
    cache = [(torch.randn(2, n_slots, 2, Lc, 16, generator=g) * 0.5).to(dtype).to(DEV) for _ in range(2)]
    want, wk, wv = _forward(model, False, monkeypatch, tokens, positions, cache, slots)
    got, gk, gv = _forward(model, True, monkeypatch, tokens, positions, cache, slots)
    if slotted:
        assert torch.equal(gk[:, 1], cache[0][:, 1]) and not torch.equal(gk[:, 2], cache[0][:, 2])
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    assert torch.allclose(got, want, **tol), (got - want).abs().max()
    assert torch.allclose(gk.float(), wk.float(), **tol) and torch.allclose(gv.float(), wv.float(), **tol)
    if dtype == torch.float32:
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert model.linear_sync.shape == (SYNC_SLOTS,) and not model.linear_sync.any()

    real = _dl.decode_linear_ref
    monkeypatch.setattr(_dl, "decode_linear_ref", lambda x, w, b=None, nw=None, eps=0.0, r=None: real(x, w, b, nw, eps))
    monkeypatch.setattr(_dl, "use_kernel", lambda *a: False)  # the (broken) reference stands in for the kernel
    bad, _, _ = _forward(model, True, monkeypatch, tokens, positions, cache, slots)
    assert not torch.allclose(bad, want, **tol)


def _launch_log(monkeypatch) -> list:
    """The epilogue mode of every fused kernel launch from now on, in order."""
    calls = []
    real = _dl._launch
    monkeypatch.setattr(_dl, "_launch", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    return calls


def test_prefill_rows_take_the_module_path(monkeypatch):
    """More rows than the kernels take run nn.Linear: no fused op is called. 2 x 9 rows: the attention op still
    runs (2 query heads per KV head x 9 positions), so the row limit alone decides."""
    _require_kernel()
    calls = _launch_log(monkeypatch)
    model = _layer_model(torch.float32)
    B, T = 2, _dl.MAX_ROWS // 2 + 1
    cache = [torch.zeros(2, B, 2, 80, 16, device=DEV) for _ in range(2)]
    tokens = torch.zeros(B, T, dtype=torch.long, device=DEV)
    positions = torch.arange(T, device=DEV).expand(B, T).contiguous()
    _forward(model, True, monkeypatch, tokens, positions, cache)
    assert calls == []
    _forward(model, True, monkeypatch, tokens[:, :4], positions[:, :4], cache)
    assert sorted(set(calls)) == [_dl.PLAIN, _dl.SILU_MUL, _dl.ROPE]


def test_per_model_switch(monkeypatch):
    """Transformer.fused_layers turns the fused kernels on or off for one model, over FUSED_LAYERS."""
    _require_kernel()
    from spec_graph.models import llama

    calls = _launch_log(monkeypatch)
    model = _layer_model(torch.float32)
    cache = [torch.zeros(2, 1, 2, 40, 16, device=DEV) for _ in range(2)]
    tokens = torch.zeros(1, 2, dtype=torch.long, device=DEV)
    positions = torch.arange(2, device=DEV)[None]
    for flag, default, used in ((None, True, True), (False, True, False), (True, False, True), (None, False, False)):
        calls.clear()
        model.fused_layers = flag
        monkeypatch.setattr(llama, "FUSED_LAYERS", default)
        with torch.no_grad():
            model(tokens, positions, *(c.clone() for c in cache))
        assert bool(calls) == used, (flag, default)



_EXPORT_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, "tests")
import test_decode_linear as t
from spec_graph.kernels import attention, decode_linear as dl
from spec_graph.models import llama

T, naive = int(sys.argv[1]), sys.argv[2] == "naive"
for mod in (dl, attention):
    mod.use_kernel = lambda kernel, x: True  # the kernels' path, as on a GPU (traced, never run)
llama.platform.use_triton = lambda device: True
if naive:  # asks the symbolic row count: a guard
    llama.fused_rows_ok = lambda x: x.numel() // x.shape[-1] <= dl.MAX_ROWS
model = t._layer_model(torch.float32)

class Forward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, kc, vc):
        return self.model(tokens, positions, kc, vc)

dev = next(model.parameters()).device  # the test device: a GPU where there is one
kc, vc = (torch.zeros(2, 4, 2, 32, 16, device=dev) for _ in range(2))
args = (torch.zeros(4, T, dtype=torch.long, device=dev), torch.arange(T, device=dev).expand(4, T).contiguous() + 8,
        kc, vc)
batch = torch.export.Dim("B", min=1, max=4)
try:
    with torch.no_grad():
        ep = torch.export.export(Forward(), args, dynamic_shapes=({0: batch}, {0: batch}, None, None), strict=False)
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)[:2000]}))
else:
    ops = sorted({str(n.target).split(".")[1] for n in ep.graph.nodes if str(n.target).startswith("spec_graph.")})
    print(json.dumps({"ops": ops, "ranges": [[int(r.lower), int(r.upper)] for r in ep.range_constraints.values()]}))
"""


def _export_in_fresh_process(T: int, variant: str) -> dict:
    return run_compiled_script(_EXPORT_SCRIPT, T, variant)


@pytest.mark.parametrize("T,fused_ops", [(3, True), (5, False)])
def test_export_keeps_a_symbolic_batch(T, fused_ops):
    """torch.export of a decode forward with the batch symbolic over 1..4 (as the exported step has it), traced
    as on a GPU: 4 x 3 rows fit the fused kernels, so their ops are in the program; 4 x 5 do not, so the layers
    take nn.Linear. Either way the batch stays symbolic. A rows test that asks the symbolic row count where the
    range cannot answer (a guard) specialises the batch and fails the export."""
    got = _export_in_fresh_process(T, "as is")
    assert got["ops"] == (["decode_attention", "decode_gate_up", "decode_linear", "decode_qkv_rope_cache"] if fused_ops
                          else ["decode_attention"]), got
    assert got["ranges"] == [[1, 4]], got
    if not fused_ops:  # 4 x 5 rows may or may not fit: only a guard on the batch could say
        bad = _export_in_fresh_process(T, "naive")
        assert "error" in bad and re.search(r"\bB\b", bad["message"]), bad  # refused over the batch dim B


def test_strided_bias_and_norm_weight(monkeypatch):
    """The ops take any strides: a bias and a norm weight that are every other element of a larger tensor."""
    _require_kernel()
    torch.manual_seed(0)
    x = torch.randn(3, 64, device=DEV)
    w = torch.randn(48, 64, device=DEV) * 0.1
    b = torch.randn(96, device=DEV)[::2]
    nw = torch.rand(128, device=DEV)[::2] + 0.5
    for fn, ref in ((decode_linear, decode_linear_ref), (decode_gate_up, decode_gate_up_ref)):
        torch.testing.assert_close(fn(x, w, b, nw, 1e-6), ref(x, w, b, nw, 1e-6), **TOL[torch.float32])


def test_strided_inputs_of_every_op():
    """Each op with every tensor input strided (a compiled graph may hand an op any layout: the engine's step keeps
    its ops opaque) gives what it gives on contiguous copies, bit for bit, caches written alike."""
    _require_kernel()
    g = torch.Generator().manual_seed(3)
    B, T, H, D, Hq, Hkv, Lc = 2, 3, 64, 16, 4, 2, 12
    x, w, b, nw = _dev(*_inputs(B, T, H, (Hq + 2 * Hkv) * D, torch.float32, True, True, g))
    cos, sin = _dev(*_rope_tables(B, T, D, torch.float32, g))
    res = torch.randn(B, T, H, generator=g).to(DEV)
    wo = (torch.randn(H, H, generator=g) / 8).to(DEV)
    wg = (torch.randn(2 * H, H, generator=g) / 8).to(DEV)
    slots, positions = torch.tensor([2, 0], device=DEV), torch.tensor([[4, 5, 6], [9, 10, 11]], device=DEV)
    caches = [torch.randn(2, 3, Hkv, Lc, D, generator=g).to(DEV) for _ in range(2)]
    ops = ((decode_linear, (x, wo, b[:H], nw, 1e-6, res)), (decode_gate_up, (x, wg, None, nw, 1e-6)),
           (decode_qkv_rope, (x, w, b, nw, 1e-6, cos, sin, Hq + Hkv, D)))
    for op, args in ops:
        want = op(*args)
        for layout in (rows_apart, strided_copy):  # rows read in place; every stride off one
            assert torch.equal(op(*(layout(t) if isinstance(t, torch.Tensor) else t for t in args)), want), op
    S = strided_copy
    kc, vc = (c.clone() for c in caches)
    want = _dl.decode_qkv_rope_cache(x, w, b, nw, 1e-6, cos, sin, Hq, D, kc, vc, 1, slots, positions)
    with pytest.raises(ValueError, match="unit last stride"):  # the one layout refused, with a clear error
        _dl.decode_qkv_rope_cache(x, w, b, nw, 1e-6, cos, sin, Hq, D, S(caches[0]), caches[1].clone(), 1, slots,
                                  positions)
    kc2, vc2 = (c.clone() for c in caches)
    got = _dl.decode_qkv_rope_cache(S(x), S(w), S(b), S(nw), 1e-6, S(cos), S(sin), Hq, D, kc2, vc2, 1, S(slots),
                                    S(positions))
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert not torch.equal(kc, caches[0])


_SMEM_SCRIPT = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spec_graph.kernels import decode_linear as dl, linear_launch as ll

itemsize = int(sys.argv[1])
sms = 132 if itemsize == 4 else 0  # the control (2-byte tiles) unsplit: split launches take smaller tiles
fn = dl._decode_linear_kernel
out, splits = {}, []
shapes = ((dl.ROPE, 3072, 4096), (dl.SILU_MUL, 14336, 4096), (dl.PLAIN, 4096, 14336))
for rows, (mode, cols, K) in [(r, s) for r in (4, 1) for s in shapes]:
    dot, bn, bk, warps, stages, split = ll.launch_config(rows, cols, K, mode != dl.PLAIN, itemsize, sms,
                                                         rope=mode == dl.ROPE)
    splits.append(split)
    const = dict(MODE=mode, HALF=64 if mode == dl.ROPE else 1, HAS_BIAS=False, HAS_NORM=mode != dl.PLAIN,
                 HAS_RES=mode == dl.PLAIN, WRITE_KV=False, HAS_SLOTS=False, DOT=dot, IEEE=True, UPCAST=False,
                 BLOCK_M=16 if dot else 1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, NORM_BLOCK=bk,
                 NORM_UNROLL=ll.NORM_UNROLL, ONE_STEP=ll.one_step(dot, split, K, bk), CHOOSE=False, MERGE=256)
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    # tensors fp32 but for the 2-byte one-row launches (the 4-row control: the 2-byte tiles on fp32 data)
    ptr = "*bf16" if rows == 1 and itemsize == 2 else "*fp32"
    sig = {n: ("constexpr" if n in const else "*i32" if n == "sync_ptr" else "*fp32" if n == "ws_ptr"
               else ptr if n.endswith("_ptr") else "fp32" if n == "eps" else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    out[f"{rows} rows, mode {mode}"] = k.metadata.shared
assert max(splits) > 1 or not sms, splits  # the split-K path (atomics, barrier) compiles too
print(json.dumps(out))
"""


def test_fp32_launches_fit_an_sm90s_shared_memory():
    """fp32 layers of an 8B-size model, compiled for sm90 on any machine: each launch configuration (4 rows on
    tensor cores, 1 row on CUDA cores) needs at most the 227 KiB of shared memory an H100/H200 program gets. The
    2-byte tensor-core configurations used for fp32 (the control, unsplit) need more, so an fp32 model would
    fail at its first decode step. The fp32 qkv and down_proj launches are split-K ones."""
    shared = {itemsize: run_compiled_script(_SMEM_SCRIPT, itemsize, skip_without_ptxas=True) for itemsize in (4, 2)}
    assert max(shared[4].values()) <= 232448, shared
    assert max(v for k, v in shared[2].items() if k.startswith("4 rows")) > 232448, shared
    assert max(v for k, v in shared[2].items() if k.startswith("1 rows")) <= 232448, shared


def _compiled_graphs(model, T: int, batches, bound=None) -> list:
    """The spec_graph ops of each graph torch.compile makes for a forward run at these batch sizes, every size
    above 1 marked dynamic as the engine marks it, the batch said to be at most `bound` inside (None: nothing
    said)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target).split(".")[1] for n in gm.graph.nodes if "spec_graph" in str(n.target)})
        return gm.forward

    def forward(tokens, *rest):
        if bound is not None:  # as the engine's step says it
            torch._check(tokens.shape[0] <= bound)
        return model(tokens, *rest)

    torch._dynamo.reset()
    f = torch.compile(forward, backend=backend, fullgraph=True, dynamic=False)
    for B in batches:
        tokens = torch.zeros(B, T, dtype=torch.long)
        positions = torch.arange(T).expand(B, T).contiguous() + 5
        kc, vc = (torch.zeros(2, 32, 2, 32, 16) for _ in range(2))
        if B > 1:
            for t in (tokens, positions):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch.no_grad():
            f(tokens, positions, kc, vc)
    torch._dynamo.reset()
    return graphs


FUSED_OPS = {"decode_attention", "decode_qkv_rope_cache", "decode_linear", "decode_gate_up"}


@pytest.mark.parametrize("T,bound,fused", [(2, 8, True), (3, 8, False)])
def test_compile_with_a_bounded_batch_decides_by_its_range(T, bound, fused, monkeypatch):
    """The engine's step says its batch is at most its rows: batches 2..8 share one graph, which has the fused
    ops where 8 x T rows fit (T=2) and nn.Linear where they do not (T=3), without a guard either way."""
    from spec_graph.models import llama

    monkeypatch.setattr(llama.platform, "use_triton", lambda device: True)  # the path choice as on a GPU
    graphs = _compiled_graphs(_layer_model(torch.float32).cpu(), T, (2, 4, 8), bound)
    assert len(graphs) == 1, graphs
    assert (graphs[0] >= FUSED_OPS) == fused and "decode_attention" in graphs[0], graphs


@pytest.mark.parametrize("naive", [False, True])
def test_compile_with_a_symbolic_batch_adds_no_guard(naive, monkeypatch):
    """torch.compile with the batch marked dynamic without a bound: batches of 2 to 32 share one graph, in which
    the layers keep nn.Linear (the range of the batch cannot prove 16 rows or fewer); a batch of 1, specialised,
    gets the fused ops. The control asks the symbolic row count, which puts a guard on the batch: the sizes
    above 1 then take two graphs."""
    from spec_graph.models import llama

    monkeypatch.setattr(llama.platform, "use_triton", lambda device: True)  # the path choice as on a GPU
    if naive:
        monkeypatch.setattr(llama, "fused_rows_ok", lambda x: x.numel() // x.shape[-1] <= _dl.MAX_ROWS)
    graphs = _compiled_graphs(_layer_model(torch.float32).cpu(), 3, (2, 4, 8, 32, 1))
    if naive:  # 2 and 4 (3 x 4 rows fit) in one graph, 8 and 32 in another, then 1
        assert len(graphs) == 3, graphs
        return
    assert len(graphs) == 2, graphs
    assert graphs[0] == {"decode_attention"}
    assert graphs[1] >= FUSED_OPS

@pytest.mark.parametrize("max_batch_size,fused_above_1", [(8, True), (32, False)])
def test_engine_bounds_its_batch_for_the_fused_layers(max_batch_size, fused_above_1, monkeypatch, tmp_path):
    """The engine's compiled step, traced as on a GPU: the graph of the buckets above 1 has the fused ops where
    the engine's rows keep the draft forwards within 16 rows (8 rows at K=4: 8 and 16), since the step says its
    batch is at most its rows; with 32 rows it has nn.Linear. The size-1 graph has them either way."""
    import collections

    from helpers import build_tokenizer, make_checkpoint, perturbed_copy
    import spec_graph.backend as backend
    from spec_graph import SpecDecoder, SpecGraphConfig
    from spec_graph.models import llama

    tok = build_tokenizer(96)
    target = make_checkpoint(tmp_path / "t", vocab_size=96, tokenizer=tok, layers=2)
    draft = perturbed_copy(target, tmp_path / "d", noise=0.03)
    monkeypatch.setattr(llama.platform, "use_triton", lambda device: True)  # the path choice as on a GPU
    from spec_graph import kernels

    for module in kernels._kernel_modules():  # the ops run their references: the graphs are what is tested
        if hasattr(module, "use_kernel"):
            monkeypatch.setattr(module, "use_kernel", lambda kernel, t: False)
    graphs = []

    def recording(gm, example_inputs, **kw):
        graphs.append(collections.Counter(str(n.target).split(".")[1] for n in gm.graph.nodes
                                          if "spec_graph" in str(n.target)))
        return gm.forward

    monkeypatch.setattr(backend, "spec_graph_backend", recording)
    dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=4, max_len=64,
                                                                     max_batch_size=max_batch_size,
                                                                     enable_graph=True))
    torch._dynamo.reset()
    with torch.inference_mode():
        for b in (2, 4, 1):
            dec._step_fn(True)(*dec._step_args(b))
    torch._dynamo.reset()
    assert len(graphs) == 2, graphs
    above_1, size_1 = graphs
    # size 1: every layer-forward of the K+1 forwards (the verify's 5 rows fit); above 1: the draft's K forwards,
    # every layer of them (a batch bounded only by a guard met on the way would leave the first layers out)
    draft_layers, target_layers = dec.draft.args.num_layers, dec.target.args.num_layers
    assert size_1["decode_qkv_rope_cache"] == 4 * draft_layers + target_layers, size_1
    assert above_1["decode_qkv_rope_cache"] == (4 * draft_layers if fused_above_1 else 0), above_1
    assert above_1["decode_attention"] == size_1["decode_attention"]


def test_fused_linear_runs_on_cuda_not_npu(monkeypatch):
    """The fused linear kernels' grid (a program per column block) is for CUDA: triton-ascend takes one program
    per vector core, so NPU forwards keep nn.Linear even where the other Triton kernels run."""
    import types

    monkeypatch.setattr(platform, "use_triton", lambda device: True)
    assert platform.use_fused_linear(types.SimpleNamespace(type="cuda"))
    assert not platform.use_fused_linear(types.SimpleNamespace(type="npu"))
