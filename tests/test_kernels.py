"""Triton kernels vs their torch references, exactly, plus the RNG and the op registration.

Triton decides compiled-or-interpreted when it is imported. On a CPU machine:
- if nothing has imported triton yet, this module sets TRITON_INTERPRET=1 for the
  import of the kernels (interpreter builds) and again while its own tests run,
  and restores the variable in between, so other test modules keep running the
  torch references at full speed;
- if triton was imported earlier (another test module imported the kernels), the
  kernel tests run in a fresh Python process instead
  (`test_kernel_suite_in_a_fresh_process`): delegated, never silently skipped.
On a GPU machine (TRITON_INTERPRET unset or 0) the same tests run the compiled
kernels on the GPU.
"""
import os
import sys

from helpers import interpreter_before_triton

_ENV_BEFORE = interpreter_before_triton()  # before anything below imports triton

import importlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from helpers import interpreter_while_testing, kernel_setting  # noqa: E402

from spec_graph import platform  # noqa: E402
from spec_graph.kernels import (  # noqa: E402
    ACCEPT_COL,
    DRAFT_POS_BASE,
    PLACEHOLDER,
    REQUEST_ROW,
    greedy_accept_prepare,
    greedy_accept_prepare_ref,
    hash_uniform,
    prepare_next,
    prepare_next_ref,
    race_sample,
    rejection_sample,
    rejection_sample_ref,
)

# submodules by path: the package re-exports functions under two of these names
rng = importlib.import_module("spec_graph.kernels.rng")
_ga = importlib.import_module("spec_graph.kernels.greedy_accept")
_pn = importlib.import_module("spec_graph.kernels.prepare_next")
_rs = importlib.import_module("spec_graph.kernels.rejection_sample")
KERNELS = (_ga._greedy_accept_prepare_kernel, _pn._prepare_next_kernel, _rs._rejection_sample_kernel)

COMPILED, INTERPRETER_BUILDS, DEV, NEEDS_FRESH_PROCESS = kernel_setting(KERNELS[0], _ENV_BEFORE)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
I64 = dict(dtype=torch.int64, device=DEV)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on_while_testing():
    with interpreter_while_testing(DEV.type == "cpu" and INTERPRETER_BUILDS, _ENV_BEFORE):
        yield


def _t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype, device=DEV)


def _require_kernels():
    """Fail unless the ops really launch their Triton kernels on DEV (or defer to the fresh process)."""
    if NEEDS_FRESH_PROCESS:
        pytest.skip("triton was imported before this module: run by test_kernel_suite_in_a_fresh_process")
    assert platform.use_triton(DEV), "kernel tests would compare the reference with itself"
    probe = torch.zeros(1, device=DEV)
    for kern in KERNELS:
        assert rng.use_kernel(kern, probe), f"{kern} cannot run on {DEV}"


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernels run in this process")
def test_kernel_suite_in_a_fresh_process():
    """Something imported triton before TRITON_INTERPRET=1 could be set: run this module afresh."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).resolve()
    # -rs: the summary says why, should anything be skipped; this test itself is deselected there
    # (it skips itself in a process where the kernels run)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(here),
                        "-k", "not test_kernel_suite_in_a_fresh_process"],
                       cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    summary = r.stdout.strip().splitlines()[-1]  # "N passed, 1 deselected in 12.3s"
    assert re.search(r"\b[1-9]\d* passed", summary), r.stdout[-2000:]
    # the delegated run must run the whole suite: a skip there would go unseen (this test passes)
    assert not re.search(r"\b\d+ skipped", summary), r.stdout[-3000:]
    assert not re.search(r"\b\d+ (failed|errors?|xfailed|xpassed)", summary), r.stdout[-3000:]


def test_triton_path_really_runs():
    _require_kernels()


# ----------------------------------------------------------------------- RNG
def _py_mix32(x):
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & m
    x ^= x >> 15
    x = (x * 0x735A2D97) & m
    return x ^ (x >> 15)


def _py_hash_uniform(seed, step, row, pos, col):
    """The contract's formula on Python ints (an independent oracle)."""
    m = 0xFFFFFFFF
    h = _py_mix32((seed & m) ^ 0x9E3779B9)
    h = _py_mix32(h ^ ((seed >> 32) & m))
    for x in (step, row, pos, col):
        h = _py_mix32(h ^ (x & m))
    return ((h >> 9) + 0.5) * 2.0**-23  # exact in float32


