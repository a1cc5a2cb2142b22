"""The fused decode linear kernels (kernels/decode_linear.py) against cuBLAS, per layer shape of bench_step.py's pair.

    python benchmarks/bench_decode_linear.py [--rows 1,5,8,40] [--sweep | --chain [--norm-blocks 0,512] [--ablate]
        [--one-row-grid] [--per-product] [--one-step-rows]]

For each linear layer of the target and the draft (qkv with RMSNorm and RoPE, o_proj with the residual add,
gate_up with RMSNorm and SiLU*up, down_proj with the residual add, lm_head with the final norm) and each row
count M (B x positions), times
  - cublas: F.linear alone (the matmul the fused kernel replaces; its norm and epilogue kernels not counted)
  - fused: the spec_graph op with split-K counters, at the launch configuration `launch_config` picks (and,
    with --sweep, the best of a grid of (DOT, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K), printed for the
    choices in `launch_config`)
Each timing captures REPS calls in one CUDA graph, each call on its own copy of the weights (as the layers
of a forward: nothing is served from L2), and reports the median replay time / REPS. GB/s counts the
weight bytes. --chain instead times each model's four products per layer chained through all its layers in one
graph (a forward's linear kernels; --norm-blocks: once per NORM_BLOCK_K, the norm's step), against the weight
bytes over the measured copy bandwidth, and beside them
the same chain of plain streaming kernels (each reads its weight once and sums it: no norm, epilogue or split
meeting; the best of a small grid of launch shapes) and of empty kernels: what any chain of separate kernels
costs per kernel on this device. --ablate adds the fused chain without split-K, without the norm and without
the residual, and a chain of plain one-row products (no norm, epilogue or split: the best of a grid of tiles).
--one-row-grid times the chain at one row under other CUDA-core tiles, each with the kernel's ONE_STEP_K as set and
lower (ONE_STEP_K_OTHER). --per-product times each of a layer's four products alone through the layers at one row,
fused (at each ONE_STEP_K; the paired ones also on the grid's first paired tile) and as plain one-row products over
the same weights: which product holds the fused chain above the plain one. --one-step-rows times each row count
above one again with ONE_STEP_ROWS raised to that count and no bound on the weights (ONE_STEP_ROWS_WEIGHTS): every
product whose K fits ONE_STEP_K on CUDA cores in one step, a row at a time (the others on tensor cores), against
the default; with --per-product, each product alone at each such row count both ways too. CUDA only.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step as bs  # noqa: E402
import bench_util as bu  # noqa: E402
from bench_attention import graphed  # noqa: E402
from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph.kernels import decode_linear as dl, linear_launch as ll  # noqa: E402
from spec_graph.kernels._triton import tl, triton  # noqa: E402
from spec_graph.kernels.counters import new_sync  # noqa: E402

REPS = 16
# (DOT, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) tried by --sweep: CUDA-core sums where launch_config
# picks them, tensor-core sums elsewhere (warps and stages as launch_config picks them for the layer)
GRID_CUDA_CORES = [(False, n, k, w, 2, 1) for n, k, w in itertools.product((2, 4, 8), (256, 512, 1024), (4, 8))]
GRID_DOT = list(itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8)))
# (programs per SM, BLOCK, num_warps) of the streaming baseline in --chain
GRID_STREAM = list(itertools.product((1, 2, 4, 8), (2048, 8192), (4, 8)))
# (BLOCK_N, BLOCK_K, num_warps) of the plain one-row product baseline in --chain --ablate
GRID_GEMV = list(itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8)))
# --chain --one-row-grid: CUDA_CORE_TILES entries (BLOCK_N, BLOCK_K, num_warps, num_stages) tried one at a time
# for the unpaired products (o_proj, down_proj) and the paired ones (qkv, gate_up), and NORM_BLOCK_K values, each
# with ONE_STEP_K as set and ONE_STEP_K_OTHER
ONE_ROW_UNPAIRED = [(1, 1024, 4, 2), (2, 1024, 4, 3), (2, 2048, 8, 2)]
ONE_ROW_PAIRED = [(1, 1024, 4, 2), (1, 1024, 2, 2), (2, 1024, 4, 1)]
ONE_ROW_NORM_BLOCKS = [512]
ONE_STEP_K_OTHER = (0, 1024)
PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's four fused products, in order


@triton.jit
def _stream_kernel(w_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[pid] = x[0] + sum of w's elements pid * BLOCK + [0, BLOCK), then every nprog * BLOCK after (grid-stride):
    each weight element read once, and the result depends on the kernel before (x is its out)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0) + tl.load(x_ptr).to(tl.float32))


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n] = sum_k w[n, k] x[k] for n = pid * BLOCK_N + [0, BLOCK_N) < N, on CUDA cores (fp32 sums): a one-row
    product with no norm, epilogue or split, the least a chain of separate product kernels can do."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


def layer_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of each linear layer of a bench_step model config."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = H // Hq
    return [("qkv", (Hq + 2 * Hkv) * D, H), ("o", H, Hq * D), ("gate_up", 2 * I, H), ("down", H, I),
            ("lm_head", V, H)]


def timed(plat, fn, iters: int = 20) -> float:
    """ms per call of fn (which makes REPS calls), captured in one graph; median of iters replays."""
    replay, _ = graphed(plat, fn)
    return bu.median_ms(replay, iters, warmup=3) / REPS


def calls(name: str, M: int, N: int, K: int, cfg: dict, dev, dt):
    """(cublas, fused) callables of REPS calls each, on REPS weight copies."""
    torch.manual_seed(0)
    ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(REPS)]
    x = torch.randn(M, K, device=dev, dtype=dt)
    nw = torch.ones(K, device=dev, dtype=dt)
    r = torch.randn(M, N, device=dev, dtype=dt)
    D = cfg["hidden_size"] // cfg["num_attention_heads"]
    cos, sin = torch.randn(M, D, device=dev, dtype=dt), torch.randn(M, D, device=dev, dtype=dt)
    rope_heads = cfg["num_attention_heads"] + cfg["num_key_value_heads"]
    ops = {
        "qkv": lambda w, sync: dl.decode_qkv_rope(x, w, None, nw, 1e-6, cos, sin, rope_heads, D, sync=sync),
        "o": lambda w, sync: dl.decode_linear(x, w, residual=r, sync=sync),
        "gate_up": lambda w, sync: dl.decode_gate_up(x, w, None, nw, 1e-6, sync=sync),
        "down": lambda w, sync: dl.decode_linear(x, w, residual=r, sync=sync),
        "lm_head": lambda w, sync: dl.decode_linear(x, w, None, nw, 1e-6, sync=sync),
    }
    sync = new_sync(dev)
    op = ops[name]
    op = (lambda w, op=op: op(w, sync=sync))
    return (lambda: [F.linear(x, w) for w in ws]), (lambda: [op(w) for w in ws])


def layer_weights(cfg: dict, dev, dt) -> list[tuple]:
    """Each layer's (qkv, o, gate_up, down) weights, random, of layer_shapes' sizes."""
    torch.manual_seed(0)
    shapes = [(n, k) for _, n, k in layer_shapes(cfg)[:4]]
    return [tuple(torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for n, k in shapes)
            for _ in range(cfg["num_hidden_layers"])]


def chain(cfg: dict, layers: list, M: int, dev, dt, sync, norm: bool = True, residual: bool = True):
    """run: every layer's four fused products in order, each reading the one before (a decode forward's linear
    kernels without attention: q's first H columns stand in for attention's output). sync None: no split-K;
    norm / residual False: the products without their RMSNorm prologue / residual epilogue."""
    H, Hq, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = H // Hq
    nw = torch.ones(H, device=dev, dtype=dt) if norm else None
    cos, sin = torch.randn(M, D, device=dev, dtype=dt), torch.randn(M, D, device=dev, dtype=dt)
    x0 = torch.randn(M, H, device=dev, dtype=dt)

    def run():
        h = x0
        for qkv, o, gate_up, down in layers:
            q = dl.decode_qkv_rope(h, qkv, None, nw, 1e-6, cos, sin, Hq + Hkv, D, sync=sync)
            h = dl.decode_linear(q[:, :Hq * D], o, residual=h if residual else None, sync=sync)
            g = dl.decode_gate_up(h, gate_up, None, nw, 1e-6, sync=sync)
            h = dl.decode_linear(g, down, residual=h if residual else None, sync=sync)
        return h
    return run


def product_chain(cfg: dict, layers: list, i: int, dev, dt, sync, M: int = 1):
    """run: product i (of PRODUCTS) of every layer alone at M rows, fused as a decode forward runs it (the norm
    in qkv's and gate_up's prologue, the residual in o's and down's epilogue), on fixed inputs (one stream
    orders the launches)."""
    H, Hq, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = H // Hq
    nw, r = torch.ones(H, device=dev, dtype=dt), torch.randn(M, H, device=dev, dtype=dt)
    cos, sin = torch.randn(M, D, device=dev, dtype=dt), torch.randn(M, D, device=dev, dtype=dt)
    xs = {k: torch.randn(M, k, device=dev, dtype=dt) for k in {layer[i].shape[1] for layer in layers}}

    def run():
        for layer in layers:
            w = layer[i]
            x = xs[w.shape[1]]
            if PRODUCTS[i] == "qkv":
                out = dl.decode_qkv_rope(x, w, None, nw, 1e-6, cos, sin, Hq + Hkv, D, sync=sync)
            elif PRODUCTS[i] == "gate_up":
                out = dl.decode_gate_up(x, w, None, nw, 1e-6, sync=sync)
            else:
                out = dl.decode_linear(x, w, residual=r, sync=sync)
        return out
    return run


def gemv_chain(mats: list, dev, dt, block_n: int, block_k: int, warps: int):
    """run: one _gemv_kernel per matrix in order, each multiplying the first columns of the one before's output."""
    outs = [torch.randn(max(m.shape[0] for m in mats), device=dev, dtype=dt) for _ in range(2)]

    def run():
        for i, m in enumerate(mats):
            N, K = m.shape
            _gemv_kernel[(triton.cdiv(N, block_n),)](m, outs[i % 2 - 1], outs[i % 2], N, K, BLOCK_N=block_n,
                                                     BLOCK_K=block_k, num_warps=warps)
        return outs[(len(mats) - 1) % 2]
    return run


