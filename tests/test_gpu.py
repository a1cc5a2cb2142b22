"""GPU runs (CUDA/NPU): eager engine == HF, captured bf16 == eager bf16, N-step == 1-step, fallback,
adaptive K captured == HF, and an export of bench_step.py's pair loaded and captured on the device == the
eager engine.

The captured engine is shared: buckets above 1 share one compile, so the module compiles the step
four times (greedy and sampling, each at size 1 and at a symbolic batch)."""
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from helpers import assert_every_count, hf_greedy

from spec_graph import SpecDecoder, SpecGraphConfig
from spec_graph.cli import DEFAULT_PAIR
from spec_graph.engine import prefill_models
from spec_graph.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [list(b"def __init__(self, "), list(b"import "), list(b"    for i in range("), list(b"class Foo(object):\n"),
           list(b"return ")]


def pair_engine(**cfg):
    cfg.setdefault("num_speculative_tokens", 4)
    cfg.setdefault("max_len", 128)
    cfg.setdefault("dtype", "bfloat16")
    return SpecDecoder.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", SpecGraphConfig(**cfg))


@pytest.fixture(scope="module")
def eager_bf16():
    dec = pair_engine(enable_graph=False, max_batch_size=4)
    return [r.token_ids for r in dec.generate(PROMPTS, 48)]


def test_eager_fp32_on_device_equals_hf(llama_pair):
    target, draft = llama_pair
    dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=3, max_len=64,
                                                                     dtype="float32", enable_graph=False))
    assert dec.device.type != "cpu"
    prompts = [[5, 9, 17, 33, 2], [40, 41], [3]]
    out = dec.generate(prompts, 16)
    assert [r.token_ids for r in out] == [hf_greedy(target, p, 16) for p in prompts]
    assert_every_count(out, 3)


@pytest.mark.parametrize("fused_choice", [False, True])
def test_captured_near_draft_fp32_equals_hf(llama_pair, fused_choice, monkeypatch):
    """The compiled, captured step in fp32 with the near draft: HF's greedy tokens, every accepted count 0..K; with
    the heads' argmax folded into their kernel (FUSED_CHOICE) too."""
    from spec_graph.models import llama

    monkeypatch.setattr(llama, "FUSED_CHOICE", fused_choice)
    target, draft = llama_pair
    dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=3, max_len=64,
                                                                     dtype="float32", max_batch_size=4,
                                                                     batch_buckets=(4,)))
    assert dec.graphs is not None
    prompts = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13], [3], [60, 61, 62, 63]]
    out = dec.generate(prompts, 20)
    assert [r.token_ids for r in out] == [hf_greedy(target, p, 20) for p in prompts]
    assert set(dec.graphs.graphs) == {(True, 4, 3)} and not dec.graphs.failed
    assert_every_count(out, 3)


def test_captured_auto_k_fp32_equals_hf(llama_pair):
    """num_speculative_tokens="auto", compiled and captured: one graph per (bucket, K), each timed on the device;
    HF's greedy tokens, each step's accepted count within its K."""
    target, draft = llama_pair
    dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens="auto",
                                                                     max_speculative_tokens=2, max_len=64,
                                                                     dtype="float32", max_batch_size=4,
                                                                     batch_buckets=(4,)))
    prompts = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13], [3], [60, 61, 62, 63]]
    out = dec.generate(prompts, 20)
    assert [r.token_ids for r in out] == [hf_greedy(target, p, 20) for p in prompts]
    keys = {(True, 4, k) for k in (1, 2)}
    assert set(dec.graphs.graphs) == keys and not dec.graphs.failed and set(dec.step_times) == keys
    assert set(dec.capture_report) == {1, 2}
    assert all(r["capture_s"] > 0 and r["memory_bytes"] is not None for r in dec.capture_report.values())
    assert all(a <= k for r in out for a, k in zip(r.accepted_counts, r.k_per_step))


@pytest.fixture(scope="module")
def captured():
    return pair_engine(max_batch_size=4, batch_buckets=(1, 2, 4))


def test_captured_equals_eager_bf16(captured, eager_bf16):
    assert captured.graphs is not None
    out = captured.generate(PROMPTS, 48)
    assert set(captured.graphs.graphs) == {(True, 1, 4), (True, 2, 4), (True, 4, 4)} and not captured.graphs.failed
    assert [r.token_ids for r in out] == eager_bf16
    assert out.stats.acceptance_rate > 0.5
    assert_every_count(out, 4)