def test_hash_uniform_known_values():
    # Pins the random stream: a change here changes every sampled token.
    golden = {(0, 0, 0, 0, 0): 0.2658076882362366, (1, 2, 3, 4, 5): 0.422821581363678,
              (-1, 2**40, 7, 36, ACCEPT_COL): 0.09721606969833374, (2**62 + 12345, 1, 0, 0, 3): 0.7890776991844177}
    for args, want in golden.items():
        assert hash_uniform(*args).item() == want
        assert _py_hash_uniform(*args) == want


def test_hash_uniform_torch_triton_bit_identical():
    _require_kernels()
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, -(2**62), 2**63 - 1, -(2**63)])
    n = 6000
    seed = torch.cat((special.repeat_interleave(n // len(special) + 1)[:n // 2],
                      torch.randint(-(2**63), 2**63 - 1, (n - n // 2,), generator=g)))
    step, row, pos = (torch.randint(0, 2**34, (n,), generator=g) for _ in range(3))
    col = torch.where(torch.rand(n, generator=g) < 0.2, ACCEPT_COL, torch.randint(0, 200_000, (n,), generator=g))
    wild = torch.arange(n) % 3 == 0  # any int64 in every field: only the low 32 bits may count
    step, row, pos, col = (torch.where(wild, torch.randint(-(2**63), 2**63 - 1, (n,), generator=g), t)
                           for t in (step, row, pos, col))
    args = [t.to(DEV) for t in (seed, step, row, pos, col)]
    u_torch = hash_uniform(*args)
    u_triton = rng.hash_uniform_triton(*args)
    assert u_torch.dtype == torch.float32
    assert torch.equal(u_torch, u_triton)
    for i in range(0, n, 97):  # the torch version is the contract's formula
        assert u_torch[i].item() == _py_hash_uniform(*(int(a[i]) for a in args))


def test_hash_uniform_range_and_uniformity():
    seeds = torch.arange(64, device=DEV)[:, None, None] * 0x1234567
    u = hash_uniform(seeds, 3, 5, torch.arange(8, device=DEV)[None, :, None], torch.arange(4096, device=DEV))
    assert u.shape == (64, 8, 4096)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u.float().cpu(), bins=16, min=0.0, max=1.0) / u.numel()
    assert float((hist - 1 / 16).abs().max()) < 0.003
    # neighbouring counters are uncorrelated
    flat = u.flatten().double()
    assert abs(float(torch.corrcoef(torch.stack((flat[:-1], flat[1:])))[0, 1])) < 0.01


def test_race_sample_frequencies():
    w = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 0.0], device=DEV)  # unnormalised on purpose
    n = 40_000
    weights = w.expand(n, -1)
    seeds = torch.full((n,), 1234, **I64)
    idx = race_sample(weights, seeds, torch.zeros(n, **I64), torch.arange(n, **I64), 7)
    assert idx.dtype == torch.int64 and idx.shape == (n,)
    freq = torch.bincount(idx, minlength=6).double() / n
    assert freq[0] == 0 and freq[5] == 0  # zero weight is never drawn
    assert float((freq - w.double() / w.sum()).abs().max()) < 0.015
    # pos as a tensor, and determinism
    pos = torch.full((n,), 7, **I64)
    assert torch.equal(idx, race_sample(weights, seeds, torch.zeros(n, **I64), torch.arange(n, **I64), pos))
    # all-zero row -> first index; one-hot row -> that index
    z = torch.zeros(2, 5, device=DEV)
    z[1, 3] = 0.25
    assert race_sample(z, seeds[:2], seeds[:2], seeds[:2], 0).tolist() == [0, 3]


# ------------------------------------------------------- greedy: worked example
def test_greedy_worked_example():
    _require_kernels()
    K, L = 3, 6
    draft = _t([[5, 6, 7], [5, 6, 7], [3, 3, 3], [1, 2, 3], [9, 9, 9], [4, 4, 4]])
    target = _t([[5, 6, 9, 4], [5, 6, 7, 8], [3, 3, 3, 3], [1, 2, 3, 4], [9, 9, 9, 9], [2, 4, 4, 4]])
    active = _t([1, 1, 1, 1, 0, 1], torch.bool)
    tail = _t([[1, 2], [1, 2], [1, 2], [1, 2], [1, 2], [1, 2]])
    seq_lens = _t([10, 10, 10, 10, 10, 10])
    n_out = _t([0, 1, 4, 5, 0, 0])
    max_new = _t([100, 100, 6, 100, 100, 100])
    stop_ids = _t([8, PLACEHOLDER, 42])
    out0 = torch.full((6, L), 77, **I64)
    want_out = out0.clone()
    want_out[0, :3] = _t([5, 6, 9])  # mismatch at j=2: two accepted + target's token
    want_out[1, 1:5] = _t([5, 6, 7, 8])  # all accepted, bonus 8 is a stop id
    want_out[2, 4:6] = _t([3, 3])  # budget: max_new - n_out = 2
    want_out[3, 5] = 1  # out_buf full after one column
    want_out[5, 0] = 2  # none accepted
    want = (
        _t([[5, 6, 9, -1], [5, 6, 7, 8], [3, 3, 3, 3], [1, 2, 3, 4], [-1, -1, -1, -1], [2, -1, -1, -1]]),
        _t([2, 3, 3, 3, 0, 0]),  # num_accepted
        _t([1, 0, 0, 0, 0, 3]),  # num_rejected
        _t([[6, 9], [7, 8], [3, 3], [3, 4], [1, 2], [2, 2]]),  # new_tail
        _t([13, 14, 14, 14, 10, 11]),  # new_seq_lens
        _t([3, 5, 6, 9, 0, 1]),  # new_n_out
        _t([False, True, True, False, False, False], torch.bool),  # done
    )
    for fn in (greedy_accept_prepare, greedy_accept_prepare_ref):
        out = out0.clone()
        got = fn(draft, target, active, tail, seq_lens, n_out, max_new, stop_ids, out)
        for name, g, w in zip(("sampled", "acc", "rej", "tail", "seq", "n_out", "done"), got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), (fn.__name__, name, g, w)
        assert torch.equal(out, want_out), fn.__name__


def test_prepare_next_worked_example():
    _require_kernels()
    sampled = _t([[5, 6, -1, -1], [7, -1, 3, 3], [-1, -1, -1, -1], [4, 8, 5, 5], [1, 2, 3, 4]])
    active = _t([1, 1, 1, 1, 0], torch.bool)
    tail = _t([[1, 2]] * 5)
    n_out = _t([0, 0, 0, 0, 0])
    max_new = _t([10, 10, 10, 10, 10])
    stop_ids = _t([8])
    want = (_t([1, 0, 0, 3, 0]), _t([2, 3, 4, 0, 0]), _t([[5, 6], [2, 7], [1, 2], [5, 5], [1, 2]]),
            _t([2, 1, 0, 4, 0]), _t([2, 1, 0, 2, 0]), _t([False, False, False, True, False], torch.bool))
    for fn in (prepare_next, prepare_next_ref):
        out = torch.zeros((5, 4), **I64)
        got = fn(sampled, active, tail, torch.zeros(5, **I64), n_out, max_new, stop_ids, out)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (fn.__name__, g, w)
        assert out[:, :2].tolist() == [[5, 6], [7, 0], [0, 0], [4, 8], [0, 0]]


# ------------------------------------------------------ hypothesis: exact match
@st.composite
def prep_case(draw):
    B = draw(st.integers(1, 9))
    K = draw(st.integers(1, 8))
    L = draw(st.integers(1, 3 * (K + 1)))
    vocab = draw(st.integers(2, 5))  # small, so drafts often match and stop ids often hit
    modes = draw(st.lists(st.sampled_from(["mixed", "all", "none", "inactive"]), min_size=B, max_size=B))
    n_out = draw(st.lists(st.integers(0, L + 1), min_size=B, max_size=B))  # up to past the end of out_buf
    budget = draw(st.lists(st.integers(0, K + 2), min_size=B, max_size=B))
    stop = draw(st.lists(st.integers(PLACEHOLDER, vocab + 1), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**32 - 1))
    max_programs = draw(st.sampled_from([1, 2, 3, 0]))
    return B, K, L, vocab, modes, n_out, budget, stop, seed, max_programs


def _build_prep(case):
    B, K, L, vocab, modes, n_out, budget, stop, seed, max_programs = case
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (B, K + 1), generator=g)
    draft = torch.randint(0, vocab, (B, K), generator=g)
    # "mixed": a random matching prefix, then random tokens
    prefix = torch.randint(0, K + 1, (B, 1), generator=g)
    draft = torch.where(torch.arange(K)[None, :] < prefix, target[:, :K], draft)
    for b, m in enumerate(modes):
        if m == "all":
            draft[b] = target[b, :K]
        elif m == "none":
            draft[b, 0] = (target[b, 0] + 1) % vocab
    active = torch.tensor([m != "inactive" for m in modes])
    tail = torch.randint(0, vocab, (B, 2), generator=g)
    seq_lens = torch.randint(2, 1000, (B,), generator=g)
    n_out_t = torch.tensor(n_out)
    max_new = n_out_t + torch.tensor(budget) - 1  # budget - 1 < 0 exercises n_out > max_new
    out_buf = torch.randint(-5, 100, (B, L), generator=g)
    t = [x.to(DEV) for x in (draft, target, active, tail, seq_lens, n_out_t, max_new, torch.tensor(stop), out_buf)]
    return t, max_programs


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y), (i, x, y)


