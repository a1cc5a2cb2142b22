"""The benchmark scripts' own settings and helpers (no GPU: nothing here compiles, and no time is checked)."""
import sys
from pathlib import Path

import pytest
from torch._functorch import config as aot_config
from torch._inductor import config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_step  # noqa: E402
import bench_step  # noqa: E402
import bench_util  # noqa: E402

from spec_graph.kernels import launch_key, linear_launch  # noqa: E402

ROWS = linear_launch.ONE_STEP_ROWS


def caches_on():
    """Inductor's caches on inside, and restored after (configs patched: apply_settings writes them)."""
    return inductor_config.patch(fx_graph_cache=True), aot_config.patch(enable_autograd_cache=True)


def test_bench_step_settings_reach_every_compile(monkeypatch):
    """--set changes the kernels' setting and the backend's cache key, and turns inductor's caches off, so that
    the plain torch.compile of (e) cannot load a graph built under other settings."""
    monkeypatch.setattr(linear_launch, "ONE_STEP_ROWS", ROWS)
    fx, aot = caches_on()
    with fx, aot:
        before = launch_key()
        bench_util.apply_settings([f"linear_launch.ONE_STEP_ROWS={ROWS + 3}"])
        assert linear_launch.ONE_STEP_ROWS == ROWS + 3 and launch_key() != before
        assert inductor_config.fx_graph_cache is False and aot_config.enable_autograd_cache is False


def test_bench_step_settings_left_alone_without_set():
    fx, aot = caches_on()
    with fx, aot:
        bench_util.apply_settings([])
        assert inductor_config.fx_graph_cache is True and aot_config.enable_autograd_cache is True


@pytest.mark.parametrize("pair,message", [("ONE_STEP_ROWS", "MODULE.NAME=VALUE"),
                                          ("nomodule.X=1", "has a module"),
                                          ("linear_launch.NOPE=1", "no setting"),
                                          ("linear_launch.ONE_STEP_ROWS=abc", "not a Python literal")])
def test_bench_step_settings_reject_bad_input(pair, message):
    """A bad pair stops the run before any setting is made (the good pair before it included)."""
    fx, aot = caches_on()
    with fx, aot:
        with pytest.raises(SystemExit, match=message):
            bench_util.apply_settings([f"linear_launch.ONE_STEP_ROWS={ROWS + 3}", pair])
        assert linear_launch.ONE_STEP_ROWS == ROWS and inductor_config.fx_graph_cache is True


def test_bench_step_settings_of_the_models_too():
    """--set reaches the models' switches (read when the step is traced) as well as the kernels' settings."""
    mod, name, value = bench_util.parse_setting("llama.FUSED_CHOICE=False")
    assert (mod.__name__, name, value) == ("spec_graph.models.llama", "FUSED_CHOICE", False)
    with pytest.raises(SystemExit, match="spec_graph.models.llama has no setting 'NOPE'"):
        bench_util.parse_setting("llama.NOPE=1")


def test_bench_step_reports_both_compiles_of_the_target_decode():
    """(e) is the engine's compile; with --e-plain the plain torch.compile's figures follow it, each with its share
    of the copy bandwidth; without it, no such line."""
    import argparse

    a = argparse.Namespace(iters=5, inductor_variants="", layer_variants="")
    res = {1: {"c": 1.2, "e": 0.6, "e_kernels": 100.0, "e_floor": 0.36, "floor": 0.5}}
    plain = "(e) compiled by a plain torch.compile"
    assert not any(plain in line for line in bench_step.report(res, [1], 4e12, "dev", 1.0, a, None, None, None))
    res[1].update(e_plain=0.72, e_plain_kernels=104.0)
    lines = bench_step.report(res, [1], 4e12, "dev", 1.0, a, None, None, None)
    row = next(line for line in lines if line.startswith("| 1 |"))
    assert "| 0.600 |" in row and row.endswith("| 2.00x |")  # (c)/(e) on the engine's compile
    assert "(e) 60%" in "\n".join(lines)
    assert f"- B=1: {plain}: 0.720 ms, 104 kernels, 50% of the copy bandwidth (the engine's compile: 0.600 ms)" in lines


def test_ab_step_values_of_one_setting():
    mod, name, values = ab_step.parse_values("attention.MIN_SPLIT_KEYS=64,256,1024")
    assert (mod.__name__, name, values) == ("spec_graph.kernels.attention", "MIN_SPLIT_KEYS", [64, 256, 1024])
    assert ab_step.parse_values("linear_launch.ONE_STEP_K=0")[2] == [0]
    launches = ab_step.parse_values("attention.LAUNCH={},{'num_warps': 2, 'num_stages': 1},{'num_warps': 8}")[2]
    assert launches == [{}, {"num_warps": 2, "num_stages": 1}, {"num_warps": 8}]  # commas inside a value


