"""Where adaptive K's call time goes at one batch bucket: the chooser's host work, or the Ks it chose.

    python benchmarks/bench_auto_host.py [--batch-size 8] [--prompts 16] [--max-k 8] [--fixed 1,4]
        [--rounds 21] [--device cuda] [--auto-set NAME=VALUE ...] [--waits W,W]
        [--choose-every N,N]

One auto engine (the embedded pair, bf16 on CUDA, max_len 512, the one bucket B, greedy) runs bench_adaptive's
three workloads under these choosers, taking turns call by call:

  auto          the engine's own chooser (``adaptive.ChoiceAhead``)
  auto no-fork  the same, without choosing ahead for each outcome where one row is busy (MAX_FORK_ROWS = 0)
  replayed      the Ks auto chose in its last call, replayed with no chooser work at all
  replayed+work the same Ks, with auto's chooser work done beside them and its choices dropped
  auto+flush    auto, with a query of the stream right after each graph launch (a driver call that may submit
                work the driver still holds, before the chooser's host work)
  auto N=V      auto with spec_graph.adaptive's setting N at V (--auto-set N=V; N=V+M=W sets both)
  K=k           each K of --fixed at every replay, with no chooser work
  K=k async     the first K of --fixed, each finished row's results copied to a fresh pinned buffer with an event
                and waited for after the next launch, in place of the engine's blocking copy before it
  auto chain    auto priced by a table timed as the loop runs (--chain-table): per K, a chain of replays each
                followed by the host's read, in place of the engine's table (one replay and a sync per timing,
                plus the host's share measured at the smallest K)
  NAME serial   chooser NAME of --serial with the engine's launch ahead off: each replay read before the next
                launch (the "loop - table" cycles are timed in this form alone)
  NAME wait=W   auto and each K of --fixed with the engine's admission_wait at W slot-steps (--waits), in place of
                its default (the batch size)
  auto every N  auto choosing for the batch only every N-th replay (--choose-every; bench_adaptive.choosing_every):
                its host work there cut to 1/N, its choices later

Greedy tokens do not depend on K, so "replayed" runs auto's steps and prefills again: what it loses against auto
is the chooser's host time on the replays' path, and what it loses against the best fixed K lies in the Ks.
"replayed+work" splits the first part: where it runs as auto does, the chooser's work costs the call its time
although it falls while the replays run; where it runs as "replayed" does, the loss lies in when auto chooses.
Per chooser: the median wall time of a generate call (the garbage collector off), replays and prefills per
call, the call's time in prefills (each ends in a host read, so the device is idle when the next starts), what
the engine's step-time table prices its replays at (each replay's K and bucket at its longest row's length, the
host's measured share included), and the rest, over the replays: what the table leaves out (at B=8 about the same
per call for every fixed K: a cost per call more than per replay). And, from one more call with the chooser's
methods timed, its host microseconds per replay, apart for replays with one busy row and with more.
Per chooser and K, "loop - table": what a replay cycle in the call took (from one read after a replay to the
next, without a prefill between) beyond the table's price of that replay, mean and median over the timed calls.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import collections
import gc
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "examples")]
from bench_adaptive import MAX_LEN, WORKLOADS, choosing_every, replay_counts, workloads  # noqa: E402
from bench_util import int_list, settings_as  # noqa: E402
from spec_graph import SpecDecoder, SpecGraphConfig, adaptive  # noqa: E402
from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph import runtime as sg_runtime  # noqa: E402
from spec_graph.adaptive import ChoiceAhead  # noqa: E402
from spec_graph.cli import DEFAULT_PAIR  # noqa: E402


class Scripted:
    """In place of ChoiceAhead: the Ks of ``script`` (an int: that K always), and no other work."""

    script: list[int] | int = 4

    def __init__(self, chooser, choose):
        s = Scripted.script
        self._ks = iter(s) if isinstance(s, list) else None
        self._last = s if isinstance(s, int) else s[-1]
        self._next = None

    def pick(self, lens):  # the same K until the replay it is for is launched (the engine may ask twice)
        if self._next is None:
            self._next = self._last if self._ks is None else next(self._ks, self._last)
        return self._next

    def ahead(self, k, n, lens):
        self._last, self._next = k, None

    def admit(self, row): pass
    def seen(self, counts, lens): pass


class Shadowed(Scripted):
    """Scripted's Ks, with auto's own chooser work done beside them and its choices dropped: where the Ks are auto's
    (replayed) the host does what auto's does at the same points of the loop, and only where the Ks come from
    differs."""

    def __init__(self, chooser, choose):
        super().__init__(chooser, choose)
        self.shadow = ChoiceAhead(chooser, choose)

    def pick(self, lens):
        self.shadow.pick(lens)
        return super().pick(lens)

    def ahead(self, k, n, lens):
        self.shadow.ahead(k, n, lens)
        super().ahead(k, n, lens)

    def admit(self, row):
        self.shadow.admit(row)

    def seen(self, counts, lens):
        self.shadow.seen(counts, lens)


class Timed(ChoiceAhead):
    """ChoiceAhead with its host time per replay added up, by busy rows (one, or more)."""

    spent: dict = collections.defaultdict(float)
    replays: dict = collections.defaultdict(int)

    def _timed(name):
        def wrap(self, *args):
            t0 = time.perf_counter()
            try:
                return getattr(ChoiceAhead, name)(self, *args)
            finally:
                lens = args[-1] if name in ("pick", "ahead", "seen") else {}
                Timed.spent["one row" if len(lens) == 1 else "more rows"] += time.perf_counter() - t0
                if name == "pick":
                    Timed.replays["one row" if len(lens) == 1 else "more rows"] += 1
        return wrap

    pick, ahead, seen = _timed("pick"), _timed("ahead"), _timed("seen")
    admit = _timed("admit")


def auto_variants(items: list[str]) -> dict[str, dict[str, object]]:
    """["TAIL=1.0", "A=1+B=None", ...] (--auto-set) -> {"auto TAIL=1.0": {"TAIL": 1.0}, "auto A=1+B=None": {"A": 1,
    "B": None}, ...}: each variant's settings of spec_graph.adaptive (upper-case names it has), joined by "+", and
    their values (Python literals)."""
    out = {}
    for item in items:
        settings = {}
        for part in re.split(r"\+(?=[A-Za-z_]\w*=)", item):
            name, eq, value = part.partition("=")
            if not eq or not name.isupper() or not hasattr(adaptive, name):
                raise SystemExit(f"--auto-set {item!r}: NAME=VALUE[+NAME=VALUE...] with each NAME one of "
                                 "spec_graph.adaptive's upper-case settings (DECAY, EXPLORE_MARGIN, ...)")
            try:
                settings[name] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                raise SystemExit(f"--auto-set {item!r}: VALUE must be a Python literal (0.9, None, 2)") from None
        out[f"auto {item}"] = settings
    return out


def wait_variants(waits: str, fixed: list[int]) -> list[str]:
    """--waits "16,32" -> ["auto wait=16", "K=1 wait=16", ..., "auto wait=32", ...]: auto and each fixed K at each
    admission_wait (slot-steps, a non-negative integer); anything else is refused by name."""
    return [f"{name} wait={wait}" for wait in int_list(waits, "--waits", "an admission_wait in slot-steps", 0)
            for name in ["auto", *(f"K={k}" for k in fixed)]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-k", type=int, default=8,
                    help="max_speculative_tokens (K choices: 1, 2, 3, 4, 6, 8 up to it)")
    ap.add_argument("--fixed", default="1,4")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--auto-set", action="append", default=[], metavar="NAME=VALUE",
                    help="one more chooser, 'auto NAME=VALUE': auto with spec_graph.adaptive's setting NAME at "
                         "VALUE (a Python literal); repeatable")
    ap.add_argument("--chain-table", action="store_true",
                    help="time each K as the loop runs it (a chain of replays, each followed by the read) and add "
                         "the chooser 'auto chain', priced by that table")
    ap.add_argument("--serial", default="", metavar="NAMES",
                    help="comma-separated choosers (auto,K=1,...) run once more each as 'NAME serial': with the "
                         "engine's launch ahead off")
    ap.add_argument("--waits", default="", metavar="W,W",
                    help="comma-separated admission_wait values (slot-steps): auto and each K of --fixed run once "
                         "more at each, as 'NAME wait=W'")
    ap.add_argument("--choose-every", default="", metavar="N,N",
                    help="comma-separated replay counts: auto once more for each, as 'auto every N', choosing for "
                         "the batch only every N-th replay")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the tables, the host's N costliest functions (cProfile, own time) in one call of "
                         "auto and of the first --fixed K on the stdlib workload")
    a = ap.parse_args()
    variants = auto_variants(a.auto_set)
    fixed = [int(x) for x in a.fixed.split(",") if x]
    waits = wait_variants(a.waits, fixed)
    everies = [f"auto every {n}" for n in replay_counts(a.choose_every)]
    B = a.batch_size
    cfg = SpecGraphConfig(num_speculative_tokens="auto", max_speculative_tokens=a.max_k, max_batch_size=B,
                          max_len=MAX_LEN, batch_buckets=(B,), device=a.device)
    dec = SpecDecoder.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", cfg)
    plat = sg_platform.get(a.device)
    print(f"{plat.device_name()}; torch {torch.__version__}; K choices {dec.k_choices}", flush=True)
    wl = {w: p[: a.prompts] for w, p in workloads(a.prompts).items()}
    t0 = time.perf_counter()
    dec.generate([wl["stdlib"][0][:16]], 4)
    print(f"compile + capture: {time.perf_counter() - t0:.1f} s", flush=True)
    real = sg_runtime.ChoiceAhead
    names = ["auto", "auto no-fork", "replayed", "replayed+work", "auto+flush", *variants]
    names += [f"K={k}" for k in fixed]
    names += [f"K={fixed[0]} async"] if fixed else []
    for name in filter(None, a.serial.split(",")):
        if name not in names:
            raise SystemExit(f"--serial {name!r}: not one of the choosers {names}")
        names.append(f"{name} serial")
    names += waits + everies
    engine_table = (dict(dec.step_times), dict(dec.host_times))  # as measured at capture
    chained = None
    if a.chain_table:
        chained = chain_table(dec, B)
        names.append("auto chain")
        print("- chain table at length 192 (ms): " + ", ".join(
            f"K={k} {1e3 * (t[0] + t[1] * 192):.3f}" for (_, _, k), t in sorted(chained.items())), flush=True)
    real_to_host = sg_platform.Platform.to_host
    real_replay = sg_platform.Platform.replay

    def flushed_replay(self, graph):
        real_replay(self, graph)
        if self.name == "cuda":
            torch.cuda.current_stream().query()
    last_ks: dict = {}

    split = {"prefill": 0.0, "table": 0.0}
    real_prefill, real_run, real_read = dec._prefill, dec._run_steps, dec._read_after_replay
    cycle = {"last": None, "price": None, "K": None, "name": None}  # the replay cycle in flight (loop - table)
    over = collections.defaultdict(list)  # ((chooser, workload), K): seconds of each cycle past its table price

    def timed_prefill(*args):
        t = time.perf_counter()
        try:
            return real_prefill(*args)
        finally:
            split["prefill"] += time.perf_counter() - t
            cycle["last"] = None  # a cycle with a prefill in it is not one replay's

    prices: dict = {}  # (greedy, bucket): the engine's table as a function of length, read once

    def priced_run(B, greedy, K=None, longest=None):
        if (greedy, B) not in prices:
            with settings_as(dec, step_times=engine_table[0], host_times=engine_table[1]):
                prices[(greedy, B)] = dec._prices(greedy, B)
        price = prices[(greedy, B)](longest)[K] * dec.config.steps_per_graph
        split["table"] += price
        cycle.update(price=price, K=K)
        return real_run(B, greedy, K, longest)

    def timed_read(*args):
        out = real_read(*args)
        t = time.perf_counter()
        if cycle["last"] is not None and cycle["name"] is not None:
            over[(cycle["name"], cycle["K"])].append(t - cycle["last"] - cycle["price"])
        cycle["last"] = t
        return out

    dec._prefill, dec._run_steps, dec._read_after_replay = timed_prefill, priced_run, timed_read

    launch_ahead = dec.launch_ahead

    def call(name, w, timed=False):
        fork_rows = ChoiceAhead.MAX_FORK_ROWS
        dec.launch_ahead = launch_ahead and not name.endswith(" serial")
        full, name = name, name.removesuffix(" serial")
        name, at_wait, wait = name.partition(" wait=")
        split.update(prefill=0.0, table=0.0)
        if name.startswith("K=") or name.startswith("replayed"):
            Scripted.script = int(name[2:].split()[0]) if name.startswith("K=") else last_ks[w]
            if name.endswith(" async"):
                sg_platform.Platform.to_host = sg_platform.Platform.to_host_later
            sg_runtime.ChoiceAhead = Shadowed if name == "replayed+work" else Scripted
        elif name == "auto no-fork":
            ChoiceAhead.MAX_FORK_ROWS = 0
        elif name == "auto+flush":
            sg_platform.Platform.replay = flushed_replay
        setting = settings_as(adaptive, **variants[name]) if name in variants else contextlib.nullcontext()
        if name.startswith("auto every "):
            setting = choosing_every(int(name.split()[-1]))
        if name == "auto chain":
            hosts = {key: 0.0 for key in dec.host_times}  # the chain's times hold the read
            setting = settings_as(dec, step_times={**dec.step_times, **chained}, host_times=hosts)
        cycle.update(last=None, name=(full, w) if timed else None)
        try:
            with setting, settings_as(dec.config, **({"admission_wait": int(wait)} if at_wait else {})):
                plat.synchronize()
                t = time.perf_counter()
                out = dec.generate(wl[w], a.max_new_tokens)
                wall = time.perf_counter() - t
        finally:
            dec.launch_ahead = launch_ahead
            sg_runtime.ChoiceAhead, ChoiceAhead.MAX_FORK_ROWS = real, fork_rows
            sg_platform.Platform.replay, sg_platform.Platform.to_host = real_replay, real_to_host
        if full == "auto":
            last_ks[w] = list(out.stats.k_per_step)
        return wall, out, dict(split)

    res = collections.defaultdict(list)
    tokens = {}
    for w in WORKLOADS:  # untimed: prefill graphs of each shape the calls admit
        for name in names:
            _, out, _ = call(name, w)
            tokens[(name, w)] = [r.token_ids for r in out]
    gc.collect()
    gc.disable()
    try:
        for _ in range(a.rounds):
            for w in WORKLOADS:
                for name in names:
                    wall, out, parts = call(name, w, timed=True)
                    res[(name, w)].append((wall, out.stats, parts))
    finally:
        gc.enable()
    for w in WORKLOADS:
        print(f"\n{w}: {a.prompts} prompts, B={B}, {a.max_new_tokens} new tokens, median of {a.rounds} calls")
        print("| chooser | ms per call | min | replays | prefills | prefill ms | table ms | rest us/replay | "
              "tok/step | mean K | K changes | tokens as auto's |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        N = dec.config.steps_per_graph
        for name in names:
            walls = [x[0] for x in res[(name, w)]]
            st = res[(name, w)][-1][1]
            same = tokens[(name, w)] == tokens[("auto", w)]
            pre = statistics.median(x[2]["prefill"] for x in res[(name, w)])
            table = statistics.median(x[2]["table"] for x in res[(name, w)])
            rest = statistics.median((x[0] - x[2]["prefill"] - x[2]["table"]) / (x[1].steps // N)
                                     for x in res[(name, w)])
            print(f"| {name} | {1e3 * statistics.median(walls):.2f} | {1e3 * min(walls):.2f} | {st.steps} | "
                  f"{st.prefills} | {1e3 * pre:.2f} | {1e3 * table:.2f} | {1e6 * rest:.1f} | "
                  f"{st.tokens_per_step:.2f} | {statistics.fmean(st.k_per_step):.2f} | "
                  f"{sum(a != b for a, b in zip(st.k_per_step, st.k_per_step[1:]))} | {'yes' if same else 'no'} |")
        print("- loop - table, us per replay by K (mean / median, cycles): " + "; ".join(
            f"{name}: " + ", ".join(
                f"K={k} {1e6 * statistics.fmean(v):.1f} / {1e6 * statistics.median(v):.1f} ({len(v)})"
                for (n, k), v in sorted(over.items()) if n == (name, w)) for name in names))
        host = dec.host_times.get((True, B), 0.0)
        print(f"- the table's host share: {1e6 * host:.1f} us per replay; its steps at length 192: " + ", ".join(
            f"K={k} {1e3 * t:.3f} ms" for k, t in dec._times_for(True, B, 192).items()))
        Timed.spent.clear()
        Timed.replays.clear()
        sg_runtime.ChoiceAhead = Timed
        try:
            call("auto", w)
        finally:
            sg_runtime.ChoiceAhead = real
        print("- auto's chooser, host us per replay: " + ", ".join(
            f"{k} {1e6 * Timed.spent[k] / max(n, 1):.1f} ({n} replays)" for k, n in sorted(Timed.replays.items())))
    if a.profile:
        import cProfile
        import pstats
        for name in ("auto", f"K={fixed[0]}" if fixed else "replayed"):
            prof = cProfile.Profile()
            prof.enable()
            wall, _, _ = call(name, "stdlib")
            prof.disable()
            print(f"\n- host profile, {name}, stdlib (one call, {1e3 * wall:.2f} ms under the profiler):")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(a.profile)


def chain_table(dec, B: int, lengths=(16, 256), chain: int = 16, repeats: int = 3) -> dict:
    """{(True, B, K): (base_s, per_position_s)}: each K's replay timed as the engine's loop runs it, a chain of
    ``chain`` replays each followed by the host's read, at two live lengths with every row active (the median
    of ``repeats`` chains), fitted as the engine fits its table; the state is put back afterwards."""
    def seconds(run, L):
        times = []
        for _ in range(repeats + 1):  # the first warms
            dec._as_if_live(snap, L)
            dec.platform.synchronize()
            t0 = time.perf_counter()
            for _ in range(chain):
                dec._read_after_replay(B, run())
            times.append((time.perf_counter() - t0) / chain)
        return statistics.median(times[1:])

    with torch.inference_mode(), dec._state_kept() as snap:
        return {(True, B, K): dec._fitted((True, B, K), lengths, seconds) for K in dec.k_choices}


if __name__ == "__main__":
    main()