@settings(max_examples=120, **SETTINGS)
@given(prep_case())
def test_greedy_accept_prepare_matches_reference(case):
    _require_kernels()
    (draft, target, active, tail, seq_lens, n_out, max_new, stop, out_buf), mp = _build_prep(case)
    out_k, out_r = out_buf.clone(), out_buf.clone()
    got = greedy_accept_prepare(draft, target, active, tail, seq_lens, n_out, max_new, stop, out_k, max_programs=mp)
    ref = greedy_accept_prepare_ref(draft, target, active, tail, seq_lens, n_out, max_new, stop, out_r)
    _assert_same(got, ref)
    assert torch.equal(out_k, out_r)
    sampled, n_acc, n_rej, new_tail, new_seq, new_n_out, done = ref
    modes = case[4]
    K = draft.shape[1]
    for b, m in enumerate(modes):
        if m == "all":
            assert n_acc[b] == K and n_rej[b] == 0
        elif m == "none":
            assert n_acc[b] == 0 and n_rej[b] == K
        elif m == "inactive":
            assert torch.equal(out_r[b], out_buf[b]) and not done[b] and (sampled[b] == PLACEHOLDER).all()
            assert torch.equal(new_tail[b], tail[b]) and new_n_out[b] == n_out[b] and new_seq[b] == seq_lens[b]
    # the shared prep logic: prepare_next on greedy's `sampled` gives the same counts and state
    out_p = out_buf.clone()
    _assert_same(prepare_next(sampled, active, tail, seq_lens, n_out, max_new, stop, out_p, max_programs=mp), ref[1:])
    assert torch.equal(out_p, out_r)


