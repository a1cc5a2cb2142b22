"""Compiled and captured engine paths on CPU: compiled == eager tokens, N-step == 1-step,
the platform seam (with a stand-in platform that records and replays), the oversized-batch
fallback, and the backend's entry point."""
import contextlib
import gc
import logging
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from helpers import FakePlatform, assert_every_count, fake_platform, hf_greedy

from spec_graph import SpecDecoder, SpecGraphConfig, prefill
from spec_graph import capture as capture_mod
from spec_graph.capture import CapturedFunction, GraphSet
from spec_graph.engine import prefill_models

PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13], [3], [60, 61, 62, 63], [20, 21, 22]]
PKG = Path(__file__).parents[1] / "spec_graph"


def engine(pair, plat=None, compile_step=True, **cfg):
    """An engine; with compile_step=False the captured step is the eager one (inductor compiles on
    CPU take tens of seconds, and the capture tests are about capture and replay, not compilation)."""
    cfg.setdefault("num_speculative_tokens", 3)
    cfg.setdefault("max_len", 64)
    target, draft = pair
    base = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(**cfg))
    if plat is None:
        return base
    dec = SpecDecoder(base.target, base.draft, base.config, base.tokenizer, base.eos_token_ids, plat=plat)
    dec.compiled = compile_step
    return dec


def step_events(plat, dec, out) -> tuple[int, int]:
    """(step graphs recorded, step replays): every prefill here is short, so each one replays a graph too."""
    prefill_graphs = len(dec.prefill_graphs.graphs)
    return plat.events.count("record") - prefill_graphs, plat.events.count("replay") - out.stats.prefills


@pytest.fixture(scope="module")
def eager_tokens(llama_pair):
    """The eager engine's tokens, which are HF's own greedy tokens (the other tests compare against these)."""
    out = engine(llama_pair, max_batch_size=4).generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == [hf_greedy(llama_pair[0], p, 20) for p in PROMPTS]
    assert_every_count(out, 3)
    return [r.token_ids for r in out]


def test_compiled_engine_equals_eager(llama_pair, eager_tokens, monkeypatch):
    from torch._dynamo.utils import counters
    from torch._functorch import config as aot_config
    from torch._inductor import config as inductor_config

    from spec_graph.passes.manager import PassManager

    runs = []
    orig = PassManager.__call__
    monkeypatch.setattr(PassManager, "__call__", lambda self, g: (orig(self, g), runs.append(self.last_counts))[0])
    dec = engine(llama_pair, enable_graph=True, max_batch_size=4, batch_buckets=(1, 2, 4))
    assert dec.compiled and dec.graphs is None  # CPU: compiled, no capture
    before = counters["stats"]["unique_graphs"]
    # compile for real: a cache hit (an earlier run of the same graph) would skip the passes
    with inductor_config.patch(fx_graph_cache=False), aot_config.patch(enable_autograd_cache=False), \
            torch.inference_mode():
        for b in (4, 2, 1, 4, 2):
            dec._step_fn(True)(*dec._step_args(b))
    # buckets above 1 share one compile with a symbolic batch; size 1 gets its own
    assert counters["stats"]["unique_graphs"] - before == 2
    # the fusion fires on the symbolic-batch graph as on the static one
    assert [r["fuse_greedy_accept"] for r in runs] == [1, 1]
    out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    assert_every_count(out, 3)


def test_compiled_multi_step_capture_equals_eager(llama_pair, eager_tokens):
    plat = fake_platform()
    dec = engine(llama_pair, plat=plat, enable_graph=True, max_batch_size=4, batch_buckets=(4,), steps_per_graph=2)
    out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    assert _debug_get_cache_entry_list(prefill_models)  # a compiled engine with graphs compiles its prefills too
    assert_every_count(out, 3)
    records, step_replays = step_events(plat, dec, out)
    assert records == 1 and out.stats.steps == 2 * step_replays


