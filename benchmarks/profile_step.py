"""Where the captured step's time goes: kernels per replay, their total time, the biggest ones.

    python benchmarks/profile_step.py [--batch-size 1] [--timeline] [--out profile.md]

Builds bench_step.py's random-weight pair, captures the spec-graph step and a
target-only decode for one batch size, and profiles graph replays with
torch.profiler: replay time (CUDA events) against the sum of kernel times
tells launch gaps from kernel work; the kernel table says which kernels to
attack. --timeline adds (c)'s kernels of one replay in launch order, each with its time and the gap before
it, which tells the draft's forwards from the verify's. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step as bs  # noqa: E402
import bench_util as bu  # noqa: E402

from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph.capture import GraphSet  # noqa: E402

REPLAYS = 20


def kernel_table(fn, replays: int = REPLAYS, top: int = 25) -> tuple[list[str], float, float]:
    """Profile ``replays`` calls of ``fn``; return table lines, kernels per call, kernel ms per call."""
    agg: dict = defaultdict(lambda: [0, 0.0])
    for ev in bu.device_events(fn, replays):
        dur = getattr(ev, "device_time", None)
        if dur is None:
            dur = ev.cuda_time
        agg[ev.name][0] += 1
        agg[ev.name][1] += dur / 1e3  # us -> ms
    n = sum(c for c, _ in agg.values()) / replays
    total = sum(t for _, t in agg.values()) / replays
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    lines = ["| kernel | calls/step | ms/step | share |", "|---|---|---|---|"]
    for name, (c, t) in rows:
        lines.append(f"| `{name[:90]}` | {c / replays:.0f} | {t / replays:.4f} | {t / replays / total:.1%} |")
    return lines, n, total


def timeline(fn) -> list[str]:
    """The kernels of one call of ``fn`` in launch order: time, gap since the previous kernel ended (us)."""
    evs = sorted(bu.device_events(fn, 1), key=lambda ev: ev.time_range.start)
    lines = ["| # | kernel | us | gap us |", "|---|---|---|---|"]
    end = None
    for i, ev in enumerate(evs):
        start, stop = ev.time_range.start, ev.time_range.end
        gap = "" if end is None else f"{start - end:.1f}"
        lines.append(f"| {i} | `{ev.name[:70]}` | {stop - start:.1f} | {gap} |")
        end = stop
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--timeline", action="store_true", help="also list one replay's kernels in order")
    ap.add_argument("--out", default="profile.md")
    a = ap.parse_args()
    B = a.batch_size
    torch.backends.cuda.matmul.allow_tf32 = True
    root = Path(tempfile.mkdtemp())
    (tdir, hf_t), (ddir, hf_d) = bs.make_pair(root)
    del hf_t, hf_d
    torch.cuda.empty_cache()
    L = [f"# profile_step B={B} — torch {torch.__version__}, {sg_platform.current().device_name()}", ""]

    bu.progress("spec-graph step: compile + capture")
    dec = bs.build_decoder(tdir, ddir, [B], {}, 1, bu.Bar(1, "compile+capture"))
    snap = bs.prime(dec, B)
    ms = bu.median_ms(lambda: dec._run_steps(B, True), a.iters, setup=lambda: bs.restore(dec, snap))
    bs.restore(dec, snap)
    lines, n, kt = kernel_table(lambda: (bs.restore(dec, snap), dec._run_steps(B, True)))
    L += [f"## (c) spec-graph step: {ms:.3f} ms per replay; {n:.0f} kernels, {kt:.3f} ms of kernel time "
          "per replay (includes the state restore copies)", ""] + lines + [""]
    if a.timeline:
        L += ["### (c)'s kernels of one replay, in order (the first are the state restore copies)", ""]
        L += timeline(lambda: (bs.restore(dec, snap), dec._run_steps(B, True))) + [""]

    bu.progress("target-only decode: compile + capture")
    g = GraphSet(sg_platform.current())
    e_ms, _ = bs.bench_target_decode(dec.target, B, a.iters, g)
    lines, n, kt = kernel_table(lambda: g.replay(("decode", B)))
    L += [f"## (e) target decode: {e_ms:.3f} ms per replay; {n:.0f} kernels, {kt:.3f} ms of kernel time", ""]
    L += lines + [""]
    Path(a.out).write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