@settings(max_examples=120, **SETTINGS)
@given(prep_case(), st.data())
def test_prepare_next_matches_reference(case, data):
    _require_kernels()
    (draft, target, active, tail, seq_lens, n_out, max_new, stop, out_buf), mp = _build_prep(case)
    B, K1 = target.shape
    valid = torch.tensor(data.draw(st.lists(st.integers(0, K1), min_size=B, max_size=B)), device=DEV)
    garbage = data.draw(st.booleans())  # tokens after the first PLACEHOLDER must be ignored
    j = torch.arange(K1, device=DEV)[None, :]
    sampled = torch.where(j < valid[:, None], target, PLACEHOLDER)
    if garbage:
        sampled = torch.where(j > valid[:, None], target, sampled)
    out_k, out_r = out_buf.clone(), out_buf.clone()
    got = prepare_next(sampled, active, tail, seq_lens, n_out, max_new, stop, out_k, max_programs=mp)
    ref = prepare_next_ref(sampled, active, tail, seq_lens, n_out, max_new, stop, out_r)
    _assert_same(got, ref)
    assert torch.equal(out_k, out_r)
    v = torch.where(active, valid, 0)
    assert torch.equal(ref[0], (v - 1).clamp(min=0)) and torch.equal(ref[3], seq_lens + v)


@st.composite
def rejection_case(draw):
    B = draw(st.integers(1, 9))
    K = draw(st.integers(1, 8))
    V = draw(st.sampled_from([1, 2, 3, 5, 16, 33, 64]))
    kinds = ["mixed", "all", "all_zero_bonus", "none", "inactive", "sparse"]
    modes = draw(st.lists(st.sampled_from(kinds), min_size=B, max_size=B))
    seed = draw(st.integers(0, 2**32 - 1))
    row_seeds = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=B, max_size=B))
    steps = draw(st.lists(st.integers(0, 2**40), min_size=B, max_size=B))
    max_programs = draw(st.sampled_from([1, 2, 3, 0]))
    return B, K, V, modes, seed, row_seeds, steps, max_programs


