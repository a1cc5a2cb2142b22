"""A fixed-K engine's generate calls with replays launched ahead of the read before them, and without.

    python benchmarks/bench_launch_ahead.py [--k 4] [--batch-sizes 8,1] [--prompts 16] [--rounds 9]
        [--max-new-tokens 128] [--device cuda]

One engine per batch size B (the embedded pair, bf16 on CUDA, K drafts, max_len 512, the one bucket B, greedy)
runs bench_adaptive.py's three workloads, taking turns call by call among:

  ahead         as shipped: a replay over two or more busy rows launched before the read of the one before it,
                while some busy row cannot yet have reached its max_new_tokens
  flags only    the same, with every read holding the active flags alone: the host bounds each row's tokens by
                K + 1 a step, so launches ahead stop where those bounds reach max_new_tokens
  serial        launch ahead off: each replay read before the next launch
  ahead at 1    "ahead" with launches ahead from one busy row (AHEAD_ROWS = 1): a row that ends by a stop token
                leaves one replay run for nothing

Per variant and workload: the median wall time of a call (the garbage collector off) with the spread (max - min)
/ median and the fastest call (greedy calls of one workload do the same work, so the fastest is the one least
slowed by the machine), tokens per second at the median, the steps of a call (``stats.steps``: its replays, less
any that ran for no row) and the replays launched ahead as a share of them.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from bench_adaptive import MAX_LEN, workloads  # noqa: E402
from bench_util import settings_as  # noqa: E402
from spec_graph import SpecDecoder, SpecGraphConfig  # noqa: E402
from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph import runtime as sg_runtime  # noqa: E402
from spec_graph.cli import DEFAULT_PAIR  # noqa: E402

VARIANTS = ("ahead", "flags only", "serial", "ahead at 1")


def run_variant(dec, name: str, prompts, max_new: int):
    """One timed call of variant `name`: (seconds, generated tokens, replays launched ahead, replay steps)."""
    flags_only = {"_reads_counts": lambda progress, *rest: progress} if name == "flags only" else {}
    one_row = {"AHEAD_ROWS": 1} if name == "ahead at 1" else {}
    dec.launch_ahead = name != "serial"
    with settings_as(sg_runtime, **flags_only), settings_as(dec, **one_row):
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter()
            out = dec.generate(prompts, max_new)
            dt = time.perf_counter() - t
        finally:
            gc.enable()
    return dt, sum(len(r.token_ids) for r in out), dec.launched_ahead, out.stats.steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-sizes", default="8,1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    plat = sg_platform.get(a.device)
    print(f"{plat.device_name()}; torch {torch.__version__}; K={a.k}", flush=True)
    wl = workloads(a.prompts)
    print("| B | workload | variant | median ms | spread | fastest ms | tok/s | steps | launched ahead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B in (int(b) for b in a.batch_sizes.split(",")):
        cfg = SpecGraphConfig(num_speculative_tokens=a.k, max_batch_size=B, max_len=MAX_LEN, batch_buckets=(B,),
                              device=a.device)
        dec = SpecDecoder.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", cfg)
        t0 = time.perf_counter()
        dec.generate([wl["stdlib"][0][:16]], 4)
        print(f"B={B}: compile + capture {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        for w, prompts in wl.items():
            for name in VARIANTS:  # one untimed call each
                run_variant(dec, name, prompts, a.max_new_tokens)
            runs = {name: [] for name in VARIANTS}
            for _ in range(a.rounds):
                for name in VARIANTS:
                    runs[name].append(run_variant(dec, name, prompts, a.max_new_tokens))
            for name, rs in runs.items():
                secs = [r[0] for r in rs]
                med = statistics.median(secs)
                _, toks, ahead, steps = rs[0]
                print(f"| {B} | {w} | {name} | {1e3 * med:.2f} | {(max(secs) - min(secs)) / med:.1%} | "
                      f"{1e3 * min(secs):.2f} | {toks / med:.0f} | {steps} | {ahead / max(steps, 1):.0%} |", flush=True)


if __name__ == "__main__":
    main()