def stream_chain(mats: list, dev, programs: int, block: int, warps: int, empty: bool = False):
    """run: one _stream_kernel per matrix in order, each reading the one before's output (empty: reading no
    weights, the cost of the launches and their order alone)."""
    outs = [torch.zeros(programs, device=dev, dtype=torch.float32) for _ in range(2)]

    def run():
        for i, m in enumerate(mats):
            _stream_kernel[(programs,)](m, outs[i % 2 - 1], outs[i % 2], 0 if empty else m.numel(), BLOCK=block,
                                        num_warps=warps)
        return outs[(len(mats) - 1) % 2]
    return run


def one_row_variants() -> list[tuple[str, dict, int, int]]:
    """(label, CUDA_CORE_TILES, NORM_BLOCK_K, ONE_STEP_K) of --one-row-grid: the default, then one change at a
    time, each with ONE_STEP_K as set and as each of ONE_STEP_K_OTHER."""
    base = dict(ll.CUDA_CORE_TILES)
    out = [("default", base, 0)]
    out += [(f"unpaired {t}", {**base, False: t}, 0) for t in ONE_ROW_UNPAIRED]
    out += [(f"paired {t}", {**base, True: t}, 0) for t in ONE_ROW_PAIRED]
    out += [(f"NORM_BLOCK_K {nb}", base, nb) for nb in ONE_ROW_NORM_BLOCKS]
    return [(f"one-row {label}{'' if k == ll.ONE_STEP_K else f', ONE_STEP_K {k}'}", tiles, nb, k)
            for label, tiles, nb in out for k in (ll.ONE_STEP_K, *ONE_STEP_K_OTHER)]


