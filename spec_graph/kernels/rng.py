"""One counter-based RNG, bit-identical in torch and Triton.

Every random number in the engine is a pure function of
``(seed, step, row, pos, col)``: no generator state, so a sampled token never
depends on batch composition, the grid, or which backend (kernel or torch
reference) ran. All hashing is int64 arithmetic on values in [0, 2^32); both
multipliers are < 2^31, so no product overflows and every backend agrees.

Also home to the small launch helpers the three kernel files share.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

from .. import platform

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9  # seeds the first mix so seed 0 does not hash to 0
MUL1 = 0x21F0AAAD
MUL2 = 0x735A2D97
# The uniform keeps 23 hash bits: (k + 0.5) * 2^-23 with k < 2^23 needs 24
# significant bits, so it is exact in float32 and lies in [2^-24, 1 - 2^-24].
# (24 bits would round the top value to 1.0, and -log(1) = 0 breaks the race.)
UNIFORM_SHIFT = 9
UNIFORM_SCALE = 2.0**-23

ACCEPT_COL = MASK32  # `col` of the acceptance uniform at a draft position
# `row` of every draw the engine makes. Requests differ by their own seeds, and `step` counts each request's
# own steps, so a sampled token depends on its request alone, never on the slot or batch it ran in.
REQUEST_ROW = 0
DRAFT_POS_BASE = 32  # draft model's own sampling at draft position j uses pos = DRAFT_POS_BASE + j

# Triton sees module globals only as constexprs.
_TL_MASK32 = tl.constexpr(MASK32)
_TL_GOLDEN32 = tl.constexpr(GOLDEN32)
_TL_MUL1 = tl.constexpr(MUL1)
_TL_MUL2 = tl.constexpr(MUL2)
_TL_UNIFORM_SHIFT = tl.constexpr(UNIFORM_SHIFT)
_TL_UNIFORM_SCALE = tl.constexpr(UNIFORM_SCALE)
_TL_REQUEST_ROW = tl.constexpr(REQUEST_ROW)


# ---------------------------------------------------------------- torch side
def mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 15)


def _i64(v, device: torch.device | None) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(torch.int64)
    return torch.tensor(v, dtype=torch.int64, device=device)


def hash_uniform(seed, step, row, pos, col) -> torch.Tensor:
    """float32 uniform in (0, 1) from int64 tensors (or ints) that broadcast together.

    h = mix32((seed & M) ^ GOLDEN); h = mix32(h ^ ((seed >> 32) & M));
    then h = mix32(h ^ (x & M)) for x in step, row, pos, col;
    u = ((h >> 9) + 0.5) * 2^-23.
    """
    device = next((v.device for v in (seed, step, row, pos, col) if isinstance(v, torch.Tensor)), None)
    seed, step, row, pos, col = (_i64(v, device) for v in (seed, step, row, pos, col))
    h = mix32((seed & MASK32) ^ GOLDEN32)
    h = mix32(h ^ ((seed >> 32) & MASK32))
    h = mix32(h ^ (step & MASK32))
    h = mix32(h ^ (row & MASK32))
    h = mix32(h ^ (pos & MASK32))
    h = mix32(h ^ (col & MASK32))
    return ((h >> UNIFORM_SHIFT).to(torch.float32) + 0.5) * UNIFORM_SCALE


def race_sample(weights: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, rows, pos) -> torch.Tensor:
    """Sample one index per row of `weights` [N, V] (>= 0, unnormalised) -> int64 [N].

    Exponential race: argmax_v weights[v] / (-log u_v) with
    u_v = hash_uniform(seed, step, row, pos, v); the winner is distributed as
    weights / sum(weights). First index wins ties (an all-zero row gives 0).
    `rows` and `pos` are ints or int64 [N] tensors.
    """
    n, v = weights.shape
    col = torch.arange(v, dtype=torch.int64, device=weights.device)[None, :]
    rows, pos = (x.to(torch.int64).reshape(n, 1) if isinstance(x, torch.Tensor) else x for x in (rows, pos))
    u = hash_uniform(seeds.reshape(n, 1), steps.reshape(n, 1), rows, pos, col)
    return torch.argmax(weights.to(torch.float32) / -torch.log(u), dim=1)


# --------------------------------------------------------------- triton side
@triton.jit
def tl_mix32(x):
    """mix32 on int64 scalars/blocks holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _TL_MUL1) & _TL_MASK32
    x = x ^ (x >> 15)
    x = (x * _TL_MUL2) & _TL_MASK32
    return x ^ (x >> 15)


