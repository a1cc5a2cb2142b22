"""SpecGraphConfig: everything that shapes the engine's static graphs."""
from __future__ import annotations

import math
import numbers
import os
import reprlib
from dataclasses import dataclass, field, replace

MAX_SPECULATIVE_TOKENS = 16
AUTO = "auto"
# K values adaptive speculation chooses among (those up to max_speculative_tokens, which is always one of them)
K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
DEFAULT_MAX_SPECULATIVE_TOKENS = 8
DEFAULT_MAX_LEN = 512
DEVICES = ("cuda", "npu", "cpu")
# Fields an engine is built from (its buffers, caches and compiled steps): fixed once it is built. Of the rest,
# max_batch_size and max_len may be lowered on a built engine, and batch_buckets and steps_per_graph changed
# (its graphs are captured again); admission_wait is read per call.
FIXED_FIELDS = ("num_speculative_tokens", "max_speculative_tokens", "dtype", "device", "enable_graph", "passes",
                "verification")
CEILING_FIELDS = ("max_batch_size", "max_len")
CEILING_MIN = {"max_batch_size": 1, "max_len": 2}  # the least value of each that an engine takes
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
VERIFICATIONS = ("token", "block")
CACHE_ALIGN = 16  # cache positions: rows of attention scores stay 32-byte aligned for the matmul kernels