def test_failed_prefill_compile_falls_back_to_eager(llama_pair, monkeypatch, caplog):
    """A prefill whose compile fails warns once and runs the eager forward, then and after: the same logits and
    caches as the eager forward, no error reaching the request."""
    from spec_graph import engine as engine_mod

    dec = engine(llama_pair, plat=fake_platform(), compile_step=True, enable_graph=True, max_batch_size=4,
                 batch_buckets=(4,))
    calls = []

    def failing(*args):
        calls.append(1)
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit hit")

    monkeypatch.setattr(engine_mod, "compiled_prefill", lambda *a: failing)
    n, T = 2, 8
    assert dec._compiles_prefill(n, T)
    toks = torch.randint(0, dec.vocab_size, (n, T), generator=torch.Generator().manual_seed(0))
    pos, slots, lens = torch.arange(T).expand(n, T), torch.tensor([3, 1]), torch.tensor([T, 5])
    with caplog.at_level(logging.WARNING, logger="spec_graph"):
        got = [dec._prefill_forward(toks, pos, slots, lens) for _ in range(2)]
    kv = [c.clone() for c in (*dec.draft_kv, *dec.target_kv)]
    assert calls == [1] and not dec.compile_prefill and engine_mod.SpecDecoder.compile_prefill is True
    assert sum("prefill's compile failed" in r.getMessage() for r in caplog.records) == 1
    with torch.inference_mode():
        want = prefill_models(dec.draft, dec.target, toks, pos, slots, lens, *dec.draft_kv, *dec.target_kv)
    assert all(torch.equal(g, want) for g in got)
    assert all(torch.equal(a, b) for a, b in zip(kv, (*dec.draft_kv, *dec.target_kv)))


def test_captured_through_platform_seam(llama_pair, eager_tokens):
    plat = fake_platform()
    dec = engine(llama_pair, plat=plat, compile_step=False, enable_graph=True, max_batch_size=4,
                 batch_buckets=(1, 2, 4))
    out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    assert_every_count(out, 3)
    records, step_replays = step_events(plat, dec, out)
    assert records == 3  # one graph per bucket
    assert step_replays == out.stats.steps  # every step ran as a replay
    assert set(dec.graphs.graphs) == {(True, 1, 3), (True, 2, 3), (True, 4, 3)}


def check_results_read_behind_a_launch(pair, eager_tokens, at_once: bool):
    """Where rows finish, their results are copied to the host at once (the platform decides how) and waited for
    and built into results only after the next launch (the host waits there anyway), so building them holds up no
    launch: each "copy" has a "replay" before its "wait", unless no launch follows it (the call's last rows)."""
    class Reading(FakePlatform):
        def to_host(self, t):
            if t.dim() == 1:  # a read after a replay (its active flags), not finished rows' results
                return t.clone(), lambda: None
            self.events.append("copy")
            if at_once:  # a read before the next launch: the device idles while the host reads, builds results
                self.events.append("wait")
                return t, lambda: None
            return t, lambda: self.events.append("wait")

        to_host_later = to_host  # (where a replay was launched ahead of the read that finished them)

    plat = Reading("cpu", [])
    dec = engine(pair, plat=plat, compile_step=False, enable_graph=True, max_batch_size=2, batch_buckets=(1, 2))
    out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    assert_every_count(out, 3)
    ev = [e for e in plat.events if e in ("copy", "wait", "replay")]
    copies = [i for i, e in enumerate(ev) if e == "copy"]
    assert len(copies) >= 3, ev  # rows finished apart: reads mid-call to check
    for i in copies:
        j = ev.index("wait", i)
        assert "replay" in ev[i:j] or "replay" not in ev[j:], (i, ev)


def test_finished_rows_are_read_behind_the_next_launch(llama_pair, eager_tokens):
    check_results_read_behind_a_launch(llama_pair, eager_tokens, at_once=False)


def test_a_read_before_the_next_launch_is_caught(llama_pair, eager_tokens):
    with pytest.raises(AssertionError):
        check_results_read_behind_a_launch(llama_pair, eager_tokens, at_once=True)


@pytest.mark.parametrize("n", [3, 8])
def test_multi_step_equals_single_step(llama_pair, eager_tokens, n):
    plat = fake_platform()
    dec = engine(llama_pair, plat=plat, compile_step=False, enable_graph=True, max_batch_size=4,
                 batch_buckets=(2, 4), steps_per_graph=n)
    out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    assert_every_count(out, 3)
    # the host reads once per replay, and a replay runs n steps
    assert out.stats.steps == n * step_events(plat, dec, out)[1]


def test_multi_step_sampling_equals_single_step(llama_pair):
    one = engine(llama_pair, max_batch_size=4).generate(PROMPTS, 16, temperature=0.9, top_k=20, seed=7)
    many = engine(llama_pair, plat=fake_platform(), compile_step=False, enable_graph=True, max_batch_size=4,
                  batch_buckets=(4,), steps_per_graph=4).generate(PROMPTS, 16, temperature=0.9, top_k=20, seed=7)
    assert [r.token_ids for r in one] == [r.token_ids for r in many]