def test_ab_step_table_of_dict_values():
    """Values that cannot be dict keys (launch options) each get their row, in order, against the first."""
    values = [{}, {"num_warps": 2}, {"num_warps": 8}]
    times = [{"c": [1.0, 1.2, 1.1], "e": [0.5, 0.5, 0.6]}, {"c": [0.99, 0.99, 1.32], "e": [0.55, 0.5, 0.6]},
             {"c": [2.2, 2.2, 2.2], "e": [1.0, 1.0, 1.0]}]
    rows = ab_step.table(values, times)[2:]
    assert rows == ["| {} | 1.100 | 1.000-1.200 | 1.000x | 0.500 | 0.500-0.600 | 1.000x |",
                    "| {'num_warps': 2} | 0.990 | 0.990-1.320 | 0.900x | 0.550 | 0.500-0.600 | 1.100x |",
                    "| {'num_warps': 8} | 2.200 | 2.200-2.200 | 2.000x | 1.000 | 1.000-1.000 | 2.000x |"]


@pytest.mark.parametrize("text,message", [("attention.MIN_SPLIT_KEYS", "MODULE.NAME=V1,V2"),
                                          ("attention.MIN_SPLIT_KEYS=", "MODULE.NAME=V1,V2"),
                                          ("nomodule.X=1,2", "has a module"),
                                          ("attention.NOPE=1,2", "no setting"),
                                          ("attention.MIN_SPLIT_KEYS=64,abc", "not a comma-separated list"),
                                          ("attention.MIN_SPLIT_KEYS=64,,", "not a comma-separated list")])
def test_ab_step_rejects_bad_settings(text, message):
    with pytest.raises(SystemExit, match=message):
        ab_step.parse_values(text)


class _Stats:
    generated_tokens, steps, request_steps, acceptance_rate, k_per_step, prefills = 64, 16, 17, 0.5, [2] * 16, 3


class _FakeEngine:
    """Stands in for an engine: every generate call takes a moment and returns the same stats."""

    capture_report, step_times, host_times = {}, {}, {}

    def __init__(self):
        self.config = type("Cfg", (), {"admission_wait": None})()
        self.waits = []  # admission_wait at each call

    def generate(self, prompts, n, temperature=0.0, seed=0):
        self.waits.append(self.config.admission_wait)
        return type("Out", (), {"stats": _Stats()})()


@pytest.mark.parametrize("cut_after", [None, 7])
def test_bench_adaptive_keeps_the_rounds_of_a_run_cut_short(monkeypatch, tmp_path, cut_after):
    """Each finished round of timed calls is in the report at once, and the report says how many calls its medians
    hold: a run stopped in its third round leaves the first two, said to be 2 of the 4 asked; a whole run says 4.
    The engine's compile times are in it from the start, and each cell's prefills per call."""
    import bench_adaptive

    calls = []
    real = bench_adaptive.timed_call

    def timed(*args):
        calls.append(1)
        if cut_after is not None and len(calls) > cut_after:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(bench_adaptive, "build", lambda *a: _FakeEngine())
    monkeypatch.setattr(bench_adaptive, "timed_call", timed)
    out = tmp_path / "r.md"
    monkeypatch.setattr(sys, "argv", ["bench_adaptive.py", "--k-set", "1", "--batch-sizes", "1", "--prompts", "2",
                                      "--skip-sampling", "--skip-fixed", "--repeats", "4", "--out", str(out)])
    monkeypatch.setattr(bench_adaptive, "workloads", lambda n: {w: [[1, 2, 3]] * n for w in bench_adaptive.WORKLOADS})
    monkeypatch.setattr(bench_adaptive.sg_platform, "get", lambda d: type("P", (), {"device_name": lambda s: "x"})())
    if cut_after is None:
        bench_adaptive.main()
    else:
        with pytest.raises(KeyboardInterrupt):
            bench_adaptive.main()
    text = out.read_text()
    said = "the median of 4 timed" if cut_after is None else "the median of 2 (of 4 asked: the run was cut short)"
    assert said in text and "| 1 | greedy | auto | token |" in text, text
    assert "- B=1 K=auto token: load " in text and "compile+capture greedy " in text, text
    assert "| 3 / 3 / 3 |" in text.split("| 1 | greedy | auto | token |")[1].splitlines()[0], text