@settings(max_examples=120, **SETTINGS)
@given(rejection_case(), st.sampled_from([4, 16, _rs.MAX_BLOCK_V]))
def test_rejection_sample_matches_reference(case, block_v):
    _require_kernels()
    saved = _rs.MAX_BLOCK_V
    _rs.MAX_BLOCK_V = block_v  # small chunks walk the vocabulary loop several times
    try:
        _check_rejection(case)
    finally:
        _rs.MAX_BLOCK_V = saved


def _check_rejection(case):
    B, K, V, modes, seed, row_seeds, steps, mp = case
    g = torch.Generator().manual_seed(seed)
    dp = torch.rand(B, K, V, generator=g) ** 3
    tp = torch.rand(B, K + 1, V, generator=g) ** 3
    dp[:, :, 0] += 1e-3  # keep every row's mass positive
    tp[:, :, 0] += 1e-3
    draft = torch.randint(0, V, (B, K), generator=g)
    for b, m in enumerate(modes):
        if m in ("all", "all_zero_bonus"):  # p == q: u * q <= p always holds
            tp[b, :K] = dp[b]
            if m == "all_zero_bonus":
                tp[b, K] = 0.0  # bonus race over all-zero weights: index 0
        elif m == "none":  # target gives the first draft no mass
            tp[b, 0, draft[b, 0]] = 0.0
            tp[b, 0, (draft[b, 0] + 1) % V] += 0.5
        elif m == "sparse":  # exact zeros: q = 0 rejects; residual may vanish (fallback to target)
            dp[b] = torch.where(torch.rand(K, V, generator=g) < 0.5, 0.0, dp[b])
            tp[b] = torch.where(torch.rand(K + 1, V, generator=g) < 0.5, 0.0, tp[b])
            if V > 1 and torch.rand((), generator=g) < 0.5:
                tp[b, -1] = 0.0  # all-zero bonus row: race gives index 0
    dp = dp / dp.sum(-1, keepdim=True).clamp(min=1e-30)
    tp = tp / tp.sum(-1, keepdim=True).clamp(min=1e-30)
    active = torch.tensor([m != "inactive" for m in modes])
    args = [x.to(DEV) for x in (draft, dp, tp, torch.tensor(row_seeds), torch.tensor(steps), active)]
    got = rejection_sample(*args, max_programs=mp)
    ref = rejection_sample_ref(*args)
    _assert_same(got, ref)
    sampled, n_acc = ref
    assert sampled.dtype == torch.int64 and sampled.shape == (B, K + 1)
    for b, m in enumerate(modes):
        n = int(n_acc[b])
        if m == "inactive":
            assert n == 0 and (sampled[b] == PLACEHOLDER).all()
            continue
        assert torch.equal(sampled[b, :n], args[0][b, :n]) and (sampled[b, n + 1:] == PLACEHOLDER).all()
        assert 0 <= int(sampled[b, n]) < V
        if m in ("all", "all_zero_bonus"):
            assert n == K
        if m == "all_zero_bonus":
            assert int(sampled[b, K]) == 0
        if m == "none" and V > 1:
            assert n == 0 and int(sampled[b, 0]) != int(draft[b, 0])