def test_an_uncaptured_engine_prefills_the_captured_shapes(llama_pair, eager_tokens, monkeypatch):
    """On a platform with graphs, an engine that does not capture pads its prefills as one that does: the same
    shapes run the same kernels, so in bf16 the two give the same tokens. (On CPU, without graphs, a prefill runs
    at its own length: test_engine.py.)"""
    def shapes_of(dec):
        seen, run = [], dec._prefill_run

        def record(rows, *a):
            seen.append((rows.shape[0], rows.shape[1] - prefill.PREFILL_COLUMNS))
            return run(rows, *a)
        monkeypatch.setattr(dec, "_prefill_run", record)
        return seen

    prompts = [list(range(2, 35)), [3, 4, 5], list(range(10, 30))]
    runs = []
    for graphs in (False, True):
        dec = engine(llama_pair, plat=fake_platform(), compile_step=False, enable_graph=graphs, max_batch_size=2,
                     batch_buckets=(1, 2))
        assert (dec.prefill_graphs is not None) == graphs
        seen = shapes_of(dec)
        runs.append((seen, [r.token_ids for r in dec.generate(prompts, 6)]))
    assert runs[0] == runs[1] and runs[0][0] == [(2, 64), (1, 32)]
    assert runs[0][1] == [hf_greedy(llama_pair[0], p, 6) for p in prompts]


def test_oversized_batch_falls_back_with_one_warning(llama_pair, eager_tokens, caplog):
    plat = fake_platform()
    dec = engine(llama_pair, plat=plat, compile_step=False, enable_graph=True, max_batch_size=4,
                 batch_buckets=(1, 2))
    with caplog.at_level(logging.WARNING, logger="spec_graph"):
        out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    warnings = [r for r in caplog.records if "uncaptured" in r.getMessage()]
    assert len(warnings) == 1 and "over the largest bucket" in warnings[0].getMessage()


def test_failed_capture_falls_back(llama_pair, eager_tokens, caplog):
    class Broken(FakePlatform):
        def record(self, graph, fn, pool=None, stream=None):
            raise RuntimeError("operation not permitted when stream is capturing")

    dec = engine(llama_pair, plat=Broken("cpu", []), compile_step=False, enable_graph=True, max_batch_size=4,
                 batch_buckets=(4,))
    with caplog.at_level(logging.WARNING, logger="spec_graph"):
        out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    assert dec.graphs.failed and any("capture" in r.getMessage() for r in caplog.records)


def test_a_capture_records_with_the_collector_paused_and_tries_again(caplog):
    """Automatic garbage collection is off while a graph records (a collection there can destroy a dropped graph
    kept by a cycle, which invalidates the capture) and back on after. A record that fails once is tried again
    and holds, warm-up run once, in a fresh pool; one that always fails gives up after CAPTURE_TRIES records
    with one warning.
    The controls: with one try the first failure is final, and without the pause a record that never fails
    otherwise fails its check of the collector."""
    class Flaky(FakePlatform):
        fails = 1

        def graph_pool(self):
            self.events.append("pool")
            return super().graph_pool()

        def record(self, graph, fn, pool=None, stream=None):
            assert not gc.isenabled(), "the collector runs while a graph records"
            super().record(graph, fn, pool, stream)
            if self.fails:
                self.fails -= 1
                raise RuntimeError("operation failed due to a previous error during capture")

    calls = []
    fn = lambda: calls.append(1)  # noqa: E731
    assert gc.isenabled()
    plat = Flaky("cpu", [])
    gs = GraphSet(plat)
    with caplog.at_level(logging.INFO, logger="spec_graph"):
        assert gs.capture("k", fn, warmup=1) and "k" in gs and not gs.failed
    assert gc.isenabled() and plat.events.count("record") == 2 and len(calls) == 1
    assert plat.events.count("pool") == 2  # the set's first pool, then a fresh one after the failed record
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("capturing again" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()

    plat = Flaky("cpu", [])
    plat.fails = 10**6
    gs = GraphSet(plat)
    with caplog.at_level(logging.WARNING, logger="spec_graph"):
        assert not gs.capture("k", fn, warmup=0) and "previous error" in gs.failed["k"]
    assert plat.events.count("record") == capture_mod.CAPTURE_TRIES == 2 and gc.isenabled()
    assert sum("runs uncaptured" in r.getMessage() for r in caplog.records) == 1

    gs = GraphSet(Flaky("cpu", []))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture_mod, "CAPTURE_TRIES", 1)
        assert not gs.capture("k", fn, warmup=0)

    plat = Flaky("cpu", [])
    plat.fails = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture_mod, "_collector_paused", contextlib.nullcontext)
        assert not GraphSet(plat).capture("k", fn, warmup=0)