def cache_length(max_len: int, num_speculative_tokens: int) -> int:
    """Positions in a static KV cache: speculation writes up to K+1 past the committed end, and the
    length is rounded up to CACHE_ALIGN (an odd length pushes cuBLAS onto slow unaligned kernels)."""
    need = max_len + num_speculative_tokens + 2
    return -(-need // CACHE_ALIGN) * CACHE_ALIGN


def kv_fit(need: int, have: int, slots: int, cache_len: int, num_speculative_tokens: int) -> tuple[int, int]:
    """For KV caches of `need` bytes over `slots` x `cache_len` positions, with `have` bytes free: the largest
    max_len whose caches fit these slots (0 where none does), and the most slots that fit at this cache_len."""
    per_position = need // (slots * cache_len)  # bytes of one slot's position in every cache
    positions = have // (per_position * slots)
    return (max(positions // CACHE_ALIGN * CACHE_ALIGN - num_speculative_tokens - 2, 0),
            have // (per_position * cache_len))


@dataclass
class SpecGraphConfig:
    """Engine settings.

    num_speculative_tokens: K, draft tokens proposed per step (1..16), or "auto": before each graph replay the
        engine picks K from ``k_choices`` (one graph each per batch bucket, in one memory pool), the K that
        finishes the work left soonest by smoothed per-position acceptance estimates (over all rows and per row)
        and each K's step time measured when the graphs are captured (adaptive.py).
    max_speculative_tokens: the largest K "auto" may pick (1..16, default 8); checked, and otherwise unused, with a
        fixed K.
    max_batch_size: request slots decoded together; more prompts are queued.
    max_len: longest prompt + generated tokens a request may reach. None (the default) means 512, lowered
        to the models' window (max_position_embeddings) when that is shorter; a max_len given above the
        window is kept, with a warning.
    dtype: "auto" (bfloat16 on accelerators, float32 on CPU), "float32", "bfloat16" or "float16".
    device: "cuda", "npu", "cpu" or None for the best one found.
    batch_buckets: padded batch sizes the step is built for.
    enable_graph: capture the step in static graphs; None means on where the platform has graphs.
    steps_per_graph: speculative steps per captured graph replay (the host reads once per replay).
    passes: {fusion pass name: bool} to turn spec_graph backend passes on or off.
    admission_wait: how long freed slots may wait for others to free so that their queued requests share one
        prefill, in slot-steps (the free slots' idle steps added up; 0: admit at once). None (the default) means
        max_batch_size: one step's worth of the batch's work (a prefill costs about the same for one row as for
        several; a waiting slot, its share of each step; admission.py). One free slot waits at most that many
        steps.
    verification: how sampled drafts are verified: "token" (token by token, Leviathan et al. / Chen et al.)
        or "block" (the drafts judged jointly, Sun et al. 2025: as lossless, never fewer accepted tokens in
        expectation). Greedy decoding is the same under both.
    """

    num_speculative_tokens: int | str = 4
    max_batch_size: int = 8
    max_len: int | None = None
    dtype: str = "auto"
    device: str | None = None
    batch_buckets: tuple[int, ...] = field(default_factory=lambda: DEFAULT_BUCKETS)
    enable_graph: bool | None = None
    steps_per_graph: int = 1
    passes: dict = field(default_factory=dict)
    verification: str = "token"
    max_speculative_tokens: int = DEFAULT_MAX_SPECULATIVE_TOKENS
    admission_wait: int | None = None

    def __post_init__(self):
        k = self.num_speculative_tokens = spelled(self.num_speculative_tokens)
        if k != AUTO and (not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"num_speculative_tokens (K) must be an integer in 1..{MAX_SPECULATIVE_TOKENS} or \"auto\", got {k!r}"
            )
        m = self.max_speculative_tokens
        if not is_int(m) or not 1 <= m <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"max_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {m!r}"
            )
        for f in ("num_speculative_tokens", "max_speculative_tokens", "max_batch_size", "max_len"):
            if is_int(getattr(self, f)):  # numpy integers are stored as ints
                setattr(self, f, int(getattr(self, f)))
        if not is_int(self.max_batch_size) or self.max_batch_size < CEILING_MIN["max_batch_size"]:
            raise ValueError(f"max_batch_size must be a positive integer, got {self.max_batch_size!r}")
        # max_len_given: whether the caller chose max_len (the engine lowers only the default to the window)
        self.max_len_given = self.max_len is not None
        if self.max_len is None:
            self.max_len = DEFAULT_MAX_LEN
        if not is_int(self.max_len) or self.max_len < CEILING_MIN["max_len"]:
            raise ValueError(f"max_len must be an integer >= {CEILING_MIN['max_len']}, got {self.max_len!r}")
        self.batch_buckets = checked_buckets(self.batch_buckets)
        if self.enable_graph not in (None, True, False):
            raise ValueError(f"enable_graph must be True, False or None (on where the platform has graphs), "
                             f"got {self.enable_graph!r}")
        if self.passes != {}:  # (the pass manager's import is left out of the common case)
            from .passes.manager import check_enabled

            check_enabled(self.passes)
        self.steps_per_graph = checked_steps_per_graph(self.steps_per_graph)
        self.slot_steps_waited  # noqa: B018 - checks admission_wait
        self.verification = spelled(self.verification)
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS}, got {self.verification!r}")

    def checked(self) -> "SpecGraphConfig":
        """A copy with every field checked again, as the constructor checks them (fields may be set after it)."""
        given = self.max_len_given or self.max_len != DEFAULT_MAX_LEN
        return replace(self, max_len=self.max_len if given else None)

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def k_choices(self) -> tuple[int, ...]:
        """The K values the step is built for: the one K, or "auto"'s set up to max_speculative_tokens."""
        if not self.adaptive:
            return (self.num_speculative_tokens,)
        m = self.max_speculative_tokens
        return tuple(sorted({k for k in K_CHOICES if k < m} | {m}))

    @property
    def slot_steps_waited(self) -> int:
        """admission_wait, None resolved and checked (it may be set after construction): the slot-steps freed slots
        may wait to share a prefill."""
        w = self.admission_wait
        if w is not None and (not is_int(w) or w < 0):
            raise ValueError(f"admission_wait must be a non-negative integer (slot-steps; 0 admits queued requests at "
                             f"once) or None (max_batch_size), got {w!r}")
        return self.max_batch_size if w is None else int(w)

    @property
    def max_k(self) -> int:
        """The largest K a step may use: buffers and caches are sized for it."""
        return self.k_choices[-1]

    @property
    def cache_len(self) -> int:
        return cache_length(self.max_len, self.max_k)

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket holding `batch` rows (the batch itself above the largest bucket)."""
        for b in self.batch_buckets:
            if b >= batch:
                return b
        return batch


def checked_buckets(bb, name: str = "batch_buckets") -> tuple[int, ...]:
    """Sorted distinct padded batch sizes; `name` is the setting as the user spelled it (for the message)."""
    if not isinstance(bb, (list, tuple, set, frozenset, range)) or not bb \
            or not all(is_int(b) and b >= 1 for b in bb):
        raise ValueError(f"{name} must be a non-empty list of positive integers (padded batch sizes such "
                         f"as [1, 2, 4, 8]), got {bb!r}")
    return tuple(sorted({int(b) for b in bb}))


MAX_STEPS_PER_GRAPH = 64  # steps unrolled in one captured graph, whose compile and capture grow with them


def checked_steps_per_graph(n, name: str = "steps_per_graph") -> int:
    if not is_int(n) or not 1 <= n <= MAX_STEPS_PER_GRAPH:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_STEPS_PER_GRAPH} (steps in one graph replay), "
                         f"got {n!r}")
    return int(n)


SPELLED_FIELDS = ("num_speculative_tokens", "verification")  # string options stored as spelled() gives them


def spelled(v):
    """A string option as the config stores it (case and surrounding blanks aside: "Auto " is "auto"); other
    values as they are."""
    return v.strip().lower() if isinstance(v, str) else v


def is_int(v) -> bool:
    """An integer that is not a bool (numpy integers included)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A finite real number that is not a bool (numpy scalars included)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def check_path_arg(value, must_be: str) -> None:
    """Refuse a value that is no path at all (None, an int) before pathlib raises its own TypeError."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{must_be} (a str or os.PathLike), got {reprlib.repr(value)}")


def check_device(device) -> None:
    """Refuse, with the project's one-line message, a device string torch cannot even parse: an unknown type,
    or "npu" where torch_npu is missing (torch only learns the type "npu" when torch_npu is imported, so
    ``torch.device("npu")`` would raise torch's own message first)."""
    if device is None:
        return
    import torch

    if isinstance(device, torch.device):
        kind = device.type
    elif isinstance(device, str):
        kind = device.strip().split(":")[0].lower()
    else:
        raise ValueError(f"device must be a string such as 'cpu', 'cuda' or 'cuda:1', got {device!r}")
    if kind not in DEVICES:
        raise ValueError(f"unsupported device {device!r}: use cuda, npu or cpu")
    from . import platform

    if kind == "npu" and not platform._npu_available():
        raise ValueError("device 'npu' was asked for but torch_npu finds no NPU; use device 'cpu' "
                         "(device='cpu' in Python, --device cpu on the command line)")
    try:
        torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"malformed device {device!r}: use cuda, cuda:N, npu, npu:N or cpu") from None


WINDOW_SOURCE = "max_position_embeddings in config.json"


def check_text(text: str, what: str) -> None:
    """A prompt must be encodable as UTF-8 (a command line's undecodable bytes arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text ({e.reason} at character {e.start}): fix its encoding, "
                         "or pass token ids (--prompt-ids on the command line)") from None


def check_window(prompt_len: int, max_new_tokens: int, window: int, what: str = "the prompt",
                 fix: str = "shorten the prompt or lower max_new_tokens", source: str = WINDOW_SOURCE) -> None:
    """Raise a one-line ValueError naming both numbers when ``prompt_len + max_new_tokens`` positions do not fit
    ``window`` (the model's ``max_position_embeddings``; a pair's: ``pair_window``, whose ``window_source``
    names the model that sets it). For the export and the vLLM drafter as well as the engine."""
    need = prompt_len + max_new_tokens
    if need > window:
        raise ValueError(
            f"{what} has {prompt_len} tokens; with max_new_tokens={max_new_tokens} it needs {need} positions, "
            f"past the model's window of {window} ({source}): {fix}"
        )


def beyond_window_warning(max_len: int, window: int, rope_scaling: dict | None = None,
                          source: str = WINDOW_SOURCE) -> str | None:
    """The warning for a max_len chosen above the window, or None when it fits."""
    if max_len <= window:
        return None
    why = ("the config's llama3 rope scaling already counts in that window" if rope_scaling else
           "the config has no rope scaling (rope_scaling) that would extend it")
    return (f"max_len={max_len} is past the model's window of {window} positions ({source}; {why}): tokens past "
            f"position {window} were never trained for and may be garbage")