def test_slots_left_non_finite_need_no_zeroing(captured, eager_bf16):
    """On the device every forward attends to its own request's positions alone (prefills to kv_len, steps
    through the live-length kernel), so admission skips zeroing max_len positions per slot; caches full of NaN
    (5 prompts over 4 slots: one slot is reused too) still give the eager tokens."""
    assert captured._reads_live_only()
    for kv in (captured.target_kv, captured.draft_kv):
        for c in kv:
            c.fill_(float("nan"))
    out = captured.generate(PROMPTS, 48)
    assert [r.token_ids for r in out] == eager_bf16


def test_auto_k_engine_captures_in_a_fresh_process():
    """A process whose first forward is traced (an auto-K engine times its steps before any prefill runs):
    the device checks inside the models must trace as constants. torch 2.11 failed the capture ("Guard failed
    on the same frame it was created") when the Triton check's cache was a guarded dict filled during the
    trace, and the engine ran uncaptured."""
    import subprocess
    code = ("import logging, sys\nfrom spec_graph import SpecDecoder, SpecGraphConfig\n"
            "from spec_graph.cli import DEFAULT_PAIR\nlogging.basicConfig(level=logging.WARNING)\n"
            "cfg = SpecGraphConfig(num_speculative_tokens='auto', max_speculative_tokens=2, max_len=128, "
            "dtype='bfloat16', max_batch_size=1, batch_buckets=(1,))\n"
            "dec = SpecDecoder.from_pretrained(DEFAULT_PAIR / 'target', DEFAULT_PAIR / 'draft', cfg)\n"
            "out = dec.generate([list(b'import ')], 8)\n"
            "assert 1 <= len(out[0].token_ids) <= 8 and dec.graphs.graphs and not dec.graphs.failed, "
            "(dec.graphs.graphs, dec.graphs.failed)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "capture of" not in r.stderr, r.stderr[-3000:]


def test_multi_step_equals_single_step_captured(captured, eager_bf16):
    s1 = captured.generate(PROMPTS, 40, temperature=0.8, seed=3)
    captured.reset_graphs(steps_per_graph=8)
    try:
        out = captured.generate(PROMPTS, 48)
        assert [r.token_ids for r in out] == eager_bf16
        s8 = captured.generate(PROMPTS, 40, temperature=0.8, seed=3)
        assert [r.token_ids for r in s1] == [r.token_ids for r in s8]
    finally:
        captured.reset_graphs(steps_per_graph=1)


def test_oversized_batch_falls_back(captured, eager_bf16, caplog):
    # the same engine with its largest bucket (4) dropped: a batch of 4 runs the compiled step uncaptured
    buckets = captured.config.batch_buckets
    captured.config.batch_buckets = (1, 2)
    captured.reset_graphs()
    try:
        with caplog.at_level(logging.WARNING, logger="spec_graph"):
            out = captured.generate(PROMPTS, 48)
        assert set(captured.graphs.graphs) == {(True, 1, 4), (True, 2, 4)}
        assert [r.token_ids for r in out] == eager_bf16
        assert len([r for r in caplog.records if "uncaptured" in r.getMessage()]) == 1
    finally:
        captured.config.batch_buckets = buckets
        captured.reset_graphs()


def test_export_bench_pair_loaded_and_captured(tmp_path):
    # benchmarks/bench_step.py's pair (~0.85B target, 74M draft) in fp32: the export's prefill is compiled and the
    # engine's is eager, and bf16 rounding would differ. benchmarks/bench_export.py times it in bf16.
    from spec_graph.export import export_pair, load_exported

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_step

    (tdir, hf_t), (ddir, hf_d) = bench_step.make_pair(tmp_path)
    del hf_t, hf_d
    pkg = tmp_path / "bench_pair.pt2"
    meta = export_pair(tdir, ddir, pkg, num_speculative_tokens=bench_step.K, batch_sizes=(1,), max_len=256,
                       dtype="float32", progress=False)
    assert pkg.stat().st_size <= 1.1 * meta["weight_bytes"]
    runner = load_exported(pkg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (64,), generator=g).tolist() for _ in range(2)]
    out = [r.token_ids for r in runner.generate(prompts, 48)]
    assert set(runner.graphs.graphs) == {(True, 1, bench_step.K)} and not runner.graphs.failed
    del runner
    eager = SpecDecoder.from_pretrained(tdir, ddir, SpecGraphConfig(num_speculative_tokens=bench_step.K, max_len=256,
                                                                    dtype="float32", enable_graph=False))
    assert out == [r.token_ids for r in eager.generate(prompts, 48)]


