"""SpecGraphConfig: everything that shapes the engine's static graphs."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_SPECULATIVE_TOKENS = 16
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
CACHE_ALIGN = 16  # cache positions: rows of attention scores stay 32-byte aligned for the matmul kernels


def cache_length(max_len: int, num_speculative_tokens: int) -> int:
    """Positions in a static KV cache: speculation writes up to K+1 past the committed end, and the
    length is rounded up to CACHE_ALIGN (an odd length pushes cuBLAS onto slow unaligned kernels)."""
    need = max_len + num_speculative_tokens + 2
    return -(-need // CACHE_ALIGN) * CACHE_ALIGN


@dataclass
class SpecGraphConfig:
    """Engine settings.

    num_speculative_tokens: K, draft tokens proposed per step (1..16).
    max_batch_size: request slots decoded together; more prompts are queued.
    max_len: longest prompt + generated tokens a request may reach.
    dtype: "auto" (bfloat16 on accelerators, float32 on CPU), "float32", "bfloat16" or "float16".
    device: "cuda", "npu", "cpu" or None for the best one found.
    batch_buckets: padded batch sizes the step is built for.
    enable_graph: capture the step in static graphs; None means on where the platform has graphs.
    steps_per_graph: speculative steps per captured graph replay (the host reads once per replay).
    passes: {fusion pass name: bool} to turn spec_graph backend passes on or off.
    """

    num_speculative_tokens: int = 4
    max_batch_size: int = 8
    max_len: int = 512
    dtype: str = "auto"
    device: str | None = None
    batch_buckets: tuple[int, ...] = field(default_factory=lambda: DEFAULT_BUCKETS)
    enable_graph: bool | None = None
    steps_per_graph: int = 1
    passes: dict = field(default_factory=dict)

    def __post_init__(self):
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens (K) must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {self.max_batch_size!r}")
        if not isinstance(self.max_len, int) or self.max_len < 2:
            raise ValueError(f"max_len must be an integer >= 2, got {self.max_len!r}")
        buckets = tuple(sorted({int(b) for b in self.batch_buckets}))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"batch_buckets must be positive integers, got {self.batch_buckets!r}")
        self.batch_buckets = buckets
        if not isinstance(self.steps_per_graph, int) or self.steps_per_graph < 1:
            raise ValueError(f"steps_per_graph must be a positive integer, got {self.steps_per_graph!r}")

    @property
    def cache_len(self) -> int:
        return cache_length(self.max_len, self.num_speculative_tokens)

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket holding `batch` rows (the batch itself above the largest bucket)."""
        for b in self.batch_buckets:
            if b >= batch:
                return b
        return batch