def test_bench_adaptive_at_once_twins(monkeypatch, tmp_path):
    """--at-once-too auto: auto's calls again with admission_wait 0, taking turns with auto's own (the config's
    wait), each in a row of its own; the engine's wait is restored after each."""
    import bench_adaptive

    eng = _FakeEngine()
    monkeypatch.setattr(bench_adaptive, "build", lambda *a: eng)
    out = tmp_path / "r.md"
    monkeypatch.setattr(sys, "argv", ["bench_adaptive.py", "--k-set", "1", "--batch-sizes", "1", "--prompts", "2",
                                      "--skip-sampling", "--skip-fixed", "--repeats", "2", "--at-once-too", "auto",
                                      "--out", str(out)])
    monkeypatch.setattr(bench_adaptive, "workloads", lambda n: {w: [[1, 2, 3]] * n for w in bench_adaptive.WORKLOADS})
    monkeypatch.setattr(bench_adaptive.sg_platform, "get", lambda d: type("P", (), {"device_name": lambda s: "x"})())
    bench_adaptive.main()
    text = out.read_text()
    assert "| 1 | greedy | auto | token |" in text and "| 1 | greedy | auto at once | token |" in text, text
    calls = eng.waits[1:]  # after the compile call: per seed, auto's 3 workloads x 2 calls, then its twin's
    assert calls == ([None] * 6 + [0] * 6) * 2 and eng.config.admission_wait is None


def test_bench_adaptive_reads_greedy_targets_on_the_fastest_calls():
    """Each cell keeps its fastest call beside its median, and each greedy target is read on both: here auto's
    median call meets none and its fastest calls meet all (against the best fixed K's fastest call, K=1 on (i),
    K=4 on (ii)); sampled targets stay on the medians alone."""
    import types

    import bench_adaptive

    calls = {1: ([90, 100, 110], [80, 80, 80], [95, 95, 95]), 4: ([70, 70, 70], [85, 90, 99], [100, 100, 100]),
             "auto": ([50, 60, 120], [50, 60, 105], [50, 60, 112])}
    res = {}
    for k, per_w in calls.items():
        for w, rates in zip(bench_adaptive.WORKLOADS, per_w):
            res[(8, "greedy", k, "token", w)] = bench_adaptive.summary([(r, _Stats(), 0.5) for r in rates])
            res[(8, "sampling", k, "token", w)] = res[(8, "greedy", k, "token", w)]
    a = types.SimpleNamespace(batch_sizes=[8], k_set=[1, 4], skip_sampling=True, sampling_ks=[])
    lines = bench_adaptive.targets(res, a)
    greedy = [x for x in lines if " at temperature" not in x]
    assert len(greedy) == 3 and all(": NOT met; on the fastest calls" in x for x in greedy), lines
    assert "on the fastest calls 1.091x K=1: met" in greedy[0], greedy  # 120 / 110
    assert "on the fastest calls 1.061x K=4: met" in greedy[1], greedy  # 105 / 99
    assert "on the fastest calls 1.120x K=4: met" in greedy[2], greedy  # 112 / 100
    assert all("fastest" not in x for x in lines if " at temperature" in x), lines
    table = "\n".join(bench_adaptive.tables(res, a))
    assert "| 8 | greedy | auto | token | 60 / 60 / 60 |" in table and "| 120 / 105 / 112 |" in table, table


def test_bench_adaptive_chooser_variants_parse_and_take_their_settings():
    """Each chooser variant's tags reach the chooser: :blind turns the work left off, :explore=N sets
    adaptive.EXPLORE_ROWS inside and restores it after; an unknown tag is refused by name."""
    import bench_adaptive

    from spec_graph import adaptive, runtime

    got = bench_adaptive.chooser_variants("0.85,0.9+0.09,0.95-h,0.85:blind,0.8:explore=8:blind")
    assert got == [("0.85", 0.85, 0.0, True, None), ("0.9+0.09", 0.9, 0.09, True, None),
                   ("0.95-h", 0.95, None, True, None), ("0.85:blind", 0.85, 0.0, False, None),
                   ("0.8:explore=8:blind", 0.8, 0.0, False, 8)]
    with pytest.raises(SystemExit, match=r"0.85:wide.*:explore=N"):
        bench_adaptive.chooser_variants("0.85:wide")
    was = adaptive.EXPLORE_ROWS
    with bench_adaptive.chooser_as(decay=0.8, explore_rows=3):
        assert adaptive.EXPLORE_ROWS == 3 != was and runtime.KChooser((1, 2)).decay == 0.8
    assert adaptive.EXPLORE_ROWS == was and runtime.KChooser is adaptive.KChooser


