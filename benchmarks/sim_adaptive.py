"""Adaptive K's choices priced with a device's step times, on any machine: which chooser settings would win.

    python benchmarks/sim_adaptive.py [--times 0.294,0.399,0.501,0.606,0.815,1.031] [--k-set 1,2,3,4,6,8]
        [--overhead 0.09] [--batch-size 1] [--prompts 8] [--decays 0.9,0.95,0.98] [--temperature 0]
        [--device cpu] [--prior-shrinks 0.9:4] [--seeds 0,1,2]

Acceptance does not depend on the device: the engine runs the embedded pair on bench_adaptive.py's workloads
((i) held-out stdlib, (ii) random bytes, (iii) alternating) wherever it is, greedy (or sampled at --temperature
under the same --seeds for every run, a whole pass each), at each fixed K and at K="auto", and each run is priced
as if each replay had taken ``times[K] + overhead`` ms (defaults: the H200 table the auto engine measured at B=1
for the embedded pair, and the host time per replay read from that run's fixed-K rows; RESULTS.md, 2026-12-01).
The chooser sees ``times[K]`` as its table, plus the overhead for the variants marked "+h"; each variant runs
again blind to the work each row has left (the most tokens per second over the busy rows at every replay, as the
engine chose before). Simulated tok/ms = generated tokens / priced
time (prefills left out: equal for all).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_adaptive as ba  # noqa: E402
from spec_graph import SpecDecoder, SpecGraphConfig, adaptive  # noqa: E402


def engine(k, B: int, kmax: int, device: str) -> SpecDecoder:
    kw = dict(max_speculative_tokens=kmax) if k == ba.AUTO else {}
    cfg = SpecGraphConfig(num_speculative_tokens=k, max_batch_size=B, max_len=ba.MAX_LEN, device=device,
                          batch_buckets=(B,), **kw)
    return SpecDecoder.from_pretrained(ba.DEFAULT_PAIR / "target", ba.DEFAULT_PAIR / "draft", cfg)


@contextlib.contextmanager
def prior_as(shrink: float, weight: float):
    """The chooser's prior for each position: the rate of the one before it times `shrink` (1: as the engine has
    it), weighing `weight` row-steps against the observations."""
    saved = adaptive.PRIOR_SHRINK, adaptive.PRIOR_WEIGHT
    adaptive.PRIOR_SHRINK, adaptive.PRIOR_WEIGHT = shrink, weight
    try:
        yield
    finally:
        adaptive.PRIOR_SHRINK, adaptive.PRIOR_WEIGHT = saved


def priced(stats, times: dict, overhead: float, fixed_k=None) -> float:
    """Generated tokens per priced ms (stats: one call's, or a list of calls' summed)."""
    runs = stats if isinstance(stats, list) else [stats]
    ms = sum(times[k] + overhead for s in runs for k in (s.k_per_step or [fixed_k] * s.steps))
    return sum(s.generated_tokens for s in runs) / ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--times", default="0.294,0.399,0.501,0.606,0.815,1.031", help="ms per step for each K of --k-set")
    ap.add_argument("--k-set", default="1,2,3,4,6,8")
    ap.add_argument("--overhead", type=float, default=0.09, help="host ms per replay added to every step")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--decays", default="0.9,0.95,0.98", help="chooser decays per row-step to try")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled (token verification)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", default=str(ba.SEED),
                    help="sampling seeds: each cell sums every seed's tokens and priced time (sampled runs vary by "
                         "several percent from one seed to the next)")
    ap.add_argument("--prior-shrinks", default="",
                    help="also the engine's chooser (+h) with other priors per position, as shrink:weight pairs "
                         "(0.9:4: the rate of the position before x 0.9, weighing 4 row-steps)")
    a = ap.parse_args()
    ks = [int(k) for k in a.k_set.split(",")]
    times = dict(zip(ks, (float(t) for t in a.times.split(","))))
    if len(times) != len(ks):
        ap.error("--times needs one value per K of --k-set")
    B, seeds = a.batch_size, [int(x) for x in a.seeds.split(",")]
    wl = {w: p[:a.prompts] for w, p in ba.workloads(a.prompts).items()}
    rows = {}
    gen = lambda dec, w: [dec.generate(wl[w], a.max_new_tokens, temperature=a.temperature, seed=seed).stats  # noqa
                          for seed in seeds]
    for k in ks:
        dec = engine(k, B, max(ks), a.device)
        rows[f"K={k}"] = [priced(gen(dec, w), times, a.overhead, k) for w in ba.WORKLOADS]
        print(f"K={k}: " + " / ".join(f"{x:.3f}" for x in rows[f"K={k}"]), flush=True)
    dec = engine(ba.AUTO, B, max(ks), a.device)
    dec.step_times = {(g, B, k): 1e-3 * t for k, t in times.items() for g in (True, False)}
    variants = [(f"auto decay {d}" + (" +h" if h else "") + ("" if by_row else ", blind to rows' work left"), d,
                 h, adaptive.PRIOR_SHRINK, adaptive.PRIOR_WEIGHT, by_row)
                for d in (float(x) for x in a.decays.split(",")) for h in (False, True) for by_row in (True, False)]
    for item in (x for x in a.prior_shrinks.split(",") if x):
        shrink, weight = (float(v) for v in item.split(":"))
        variants += [(f"auto decay {d} +h, prior x{shrink} weight {weight:g}", d, True, shrink, weight, True)
                     for d in (float(x) for x in a.decays.split(","))]
    for name, decay, with_h, shrink, weight, by_row in variants:
        with ba.chooser_as(decay=decay, host_ms=a.overhead if with_h else 0.0, rows=by_row), \
                prior_as(shrink, weight):
            out = [gen(dec, w) for w in ba.WORKLOADS]
        rows[name] = [priced(s, times, a.overhead) for s in out]
        mean_k = [sum(k for s in runs for k in s.k_per_step) / sum(len(s.k_per_step) for s in runs) for runs in out]
        print(f"{name}: " + " / ".join(f"{x:.3f}" for x in rows[name])
              + "  (mean K " + " / ".join(f"{m:.2f}" for m in mean_k) + ")", flush=True)
    best = {w: max((r[i], n) for n, r in rows.items() if n.startswith("K=")) for i, w in enumerate(ba.WORKLOADS)}
    print(f"\ntemperature {a.temperature}")
    print("| variant | simulated tok/ms (i) / (ii) / (iii) | vs best fixed K (i) / (ii) | vs K=4 (iii) |")
    print("|---|---|---|---|")
    for n, r in rows.items():
        vs = " / ".join(f"{r[i] / best[w][0]:.3f}" for i, w in enumerate(ba.WORKLOADS[:2]))
        k4 = rows.get("K=4")
        print(f"| {n} | {' / '.join(f'{x:.3f}' for x in r)} | {vs} | " + (f"{r[2] / k4[2]:.3f} |" if k4 else "n/a |"))
    print("best fixed K: " + ", ".join(f"{w} {best[w][1]}" for w in ba.WORKLOADS))


if __name__ == "__main__":
    main()
