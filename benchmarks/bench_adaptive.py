"""End-to-end tokens/s of adaptive K and of block verification on the embedded default pair.

    python benchmarks/bench_adaptive.py [--k-set 1,2,3,4,6,8] [--batch-sizes 1,8] [--prompts 8,16]
        [--max-new-tokens 128] [--sampling-ks 4[,auto]] [--skip-greedy | --skip-sampling] [--skip-block]
        [--repeats 9]
        [--pin-in-auto] [--chooser-variants 0.85,0.95-h] [--admission-wait W] [--at-once-too auto,1,4]
        [--device cuda] [--out benchmarks/RESULTS.md]

Workloads, prompts of 96-128 byte tokens (prompt + 128 new tokens stays inside the pair's 256-token
training window):
  (i)   stdlib: spans of the standard-library files the training script held out (its path-hash split)
  (ii)  random: seeded random bytes, of the same lengths as (i)
  (iii) mixed: (i) and (ii) alternating, so acceptance changes from one request to the next

One engine per (K, verification, B), max_batch_size=B and the one bucket B (fewer compiles; the tail of a
batch runs padded to B). With --pin-in-auto the fixed K run in the auto engine instead, its choice pinned to
each K in turn: the same captured graphs as auto's, and one compile for the lot (about half the run).
--chooser-variants runs auto's workloads (greedy, and sampled where auto samples) again with other choosers on
the same graphs: another decay per row-step, a host time per replay added to every K's step time ("+ms") or the
engine's own measured host time taken off it ("-h": the table of the replays alone), blind to the work each row
has left (":blind"), or trying a larger K at up to N busy rows (":explore=N"). --at-once-too runs the runs it
names again with queued requests admitted at once (admission_wait 0) where the engines wait (--admission-wait,
by default max_batch_size slot-steps) for freed slots to share a prefill.

A B=1 engine runs its prompts one after another inside one generate call, so "auto" carries what it learnt
from request to request. Greedy at each fixed K of --k-set and at K="auto" (max_speculative_tokens = the
largest K of the set); at temperature 1.0, "token" vs "block" verification at each K of --sampling-ks ("auto"
there compiles every K again per verification: left out by default; with --pin-in-auto the fixed K of --k-set
then run sampled in the auto token engine too, pinned, and the auto targets are checked at temperature 1 as
well). Each engine first runs a 4-token generate per mode (its compile and capture, timed apart). Each
workload then runs once untimed and once timed per seed 0..--repeats-1; tokens/s = generated tokens / wall
time of a timed generate call (prefills included, Python's garbage collector off; the median call, with the spread
(max - min) / median beside it, and the fastest call), tokens/step and the K histogram pooled over them, and the
prefills per call (their median: which rows finish together decides how many a call takes). Greedy calls of one
cell do the same work (greedy tokens do not depend on the seed, and auto's table is fixed once measured), so their
fastest call is the one least slowed by the host: the greedy targets are also read on the fastest calls. Runs on
one engine (auto, its chooser variants, the pinned K) take turns seed by seed, so that a drift of the machine
falls on all of them alike. Each engine's compile times go into the report as soon as they are known.

Targets checked at the end: auto within 3% of the best fixed K on (i) and (ii); auto >= 1.10x K=4 on
(iii) (greedy, and at temperature 1 where sampled auto ran with the fixed K); block tokens/step >= token
tokens/step on every workload.

CPU smoke check:
    python benchmarks/bench_adaptive.py --device cpu --k-set 1,2 --batch-sizes 1 --prompts 2 \\
        --max-new-tokens 16 --skip-sampling --out /tmp/x.md
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import itertools
import random
import statistics
import sys
import sysconfig
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from train_default_pair import load_corpus, make_prompts  # noqa: E402

from bench_util import int_list, report_head, settings_as  # noqa: E402
from spec_graph import SpecDecoder, SpecGraphConfig  # noqa: E402
from spec_graph import adaptive  # noqa: E402
from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph import runtime as sg_runtime  # noqa: E402
from spec_graph.adaptive import DECAY  # noqa: E402
from spec_graph.cli import DEFAULT_PAIR  # noqa: E402

WORKLOADS = ("stdlib", "random", "mixed")
SEED = 0
MAX_LEN = 512
AUTO = "auto"


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workloads(n: int) -> dict[str, list[list[int]]]:
    _, val, _ = load_corpus(Path(sysconfig.get_paths()["stdlib"]), val_every=20, max_file_bytes=400_000)
    stdlib = make_prompts(val, n, SEED, min_len=96, max_len=128)
    if len(stdlib) < n:
        sys.exit(f"only {len(stdlib)} held-out stdlib prompts found under {sysconfig.get_paths()['stdlib']}")
    rng = random.Random(SEED)
    rand = [[rng.randrange(256) for _ in p] for p in stdlib]
    mixed = [p for pair in zip(stdlib, rand) for p in pair][:n]
    return {"stdlib": stdlib, "random": rand, "mixed": mixed}


def engine_plan(a) -> dict:
    """{(K, verification): [modes]}, in build order; greedy is the same under both verifications."""
    plan: dict = collections.defaultdict(list)
    fixed = [] if a.skip_fixed or a.pin_in_auto else a.k_set
    for k in [] if a.skip_greedy else fixed + [AUTO]:
        plan[(k, "token")].append("greedy")
    if not a.skip_sampling:
        # the fixed K of --k-set then run sampled in the auto token engine, pinned: no engine of their own
        pinned = a.pin_in_auto and not a.skip_fixed and AUTO in a.sampling_ks
        for k in a.sampling_ks:
            for v in ("token",) if a.skip_block else ("token", "block"):
                if not (pinned and v == "token" and k in a.k_set):
                    plan[(k, v)].append("sampling")
    return dict(plan)


def build(k, verification: str, B: int, a) -> SpecDecoder:
    kw = dict(max_speculative_tokens=max(a.k_set)) if k == AUTO else {}
    cfg = SpecGraphConfig(num_speculative_tokens=k, max_batch_size=B, max_len=MAX_LEN, device=a.device,
                          batch_buckets=(B,), verification=verification, steps_per_graph=a.steps_per_graph,
                          admission_wait=a.admission_wait, **kw)
    return SpecDecoder.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", cfg)


@contextlib.contextmanager
def chooser_as(pin: int | None = None, decay: float | None = None, host_ms: float = 0.0, rows: bool = True,
               explore_rows: int | None = None):
    """The auto engine's chooser replaced, for the calls inside: one that always picks K=`pin` (it still reads the
    counters; the engine then runs its own K graph, as a fixed-K engine would, with no compile of its own), or one
    with another decay and `host_ms` added to every K's time per step (negative: taken off; a chooser variant on
    the same graphs); rows=False: blind to the work each row has left (the most tokens per second over all
    rows at every replay); explore_rows: adaptive.EXPLORE_ROWS (the busy rows up to which it tries a larger K)."""
    real = sg_runtime.KChooser
    explore = adaptive.EXPLORE_ROWS if explore_rows is None else explore_rows

    class Variant(real):
        def __init__(self, choices):
            super().__init__(choices, DECAY if decay is None else decay)

        def choose(self, times, remaining=None, queued=0):
            if pin is not None:
                return pin
            times = {k: t + host_ms / 1e3 for k, t in times.items()}
            return super().choose(times, remaining, queued) if rows else super().choose(times)

    sg_runtime.KChooser = Variant
    try:
        with settings_as(adaptive, EXPLORE_ROWS=explore):
            yield
    finally:
        sg_runtime.KChooser = real


@contextlib.contextmanager
def choosing_every(n: int):
    """The engine's chooser, for the calls inside, choosing and observing only every `n`-th replay where it chooses
    from the batch's counts (more than one busy row, or N > 1), and keeping the K running between: its host work
    there cut to 1/n, its choices later. (Where it forks per outcome, at one busy row, it works every replay.)"""
    real = sg_runtime.ChoiceAhead

    class Every(real):
        replays = 0

        def ahead(self, k, steps, lens):
            if not (steps == 1 and len(lens) <= self.MAX_FORK_ROWS):
                self.replays += 1
                if self.replays % n:  # the counts read meanwhile are cumulative: the next observe takes them all
                    self._spent, self._next, self.chooser.last_k = None, k, k
                    return
            super().ahead(k, steps, lens)

    sg_runtime.ChoiceAhead = Every
    try:
        yield
    finally:
        sg_runtime.ChoiceAhead = real


def replay_counts(text: str) -> list[int]:
    """--choose-every "2,3" -> [2, 3]; anything but integers of 1 or more is refused by name."""
    return int_list(text, "--choose-every", "a replay count", 1)


@contextlib.contextmanager
def admission_as(dec: SpecDecoder, wait: int):
    """The engine's admission_wait set to `wait` for the calls inside."""
    old, dec.config.admission_wait = dec.config.admission_wait, wait
    try:
        yield
    finally:
        dec.config.admission_wait = old