def test_rejection_worked_example():
    """Acceptance boundary u * q <= p, q = 0, bonus token, residual and its fallback, inactive rows."""
    _require_kernels()
    B, K, V = 5, 2, 4
    seeds = _t([11, 22, 33, 44, 55])
    steps = _t([1, 2, 3, 4, 5])
    u = hash_uniform(seeds[:, None], steps[:, None], REQUEST_ROW, torch.arange(K, **I64)[None, :], ACCEPT_COL)
    draft = _t([[1, 2], [1, 2], [1, 2], [1, 2], [1, 2]])
    dp = torch.full((B, K, V), 0.25, device=DEV)
    tp = torch.full((B, K + 1, V), 0.25, device=DEV)
    # row 0: p == u * q exactly at both positions -> both accepted, bonus from tp[0, 2] (one-hot at 3)
    tp[0, 0, 1] = u[0, 0] * 0.25
    tp[0, 1, 2] = u[0, 1] * 0.25
    tp[0, 2] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    # row 1: p one float below u * q at j=0 -> rejected; residual is one-hot at 3
    tp[1, 0] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    tp[1, 0, 1] = torch.nextafter(u[1, 0] * 0.25, torch.tensor(0.0, device=DEV))
    # row 2: q = 0 at the draft token -> rejected even though p > 0; residual == target (one-hot 0)
    dp[2, 0] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    tp[2, 0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # row 3: j=0 accepted (p = q), j=1 rejected (p(d) = 0) with an all-zero residual max(p - q, 0)
    # -> fallback race over the target, whose only mass is at 2
    dp[3, 1] = torch.tensor([0.5, 0.0, 0.5, 0.0])
    tp[3, 1] = torch.tensor([0.0, 0.0, 0.5, 0.0])
    draft[3, 1] = 0
    active = _t([1, 1, 1, 1, 0], torch.bool)
    want_s = _t([[1, 2, 3], [3, -1, -1], [0, -1, -1], [1, 2, -1], [-1, -1, -1]])
    want_n = _t([2, 0, 0, 1, 0])
    for fn in (rejection_sample, rejection_sample_ref):
        s, n = fn(draft, dp, tp, seeds, steps, active)
        assert torch.equal(s, want_s) and torch.equal(n, want_n), (fn.__name__, s, n)


# ------------------------------------------------------------- statistics
def test_rejection_sample_keeps_target_distribution():
    n, V = 40_000, 5
    q = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1], device=DEV)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0], device=DEV)
    p_bonus = torch.tensor([0.0, 0.0, 0.5, 0.25, 0.25], device=DEV)
    rows = torch.arange(n, **I64)
    seeds = 99 + rows  # one request each
    steps = torch.full((n,), 3, **I64)
    draft = race_sample(q.expand(n, V), seeds, steps, rows, DRAFT_POS_BASE)[:, None]
    assert float((torch.bincount(draft[:, 0], minlength=V) / n - q).abs().max()) < 0.015
    dp = q.expand(n, 1, V)
    tp = torch.stack((p, p_bonus)).expand(n, 2, V)
    sampled, n_acc = rejection_sample_ref(draft, dp, tp, seeds, steps, torch.ones(n, dtype=torch.bool, device=DEV))
    freq = torch.bincount(sampled[:, 0], minlength=V).double() / n
    assert float((freq - p.double()).abs().max()) < 0.015
    assert abs(float(n_acc.double().mean()) - float(torch.minimum(p, q).sum())) < 0.015
    bonus = sampled[n_acc == 1, 1]
    assert float((torch.bincount(bonus, minlength=V).double() / bonus.numel() - p_bonus.double()).abs().max()) < 0.02
    assert (sampled[n_acc == 0, 1] == PLACEHOLDER).all()


# ---------------------------------------------------- torch.compile / export
def _small_inputs():
    g = torch.Generator().manual_seed(5)
    B, K, L, V = 5, 3, 8, 11
    target = torch.randint(0, 4, (B, K + 1), generator=g)
    draft = torch.where(torch.rand(B, K, generator=g) < 0.7, target[:, :K], torch.randint(0, 4, (B, K), generator=g))
    c = dict(draft=draft, target=target, active=torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool),
             tail=torch.randint(0, 4, (B, 2), generator=g), seq_lens=torch.full((B,), 9),
             n_out=torch.tensor([0, 2, 3, 5, 7]), max_new=torch.tensor([8, 3, 8, 8, 8]), stop=torch.tensor([3, -1]),
             dp=torch.rand(B, K, V, generator=g).softmax(-1), tp=torch.rand(B, K + 1, V, generator=g).softmax(-1),
             seeds=torch.randint(0, 2**62, (B,), generator=g), steps=torch.randint(0, 9, (B,), generator=g))
    return {k: v.to(DEV) for k, v in c.items()}, (B, L)


def _step_greedy(draft, target, active, tail, seq_lens, n_out, max_new, stop, out_buf):
    return greedy_accept_prepare(draft, target, active, tail, seq_lens, n_out, max_new, stop, out_buf, max_programs=2)


def _step_random(draft, dp, tp, seeds, steps, active, tail, seq_lens, n_out, max_new, stop, out_buf):
    sampled, n_acc = rejection_sample(draft, dp, tp, seeds, steps, active, max_programs=2)
    rest = prepare_next(sampled, active, tail, seq_lens, n_out, max_new, stop, out_buf, max_programs=2)
    first = race_sample(tp[:, 0], seeds, steps, torch.arange(draft.shape[0], device=draft.device), 0)
    return (sampled, n_acc, *rest, first)


