"""Launch configurations of the fused decode linear kernels (decode_linear.py): CUDA or tensor cores, tiles,
warps, stages and split-K, from static shapes, as measured on an H200 (bench_decode_linear.py). The settings are
module globals so that benchmarks and tests can vary them; kernels.launch_key() puts their values in the compile
cache's key.
"""
from __future__ import annotations

from ._triton import triton
from .rng import block_for

CUDA_CORE_ROWS = 1  # up to this many rows the sums run on CUDA cores (tensor cores measured faster above)
# ... and up to ONE_STEP_ROWS rows where all of K fits one step (ONE_STEP_K) and the product has fewer weight
# elements than ONE_STEP_ROWS_WEIGHTS. At 2 rows bench_step's draft products (0.6-3.1M elements) chained in 66 us
# against 83 on tensor cores; the target's (4.2M and up) in 728 against 660. Benchmarks vary both.
ONE_STEP_ROWS = 2
ONE_STEP_ROWS_WEIGHTS = 4_000_000
VOCAB_COLS = 16384  # unpaired products this wide are vocabulary heads: tensor cores at any row count
# (BLOCK_N, BLOCK_K at most, num_warps, num_stages) of CUDA-core launches, by whether the product is paired
# (a paired program reads 2 x BLOCK_N weight rows)
CUDA_CORE_TILES = {False: (2, 1024, 4, 2), True: (2, 1024, 4, 2)}
FP32_BLOCK_K = 64  # fp32's K tile on tensor cores: at most about 50 KB of shared memory per program on sm90
MAX_SPLIT_K = 8  # programs that share one column block's sums (split-K)
SPLIT_MIN_TILES = 2  # K tiles each of them reads, at least
SPLIT_PROGRAMS_PER_SM = 4  # split grids up to this many programs per multiprocessor (small tiles: one wave)
# (BLOCK_N, BLOCK_K, num_warps, num_stages (0: the product's own), K tiles per program at least) of split launches
# by kind, tried in order: the first that splits K is taken. At 2 / 5 / 9 rows through the 1B target's 16 layers
# (H200, us): qkv 139 / 136 / 143 on (64, 128, 8 warps, 3 stages, split 4) against 154 / 155 / 171 on (32, 64,
# split 8); o_proj on (32, 128, split 4) 101 / 102 / 103 against 109 / 112 / 112 unsplit.
SPLIT_TILES = {"qkv": ((64, 128, 8, 3, 4), (32, 64, 0, 0, SPLIT_MIN_TILES)), "square": ((32, 128, 0, 0, 4),),
               "long": ((32, 64, 0, 0, SPLIT_MIN_TILES),)}
NORM_BLOCK_K = 0  # x columns per step of the norm's sum of squares, rounded up to a power of two and at most K's
# (0: the product's BLOCK_K; benchmarks vary it)
NORM_UNROLL = 1  # the norm's K steps unrolled this many ways, so that their loads go out together
ONE_STEP_K = 2048  # CUDA-core products with K up to this read all of K in one step (_one_step_sums; 0: never;
# benchmarks vary it)
# Launch overrides (DOT, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for benchmarks and tests; empty:
# `launch_config`.
LAUNCH: dict = {}