def chooser_variants(spec: str) -> list[tuple[str, float, float | None, bool, int | None]]:
    """"0.85,0.9+0.09,0.95-h,0.85:blind,0.85:explore=8" -> [("0.85", 0.85, 0.0, True, None), ("0.9+0.09", 0.9,
    0.09, True, None), ("0.95-h", 0.95, None, True, None), ("0.85:blind", 0.85, 0.0, False, None), ("0.85:explore=8",
    0.85, 0.0, True, 8)]: the decay per row-step, then host ms per replay added to the engine's step times ("-h":
    without the host time the engine measured, None); ":blind": a chooser blind to the work each row has left;
    ":explore=N": it tries a larger K at up to N busy rows (adaptive.EXPLORE_ROWS)."""
    out = []
    for item in (x for x in spec.split(",") if x):
        body, *tags = item.split(":")
        explore = [t for t in tags if t.startswith("explore=")]
        if set(tags) - {"blind"} - set(explore):
            raise SystemExit(f"--chooser-variants {item!r}: tags are :blind and :explore=N")
        if body.endswith("-h"):
            decay, host = float(body[:-2]), None
        else:
            d, _, h = body.partition("+")
            decay, host = float(d), float(h or 0.0)
        out.append((item, decay, host, "blind" not in tags,
                    int(explore[-1][len("explore="):]) if explore else None))
    return out