def test_torch_compile_fullgraph_matches_eager(monkeypatch):
    if DEV.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled CPU graphs take the torch reference
    torch._dynamo.reset()
    c, (B, L) = _small_inputs()
    greedy_args = [c[k] for k in ("draft", "target", "active", "tail", "seq_lens", "n_out", "max_new", "stop")]
    random_args = [c[k] for k in ("draft", "dp", "tp", "seeds", "steps", "active", "tail", "seq_lens", "n_out",
                                  "max_new", "stop")]
    # inductor for the cheap graph; aot_eager (dynamo + functionalisation) keeps the RNG graph fast to build
    for fn, args, backend in ((_step_greedy, greedy_args, "inductor"), (_step_random, random_args, "aot_eager")):
        out_e = torch.zeros((B, L), **I64)
        out_c = torch.zeros((B, L), **I64)
        eager = fn(*args, out_e)
        compiled = torch.compile(fn, fullgraph=True, backend=backend)(*args, out_c)
        _assert_same(eager, compiled)
        assert torch.equal(out_e, out_c) and bool((out_c != 0).any())


def test_torch_export_keeps_the_op():
    class Greedy(torch.nn.Module):
        def forward(self, draft, target, active, tail, seq_lens, n_out, max_new, stop, out_buf):
            return greedy_accept_prepare(draft, target, active, tail, seq_lens, n_out, max_new, stop, out_buf)

    c, (B, L) = _small_inputs()
    args = [c[k] for k in ("draft", "target", "active", "tail", "seq_lens", "n_out", "max_new", "stop")]
    ep = torch.export.export(Greedy(), (*args, torch.zeros((B, L), **I64)))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "spec_graph.greedy_accept_prepare.default" in targets
    out_x, out_e = torch.zeros((B, L), **I64), torch.zeros((B, L), **I64)
    _assert_same(ep.module()(*args, out_x), greedy_accept_prepare(*args, out_e))
    assert torch.equal(out_x, out_e)


def test_ops_are_registered():
    for name in ("greedy_accept_prepare", "prepare_next", "rejection_sample"):
        assert hasattr(torch.ops.spec_graph, name)
    for name in ("greedy_accept_prepare", "prepare_next"):
        schema = str(getattr(torch.ops.spec_graph, name).default._schema)
        assert re.search(r"Tensor\(a\d*!\) out_buf", schema), schema  # out_buf declared mutated
        assert schema.count("!") == 1, schema
    assert "!" not in str(torch.ops.spec_graph.rejection_sample.default._schema)


@pytest.mark.parametrize("K", [1, 8])
def test_meta_shapes(K):
    B, V, L = 3, 7, 5
    m = dict(device="meta", dtype=torch.int64)
    out = greedy_accept_prepare(torch.empty(B, K, **m), torch.empty(B, K + 1, **m), torch.empty(B, dtype=torch.bool,
                                device="meta"), torch.empty(B, 2, **m), *(torch.empty(B, **m) for _ in range(3)),
                                torch.empty(2, **m), torch.empty(B, L, **m))
    assert [tuple(t.shape) for t in out] == [(B, K + 1), (B,), (B,), (B, 2), (B,), (B,), (B,)]
    assert out[-1].dtype == torch.bool
    s, n = rejection_sample(torch.empty(B, K, **m), torch.empty(B, K, V, device="meta"),
                            torch.empty(B, K + 1, V, device="meta"), torch.empty(B, **m), torch.empty(B, **m),
                            torch.empty(B, dtype=torch.bool, device="meta"))
    assert s.shape == (B, K + 1) and n.shape == (B,)


def _contract_inputs(B=2, K=3, V=5, L=8):
    i64 = dict(dtype=torch.int64)
    state = dict(active=torch.ones(B, dtype=torch.bool), tail=torch.zeros((B, 2), **i64),
                 seq_lens=torch.full((B,), 4, **i64), n_out=torch.zeros(B, **i64), max_new=torch.full((B,), L, **i64),
                 stop_ids=torch.ones(1, **i64), out_buf=torch.zeros((B, L), **i64))
    verify = dict(draft_token_ids=torch.zeros((B, K), **i64), draft_probs=torch.full((B, K, V), 1 / V),
                  target_probs=torch.full((B, K + 1, V), 1 / V), seeds=torch.zeros(B, **i64),
                  steps=torch.zeros(B, **i64), active=torch.ones(B, dtype=torch.bool))
    x, w = torch.randn(B, 1, 8), torch.randn(6, 8)
    linear = dict(x=x, w=w, b=torch.zeros(6), norm_w=torch.ones(8), eps=1e-6)
    return {"decode_linear": dict(linear, residual=torch.zeros(B, 1, 6), sync=None),
            "decode_gate_up": dict(linear, sync=None),
            "greedy_accept_prepare": dict(draft_token_ids=torch.zeros((B, K), **i64),
                                          target_argmax=torch.zeros((B, K + 1), **i64), **state),
            "prepare_next": dict(sampled=torch.zeros((B, K + 1), **i64), **state),
            "rejection_sample": verify, "block_verify": dict(verify)}