def test_overlapping_pauses_of_the_collector_end_with_the_last():
    """Two records under way at once (two threads): the first to end leaves the collector off until the other
    ends; a collector that was off before stays off. The control: a pause that restores what it saw at its
    start turns the collector on under the other record."""
    assert gc.isenabled()
    first, second = capture_mod._collector_paused(), capture_mod._collector_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with capture_mod._collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

    @contextlib.contextmanager
    def naive():  # the control
        was = gc.isenabled()
        gc.disable()
        yield
        if was:
            gc.enable()
    first, second = naive(), naive()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.isenabled()  # on again while the second record is still under way
    second.__exit__(None, None, None)


def test_a_failed_record_leaves_the_stream_and_the_pool_as_it_found_them(monkeypatch):
    """torch's graph context, when its capture was invalidated, raises from capture_end with the capture's stream
    still current, its pool still marked as recording (the next capture into it would fail) and the generator in
    graph mode. The platform's record restores the stream, ends the pool's recording and captures once more, to
    take the generator out of graph mode, then raises the capture's own error; a record that holds ends nothing,
    nor does one into a pool torch made for the graph alone. The control: without the
    clean-up the stream stays switched."""
    from spec_graph.platform import Platform

    class Graph:
        def pool(self):  # as torch's: a graph whose capture did not end cannot name its pool
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")

    class Mod:
        fail = True

        class CUDAGraph:  # the clean-up's own capture, which takes the generator out of graph mode
            def reset(self):
                mod.generator_captures.append("reset")

        def __init__(self):
            self.stream = "default"
            self.generator_captures = []

        def current_stream(self):
            return self.stream

        def set_stream(self, s):
            self.stream = s

        def current_device(self):
            return 3

        @contextlib.contextmanager
        def graph(self, graph, pool=None, stream=None):
            if isinstance(graph, Mod.CUDAGraph):
                yield
                self.generator_captures.append("ended")
                return
            self.stream = stream
            yield
            if self.fail:  # capture_end
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            self.stream = "default"

    mod = Mod()

    class Stub(Platform):
        @property
        def _mod(self):
            return mod

    ended = []

    def end(device, pool):
        ended.append((device, pool))
        if len(ended) > 1:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(1))  # the generator capture's work
    plat = Stub("cuda")
    with pytest.raises(RuntimeError, match="previous error during capture"):
        plat.record(Graph(), lambda: 1, pool=(7, 0), stream="side")
    assert mod.stream == "default" and ended == [(3, (7, 0))]
    assert mod.generator_captures == ["ended", "reset"]
    with pytest.raises(RuntimeError, match="previous error during capture"):  # torch had ended it: no new error
        plat.record(Graph(), lambda: 1, pool=(7, 0), stream="side")
    mod.fail = False
    assert plat.record(Graph(), lambda: 5, pool=(7, 0), stream="side") == 5 and len(ended) == 2
    assert len(mod.generator_captures) == 4  # a record that holds needs none
    mod.fail = True
    with pytest.raises(RuntimeError, match="previous error during capture"):
        plat.record(Graph(), lambda: 1, pool=None, stream="side")
    assert mod.stream == "default" and len(ended) == 2 and len(mod.generator_captures) == 6

    mod.fail, mod.stream = True, "default"
    monkeypatch.setattr(Stub, "_abandon_capture", lambda *a: None)
    with pytest.raises(RuntimeError):
        plat.record(Graph(), lambda: 1, pool=(7, 0), stream="side")
    assert mod.stream == "side"


def test_captured_function_runs_each_call_once():
    plat = fake_platform()
    calls = []

    def fn(x, buf):
        calls.append(1)
        buf.add_(x)
        return buf * 2

    cf = CapturedFunction(fn, plat)
    buf = torch.zeros(3)
    for i in range(4):
        out = cf(torch.ones(3), buf)
    assert torch.equal(buf, torch.full((3,), 4.0)) and torch.equal(out, torch.full((3,), 8.0))
    assert plat.events.count("record") == 1 and plat.events.count("replay") == 3
    moved = torch.zeros(3)  # a new storage: copied into the static input, then back
    cf(torch.ones(3), moved)
    assert torch.equal(moved, torch.ones(3))


def _backend_on_a_graph_platform(monkeypatch):
    """torch.compile through the spec_graph backend on the stand-in graph platform: its replays re-run the recorded
    call with the recorded arguments, as a CUDA graph replays its kernels' recorded arguments."""
    import spec_graph.backend as backend_mod

    plat = fake_platform()
    monkeypatch.setattr(backend_mod._platform, "get", lambda device=None: plat)
    torch._dynamo.reset()
    return plat