def timed_call(dec: SpecDecoder, prompts, temperature: float, seed: int, a) -> tuple:
    """One generate call with this seed, run once untimed first (its prefill graphs: a seed may admit requests
    in other group sizes), then timed: (tokens/s, stats, ms per replay)."""
    gen = lambda: dec.generate(prompts, a.max_new_tokens, temperature=temperature, seed=seed)  # noqa: E731
    gen()
    gc.collect()  # as timeit does: no collection inside the timed call
    gc.disable()
    try:
        t0 = time.perf_counter()
        stats = gen().stats
        wall = time.perf_counter() - t0
    finally:
        gc.enable()
    return stats.generated_tokens / wall, stats, 1e3 * wall / max(stats.steps / a.steps_per_graph, 1)


def summary(calls: list) -> dict:
    """The timed calls of one cell: tokens/s of the median call (a stray host stall stays out) and its spread
    ((max - min) / median over the calls); the counts pooled."""
    rates, stats, replay_ms = (list(x) for x in zip(*calls))
    n = sum(s.generated_tokens for s in stats)
    ks = [k for s in stats for k in (getattr(s, "k_per_step", None) or [])]
    mid = statistics.median(rates)
    return dict(tps=mid, tps_best=max(rates), calls=len(rates), spread=(max(rates) - min(rates)) / mid,
                tps_step=n / sum(s.request_steps for s in stats),
                ms_replay=statistics.median(replay_ms), prefills=statistics.median(s.prefills for s in stats),
                acc=statistics.fmean(s.acceptance_rate for s in stats), gen=n,
                kmean=statistics.fmean(ks) if ks else None, khist=dict(sorted(collections.Counter(ks).items())))