def one_row_settings(tiles: dict, norm_block: int, one_step_k: int):
    """linear_launch's one-row settings set inside, restored after."""
    return bu.settings_as(ll, CUDA_CORE_TILES=tiles, NORM_BLOCK_K=norm_block, ONE_STEP_K=one_step_k)


def rows_on_cuda_cores(n: int):
    """linear_launch's ONE_STEP_ROWS set to n, and no bound on the weights, inside; restored after."""
    return bu.settings_as(ll, ONE_STEP_ROWS=n, ONE_STEP_ROWS_WEIGHTS=float("inf"))


def run_one_row_grid(plat, cfg: dict, layers: list, sync, row) -> None:
    """The chain at one row under each of one_row_variants."""
    for label, tiles, nb, k in one_row_variants():
        with one_row_settings(tiles, nb, k):
            replay, _ = graphed(plat, chain(cfg, layers, 1, plat.device, torch.bfloat16, sync))
        row(f" {label}", 1, bu.median_ms(replay, 20, warmup=3) * 1e3)


def per_product_variants() -> list[tuple[str, dict, int]]:
    """(label, CUDA_CORE_TILES, ONE_STEP_K) of --per-product's fused products: the default, then each of
    ONE_STEP_K_OTHER, then the grid's first paired tile."""
    base = dict(ll.CUDA_CORE_TILES)
    return ([("fused", base, ll.ONE_STEP_K)] + [(f"fused, ONE_STEP_K {k}", base, k) for k in ONE_STEP_K_OTHER]
            + [(f"fused, paired {ONE_ROW_PAIRED[0]}", {**base, True: ONE_ROW_PAIRED[0]}, ll.ONE_STEP_K)])