@pytest.mark.parametrize("broken", [False, True])
def test_a_number_argument_gets_a_graph_per_value(broken, monkeypatch):
    """Dynamo passes a Python number that it made symbolic as a plain argument; a graph recorded at one value must
    not serve another. Control: keyed by the number's type alone, the third value's graph serves the rest."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_key", lambda args: tuple(
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a) for a in args))
    plat = _backend_on_a_graph_platform(monkeypatch)
    f = torch.compile(lambda x, n: x * n, backend="spec_graph")
    x = torch.ones(3)
    values = [n for n in range(1, 5) for _ in range(3)]  # each value warms up, records, then replays
    got = [f(x, n) for n in values]
    right = all(torch.equal(g, x * n) for g, n in zip(got, values))
    assert right != broken, [g.tolist() for g in got]
    assert plat.events.count("replay") >= 1  # the graphs did replay


def test_numbers_of_many_values_stop_recording_graphs(monkeypatch, caplog):
    """A number that takes a new value at every call would record a graph each time: past MAX_VALUE_GRAPHS values
    at one input shape they run uncaptured (one warning), still right; a NaN, never equal to itself, too."""
    plat = _backend_on_a_graph_platform(monkeypatch)
    f = torch.compile(lambda x, t: x * t, backend="spec_graph")
    x = torch.ones(3)
    values = [0.5 + n for n in range(capture_mod.MAX_VALUE_GRAPHS + 12) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="spec_graph"):
        assert all(torch.equal(f(x, t), x * t) for t in values)
        assert all(f(x, float("nan")).isnan().all() for _ in range(3))
    # Dynamo bakes the first float into its first graph (or two), then passes the float as a CPU scalar tensor
    assert 3 <= plat.events.count("record") <= capture_mod.MAX_VALUE_GRAPHS + 2 < len(set(values))
    assert sum("took over" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("broken", [False, True])
def test_a_float_argument_gets_a_graph_per_value_and_sign(broken, monkeypatch):
    """Dynamo passes a float it made dynamic as a CPU scalar tensor and reads it with item(), which a CUDA graph
    bakes in: each value, -0.0 apart from 0.0, gets its own graph. (The stand-in platform's replay runs item()
    again, so the graphs are counted here; the results are checked on CUDA.) Control: keyed by ==, 0.0 replays
    -0.0's graph."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_exact", lambda v: v)
    plat = _backend_on_a_graph_platform(monkeypatch)
    f = torch.compile(lambda x, t: x * t, backend="spec_graph")
    x = torch.ones(3)
    values = [t for t in (0.5, 1.5, 2.5, -0.0, 0.0) for _ in range(3)]  # each warms up, records, then replays
    got = [f(x, t) for t in values]
    assert all(torch.equal(g, x * t) and torch.equal(g.signbit(), (x * t).signbit()) for g, t in zip(got, values))
    assert (plat.events.count("record") == 5) != broken, plat.events
    assert plat.events.count("replay") >= 5


@pytest.mark.parametrize("broken", [False, True])
def test_a_call_never_writes_another_callers_tensors(broken, monkeypatch):
    """A module's fresh inputs are recorded through private copies, its weight (at one address while the graph
    records) as itself; a later call leaves the recording call's input alone, and a weight the user replaces gets
    its graph recorded again, the old weight untouched. Control: recorded as the caller's own tensors, a later
    call's input is copied into the recording call's."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_private_copy", lambda a: a)
    plat = _backend_on_a_graph_platform(monkeypatch)
    m = torch.nn.Linear(3, 2)
    f = torch.compile(m, backend="spec_graph")
    xs = [torch.full((4, 3), float(i)) for i in range(6)]
    with torch.no_grad():
        got = [f(x) for x in xs[:4]]
        old = m.weight
        m.weight = torch.nn.Parameter(torch.randn(2, 3))
        got += [f(x) for x in xs[4:]]
        want = [torch.nn.functional.linear(x, old if i < 4 else m.weight, m.bias) for i, x in enumerate(xs)]
    right = all(torch.allclose(g, w) for g, w in zip(got, want))
    untouched = all(torch.equal(x, torch.full((4, 3), float(i))) for i, x in enumerate(xs))
    assert (right and untouched) != broken, (right, [x[0, 0].item() for x in xs])
    assert old.data_ptr() != m.weight.data_ptr() and plat.events.count("record") == 2


@pytest.mark.parametrize("broken", [False, True])
def test_an_output_that_views_an_input_views_the_callers_tensor(broken, monkeypatch):
    """An output that is a view of an input is, at every call, that view of the caller's tensor, as in eager:
    writes through it reach the caller's. Control: returned as a copy, from the replays on the writes are lost."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_returned", lambda out, static, args: tuple(o.clone() for o in out))
    plat = _backend_on_a_graph_platform(monkeypatch)

    def scale_and_tail(x, idx):
        x.mul_(2)
        return x[1:], x.sum(), x.view(torch.int32), x[idx] * 2  # the last two: another dtype, and empty
    f = torch.compile(scale_and_tail, backend="spec_graph")
    right = []
    for _ in range(4):
        x, idx = torch.arange(4.0), torch.zeros(0, dtype=torch.long)
        with torch.no_grad():
            tail, total, bits, empty = f(x, idx)
        same_bits = torch.equal(bits, x.view(torch.int32))
        tail.fill_(-1)
        right.append(x.tolist() == [0.0, -1.0, -1.0, -1.0] and total.item() == 12.0 and same_bits
                     and bits.dtype == torch.int32 and empty.dtype == torch.float32 and empty.numel() == 0)
    assert all(right) != broken, right
    assert plat.events.count("replay") >= 2