def run_engine(key, modes, B: int, prompts: dict, a, res: dict, notes: list, save=lambda: None) -> None:
    """One engine's runs; ``save()`` after each round writes the report so far (a run cut short keeps it)."""
    k, verification = key
    t0 = time.time()
    dec = build(k, verification, B, a)
    load_s, caps = time.time() - t0, []
    head = f"- B={B} K={k} {verification}: load {load_s:.1f} s, compile+capture "
    at = len(notes)
    notes.append(head)  # filled in as the engine goes: a run cut short keeps its compile times
    for mode in modes:
        temp = 0.0 if mode == "greedy" else 1.0
        t1 = time.time()
        dec.generate([prompts["stdlib"][0][:16]], 4, temperature=temp, seed=SEED)  # compile + capture
        caps.append(f"{mode} {time.time() - t1:.1f} s")
        notes[at] = head + ", ".join(caps)
        save()
        runs = [(k, {})]
        if k == AUTO and verification == "token":
            # the host time the engine measured per replay, as ms per step (what a "-h" variant takes off)
            own_ms = 1e3 * dec.host_times.get((mode == "greedy", B), 0.0) / a.steps_per_graph
            runs += [(f"auto d={name}", dict(decay=d, host_ms=-own_ms if h is None else h / a.steps_per_graph,
                                             rows=rows, explore_rows=x))
                     for name, d, h, rows, x in chooser_variants(a.chooser_variants)]
        if k == AUTO and verification == "token" and a.pin_in_auto and not a.skip_fixed:
            runs += [(pin, dict(pin=pin)) for pin in a.k_set]
        # twins that admit queued requests at once (admission_wait 0): the same engine and graphs
        runs += [(f"{kk} at once", {**how, "at_once": True}) for kk, how in runs if str(kk) in a.at_once_too]
        # Several runs on one engine (auto, its chooser variants, each K pinned) take turns, seed by seed, so that
        # a drift of the machine over the minutes they take falls on all of them alike.
        # Each round's cells go into res at once: a run that fails later leaves the rounds before it.
        calls: dict = collections.defaultdict(list)
        for seed in range(SEED, SEED + a.repeats):
            for kk, how in runs:
                how = dict(how)
                at_once = admission_as(dec, 0) if how.pop("at_once", False) else contextlib.nullcontext()
                with chooser_as(**how) if how else contextlib.nullcontext(), at_once:
                    for w in WORKLOADS:
                        calls[(kk, w)].append(timed_call(dec, prompts[w], temp, seed, a))
                        res[(B, mode, kk, verification, w)] = r = summary(calls[(kk, w)])
                        progress(f"  B={B} K={kk} {verification} {mode} {w}, seed {seed}: {r['tps']:.0f} tok/s "
                                 f"(spread {r['spread']:.1%}), {r['tps_step']:.2f} tok/step, "
                                 f"{r['ms_replay']:.3f} ms/replay"
                                 + (f", mean K {r['kmean']:.2f}" if str(kk).startswith(AUTO) else ""))
            save()
    line = head + ", ".join(caps)
    rep = getattr(dec, "capture_report", None)
    if k == AUTO and rep:
        mib = lambda m: f"{m / 2**20:.1f} MiB" if m is not None else "n/a"  # noqa: E731
        line += "; capture_report: " + ", ".join(f"K={kk} {v['capture_s']:.2f} s {mib(v.get('memory_bytes'))}"
                                                 for kk, v in sorted(rep.items()))
    if k == AUTO and dec.step_times:  # the chooser's time table: ms per step at live length 128
        line += "; step ms at length 128: " + ", ".join(
            f"{'greedy' if g else 'sampled'} B={b} K={kk} "
            f"{1e3 * (t[0] + 128 * t[1] if isinstance(t, tuple) else t):.3f}"
            for (g, b, kk), t in sorted(dec.step_times.items(), key=str))
        line += "; host ms per replay: " + ", ".join(f"{'greedy' if g else 'sampled'} B={b} {1e3 * t:.3f}"
                                                     for (g, b), t in sorted(dec.host_times.items()))
    notes[at] = line + f"; engine total {time.time() - t0:.1f} s"
    progress(f"engine B={B} K={k} {verification} done in {time.time() - t0:.1f} s")
    del dec
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fmt3(res, B, mode, k, v, field, spec):
    cells = []
    for w in WORKLOADS:
        x = res.get((B, mode, k, v, w), {}).get(field)
        cells.append(format(x, spec) if x is not None else "n/a")
    return " / ".join(cells)


