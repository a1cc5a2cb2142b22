"""decode_attention (live-length flash-decoding) vs the masked full-cache attention of models/llama.py.

    python benchmarks/bench_attention.py [--quick] [--sweep]

One attention layer in bf16 with bench_step.py's head shapes (target 32/8 heads, draft 12/4, head_dim 64):
B in (1, 8); target T=5 (K=4 verify) and T=1, draft T=1 and 2; cache length Lc in (640, 8192, 32768)
with live lengths (512, 4096, 16384, 32000) that fit. Each op is captured in a CUDA graph (as in the
step) and timed by triton.testing.do_bench on the replay (L2 flushed between calls; median).
Bandwidth counts the live K/V bytes only: B * Hkv * live * D * 2 (K and V) * 2 bytes.
CUDA only; about a minute on an H200.

--sweep: for the long live lengths (4096 and up) at B=1 (target T=5, draft T=1), also times a grid of
(splits, BLOCK_N, num_warps, num_stages) and prints the best against the automatic choice: where the kernel's
bandwidth at long contexts can still come from.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph.kernels import decode_attention, decode_attention_ref  # noqa: E402
from spec_graph.kernels import attention as att  # noqa: E402
from spec_graph.kernels.attention import auto_num_splits  # noqa: E402

MODELS = {"target": (32, 8, 64), "draft": (12, 4, 64)}  # (Hq, Hkv, head_dim), as bench_step.py's pair
CASES = [("target", 5), ("target", 1), ("draft", 1), ("draft", 2)]
LENGTHS = [(640, 512), (8192, 512), (8192, 4096), (32768, 512), (32768, 4096), (32768, 16384), (32768, 32000)]
SWEEP = [(s, n, w, st) for s in (0, 16, 32, 64, 128) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def graphed(plat, fn):
    """fn captured once; returns (replay, output) so the timing sees one graph launch, as in the step."""
    stream = plat.new_stream()
    with plat.on_side_stream(stream):
        for _ in range(2):
            fn()
    plat.join_stream(stream)
    plat.synchronize()
    graph = plat.new_graph()
    out = plat.record(graph, fn)
    plat.synchronize()
    return (lambda: plat.replay(graph)), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B=1 target T=5 only")
    ap.add_argument("--sweep", action="store_true", help="also a launch-configuration sweep at long contexts, B=1")
    ap.add_argument("--rep", type=int, default=40, help="do_bench rep (ms) per measurement")
    a = ap.parse_args()
    plat = sg_platform.current()
    if plat.name != "cuda":
        sys.exit("bench_attention.py needs a CUDA GPU")
    import triton.testing

    dev, dt = plat.device, torch.bfloat16
    print(f"# decode_attention on {plat.device_name()}, bf16, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    hdr = (f"{'model':6} {'B':>2} {'T':>2} {'Lc':>6} {'live':>6} {'splits':>6} {'op us':>8} {'ref us':>8} "
           f"{'speedup':>8} {'op GB/s':>8} {'ref GB/s':>8} {'max|diff|':>9}")
    print(hdr)
    print("-" * len(hdr))
    batches = (1,) if a.quick else (1, 8)
    cases = CASES[:1] if a.quick else CASES
    for model, T in cases:
        Hq, Hkv, D = MODELS[model]
        for B in batches:
            for Lc, live in LENGTHS:
                torch.manual_seed(0)
                q = torch.randn(B, T, Hq, D, device=dev, dtype=dt)
                k = torch.randn(1, B, Hkv, Lc, D, device=dev, dtype=dt)
                v = torch.randn_like(k)
                pos = (live - T + torch.arange(T, device=dev)).clamp(min=0).expand(B, T).contiguous()
                op, out = graphed(plat, lambda: decode_attention(q, k, v, 0, None, pos))
                ref, out_ref = graphed(plat, lambda: decode_attention_ref(q, k, v, 0, None, pos))
                op()
                ref()
                plat.synchronize()
                diff = (out.float() - out_ref.float()).abs().max().item()
                t_op = triton.testing.do_bench(op, warmup=10, rep=a.rep, return_mode="median")
                t_ref = triton.testing.do_bench(ref, warmup=10, rep=a.rep, return_mode="median")
                gbytes = B * Hkv * live * D * 2 * q.element_size() / 1e9
                print(f"{model:6} {B:>2} {T:>2} {Lc:>6} {live:>6} {auto_num_splits(B, Hkv, Lc, dev):>6} "
                      f"{t_op * 1e3:>8.1f} {t_ref * 1e3:>8.1f} {t_ref / t_op:>7.1f}x "
                      f"{gbytes / (t_op / 1e3):>8.0f} {gbytes / (t_ref / 1e3):>8.0f} {diff:>9.2e}", flush=True)
    if a.sweep:
        sweep(plat, dev, dt, a.rep)


def sweep(plat, dev, dt, rep: int) -> None:
    """Best (splits, BLOCK_N, warps, stages) per long-context case against the automatic choice."""
    import triton.testing

    print("\n| model | T | Lc | live | auto us | auto GB/s | best (splits, BLOCK_N, warps, stages) | best us "
          "| best GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, T in (("target", 5), ("draft", 1)):
        Hq, Hkv, D = MODELS[model]
        for Lc, live in ((L, v) for L, v in LENGTHS if v >= 4096):
            torch.manual_seed(0)
            q = torch.randn(1, T, Hq, D, device=dev, dtype=dt)
            k = torch.randn(1, 1, Hkv, Lc, D, device=dev, dtype=dt)
            v = torch.randn_like(k)
            pos = (live - T + torch.arange(T, device=dev))[None].contiguous()
            gbytes = Hkv * live * D * 2 * q.element_size() / 1e9
            times = {}
            for splits, block_n, warps, stages in [(0, att.BLOCK_N, None, None)] + SWEEP:
                saved_n, saved_launch = att.BLOCK_N, dict(att.LAUNCH)
                att.BLOCK_N = block_n
                if warps is not None:
                    att.LAUNCH.update(num_warps=warps, num_stages=stages)
                try:
                    op, _ = graphed(plat, lambda: decode_attention(q, k, v, 0, None, pos, num_splits=splits))
                    times[(splits, block_n, warps, stages)] = triton.testing.do_bench(
                        op, warmup=5, rep=rep, return_mode="median")
                except Exception as e:  # a tile that does not fit, say
                    print(f"<!-- {model} {Lc} {live} {(splits, block_n, warps, stages)}: {type(e).__name__} -->")
                finally:
                    att.BLOCK_N = saved_n
                    att.LAUNCH.clear()
                    att.LAUNCH.update(saved_launch)
            auto = times.pop((0, att.BLOCK_N, None, None))
            best = min(times, key=times.get)
            print(f"| {model} | {T} | {Lc} | {live} | {auto * 1e3:.1f} | {gbytes / (auto / 1e3):.0f} | {best} | "
                  f"{times[best] * 1e3:.1f} | {gbytes / (times[best] / 1e3):.0f} |", flush=True)


if __name__ == "__main__":
    main()