@pytest.mark.parametrize("broken", [False, True])
def test_outputs_that_share_memory_share_it_for_the_caller(broken, monkeypatch):
    """Outputs that view one intermediate (``y`` and ``y[1:]``, ``y.view(2, 2)``) share one memory for the caller at
    every call, as in eager, and one returned twice is one tensor. Control: a copy each, from the replays on a write
    through one no longer shows in the others."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_copied_together", lambda group: {id(o): o.clone() for o in group})
    plat = _backend_on_a_graph_platform(monkeypatch)

    def double(x):
        y = x * 2
        return y, (y[1:], y.view(2, 2)), y
    f = torch.compile(double, backend="spec_graph")
    right = []
    for i in range(4):
        with torch.no_grad():
            y, (tail, square), again = f(torch.arange(4.0) + i)
        want = (torch.arange(4.0) + i) * 2
        ok = torch.equal(y, want) and torch.equal(tail, want[1:]) and torch.equal(square, want.view(2, 2))
        y.fill_(-1)
        right.append(ok and tail.tolist() == [-1.0] * 3 and square.tolist() == [[-1.0] * 2] * 2 and again is y)
    assert all(right) != broken, right
    assert plat.events.count("replay") >= 2


@pytest.mark.parametrize("broken", [False, True])
def test_inputs_that_come_to_share_memory_run_uncaptured(broken, monkeypatch):
    """A graph recorded with inputs apart replays private copies of them; a later call whose inputs view one tensor
    (``f(w, w[:])``) would part them so, and runs uncaptured, with eager's result. Control: replayed anyway, the
    function's write through one input is not read through the other."""
    import spec_graph.capture as capture_mod

    if broken:
        apart = capture_mod._apart
        monkeypatch.setattr(capture_mod, "_apart", lambda args: apart(args) | {
            i for i, a in enumerate(args) if isinstance(a, torch.Tensor)} if len(args) == 2 else apart(args))
    _backend_on_a_graph_platform(monkeypatch)

    def bump_and_read(a, b):
        a.add_(1)
        return b * 2
    f = torch.compile(bump_and_read, backend="spec_graph")
    with torch.no_grad():
        for _ in range(3):
            f(torch.zeros(4), torch.zeros(4))
        w = torch.zeros(4)
        out = f(w, w[:])
    assert (out.tolist() == [2.0] * 4 and w.tolist() == [1.0] * 4) != broken, (out.tolist(), w.tolist())


@pytest.mark.parametrize("broken", [False, True])
def test_an_input_reached_by_storage_offset_is_never_a_private_copy(broken, monkeypatch):
    """``as_strided`` places its view by the storage offset, so on a sliced input it reaches elements before the
    slice, which a private copy of the slice does not hold: such an input is replayed as itself, or uncaptured
    once it moves, with eager's values. Control: copied like any input, the later calls read the copy's elements."""
    import spec_graph.backend as backend_mod

    if broken:
        monkeypatch.setattr(backend_mod, "absolute_inputs", lambda gm: frozenset())
    plat = _backend_on_a_graph_platform(monkeypatch)

    def head(x):
        return x.as_strided((2,), (1,), 2) * 1
    f = torch.compile(head, backend="spec_graph")
    right = []
    for i in range(4):
        base = torch.arange(12.0) + 100 * i
        with torch.no_grad():
            right.append(f(base[4:]).tolist() == head(base[4:]).tolist() == [100.0 * i + 2, 100.0 * i + 3])
    assert all(right) != broken, right
    assert "record" in plat.events