def _buffers(dec) -> list[torch.Tensor]:
    return [*dec.state.values(), dec.out_buf, dec.acc_log, *dec.target_kv, *dec.draft_kv]


@pytest.mark.parametrize("n,T", [(2, 16), (8, 128)])  # (8, 128): a full batch of 8 admitted at once
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)])
def test_captured_prefill_equals_eager_prefill(n, T, params):
    """A short prefill replays one graph per (rows, length, greedy): the forward and the first token's commit, with
    each call's own inputs. It leaves the same caches, state and outputs as the eager prefill, and says the same
    rows go on (one row here takes a single token, so it stops at its prefill)."""
    dec = pair_engine(max_batch_size=8, max_len=256)  # graphs on; the prefill needs no step compile
    assert dec.prefill_graphs is not None
    g = torch.Generator().manual_seed(0)
    slots = list(range(n))[::-1]
    for call in range(2):  # capture, then a replay with new inputs copied into the static ones
        prompts = [torch.randint(0, dec.vocab_size, (T if i == 0 else max(1, T // 2 + i),), generator=g).tolist()
                   for i in range(n)]
        args = (slots, prompts, [1] + [64] * (n - 1), [100 * call + i for i in range(n)], params)
        before = [b.clone() for b in _buffers(dec)]
        got_active = dec._prefill(*args)
        got = [b.clone() for b in _buffers(dec)]
        for b, v in zip(_buffers(dec), before):
            b.copy_(v)
        graphs, dec.prefill_graphs = dec.prefill_graphs, None  # the same prefill, run eagerly
        want_active = dec._prefill(*args)
        dec.prefill_graphs = graphs
        assert got_active == want_active and not got_active[0] and all(got_active[1:])
        assert all(torch.equal(a, b) for a, b in zip(got, _buffers(dec)))
    assert set(dec.prefill_graphs.graphs) == {(n, T, params.greedy)} and not dec.prefill_graphs.failed


def test_compiled_prefill_equals_eager_forward(llama_pair):
    """A compiled engine on the device compiles its prefill forward with rows and length symbolic past the
    lengths that attend through the decode kernels: the first two shapes compile (one row is a shape of its
    own), later ones reuse them, and each leaves the logits and caches of the eager forward (fp32, to rounding).
    The same comparison tells apart a forward at positions shifted by one."""
    target, draft = llama_pair
    dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=3, max_len=512,
                                                                     dtype="float32", max_batch_size=4,
                                                                     batch_buckets=(4,)))
    assert not dec._compiles_prefill(2, 16)  # a few positions: the decode kernels' forward, not compiled
    caches = lambda: [*dec.draft_kv, *dec.target_kv]  # noqa: E731
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4)  # noqa: E731
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    g = torch.Generator().manual_seed(0)
    for i, (n, T) in enumerate(((1, 128), (3, 128), (4, 256), (2, 128), (1, 256))):
        if i == 2:
            compiled = graphs()
        assert dec._compiles_prefill(n, T)
        toks = torch.randint(0, dec.vocab_size, (n, T), generator=g).to(dec.device)
        pos = torch.arange(T, device=dec.device).expand(n, T)
        slots = torch.randperm(4, generator=g)[:n].to(dec.device)
        lens = torch.randint(1, T + 1, (n,), generator=g).to(dec.device)
        start = [c.clone() for c in caches()]
        got = dec._prefill_forward(toks, pos, slots, lens)
        got_kv = [c.clone() for c in caches()]
        for shift in (0, 1):
            for c, s in zip(caches(), start):
                c.copy_(s)
            with torch.inference_mode():
                want = prefill_models(dec.draft, dec.target, toks, (pos + shift).clamp(max=T - 1), slots, lens,
                                      *caches())
            same = close(got, want) and all(close(a, b) for a, b in zip(got_kv, caches()))
            assert same == (shift == 0), (n, T, shift)
    assert graphs() == compiled, "a prefill shape after the first two compiled again"
    assert _debug_get_cache_entry_list(prefill_models)