def launch_config(rows: int, cols: int, k: int, paired: bool, itemsize: int = 2, sms: int = 0,
                  rope: bool = False) -> tuple[bool, int, int, int, int, int]:
    """(DOT, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) from static shapes, measured on an H200 for 2-byte
    dtypes. Up to CUDA_CORE_ROWS rows (cuda_core_sums) the sums run on CUDA cores, unsplit, on tiles of 2
    columns x up to 1024 of K, or all of K in one step up to ONE_STEP_K (warps scaled with it) (the fastest chain
    of a model's products: bench_decode_linear.py --chain --one-row-grid). Above,
    and for vocabulary heads, on tensor cores, with the best tiles of a sweep per kind of layer at 2-5 rows
    (bench_decode_linear.py --sweep). fp32 (itemsize 4) on tensor cores takes smaller K tiles and 2 stages: its
    exact (no TF32) sums with the 2-byte tiles need up to 260 KB of shared memory for sm90, more than any GPU
    has.
    Split-K (sms: the device's multiprocessors; 0: never) where sweeps found it faster, on SPLIT_TILES: the qkv
    products (rope), and unpaired products whose sums are at least as long as their outputs (o_proj: k = cols,
    down_proj: k >= 2 cols). gate_up and the vocabulary heads measured slower or no faster split."""
    dot, block_n, block_k, warps, stages = _launch_config(rows, cols, k, paired)
    split = 1
    if LAUNCH:  # overrides: split only as they say
        split = LAUNCH.get("SPLIT_K", 1)
    elif dot and sms and (rope or (not paired and k >= cols)):
        kind = "qkv" if rope else "long" if k >= 2 * cols else "square"
        for tile_n, tile_k, tile_warps, tile_stages, tiles in SPLIT_TILES.get(kind, ()):
            split = split_k(triton.cdiv(cols, tile_n), k, tile_k, sms, tiles)
            if split > 1:
                block_n, block_k = tile_n, tile_k
                warps, stages = tile_warps or warps, tile_stages or stages
                break
    if itemsize >= 4 and dot:
        block_k, stages = min(block_k, FP32_BLOCK_K), min(stages, 2)
    return dot, block_n, block_k, warps, stages, split


def split_k(blocks: int, k: int, block_k: int, sms: int, min_tiles: int = SPLIT_MIN_TILES) -> int:
    """Programs per column block: the most (a power of two, at most MAX_SPLIT_K) that keep the grid within
    SPLIT_PROGRAMS_PER_SM programs per multiprocessor, each with min_tiles K tiles or more to read.
    (_launch rounds each program's K range up to whole tiles, which can leave fewer programs.)"""
    split = 1
    while (split < MAX_SPLIT_K and blocks * split * 2 <= SPLIT_PROGRAMS_PER_SM * sms
           and k >= 2 * split * min_tiles * block_k):
        split *= 2
    return split


def one_step(dot: bool, split: int, k: int, block_k: int) -> bool:
    """Whether a launch reads all of its K in one step (the kernel's ONE_STEP): CUDA-core sums, unsplit, K within
    one tile and ONE_STEP_K."""
    return not dot and split == 1 and k <= min(block_k, ONE_STEP_K)


def cuda_core_sums(rows: int, cols: int, paired: bool, k: int) -> bool:
    """Whether a product of this many rows, output columns and K sums on CUDA cores by default."""
    small = k <= ONE_STEP_K and (2 if paired else 1) * cols * k < ONE_STEP_ROWS_WEIGHTS
    few = rows <= CUDA_CORE_ROWS or (rows <= ONE_STEP_ROWS and small)
    return few and (paired or cols < VOCAB_COLS)


def _launch_config(rows: int, cols: int, k: int, paired: bool) -> tuple[bool, int, int, int, int]:
    if LAUNCH:
        return (LAUNCH.get("DOT", not cuda_core_sums(rows, cols, paired, k)), LAUNCH["BLOCK_N"], LAUNCH["BLOCK_K"],
                LAUNCH.get("num_warps", 4), LAUNCH.get("num_stages", 3))
    if cuda_core_sums(rows, cols, paired, k):  # long thin tiles: 16 weight elements per thread and K step in flight
        block_n, block_k, warps, stages = CUDA_CORE_TILES[paired]
        if k <= ONE_STEP_K:  # all of K in one step, each thread reading as many elements as the tile's
            warps = max(warps, warps * block_for(k) // block_k)
            block_k = block_for(k)
        return False, block_n, min(block_k, max(16, block_for(k))), warps, stages
    block_k = min(256, max(16, block_for(k)))
    if cols >= VOCAB_COLS:  # vocabulary heads (and the widest gate_up products)
        return True, 64, min(128, block_k), 8, 3
    if paired and cols >= 4096:  # a large gate_up
        return True, 64, min(128, block_k), 8, 4
    if paired and cols < 1024:  # a small qkv
        return True, 16, block_k, 4, 3
    return True, 32, block_k, 4, 4