@pytest.mark.parametrize("broken", [False, True])
def test_calls_under_inference_mode_replay(broken, monkeypatch):
    """Fresh inputs at every call under ``torch.inference_mode()``: every call gives eager's result. Control:
    private copies made as inference tensors carry no version counter, and the recording call raises."""
    import spec_graph.capture as capture_mod

    if broken:
        def private_copy(a):
            with torch.no_grad():
                return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device).copy_(a)
        monkeypatch.setattr(capture_mod, "_private_copy", private_copy)
    plat = _backend_on_a_graph_platform(monkeypatch)
    f = torch.compile(lambda x: x * 2, backend="spec_graph")
    got = []
    with torch.inference_mode():
        for i in range(5):
            try:
                got.append(f(torch.full((3,), float(i))).tolist())
            except RuntimeError as e:
                got.append(str(e))
    assert (got == [[2.0 * i] * 3 for i in range(5)]) != broken, got
    assert broken or plat.events.count("replay") >= 3


@pytest.mark.parametrize("broken", [False, True])
def test_outputs_keep_eager_layouts_and_identity(broken, monkeypatch):
    """A strided view of an intermediate keeps its strides, an expanded one stays unwritable, and a view of an
    input of the input's own layout is a new tensor, not the caller's. Control: outputs copied dense, and views
    of one layout returned as the input itself."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_copied_together", lambda group: {id(o): o.clone() for o in group})
        view = capture_mod._input_view

        def same_layout_is_the_input(out, static, args):
            for s, a in zip(static, args):
                if isinstance(s, torch.Tensor) and (out.size(), out.stride(), out.data_ptr()) == (
                        s.size(), s.stride(), s.data_ptr()):
                    return a
            return view(out, static, args)
        monkeypatch.setattr(capture_mod, "_input_view", same_layout_is_the_input)
    _backend_on_a_graph_platform(monkeypatch)

    def layouts(x):
        return (x * 2)[::2], x.sum().expand(3), x[:]
    f = torch.compile(layouts, backend="spec_graph")
    right = []
    for i in range(4):
        x = torch.ones(6, 3) * i
        with torch.no_grad():
            steps, wide, same = f(x)
        want = layouts(x)
        try:
            wide.add_(1)
            unwritable = False
        except RuntimeError:
            unwritable = True
        right.append(steps.stride() == want[0].stride() and torch.equal(steps, want[0]) and unwritable
                     and same is not x and same.data_ptr() == x.data_ptr())
    assert all(right) != broken, right


@pytest.mark.parametrize("broken", [False, True])
def test_inputs_are_written_back_only_where_the_function_writes_them(broken, monkeypatch):
    """An input the function only reads is never written (one made under inference_mode may not be, outside
    it); one it updates in place gets the update at every call. Control: with the writes unseen, the updates
    after the recording call are lost."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_versions", lambda static, private: {i: 0 for i in private})
    _backend_on_a_graph_platform(monkeypatch)

    def count_and_double(x, calls):
        calls.add_(1)
        return x * 2
    f = torch.compile(count_and_double, backend="spec_graph")
    right = []
    for i in range(4):
        with torch.inference_mode():
            x = torch.full((3,), float(i))
        calls = torch.zeros(2)
        with torch.no_grad():
            out = f(x, calls)
        right.append(torch.equal(out, torch.full((3,), 2.0 * i)) and calls.tolist() == [1.0, 1.0])
    assert all(right) != broken, right