def run_chain(plat, rows: str, norm_blocks: str = "0", ablate: bool = False, one_row_grid: bool = False,
              per_product: bool = False, one_step_rows: bool = False) -> None:
    """Each model's linear kernels chained through its layers in one graph, against the bytes floor; then the
    streaming and empty baselines over the same weights (ablate: also the fused chain without split-K, norm or
    residual, and a chain of plain one-row products; one_row_grid: one row under other CUDA-core tiles;
    per_product: each of a layer's products alone through the layers, fused and plain, at one row;
    one_step_rows: each row count above one also with every product whose K fits one step on CUDA cores)."""
    dev, dt = plat.device, torch.bfloat16
    sync = new_sync(dev)
    bw = bu.copy_bandwidth()
    print(f"# each model's fused products chained through its layers, one CUDA graph; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    print("| model | M | kernels | us per forward | weight MB | floor us | us per kernel above the floor |")
    print("|---|---|---|---|---|---|---|")
    for model, cfg in (("target", bs.TARGET), ("draft", bs.DRAFT)):
        layers = layer_weights(cfg, dev, dt)
        mats = [m for layer in layers for m in layer]
        n, nbytes = len(mats), sum(m.numel() * m.element_size() for m in mats)
        floor, sms = nbytes / bw * 1e6, sg_platform.multiprocessors(dev)

        def row(label, M, t):
            print(f"| {model}{label} | {M} | {n} | {t:.1f} | {nbytes / 1e6:.0f} | {floor:.1f} | "
                  f"{(t - floor) / n:.2f} |", flush=True)
        saved = ll.NORM_BLOCK_K
        try:
            for M, nb in itertools.product((int(m) for m in rows.split(",")), (int(b) for b in norm_blocks.split(","))):
                ll.NORM_BLOCK_K = nb
                replay, _ = graphed(plat, chain(cfg, layers, M, dev, dt, sync))
                row(f", NORM_BLOCK_K {nb}" if norm_blocks != "0" else "", M, bu.median_ms(replay, 20, warmup=3) * 1e3)
                if one_step_rows and M > ll.CUDA_CORE_ROWS:
                    with rows_on_cuda_cores(M):
                        replay, _ = graphed(plat, chain(cfg, layers, M, dev, dt, sync))
                    row(f" ONE_STEP_ROWS {M}", M, bu.median_ms(replay, 20, warmup=3) * 1e3)
        finally:
            ll.NORM_BLOCK_K = saved
        if one_row_grid:
            run_one_row_grid(plat, cfg, layers, sync, row)
        if ablate:
            for M in (int(m) for m in rows.split(",")):
                for label, split, norm, res in (("no split-K", False, True, True), ("no norm", True, False, True),
                                                ("no residual", True, True, False),
                                                ("no split-K, norm or residual", False, False, False)):
                    replay, _ = graphed(plat, chain(cfg, layers, M, dev, dt, sync if split else None, norm, res))
                    row(f" {label}", M, bu.median_ms(replay, 20, warmup=3) * 1e3)
            timed_runs = []
            for block_n, block_k, warps in GRID_GEMV:
                replay, _ = graphed(plat, gemv_chain(mats, dev, dt, block_n, block_k, warps))
                timed_runs.append((bu.median_ms(replay, 20, warmup=3) * 1e3, (block_n, block_k, warps)))
            for t, conf in sorted(timed_runs)[:3]:
                row(f" plain one-row products (BLOCK_N, BLOCK_K, warps) = {conf}", 1, t)
        if per_product:
            for i, name in enumerate(PRODUCTS):
                ms = [layer[i] for layer in layers]
                mb = sum(m.numel() * m.element_size() for m in ms)

                def product_row(how, M, t):
                    print(f"| {model} {name} alone, {how} | {M} | {len(ms)} | {t:.1f} | {mb / 1e6:.0f} | "
                          f"{mb / bw * 1e6:.1f} | {(t - mb / bw * 1e6) / len(ms):.2f} |", flush=True)
                runs = [(how, tiles, k, product_chain(cfg, layers, i, dev, dt, sync))
                        for how, tiles, k in per_product_variants()
                        if name in ("qkv", "gate_up") or tiles == ll.CUDA_CORE_TILES]
                runs.append(("plain (2, 1024, 4)", ll.CUDA_CORE_TILES, ll.ONE_STEP_K,
                             gemv_chain(ms, dev, dt, 2, 1024, 4)))
                for how, tiles, k, fn in runs:
                    with one_row_settings(tiles, ll.NORM_BLOCK_K, k):
                        replay, _ = graphed(plat, fn)
                    product_row(how, 1, bu.median_ms(replay, 20, warmup=3) * 1e3)
                for M in (int(m) for m in rows.split(",")) if one_step_rows else ():
                    if M <= ll.CUDA_CORE_ROWS:
                        continue
                    fn = product_chain(cfg, layers, i, dev, dt, sync, M)
                    for how, forced in (("default", False), (f"ONE_STEP_ROWS {M}", True)):
                        with rows_on_cuda_cores(M) if forced else contextlib.nullcontext():
                            replay, _ = graphed(plat, fn)
                        product_row(how, M, bu.median_ms(replay, 20, warmup=3) * 1e3)
        timed_runs = []
        for per_sm, block, warps in GRID_STREAM:
            replay, _ = graphed(plat, stream_chain(mats, dev, per_sm * sms, block, warps))
            timed_runs.append((bu.median_ms(replay, 20, warmup=3) * 1e3, (per_sm, block, warps)))
        t, conf = min(timed_runs)
        row(f" streaming baseline, best (programs/SM, BLOCK, warps) = {conf}", "-", t)
        replay, _ = graphed(plat, stream_chain(mats, dev, conf[0] * sms, conf[1], conf[2], empty=True))
        t = bu.median_ms(replay, 20, warmup=3) * 1e3
        print(f"| {model} empty kernels (no weight read) | - | {n} | {t:.1f} | 0 | 0 | {t / n:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5,8,16")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configurations")
    ap.add_argument("--sweep-rows", default="1", help="row counts the sweep covers")
    ap.add_argument("--chain", action="store_true",
                    help="instead, time each model's products chained through its layers against the bytes floor")
    ap.add_argument("--norm-blocks", default="0", help="--chain: NORM_BLOCK_K values (powers of two; 0: BLOCK_K)")
    ap.add_argument("--ablate", action="store_true",
                    help="--chain: also without split-K, norm or residual, and plain one-row products")
    ap.add_argument("--one-row-grid", action="store_true",
                    help="--chain: also one row under other CUDA-core tiles and norm steps, one change at a time")
    ap.add_argument("--per-product", action="store_true",
                    help="--chain: also each of a layer's products alone through the layers, fused and plain")
    ap.add_argument("--one-step-rows", action="store_true",
                    help="--chain: also each row count with the products whose K fits one step on CUDA cores")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a spec_graph.kernels setting for this run, e.g. linear_launch.SPLIT_MIN_TILES=4 (repeatable)")
    a = ap.parse_args()
    bu.apply_settings(a.set)
    if (a.norm_blocks != "0" or a.ablate or a.one_row_grid or a.per_product or a.one_step_rows) and not a.chain:
        ap.error("--norm-blocks, --ablate, --one-row-grid, --per-product and --one-step-rows go with --chain")
    plat = sg_platform.current()
    if plat.name != "cuda":
        sys.exit("bench_decode_linear.py needs a CUDA GPU")
    if a.chain:
        return run_chain(plat, a.rows, a.norm_blocks, a.ablate, a.one_row_grid, a.per_product, a.one_step_rows)
    dev, dt = plat.device, torch.bfloat16
    sms = sg_platform.multiprocessors(dev)
    print(f"# decode linear kernels on {plat.device_name()}, bf16, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print("| model | layer | M | N | K | cublas us | fused us | fused/cublas | fused GB/s | default config "
          "| best config | best us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, cfg in (("target", bs.TARGET), ("draft", bs.DRAFT)):
        for name, N, K in layer_shapes(cfg):
            for M in (int(m) for m in a.rows.split(",")):
                cublas, fused = calls(name, M, N, K, cfg, dev, dt)
                t_c = timed(plat, cublas)
                t_f = timed(plat, fused)
                paired = name in ("qkv", "gate_up")
                default = ll.launch_config(M, N // 2 if paired else N, K, paired, 2, sms, rope=name == "qkv")
                best, t_best = default, t_f
                if a.sweep and str(M) in a.sweep_rows.split(","):
                    grid = (GRID_CUDA_CORES if not default[0] else
                            [(True, n, k, *default[3:5], s) for n, k, s in GRID_DOT])
                    tried = []
                    for conf in grid:
                        ll.LAUNCH.update(DOT=conf[0], BLOCK_N=conf[1], BLOCK_K=conf[2], num_warps=conf[3],
                                         num_stages=conf[4], SPLIT_K=conf[5])
                        try:
                            t = timed(plat, fused, iters=10)
                        except Exception as e:  # e.g. out of shared memory at this tile size
                            print(f"<!-- {name} M={M} {conf}: {type(e).__name__} -->")
                            t = float("inf")
                        finally:
                            ll.LAUNCH.clear()
                        tried.append((t, conf))
                        if t < t_best:
                            best, t_best = conf, t
                    top = ", ".join(f"{c[1:3] + c[5:]} {t * 1e3:.1f}" for t, c in sorted(tried)[:6])
                    t1, c1 = min((t, c) for t, c in tried if c[5] == 1)
                    print(f"<!-- {model} {name} M={M} fastest (BLOCK_N, BLOCK_K, SPLIT_K) us: {top}; "
                          f"unsplit {c1[1:3]} {t1 * 1e3:.1f} -->")
                gbs = N * K * 2 / (t_f * 1e-3) / 1e9
                print(f"| {model} | {name} | {M} | {N} | {K} | {t_c * 1e3:.1f} | {t_f * 1e3:.1f} | {t_f / t_c:.2f} | "
                      f"{gbs:.0f} | {default} | {best} | {t_best * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