def tables(res, a) -> list[str]:
    L = ["| B | mode | K | verification | tok/s (i) / (ii) / (iii) | tok/s spread | fastest call tok/s | tok/step "
         "| acceptance | mean K | ms/replay | prefills/call |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted({key[:4] for key in res}, key=lambda r: (r[0], r[1] != "greedy", str(r[2]).zfill(4), r[3]))
    for B, mode, k, v in rows:
        L.append(f"| {B} | {mode} | {k} | {v} | {fmt3(res, B, mode, k, v, 'tps', '.0f')} | "
                 f"{fmt3(res, B, mode, k, v, 'spread', '.1%')} | {fmt3(res, B, mode, k, v, 'tps_best', '.0f')} | "
                 f"{fmt3(res, B, mode, k, v, 'tps_step', '.2f')} | "
                 f"{fmt3(res, B, mode, k, v, 'acc', '.3f')} | "
                 f"{fmt3(res, B, mode, k, v, 'kmean', '.2f') if str(k).startswith(AUTO) else k} | "
                 f"{fmt3(res, B, mode, k, v, 'ms_replay', '.3f')} | {fmt3(res, B, mode, k, v, 'prefills', 'g')} |")
    L.append("")
    order = lambda kv: (kv[0][0], kv[0][1] != "greedy", kv[0][3], WORKLOADS.index(kv[0][4]))  # noqa: E731
    for (B, mode, k, v, w), r in sorted(res.items(), key=order):
        if str(k).startswith(AUTO) and r["khist"]:
            hist = ", ".join(f"K={kk}: {n}" for kk, n in r["khist"].items())
            L.append(f"- K used by {k}, B={B} {mode} {v} {w}: {hist}")
    return L


def _ok(met: bool) -> str:
    return "met" if met else "NOT met"


def _fixed(res, B: int, mode: str, w: str, ks, field: str = "tps") -> dict:
    """{K: the cell's `field`} of the fixed Ks that ran on workload w."""
    return {k: res[key][field] for k in ks if (key := (B, mode, k, "token", w)) in res}


def targets(res, a) -> list[str]:
    L = []
    autos = sorted({key[2] for key in res if str(key[2]).startswith(AUTO)}, key=str)
    for B in a.batch_sizes:
        for mode, name in itertools.product(("greedy", "sampling"), (x for x in autos if x != AUTO)):
            # chooser variants: against the best fixed K and K=4
            row = [res.get((B, mode, name, "token", w)) for w in WORKLOADS]
            fixed = [_fixed(res, B, mode, w, a.k_set) for w in WORKLOADS]
            if all(row) and all(fixed):
                vs = " / ".join(f"{r['tps'] / max(f.values()):.3f}" for r, f in zip(row[:2], fixed[:2]))
                k4 = res.get((B, mode, 4, "token", "mixed"))
                L.append(f"- B={B} {name}" + ("" if mode == "greedy" else " at temperature 1")
                         + f": {vs} of the best fixed K on (i) / (ii)"
                         + (f"; {row[2]['tps'] / k4['tps']:.3f}x K=4 on (iii)" if k4 else ""))
        for mode in ("greedy", "sampling"):
            at = "" if mode == "greedy" else " at temperature 1"
            for w in ("stdlib", "random"):
                auto = res.get((B, mode, AUTO, "token", w))
                fixed = _fixed(res, B, mode, w, a.k_set)
                if auto and set(fixed) == set(a.k_set):  # every fixed K ran in this mode
                    best = max(fixed, key=fixed.get)
                    ratio = auto["tps"] / fixed[best]
                    L.append(f"- B={B} {w}{at}: auto {auto['tps']:.0f} tok/s vs best fixed K={best} "
                             f"{fixed[best]:.0f} ({ratio:.3f}x; target >= 0.97x): {_ok(ratio >= 0.97)}"
                             + (_fastest(res, B, w, a.k_set, 0.97) if mode == "greedy" else ""))
            auto, k4 = res.get((B, mode, AUTO, "token", "mixed")), res.get((B, mode, 4, "token", "mixed"))
            if auto and k4:
                ratio = auto["tps"] / k4["tps"]
                L.append(f"- B={B} mixed{at}: auto {auto['tps']:.0f} tok/s vs K=4 {k4['tps']:.0f} ({ratio:.3f}x; "
                         f"target >= 1.10x): {_ok(ratio >= 1.10)}"
                         + (_fastest(res, B, "mixed", [4], 1.10) if mode == "greedy" else ""))
        for k in ([] if a.skip_sampling else a.sampling_ks):
            for w in WORKLOADS:
                t, b = res.get((B, "sampling", k, "token", w)), res.get((B, "sampling", k, "block", w))
                if t and b:
                    gain = b["tps_step"] / t["tps_step"] - 1
                    L.append(f"- B={B} K={k} {w}, temperature 1: block {b['tps_step']:.3f} vs token "
                             f"{t['tps_step']:.3f} tok/step ({gain:+.1%}; tok/s {b['tps'] / t['tps']:.3f}x): "
                             f"{_ok(b['tps_step'] >= t['tps_step'])}")
    return L or ["- no target could be checked (variants missing)"]


def _fastest(res, B: int, w: str, ks, target: float) -> str:
    """The same greedy target read on each cell's fastest call: auto's against the best of the fixed Ks' (the
    caller has checked that those cells ran)."""
    fixed = _fixed(res, B, "greedy", w, ks, "tps_best")
    best = max(fixed, key=fixed.get)
    ratio = res[(B, "greedy", AUTO, "token", w)]["tps_best"] / fixed[best]
    return f"; on the fastest calls {ratio:.3f}x K={best}: {_ok(ratio >= target)}"


def _calls(res, a) -> str:
    """How many timed calls the cells hold: --repeats, or fewer where the run was cut short."""
    ns = sorted({r["calls"] for r in res.values()}) or [0]
    got = str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    return got if ns == [a.repeats] else f"{got} (of {a.repeats} asked: the run was cut short)"


def report(res, notes, errors, a, dev_name, elapsed) -> list[str]:
    L = report_head("bench_adaptive", "bench_adaptive.py", dev_name) + [
         f"- embedded default pair, max_len {MAX_LEN}, {a.max_new_tokens} new tokens, steps_per_graph "
         f"{a.steps_per_graph}; prompts per B: {dict(zip(a.batch_sizes, a.prompts))}; workloads (i) stdlib "
         f"held-out, (ii) random bytes, (iii) the two alternating; tok/s: the median of {_calls(res, a)} timed "
         f"generate calls (seeds {SEED}..{SEED + a.repeats - 1}, prefills included), each after an untimed one; "
         f"spread: (max - min) / median over those calls; runs on one engine take turns seed by seed; one bucket "
         f"(B) per engine; ms/replay: the timed call's wall time per graph replay (its prefills included); "
         f"prefills/call: prefill forwards per call (median); "
         + ("fixed K: the auto engine with its choice pinned to K; " if a.pin_in_auto else "")
         + f"admission_wait {'max_batch_size' if a.admission_wait is None else a.admission_wait} slot-steps"
         + (" (\"at once\": 0); " if a.at_once_too else "; ")
         + f"whole run {elapsed / 60:.1f} min", ""]
    L += tables(res, a)
    L += ["", "Engines (load, first generate per mode = compile + capture):"] + notes
    L += [f"- {k} failed: {v}" for k, v in errors.items()]
    L += ["", "Targets:"] + targets(res, a)
    return L


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k-set", default="1,2,3,4,6,8", help="fixed K values run greedy (auto goes up to the largest)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompts", default="8,16", help="prompts per batch size (one value: the same for every B)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sampling-ks", default="4", help="K values of the token vs block comparison")
    ap.add_argument("--skip-sampling", action="store_true")
    ap.add_argument("--skip-greedy", action="store_true", help="only the token vs block comparison")
    ap.add_argument("--skip-block", action="store_true", help="sampled runs with token verification only")
    ap.add_argument("--skip-fixed", action="store_true", help="greedy at K=auto only (the fixed K left out)")
    ap.add_argument("--chooser-variants", default="",
                    help="also run the auto engine's workloads (greedy, and sampled where auto samples) with these "
                         "choosers: decay[+host ms per "
                         "replay | -h][:blind][:explore=N], comma-separated (e.g. 0.85+0.09,0.9,0.95-h,0.85:blind, "
                         "0.85:explore=8; explore: tries a larger K at up to N busy rows; blind: to "
                         "the work each row has left); the same graphs, no compile")
    ap.add_argument("--pin-in-auto", action="store_true",
                    help="run each fixed K in the auto engine with its choice pinned (one compile for all K)")
    # A B=8 call takes 50-80 ms: over 3 calls the spread was 14-20% (one slow round), more than the gaps between K
    ap.add_argument("--repeats", type=int, default=9, help="timed calls per cell (seeds 0..N-1)")
    ap.add_argument("--steps-per-graph", type=int, default=1)
    ap.add_argument("--admission-wait", type=int, default=None,
                    help="the engines' SpecGraphConfig.admission_wait (default: the config's, max_batch_size)")
    ap.add_argument("--at-once-too", default="",
                    help="these runs (auto, its pinned K, ...: comma-separated) again with queued requests "
                         "admitted at once (admission_wait 0), taking turns with the others on the same engine")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    a.k_set, a.batch_sizes, a.prompts = ints(a.k_set), ints(a.batch_sizes), ints(a.prompts)
    a.at_once_too = [x for x in a.at_once_too.split(",") if x]
    a.sampling_ks = [x if x == AUTO else int(x) for x in a.sampling_ks.split(",") if x]
    if len(a.prompts) == 1:
        a.prompts *= len(a.batch_sizes)
    if len(a.prompts) != len(a.batch_sizes):
        ap.error("--prompts needs one value, or one per batch size")
    return a


def main():
    a = parse_args()
    t_start = time.time()
    dev_name = sg_platform.get(a.device).device_name()
    wl = workloads(max(a.prompts))
    progress(f"{dev_name}; prompt lengths {min(map(len, wl['stdlib']))}-{max(map(len, wl['stdlib']))} tokens")
    out = Path(a.out)
    prev = out.read_text() if out.exists() else "# Benchmark results\n"
    res, notes, errors = {}, [], {}
    save = lambda: write(out, prev, report(res, notes, errors, a, dev_name, time.time() - t_start))  # noqa: E731
    for B, n in zip(a.batch_sizes, a.prompts):
        prompts = {w: p[:n] for w, p in wl.items()}
        for key, modes in engine_plan(a).items():
            progress(f"engine B={B} K={key[0]} {key[1]} ({', '.join(modes)})")
            try:
                run_engine(key, modes, B, prompts, a, res, notes, save)
            except Exception as e:  # noqa: BLE001 - one engine failing leaves the others' numbers
                traceback.print_exc()
                why = str(e).splitlines()[0][:200] if str(e) else ""
                errors[f"B={B} K={key[0]} {key[1]}"] = f"{type(e).__name__}: {why}"
            save()
    lines = report(res, notes, errors, a, dev_name, time.time() - t_start)
    write(out, prev, lines)
    print("\n".join(lines))


def write(out: Path, prev: str, lines: list[str]) -> None:
    """The report appended to what the file held before the run; rewritten after every round of calls, so a run
    cut short still leaves what it measured."""
    out.write_text(prev.rstrip() + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