@pytest.mark.parametrize("broken", [False, True])
def test_inputs_that_share_memory_keep_sharing_it(broken, monkeypatch):
    """Two inputs that view one tensor are one memory to the function: a write through one is read through the
    other, and reaches the caller's tensor. Control: a private copy each parts them, and a write is lost."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_apart", lambda args: {
            i for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
    _backend_on_a_graph_platform(monkeypatch)

    def bump_and_read(a, b):
        a.add_(1)
        return b * 1
    f = torch.compile(bump_and_read, backend="spec_graph")
    right = []
    for _ in range(4):
        x = torch.zeros(4)
        with torch.no_grad():
            out = f(x, x.view(2, 2))
        right.append(x.tolist() == [1.0] * 4 and out.tolist() == [[1.0, 1.0], [1.0, 1.0]])
    assert all(right) != broken, right


@pytest.mark.parametrize("broken", [False, True])
def test_inputs_that_require_grad_train_through_the_backend(broken, monkeypatch):
    """A training loop (a fresh leaf input each step) gets eager's gradients, uncaptured with one warning.
    Control: captured anyway, a later step copies into the recorded leaf and fails, or its gradients go astray."""
    import spec_graph.capture as capture_mod

    if broken:
        monkeypatch.setattr(capture_mod, "_needs_autograd", lambda args: False)
    plat = _backend_on_a_graph_platform(monkeypatch)
    w = torch.randn(4, 4, requires_grad=True)
    f = torch.compile(lambda x: (x @ w).tanh().sum(), backend="spec_graph")
    ok = True
    for _ in range(4):
        x = torch.randn(2, 4, requires_grad=True)
        try:
            f(x).backward()
        except RuntimeError:
            ok = False
            break
        got = (w.grad.clone(), None if x.grad is None else x.grad.clone())
        w.grad, x.grad = None, None
        (x @ w).tanh().sum().backward()
        ok = ok and torch.allclose(got[0], w.grad, atol=1e-6) and got[1] is not None and \
            torch.allclose(got[1], x.grad, atol=1e-6)
        w.grad = None
    assert ok != broken
    if not broken:
        assert "record" not in plat.events
        with torch.no_grad():  # inference still replays graphs
            for _ in range(3):
                f(torch.randn(2, 4))
        assert plat.events.count("record") == 1


def test_graph_set_shares_one_pool():
    plat = fake_platform()
    gs = GraphSet(plat)
    for b in (1, 2, 4):
        assert gs.capture(b, lambda: None, warmup=1)
    assert gs.pool == "pool" and len(gs.graphs) == 3


def test_only_platform_names_device_apis():
    pattern = re.compile(r"torch\.(cuda|npu)\.|torch_npu\.npu\.")
    offenders = []
    for f in PKG.rglob("*.py"):
        if f.name == "platform.py":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                offenders.append(f"{f.relative_to(PKG)}:{i}: {line.strip()}")
    assert not offenders, "device APIs outside platform.py:\n" + "\n".join(offenders)


def _installed() -> bool:
    return any(ep.name == "spec_graph" for ep in entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not _installed(), reason="spec-graph is not pip-installed (no entry point)")
def test_backend_entry_point_without_import():
    code = (
        "import sys, torch\n"
        "assert 'spec_graph' not in sys.modules\n"
        "f = torch.compile(lambda x: (x * 2).sin(), backend='spec_graph', options={'capture': False})\n"
        "x = torch.randn(8)\n"
        "assert torch.allclose(f(x), (x * 2).sin())\n"
        "assert 'spec_graph.backend' in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_reset_graphs_recaptures_with_new_n(llama_pair, eager_tokens):
    plat = fake_platform()
    dec = engine(llama_pair, plat=plat, compile_step=False, enable_graph=True, max_batch_size=4,
                 batch_buckets=(4,))
    assert [r.token_ids for r in dec.generate(PROMPTS, 20)] == eager_tokens
    first_prefill_graphs = len(dec.prefill_graphs.graphs)
    dec.reset_graphs(steps_per_graph=5)
    out = dec.generate(PROMPTS, 20)
    assert [r.token_ids for r in out] == eager_tokens
    assert plat.events.count("record") == 2 + first_prefill_graphs + len(dec.prefill_graphs.graphs)
    assert dec.config.steps_per_graph == 5
    with pytest.raises(ValueError, match="steps_per_graph"):
        dec.reset_graphs(steps_per_graph=0)


def test_short_prefills_replay_a_graph_per_rows_and_length(llama_pair, eager_tokens):
    """Prefills replay graphs keyed by (rows, padded length), captured once each; tokens equal the eager engine's."""
    plat = fake_platform()
    dec = engine(llama_pair, plat=plat, compile_step=False, enable_graph=True, max_batch_size=2,
                 batch_buckets=(1, 2))
    calls = []
    forward = dec._prefill_forward
    dec._prefill_forward = lambda *a: (calls.append(tuple(a[0].shape)), forward(*a))[1]
    out = dec.generate(PROMPTS * 2, 20)  # twice over, so that prefill shapes repeat and replay
    assert [r.token_ids for r in out] == eager_tokens * 2
    keys = set(dec.prefill_graphs.graphs)
    assert keys == {(n, T, True) for n, T in calls} and out.stats.prefills > len(keys)
    # each key ran twice for warm-up, then once per prefill as a replay of the recorded callable
    assert len(calls) == 2 * len(keys) + out.stats.prefills
    assert dec.prefill_graphs.pool == "pool" and dec.prefill_graphs is not dec.graphs


def test_long_prefills_and_uncaptured_engines_run_the_forward(llama_pair, monkeypatch):
    monkeypatch.setattr(prefill, "PREFILL_GRAPH_TOKENS", 4)  # every prompt here is longer
    dec = engine(llama_pair, plat=fake_platform(), compile_step=False, enable_graph=True, max_batch_size=2,
                 batch_buckets=(2,))
    ref = engine(llama_pair, max_batch_size=2)
    assert ref.prefill_graphs is None  # CPU: no graphs
    outs = [e.generate(PROMPTS[:3], 12) for e in (dec, ref)]
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]
    assert not dec.prefill_graphs.graphs
