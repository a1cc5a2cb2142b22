"""A/B of one kernel launch setting on bench_step.py's captured step (c) and target decode (e), interleaved.

Each value is timed in one process, so the drift between machines and runs does not blur the comparison.

    python benchmarks/ab_step.py --setting attention.MIN_SPLIT_KEYS=64,256 [--batch-size 1] [--rounds 5]
        [--iters 100] [--out benchmarks/RESULTS.md]

The engine compiles its step with the ops opaque (the backend's opaque_kernels): each op picks its launch
(tiles, splits) in its own body when the step is captured. So one compile serves every value of a launch
setting, and each round recaptures the step under each value in turn. (e) is the target's one-token decode,
compiled as bench_step's (e) is and recaptured likewise. Per value: the median over rounds of each round's
median replay time (CUDA events) and the rounds' range. A setting read only at compile time (not in an op's
body) shows no difference here.
"""
from __future__ import annotations

import argparse
import ast
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step as bs  # noqa: E402
import bench_util as bu  # noqa: E402

from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph.capture import GraphSet  # noqa: E402


def parse_values(text: str) -> tuple:
    """MODULE.NAME=V1,V2,... -> (module, name, [values]) of a spec_graph.kernels setting; the values are read as
    one Python list, so a value may hold commas itself (a dict of launch options, a tuple). Exits with a message
    that names the problem."""
    target, eq, values = text.partition("=")
    if not eq or not values:
        sys.exit(f"--setting takes MODULE.NAME=V1,V2,... (e.g. attention.MIN_SPLIT_KEYS=64,256), got {text!r}")
    try:
        vals = ast.literal_eval(f"[{values}]")
    except (ValueError, SyntaxError):
        sys.exit(f"--setting {text!r}: {values!r} is not a comma-separated list of Python literals")
    if not vals:
        sys.exit(f"--setting {text!r}: no values")
    mod, name, _ = bu.parse_setting(f"{target}={vals[0]!r}", "--setting")  # the module and setting exist
    return mod, name, vals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", required=True, metavar="MODULE.NAME=V1,V2,...",
                    help="a spec_graph.kernels setting and the values to time (Python literals), e.g. "
                         "attention.MIN_SPLIT_KEYS=64,256 or \"attention.LAUNCH={},{'num_warps': 2}\"")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="times each value is recaptured and timed")
    ap.add_argument("--iters", type=int, default=100, help="replays per round and value (their median)")
    ap.add_argument("--out", default=str(bs.ROOT / "benchmarks" / "RESULTS.md"))
    a = ap.parse_args()
    mod, name, values = parse_values(a.setting)
    if not torch.cuda.is_available():
        sys.exit("ab_step.py needs a CUDA GPU")
    B = a.batch_size
    torch.backends.cuda.matmul.allow_tf32 = True
    (tdir, hf_t), (ddir, hf_d) = bs.make_pair(Path(tempfile.mkdtemp()))
    del hf_t, hf_d
    torch.cuda.empty_cache()
    bu.progress("spec-graph step: compile + capture")
    dec = bs.build_decoder(tdir, ddir, [B], {}, 1, bu.Bar(1, "compile+capture"))
    snap = bs.prime(dec, B)
    decode = bs.target_decode(dec.target, B)

    times = [{"c": [], "e": []} for _ in values]  # by position: a value may be a dict, which cannot be a key
    saved = getattr(mod, name)
    try:
        for r in range(a.rounds):
            for v, t in zip(values, times):
                setattr(mod, name, v)
                dec.state["active"].zero_()  # captures start from inactive rows (as bench_step's recaptures)
                bs.recapture(dec, 1, bu.Bar(1, f"round {r + 1}: {name}={v!r}"))
                step = lambda: dec._run_steps(B, True)  # noqa: E731
                t["c"].append(bu.median_ms(step, a.iters, setup=lambda: bs.restore(dec, snap)))
                g = GraphSet(sg_platform.current())
                with torch.no_grad():
                    assert g.capture(("decode", B), decode), g.failed
                e_step = lambda: g.replay(("decode", B))  # noqa: E731
                t["e"].append(bu.median_ms(e_step, a.iters))
                bu.progress(f"  {name}={v!r}: (c) {t['c'][-1]:.3f} ms, (e) {t['e'][-1]:.3f} ms")
    finally:
        setattr(mod, name, saved)

    L = bu.report_head(f"ab_step: {mod.__name__.rsplit('.', 1)[-1]}.{name}", "ab_step.py",
                       sg_platform.current().device_name()) + [
        f"- bench_step's pair, bf16, K={bs.K}, B={B}, context {bs.CONTEXT}, static cache {bs.CACHE_LEN}; "
        f"{a.rounds} rounds, each value recaptured in turn; per round the median of {a.iters} replays", "",
    ] + table(values, times)
    bu.append_section(a.out, L)


def table(values: list, times: list[dict]) -> list[str]:
    """The report's rows: each value's (c) and (e) medians over rounds, ranges, and ratios to the first value's."""
    med = statistics.median
    L = ["| value | (c) ms | (c) range | (c) vs first | (e) ms | (e) range | (e) vs first |",
         "|---|---|---|---|---|---|---|"]
    c0, e0 = med(times[0]["c"]), med(times[0]["e"])
    for v, t in zip(values, times):
        c, e = t["c"], t["e"]
        L.append(f"| {v!r} | {med(c):.3f} | {min(c):.3f}-{max(c):.3f} | {med(c) / c0:.3f}x "
                 f"| {med(e):.3f} | {min(e):.3f}-{max(e):.3f} | {med(e) / e0:.3f}x |")
    return L


if __name__ == "__main__":
    main()