@triton.jit
def tl_hash_uniform(seed, step, row, pos, col):
    """Triton twin of `hash_uniform`; all arguments int64 (scalars or blocks that broadcast)."""
    h = tl_mix32((seed & _TL_MASK32) ^ _TL_GOLDEN32)
    h = tl_mix32(h ^ ((seed >> 32) & _TL_MASK32))
    h = tl_mix32(h ^ (step & _TL_MASK32))
    h = tl_mix32(h ^ (row & _TL_MASK32))
    h = tl_mix32(h ^ (pos & _TL_MASK32))
    h = tl_mix32(h ^ (col & _TL_MASK32))
    return ((h >> _TL_UNIFORM_SHIFT).to(tl.float32) + 0.5) * _TL_UNIFORM_SCALE


@triton.jit
def tl_race_key(w, u):
    """weights / (-log u): the race key. div_rn = IEEE division, as torch does it."""
    return tl.math.div_rn(w, -tl.log(u))


@triton.jit
def _hash_uniform_kernel(seed_ptr, step_ptr, row_ptr, pos_ptr, col_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """out[i] = hash_uniform(seed[i], step[i], row[i], pos[i], col[i]) (used by the tests)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    u = tl_hash_uniform(tl.load(seed_ptr + offs, mask=m, other=0), tl.load(step_ptr + offs, mask=m, other=0),
                        tl.load(row_ptr + offs, mask=m, other=0), tl.load(pos_ptr + offs, mask=m, other=0),
                        tl.load(col_ptr + offs, mask=m, other=0))
    tl.store(out_ptr + offs, u, mask=m)


def hash_uniform_triton(seed, step, row, pos, col) -> torch.Tensor:
    """`hash_uniform` computed by the Triton helper (for tests): int64 tensors that broadcast together."""
    args = torch.broadcast_tensors(seed, step, row, pos, col)
    seed, step, row, pos, col = (t.to(torch.int64).contiguous() for t in args)
    out = torch.empty(seed.shape, dtype=torch.float32, device=seed.device)
    n = seed.numel()
    block = 1024
    if n:
        _hash_uniform_kernel[(triton.cdiv(n, block),)](seed, step, row, pos, col, out, n, BLOCK=block)
    return out


# --------------------------------------------------- shared launch plumbing
def use_kernel(kernel, t: torch.Tensor) -> bool:
    """Whether an op body launches `kernel` for tensor `t` (else it runs the torch reference).

    platform.use_triton decides per device; then the kernel must be runnable there.
    Triton fixes compiled-or-interpreted when it is imported, so with TRITON_INTERPRET=1
    set too late (after triton's import) a compiled kernel never runs on CPU, and an
    interpreter kernel needs triton.language's own jit helpers (tl.min, ...) built for
    the interpreter as well. An interpreter kernel runs eagerly on real tensors only:
    while torch.compile / torch.export trace with fake tensors, the reference (same
    shapes, same semantics) stands in.
    """
    if not platform.use_triton(t.device):
        return False
    from torch._subclasses.fake_tensor import is_fake
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return t.device.type != "cpu"
    return not isinstance(tl.min, JITFunction) and not is_fake(t)


def wrap_triton(kernel):
    """torch.library.wrap_triton, but interpreter kernels (TRITON_INTERPRET=1) launch as they are.

    Older torch rejects InterpretedFunction in wrap_triton; an interpreted
    kernel only ever runs eagerly on CPU tensors, so nothing is lost.
    """
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return torch.library.wrap_triton(kernel)
    return kernel


def num_programs(batch: int, max_programs: int, device: torch.device) -> int:
    """Grid size: min(B, cap), at least 1; cap 0 means the platform default."""
    cap = max_programs if max_programs > 0 else platform.max_programs(device)
    return max(1, min(batch, cap))


def block_for(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