# (op, argument, how it is broken, what the message names); None: the inputs as the contract has them
CONTRACT_CASES = [
    ("greedy_accept_prepare", None, None, None),
    ("greedy_accept_prepare", "draft_token_ids", lambda t: t.float() + 0.5, "draft_token_ids must be int64"),
    ("greedy_accept_prepare", "target_argmax", lambda t: t[:, :-1], r"target_argmax must be int64 \[2, 4\]"),
    ("greedy_accept_prepare", "active", lambda t: t.long(), r"active must be bool \[2\]"),
    ("greedy_accept_prepare", "tail", lambda t: t[:, 0], r"tail must be int64 \[2, 2\]"),
    ("greedy_accept_prepare", "out_buf", lambda t: t.t().contiguous().t(), "out_buf rows must be contiguous"),
    ("greedy_accept_prepare", "stop_ids", lambda t: t.int(), r"stop_ids must be int64 \[S\]"),
    ("prepare_next", None, None, None),
    ("prepare_next", "sampled", lambda t: t.int(), r"sampled must be int64 \[B, K\+1\]"),
    ("prepare_next", "max_new", lambda t: t[:1], r"max_new must be int64 \[2\]"),
    ("prepare_next", "out_buf", lambda t: t[:1], r"out_buf must be int64 \[2, L\]"),
    ("rejection_sample", None, None, None),
    ("rejection_sample", "target_probs", lambda t: t.double(), r"target_probs must be float32 \[2, 4, 5\]"),
    ("rejection_sample", "draft_probs", lambda t: t[:, :, 0], r"draft_probs must be float32 \[2, 3, V\]"),
    ("rejection_sample", "seeds", lambda t: t.float(), r"seeds must be int64 \[2\]"),
    ("block_verify", None, None, None),
    ("block_verify", "active", lambda t: t[:1], r"active must be bool \[2\]"),
    ("block_verify", "target_probs", lambda t: t[:, :-1], r"target_probs must be float32 \[2, 4, 5\]"),
    ("decode_linear", None, None, None),
    ("decode_linear", "w", lambda t: t[:, :7], r"w must be float32 \[N, 8\] \(x's dtype and width\)"),
    ("decode_linear", "w", lambda t: t.double(), r"w must be float32 \[N, 8\]"),
    ("decode_linear", "b", lambda t: t[:5], r"b must be None or floating \[6\]"),
    ("decode_linear", "residual", lambda t: t[..., :5], r"residual must be None or floating \[2, 1, 6\]"),
    ("decode_gate_up", None, None, None),
    ("decode_gate_up", "w", lambda t: t[:5], "w must have an even number of rows"),
    ("decode_gate_up", "norm_w", lambda t: t[:4], r"norm_w must be None or floating \[8\]"),
]


@pytest.mark.parametrize("op,arg,broken,msg", CONTRACT_CASES,
                         ids=[f"{c[0]}-{c[1] or 'valid'}-{i}" for i, c in enumerate(CONTRACT_CASES)])
def test_ops_refuse_inputs_outside_their_contract(op, arg, broken, msg):
    """Each op names the argument outside its contract in one ValueError, on whichever path runs (the kernel or its
    reference), instead of a torch error from inside it or a silently wrong result (a kernel reading past a row).
    Control: the same inputs as the contract has them run."""
    importlib.import_module("spec_graph.kernels.decode_linear")  # registers the decode ops (the models import it)
    kwargs = _contract_inputs()[op]
    fn = getattr(torch.ops.spec_graph, op)
    if arg is None:
        fn(*kwargs.values())
        return
    kwargs[arg] = broken(kwargs[arg])
    with pytest.raises(ValueError, match=f"spec_graph::{op}: {msg}"):
        fn(*kwargs.values())