def test_counted_captures_step_the_bar_and_leave_no_cycle():
    """bench_step's capture counter steps its bar once per capture and then leaves the set as it was, so a
    dropped set goes at once, not at some later collection that could run inside another capture. The control:
    the wrapper left in place keeps the set alive in a cycle."""
    import gc
    import weakref

    from helpers import fake_platform
    from spec_graph.capture import GraphSet

    class Bar:
        steps = 0

        def step(self):
            self.steps += 1

    bar, gs = Bar(), GraphSet(fake_platform())
    with bench_step.counted_captures(gs, bar):
        assert gs.capture("a", lambda: None, warmup=0) and gs.capture("b", lambda: None, warmup=0)
    assert bar.steps == 2 and "capture" not in vars(gs)

    def wrap(graphs):  # the wrapper, never removed
        orig = graphs.capture
        graphs.capture = lambda key, f, warmup=2: orig(key, f, warmup)

    left = GraphSet(fake_platform())
    wrap(left)
    refs = weakref.ref(gs), weakref.ref(left)
    was = gc.isenabled()
    gc.disable()
    try:
        del gs, left
        assert refs[0]() is None and refs[1]() is not None
    finally:
        if was:
            gc.enable()
        gc.collect()


@pytest.mark.parametrize("item, message", [("TAIL", "NAME=VALUE"), ("decay=0.9", "upper-case"),
                                           ("NO_SUCH=1", "upper-case"), ("DECAY=fast", "Python literal"),
                                           ("DECAY=0.9+NO_SUCH=1", "upper-case"),
                                           ("DECAY=0.9+decay=1", "upper-case")])
def test_bench_auto_host_variants_parse_and_refuse_bad_input(item, message):
    """--auto-set NAME=VALUE names an auto variant and the adaptive setting it changes, with its value parsed as a
    literal (several joined by "+", a literal's own "+" kept); a malformed item, a name the chooser lacks or a
    value that is not a literal is refused by name."""
    import bench_auto_host

    assert bench_auto_host.auto_variants(["DECAY=0.9", "EXPLORE_ROWS=None", "DECAY=1e+0+EXPLORE_MARGIN=0"]) == {
        "auto DECAY=0.9": {"DECAY": 0.9}, "auto EXPLORE_ROWS=None": {"EXPLORE_ROWS": None},
        "auto DECAY=1e+0+EXPLORE_MARGIN=0": {"DECAY": 1.0, "EXPLORE_MARGIN": 0}}
    with pytest.raises(SystemExit, match=message):
        bench_auto_host.auto_variants([item])


@pytest.mark.parametrize("waits, message", [("16,x", "'x' is not an admission_wait"),
                                            ("-1", "'-1' is not an admission_wait"), ("1.5", "'1.5'")])
def test_bench_auto_host_waits_name_their_variants_and_refuse_bad_input(waits, message):
    """--waits names auto and each fixed K once more at each wait, in order, each name ending in its wait; a wait that
    is not a non-negative integer is refused by name."""
    import bench_auto_host

    assert bench_auto_host.wait_variants("16,0", [1, 4]) == [
        "auto wait=16", "K=1 wait=16", "K=4 wait=16", "auto wait=0", "K=1 wait=0", "K=4 wait=0"]
    assert bench_auto_host.wait_variants("", [1]) == []
    with pytest.raises(SystemExit, match=message):
        bench_auto_host.wait_variants(waits, [1])


@pytest.mark.parametrize("broken", [False, True])
def test_choosing_every_n_replays_halves_the_batch_choices(llama_pair, monkeypatch, broken):
    """The --choose-every variant (sim_adaptive, bench_auto_host): at two busy rows, choosing every 2nd replay asks the
    chooser for the batch about half as often as the engine's own (9 against 16 here), and the greedy tokens are the
    same (they do not depend on K). Control: a variant that skips nothing asks as often, which the count rejects."""
    import bench_adaptive

    from spec_graph import SpecDecoder, SpecGraphConfig, adaptive

    cfg = SpecGraphConfig(num_speculative_tokens="auto", max_speculative_tokens=3, max_len=128, max_batch_size=2,
                          batch_buckets=(2,))
    dec = SpecDecoder.from_pretrained(*llama_pair, cfg)
    dec.step_times = {(True, 2, k): 1e-3 * (1 + k) for k in dec.k_choices}
    asked = []
    real = adaptive.KChooser.choose

    def choose(self, times, left=None, queued=0):  # counts the choices for the batch (two rows busy)
        asked.append(len(left or ()) > 1)  # (one row's forks ask for every outcome, replay by replay)
        return real(self, times, left, queued)

    monkeypatch.setattr(adaptive.KChooser, "choose", choose)
    prompts = [[5, 9, 17], [40, 41], [7, 8, 9, 10]]

    def run(every):
        asked.clear()
        with bench_adaptive.choosing_every(every):
            out = dec.generate(prompts, 24)
        return [r.token_ids for r in out], sum(asked), out.stats.steps

    tokens, engine_asks, steps = run(1)
    if broken:
        monkeypatch.setattr(bench_adaptive, "choosing_every", lambda n: bench_adaptive.contextlib.nullcontext())
    tokens2, every2_asks, _ = run(2)
    assert tokens2 == tokens and steps > 8
    assert (every2_asks < 0.75 * engine_asks) != broken, (every2_asks, engine_asks)