def test_recorded_eager_step_and_prefills_equal_eager(eager_bf16):
    """The engine with graphs and the eager step recorded (no compile): short prefills and every step replay
    graphs, and the tokens equal the eager engine's."""
    dec = pair_engine(max_batch_size=4, batch_buckets=(4,))
    dec.compiled = False
    out = dec.generate(PROMPTS, 48)
    assert [r.token_ids for r in out] == eager_bf16
    assert set(dec.graphs.graphs) == {(True, 4, 4)} and not dec.graphs.failed
    assert dec.prefill_graphs.graphs and not dec.prefill_graphs.failed


def test_an_invalidated_capture_is_tried_again_and_spoils_nothing(monkeypatch):
    """A record whose first try makes a call CUDA refuses while a stream captures (a synchronize) is invalidated,
    and torch raises from capture_end with the capture's stream current and its pool still recording. The set
    tries again and holds; the default stream is current again; the next key captures too; the replay runs the
    work once. The control: without the platform's clean-up that pool refuses every later capture."""
    import contextlib

    from spec_graph import platform
    from spec_graph.capture import GraphSet

    plat = platform.get("cuda")
    x = torch.zeros(4, device="cuda")
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 2:  # the warm-up is the first call, the first record the second
            torch.cuda.synchronize()
        x.add_(1)

    before = torch.cuda.current_stream()
    gs = GraphSet(plat)
    assert gs.capture("a", fn, warmup=1), gs.failed
    assert torch.cuda.current_stream() == before and len(calls) == 3
    assert gs.capture("b", lambda: x.mul_(2), warmup=0), gs.failed
    gs.replay("a")
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4

    pool = plat.graph_pool()
    calls[:] = [1]  # the next call synchronizes
    with monkeypatch.context() as mp:
        mp.setattr(platform.Platform, "_abandon_capture", lambda self, pool, prev: self._mod.set_stream(prev))
        with pytest.raises(RuntimeError):
            plat.record(plat.new_graph(), fn, pool=pool, stream=plat.new_stream())
        with pytest.raises(RuntimeError, match="already recording"):
            plat.record(plat.new_graph(), lambda: x.add_(1), pool=pool, stream=plat.new_stream())
    with contextlib.suppress(RuntimeError):
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    plat._end_generator_capture()  # the control's failure left the generator in graph mode
    assert torch.cuda.current_stream() == before
    torch.rand(1, device="cuda")


def test_a_capture_that_fails_on_every_try_leaves_the_generator_as_it_was(monkeypatch):
    """torch puts the device's random generator in graph mode when a capture begins and takes it out only when a
    capture ends. After a record that fails on both tries, eager random ops run, draw what they would have drawn
    without the record, and a captured one runs too. The control: without the platform's generator capture the
    eager op raises (on a torch that leaves the mode on)."""
    from spec_graph import platform
    from spec_graph.capture import GraphSet

    plat = platform.get("cuda")
    calls = []

    def fn():
        calls.append(1)
        torch.rand(4, device="cuda")
        if len(calls) > 1:  # every record synchronizes, so every try is invalidated
            torch.cuda.synchronize()

    torch.manual_seed(5)
    torch.rand(4, device="cuda")  # the warm-up's draw
    expected = torch.rand(8, device="cuda")
    torch.manual_seed(5)
    gs = GraphSet(plat)
    assert not gs.capture("a", fn, warmup=1) and "a" in gs.failed and len(calls) == 3
    assert torch.equal(torch.rand(8, device="cuda"), expected)
    graph = plat.new_graph()
    y = plat.record(graph, lambda: torch.rand(4, device="cuda"), pool=None, stream=plat.new_stream())
    plat.replay(graph)
    first = y.clone()
    plat.replay(graph)
    torch.cuda.synchronize()
    assert not torch.equal(first, y)

    calls.clear()
    with monkeypatch.context() as mp:
        mp.setattr(platform.Platform, "_end_generator_capture", lambda self: None)
        assert not GraphSet(plat).capture("a", fn, warmup=1)
    try:
        torch.rand(1, device="cuda")
        left_on = False
    except RuntimeError as e:
        left_on = "outside graph capture" in str(e)
    plat._end_generator_capture()
    torch.rand(1, device="cuda")
    if not left_on:
        pytest.skip("this torch takes the generator out of graph mode after a failed capture itself")
