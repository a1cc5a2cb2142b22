"""The compiled prefill forward against the recorded eager one, end to end on the embedded pair (CUDA GPU).

    python benchmarks/bench_prefill.py [B] [repeats]      (defaults: 8, 7)

One engine (bf16, K=4 greedy, max_len 512, the one bucket B) and bench_adaptive's stdlib and mixed workloads
(16 prompts, 128 new tokens). Each mode keeps prefill graphs of its own and the two take turns call by call;
prints the first call of each (compiles and captures), the median wall time per generate call (the garbage
collector off), how many rows' tokens differ between the modes (bf16 rounding of two attention kernels), and a
1-token generate of B prompts (a prefill and its read, synchronized).
"""
import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "examples")]
from bench_adaptive import workloads  # noqa: E402
from spec_graph import SpecDecoder, SpecGraphConfig  # noqa: E402
from spec_graph.cli import DEFAULT_PAIR  # noqa: E402


ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("B", type=int, nargs="?", default=8, help="rows of the engine's one batch bucket (default 8)")
ap.add_argument("repeats", type=int, nargs="?", default=7, help="timed calls per mode and workload (default 7)")
args = ap.parse_args()
B, reps = args.B, args.repeats
if not torch.cuda.is_available():
    sys.exit("bench_prefill.py times CUDA graphs: it needs a CUDA GPU")
w = workloads(16)
cfg = SpecGraphConfig(num_speculative_tokens=4, max_batch_size=B, max_len=512, batch_buckets=(B,))
dec = SpecDecoder.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", cfg)
res, sets = {}, {}


def use(compiled):
    """Each mode keeps its own prefill graphs: a graph records one mode's forward."""
    SpecDecoder.compile_prefill = compiled
    if compiled not in sets:
        dec._new_prefill_graphs()
        sets[compiled] = (dec.prefill_graphs, dec._prefill_inputs)
    dec.prefill_graphs, dec._prefill_inputs = sets[compiled]


for compiled in (False, True):
    use(compiled)
    t0 = time.perf_counter()
    first = dec.generate(w["stdlib"], 128)
    torch.cuda.synchronize()
    print(f"compile_prefill={compiled}: first call {time.perf_counter() - t0:.1f} s", flush=True)
    res[compiled] = {"first": [r.token_ids for r in first]}
gc.disable()
for name in ("stdlib", "mixed"):
    times = {False: [], True: []}
    for i in range(reps):
        for compiled in (False, True):
            use(compiled)
            if i == 0:
                dec.generate(w[name], 128)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = dec.generate(w[name], 128)
            torch.cuda.synchronize()
            times[compiled].append((time.perf_counter() - t0) * 1e3)
            if i == 0:
                res[compiled][name] = [r.token_ids for r in out]
    for c in (False, True):
        ts = sorted(times[c])
        print(f"B={B} {name} compile_prefill={c}: median {statistics.median(ts):.2f} ms "
              f"(min {ts[0]:.2f}, max {ts[-1]:.2f})", flush=True)
    diff = sum(a != b for a, b in zip(res[False][name], res[True][name]))
    print(f"  rows whose tokens differ eager vs compiled prefill: {diff}/{len(res[False][name])}", flush=True)
# one prefill, synchronized
for compiled in (False, True):
    use(compiled)
    p = w["stdlib"][:B]
    dec.generate(p, 1)
    ts = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.generate(p, 1)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    print(f"generate(1 token) of {B} prompts, compile_prefill={compiled}: median {statistics.median(ts):.3f} ms",
          flush=True)