@pytest.mark.parametrize("text, message", [("2,x", "'x' is not a replay count"), ("0", "'0' is not a replay count")])
def test_choose_every_replay_counts_refuse_bad_input(text, message):
    import bench_adaptive

    assert bench_adaptive.replay_counts("2,3") == [2, 3] and bench_adaptive.replay_counts("") == []
    with pytest.raises(SystemExit, match=message):
        bench_adaptive.replay_counts(text)


def test_the_chooser_reads_its_decay_setting_when_made():
    """A variant's DECAY reaches the choosers the engine makes while it is set (as the other settings, read at
    each use, do), and the engine's own after."""
    from spec_graph import adaptive

    with bench_util.settings_as(adaptive, DECAY=0.5):
        assert adaptive.KChooser((1, 2)).decay == 0.5
    assert adaptive.KChooser((1, 2)).decay == adaptive.DECAY != 0.5


@pytest.mark.parametrize("restored", [True, False])
def test_bench_auto_host_chain_table_puts_the_state_back(llama_pair, restored):
    """--chain-table times each K's replays as the loop runs them (every row active, each replay followed by the
    read) and leaves the engine's rows as it found them: a (base, per-position) entry per K of the bucket. Control:
    the same chain without putting the state back changes it, so the check can fail."""
    import torch

    import bench_auto_host
    from spec_graph import SpecDecoder, SpecGraphConfig

    cfg = SpecGraphConfig(num_speculative_tokens="auto", max_speculative_tokens=3, max_len=512, max_batch_size=2,
                          batch_buckets=(2,), enable_graph=False)
    dec = SpecDecoder.from_pretrained(*llama_pair, cfg)
    before = {k: v.clone() for k, v in dec.state.items()}
    if restored:
        table = bench_auto_host.chain_table(dec, 2, chain=2, repeats=1)
        assert set(table) == {(True, 2, k) for k in dec.k_choices}
        assert all(base + 16 * per > 0 and per >= 0 for base, per in table.values())
    else:
        with torch.inference_mode():
            dec._as_if_live(before, 16)
            dec._read_after_replay(2, dec._timed_run((True, 2, 1), 16)())
    same = all(torch.equal(before[k], v) for k, v in dec.state.items())
    assert same == restored


@pytest.mark.parametrize("name", ["ahead", "flags only", "serial", "ahead at 1"])
def test_bench_launch_ahead_variants_put_the_engine_back(llama_pair, name):
    """Each variant of bench_launch_ahead.py runs as it says (one row alone is launched ahead only "at 1"; a serial
    call launches nothing ahead) and leaves the engine's loop as it was for the next one: its rows-ahead threshold,
    and the module's rule for reading token counts."""
    import bench_launch_ahead
    from helpers import fake_platform

    from spec_graph import SpecDecoder, SpecGraphConfig, runtime

    cfg = SpecGraphConfig(num_speculative_tokens=2, max_len=64, max_batch_size=2, batch_buckets=(2,))
    base = SpecDecoder.from_pretrained(*llama_pair, cfg)
    dec = SpecDecoder(base.target, base.draft, base.config, base.tokenizer, (), plat=fake_platform())
    dec.compiled = False  # the stand-in platform records and replays the eager step
    rule = runtime._reads_counts
    one = bench_launch_ahead.run_variant(dec, name, [[5, 9, 17]], 12)
    two = bench_launch_ahead.run_variant(dec, name, [[5, 9, 17], [40, 41]], 12)
    assert one[1] == 12 and two[1] == 24
    assert (one[2] > 0) == (name == "ahead at 1")
    assert (two[2] > 0) == (name != "serial")
    assert runtime._reads_counts is rule and dec.AHEAD_ROWS == runtime.DecoderBase.AHEAD_ROWS
