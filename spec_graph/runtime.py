"""The model-agnostic decoding runtime: static state buffers, admission, prefill bookkeeping, the step loop.

``DecoderBase`` owns the per-request state, the output buffers and the KV
caches, admits queued prompts into free slots, runs the step over the
smallest batch bucket holding every busy slot (one graph replay per bucket
where the platform has graphs) and reads back only which rows finished.
Subclasses say how the models run: ``SpecDecoder`` (engine.py) with the
in-process models, ``ExportedRunner`` (export.py) with AOTInductor artifacts.
This module imports none of the model code.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .adaptive import ChoiceAhead, KChooser
from .admission import admits_now, prefill_groups
from .capture import GraphSet
from .config import (CEILING_FIELDS, CEILING_MIN, FIXED_FIELDS, SPELLED_FIELDS, WINDOW_SOURCE, SpecGraphConfig,
                     check_window, checked_buckets, checked_steps_per_graph, is_int, spelled)
from .kernels import PLACEHOLDER
from .prompts import MAX_STOP_IDS, check_max_new_tokens, prompt_ids, stop_ids
from .results import GenerationOutput, GenerationResult, GenerationStats
from .sampling import SamplingParams
from .step import STATE_FIELDS
from .prefill import Prefills
from .step_times import StepTimes

WRITEBACK = ("tail", "seq_lens", "n_out", "active", "error", "steps")
log = logging.getLogger("spec_graph")


def load_tokenizer(path: str):
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{f} is not a valid tokenizer file ({why}): re-save it with the tokenizers library, "
                         "or remove it and pass prompts as token ids") from None


class DecoderBase(StepTimes, Prefills):
    """Request slots and the step loop over static buffers; subclasses supply the forwards.

    A subclass implements ``_new_kv_caches(rows, cache_len) -> (target_kv, draft_kv)``,
    ``_prefill_forward(toks, pos, slots, lens) -> float32 logits [n, V]`` at each
    prompt's last token (writing both models' caches for those slots) and
    ``_step_fn(greedy, K)`` returning ``fn(state, out_buf, acc_log, stop_ids, draft_kv, target_kv)``
    that runs one step of ``K`` drafts over ``B = state["tail"].shape[0]`` rows, updating every argument
    in place (with "auto", ``state["k_counts"]`` too: ``adaptive.count_acceptance``).
    Where ``capture_prefill`` is set and graphs exist, short prefills replay a graph per (rows, length).
    """

    capture_prefill = False
    # Positions the models were built for (max_position_embeddings), None when unknown; a subclass sets it.
    # Requests past it are refused unless max_len was chosen above it (with a warning).
    window: int | None = None
    window_source: str = WINDOW_SOURCE  # where errors say the window comes from
    # Busy rows from which a replay is launched ahead of the read of the one before (launch_ahead): with fewer, the
    # rows may all end in that replay, and the next would run for nothing (one row's whole step, at B=1).
    AHEAD_ROWS = 2

    def __init__(self, config: SpecGraphConfig, vocab_size: int, device: torch.device, plat, tokenizer=None,
                 eos_token_ids=(), use_graphs: bool = False, rows: int | None = None):
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.device, self.platform = device, plat
        S = config.max_batch_size
        # K: the largest K a step uses (buffers, stats); k_choices: the K values with a step (one unless "auto")
        self.K, self.k_choices = config.max_k, config.k_choices
        # state rows: room for the largest bucket the slots may need (an export fixes its own)
        self.rows = rows or config.bucket_for(S)
        self.cache_len = config.cache_len
        self.target_kv, self.draft_kv = self._new_kv_caches(self.rows, self.cache_len)
        R, dev = self.rows, self.device
        i64 = dict(dtype=torch.long, device=dev)
        self.state = {
            "tail": torch.zeros(R, 2, **i64), "seq_lens": torch.full((R,), 2, **i64),
            "n_out": torch.zeros(R, **i64), "max_new": torch.zeros(R, **i64),
            "active": torch.zeros(R, dtype=torch.bool, device=dev),
            "error": torch.zeros(R, dtype=torch.bool, device=dev),
            "seeds": torch.zeros(R, **i64), "steps": torch.zeros(R, **i64),
            "temperature": torch.ones(R, dtype=torch.float32, device=dev),
            "top_k": torch.zeros(R, **i64), "top_p": torch.ones(R, dtype=torch.float32, device=dev),
        }
        assert set(self.state) == set(STATE_FIELDS)
        self.out_buf = torch.full((R, config.max_len), PLACEHOLDER, **i64)
        self.acc_log = torch.zeros(R, config.max_len, **i64)
        self.stop_buf = torch.full((MAX_STOP_IDS,), PLACEHOLDER, **i64)
        self.graphs = GraphSet(self.platform) if use_graphs else None
        self._new_prefill_graphs()
        self._captured_modes: set = set()
        self._fallback_warned = False
        # Eager steps (set by a subclass whose step takes ``kv_len``) read the caches up to their rows' longest
        # length plus what the step can write, not all of max_len; the host reads the lengths with the one read
        # per replay. Static (compiled, captured) steps cannot: their shapes are fixed.
        self.span_steps = False
        # Where the device runs launches asynchronously (every platform with graphs), a replay over AHEAD_ROWS busy
        # rows or more is launched before the read of the one before it, so the device never waits for the host's
        # work between a read and the next launch (see _generate).
        self.launch_ahead = plat.supports_graphs
        self.launched_ahead = 0  # the last call's replays launched so
        # Adaptive K: seconds per step at {(greedy, bucket, K)}, measured once at capture (an entry set beforehand
        # is kept, so a caller can fix the table); the device counters the chooser reads (see adaptive.py);
        # and {K: {"capture_s", "memory_bytes"}}: what each K's graphs cost to build.
        self.step_times: dict = {}
        self._timed: set = set()  # the step_times and host_times keys measured here
        # and {(greedy, bucket): seconds}: the host's own work per replay (the device read after it, and the choice
        # where it outlasts the replay), added once per replay to every K's steps; measured where the steps are
        self.host_times: dict = {}
        self.k_counts = torch.zeros(self.rows, 2 * self.K, dtype=torch.long, device=dev)  # per state row
        # Per state row, the cache positions its requests (or a capture's runs) may have written since it was last
        # cleared: past them the caches hold the zeros they were made with. Unknown (all) until a first admission.
        self._written_below = [self.cache_len] * self.rows
        self.capture_report: dict[int, dict] = {}
        # generate() uses the one set of slots and buffers: concurrent calls run one after the other
        self._generate_lock = threading.Lock()
        # the config fields the buffers, caches and steps above were built from (config.FIXED_FIELDS)
        self._built = {f: copy.deepcopy(getattr(config, f)) for f in FIXED_FIELDS + CEILING_FIELDS}
        self._graphs_for = (config.steps_per_graph, config.batch_buckets)

    def _new_kv_caches(self, rows: int, cache_len: int):
        raise NotImplementedError

    def _prefill_forward(self, toks, pos, slots, lens) -> torch.Tensor:
        raise NotImplementedError

    def _step_fn(self, greedy: bool, K: int):
        raise NotImplementedError

    # ------------------------------------------------------------------ validation
    def _encode(self, prompts, max_new_tokens) -> list[list[int]]:
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        out = prompt_ids(prompts, self.tokenizer, self.vocab_size)
        for i, ids in enumerate(out):
            if len(ids) + max_new_tokens > self.config.max_len:
                self._too_long(i, len(ids), max_new_tokens)
        return out

    def _too_long(self, i: int, n: int, max_new_tokens: int) -> None:
        """Refuses prompt i, of n tokens, whose request is past max_len."""
        if self.window is not None and self.config.max_len <= self.window:  # (a max_len above it was asked for)
            check_window(n, max_new_tokens, self.window, what=f"prompt {i}", source=self.window_source,
                         fix="shorten the prompt or lower max_new_tokens (an explicit max_len above the window, "
                             "SpecGraphConfig.max_len / --max-len, runs past it with a warning)")
        raise ValueError(f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs "
                         f"{n + max_new_tokens} > max_len={self.config.max_len}: raise max_len in SpecGraphConfig "
                         "(--max-len) or shorten the prompt")

    # ------------------------------------------------------------------ step
    def _step_args(self, B: int) -> tuple:
        st = {k: v[:B] for k, v in self.state.items()}
        if self.config.adaptive:
            st["k_counts"] = self.k_counts[:B]  # the step adds its acceptance counts (adaptive.count_acceptance)
        return st, self.out_buf[:B], self.acc_log[:B], self.stop_buf, self.draft_kv, self.target_kv

    def _buckets(self) -> list[int]:
        return sorted({b for b in self.config.batch_buckets if b <= self.rows} | {self.rows}, reverse=True)

    def _steps_fn(self, greedy: bool, B: int, K: int, longest: int | None = None):
        """The N-step callable over rows [0, B) with K drafts (an eager step's span: rows at most `longest` long).
        Where the host reads more than the active flags after a replay, it returns what the host reads
        (``_read_tensor``), packed inside the replay's graph."""
        fn, args, N = self._step_fn(greedy, K), self._step_args(B), self.config.steps_per_graph
        span = {} if longest is None or not self.span_steps else {"kv_len": self._span(longest, K)}
        packs = self.config.adaptive or self.span_steps

        def run():
            for _ in range(N):
                fn(*args, **span)
            return self._read_tensor(B) if packs else None
        return run

    def _span(self, longest: int, K: int) -> int:
        """Cache positions an eager replay of N steps reads where its busy rows are at most `longest` long: every
        position a step writes (up to length - 1 + K) and reads, after the replay's earlier steps."""
        return min(longest + (self.config.steps_per_graph + 1) * (K + 2), self.cache_len)

    def _capture(self, greedy: bool, rows: int | None = None) -> None:
        """Capture every (bucket, K) N-step graph, while no row is active (warm-up runs for real); with "auto",
        time each one. Without graphs, "auto" times the uncaptured steps of the buckets a call of `rows` requests
        can use (None: every bucket), when a call first needs them (eager steps on a CPU take long to time)."""
        if self.config.adaptive and self.graphs is None:
            need = self.config.bucket_for(min(rows or self.rows, self.rows))
            with torch.inference_mode():  # up to the bucket whose times a batch of `need` rows is priced with
                self._time_steps(greedy, upto=min(b for b in self._buckets() if b >= need))
        if greedy in self._captured_modes:
            return
        plat = self.platform
        with torch.inference_mode():
            for K in self.k_choices:
                if self.graphs is None:
                    break
                t0, mem0 = time.perf_counter(), plat.memory_reserved()
                for b in self._buckets():
                    if b in self.config.batch_buckets:
                        self.graphs.capture((greedy, b, K), self._steps_fn(greedy, b, K))
                mem1 = plat.memory_reserved()
                rep = self.capture_report.setdefault(K, {"capture_s": 0.0, "memory_bytes": None})
                rep["capture_s"] += time.perf_counter() - t0
                if mem0 is not None:
                    rep["memory_bytes"] = (rep["memory_bytes"] or 0) + mem1 - mem0
                log.info("spec-graph: K=%d graphs (%s steps) built in %.1fs%s", K, "greedy" if greedy else "sampling",
                         time.perf_counter() - t0, "" if mem0 is None else f", pool +{(mem1 - mem0) / 2**20:.1f} MiB")
            if self.config.adaptive and self.graphs is not None:
                self._time_steps(greedy)
        self._caches_touched()
        self._captured_modes.add(greedy)

    def reset_graphs(self, steps_per_graph: int | None = None) -> None:
        """Drop the captured graphs (re-captured at the next generate), optionally with a new N.

        The compiled step functions are kept, so re-capturing costs no compilation.
        """
        if steps_per_graph is not None:
            self.config.steps_per_graph = checked_steps_per_graph(steps_per_graph)
        self._graphs_for = (self.config.steps_per_graph, self.config.batch_buckets)
        if self.graphs is not None:
            self.graphs = GraphSet(self.platform)
        self._new_prefill_graphs()
        self._captured_modes.clear()
        self._fallback_warned = False
        self.capture_report.clear()  # the graphs it counted are gone; the next capture reports its own
        for key in self._timed:  # re-read or re-measured at the next capture; entries a caller set stay
            self.step_times.pop(key, None)
            self.host_times.pop(key, None)
        self._timed.clear()

    def _run_steps(self, B: int, greedy: bool, K: int | None = None, longest: int | None = None):
        """N speculative steps of K drafts over rows [0, B): one graph replay where a graph exists (else eager,
        over the span of rows at most `longest` long). Returns the steps' packed read (``_steps_fn``), or None."""
        K = self.K if K is None else K
        key = (greedy, B, K)
        if self.graphs is not None and key in self.graphs:
            return self.graphs.replay(key)
        if self.graphs is not None and not self._fallback_warned:
            self._fallback_warned = True
            why = self.graphs.failed.get(key, f"batch {B} is over the largest bucket {self.config.batch_buckets[-1]}")
            log.warning("spec-graph: running the step uncaptured (%s)", why)
        with torch.inference_mode():
            return self._steps_fn(greedy, B, K, longest)()

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop_token_ids=None, *, progress=None) -> GenerationOutput:
        """One result per prompt, with ``.stats``. Every argument is checked first: a bad one is a ValueError
        naming it. Calls from several threads run one after the other (the slots and buffers are shared).
        ``progress(done_tokens, total_tokens)``, when given, is called after each step replay's read, with the tokens
        that read counts (it reads nothing more), and once at the end with every token (``total_tokens`` is prompts
        x max_new_tokens; stop tokens may end a request earlier)."""
        self._check_config()
        params = SamplingParams(temperature, top_p, top_k)
        encoded = self._encode(prompts, max_new_tokens)
        max_new_tokens = int(max_new_tokens)
        stop_set = stop_ids(stop_token_ids, self.eos_token_ids, self.vocab_size)
        if seed is None:
            seed = random.SystemRandom().getrandbits(63)
        elif not is_int(seed):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        if progress is not None and not callable(progress):
            raise ValueError(f"progress must be a callable (done_tokens, total_tokens) or None, got {progress!r}")
        with self._generate_lock:
            return self._generate(encoded, max_new_tokens, params, int(seed), stop_set, progress)

    FRESH = "build a new engine"  # what gives another engine (a loaded export: loading it again)

    def _rebuild_hint(self, field: str, value=None) -> str:
        return f"{self.FRESH} for this value (SpecGraphConfig({field}=...))"

    def _check_config(self) -> None:
        """Config fields set on a built engine (config.FIXED_FIELDS): a change it cannot take is a ValueError; new
        batch buckets or steps_per_graph are taken, with the graphs captured again for them."""
        cfg = self.config
        if not isinstance(cfg, SpecGraphConfig):
            raise ValueError(f"config was set to {type(cfg).__name__} on a built engine: set fields of its "
                             f"SpecGraphConfig (dec.config.max_len = ...), or {self.FRESH} for another one")
        for f, was in self._built.items():
            now = getattr(cfg, f)
            if f in SPELLED_FIELDS and spelled(now) == was:
                setattr(cfg, f, was)  # "AUTO" for "auto": what the constructor would have stored
                continue
            if now == was or f in CEILING_FIELDS and is_int(now) and CEILING_MIN[f] <= now <= was:
                continue
            room = f"; values from {CEILING_MIN[f]} up to {was} run on it" if f in CEILING_FIELDS else ""
            raise ValueError(f"{f} was set to {now!r} on a built engine, which was built with {was!r}{room}: its "
                             f"buffers, caches and steps were made for that, so {self._rebuild_hint(f, now)}")
        cfg.batch_buckets = checked_buckets(cfg.batch_buckets)
        if cfg.bucket_for(cfg.max_batch_size) > self.rows:
            raise ValueError(f"batch_buckets {list(cfg.batch_buckets)} pads a batch of max_batch_size="
                             f"{cfg.max_batch_size} past the engine's {self.rows} rows: give a bucket of at most "
                             f"{self.rows} that holds it, or {self.FRESH}")
        cfg.steps_per_graph = checked_steps_per_graph(cfg.steps_per_graph)
        self._check_time_tables()

    def _generate(self, encoded: list[list[int]], max_new_tokens: int, params: SamplingParams, seed: int,
                  stop_set: set[int], progress) -> GenerationOutput:
        if (self.config.steps_per_graph, self.config.batch_buckets) != self._graphs_for:
            self.reset_graphs(self.config.steps_per_graph)  # set on the engine since: its graphs follow
        wait = self.config.slot_steps_waited  # checked first: it may have been set after construction
        t0 = time.perf_counter()
        # A call cut short (an exception from progress, KeyboardInterrupt) left its rows active: no row is
        # anyone's now, and a capture below runs only while none is active.
        self.state["active"].zero_()
        self.stop_buf.fill_(PLACEHOLDER)
        self.stop_buf[: len(stop_set)] = torch.tensor(sorted(stop_set), dtype=torch.long)
        self._capture(params.greedy, len(encoded))
        req_seeds = [request_seed(seed, i) for i in range(len(encoded))]

        S = self.config.max_batch_size
        pending = deque(range(len(encoded)))
        owner: list[int | None] = [None] * S
        results: list[GenerationResult | None] = [None] * len(encoded)
        steps = prefills = 0
        self.k_counts.zero_()  # the chooser starts from nothing each call: the same seed, the same Ks
        k_per_step: list[int] = []
        slot_ks: list[list[int]] = [[] for _ in range(S)]  # K of each replay step a slot took part in
        live = [0] * S  # each busy slot's committed length, as last read (the chooser's step times follow it)

        prices: dict = {}  # (bucket, host waits): its step times as a function of length (fixed during a call)
        # A replay over enough busy rows is launched before the read of the one before it (launch_ahead)
        aheads = self.launch_ahead
        most = [0] * S  # per busy slot: the most tokens its request can have committed, through every launch
        made = [0] * S  # per busy slot: the tokens its request had committed at the last read (progress)
        finished = [0]  # tokens of the requests finished (progress)
        uncounted: set[int] = set()  # requests that ended at their prefill: counted once their results are built
        admissions = [0]  # admissions so far: a replay launched before the last one credits no wait to it

        def enough(slots) -> bool:  # busy rows enough for a replay over them to be launched ahead
            return aheads and len(slots) >= self.AHEAD_ROWS

        def ahead(slots) -> bool:
            """Whether the next replay over `slots` goes before the read of the last: enough rows, one of which
            cannot have ended by its length in the replays launched (so that the next does not run for nothing)."""
            return enough(slots) and any(most[s] < max_new_tokens for s in slots)
        ran = [None]  # the bucket of the replay launched last (whose K a choice may keep)

        def choose(c: KChooser, lens: dict[int, int]) -> int:  # lens: {busy slot: committed length}
            left = {s: max_new_tokens + len(encoded[owner[s]]) - n for s, n in lens.items()}  # tokens each has left
            bucket = self.config.bucket_for(max(lens) + 1)  # the replay's (chosen before it, during a prefill)
            if bucket != ran[0]:
                c.last_k = None  # another bucket's graph runs whatever K: nothing to keep
            key = (bucket, not ahead(lens))  # a replay launched ahead does not wait for the host's work
            if key not in prices:
                prices[key] = self._prices(params.greedy, *key)
            return c.choose(prices[key](sum(lens.values()) / len(lens)), left, len(pending) * max_new_tokens)

        chooser = ChoiceAhead(KChooser(self.k_choices), choose) if self.config.adaptive else None

        later: list = []  # finished rows on their way to the host: (their requests, their Ks, copy, wait)
        # a request commits at most max_new_tokens tokens in as many steps, so that much of each buffer (not max_len)
        L = min(max_new_tokens, self.out_buf.shape[1])

        def finish(slots: list[int], behind: bool, counted: bool = True) -> None:
            """Frees `slots` at once; their results are gathered and copied to the host now (later work that reuses a
            slot comes after in stream order), and built into results by ``collect`` after the next launch.
            ``behind``: a replay launched since runs; the copy does not wait for it. ``counted``: their requests'
            tokens were read (else progress counts them from their results)."""
            if not slots:
                return
            idx = torch.tensor(slots, device=self.device)
            st = self.state
            # one read back for the lot: [n_out, error, steps, output..., acceptance log...] per slot
            rows = torch.cat((torch.stack((st["n_out"][idx], st["error"][idx].long(), st["steps"][idx]), 1),
                              self.out_buf[idx, :L], self.acc_log[idx, :L]), 1)
            copy = self.platform.to_host_later if behind else self.platform.to_host
            later.append(([owner[s] for s in slots], [slot_ks[s] for s in slots], *copy(rows)))
            for s in slots:
                if counted:
                    finished[0] += made[s]
                else:
                    uncounted.add(owner[s])
                owner[s] = None
                slot_ks[s] = []

        def collect() -> None:
            """The results of the rows ``finish`` freed, built (their tokens decoded) where the host would wait for
            the replay anyway."""
            for reqs, ks, host, wait in later:
                wait()
                rows = host.tolist()
                for j, r in enumerate(reqs):
                    n_out, err, nsteps = rows[j][:3]
                    toks = rows[j][3: 3 + n_out]
                    if err:
                        reason = "error"
                    elif toks and toks[-1] in stop_set:
                        reason = "stop"
                    else:
                        reason = "length"
                    n = nsteps - 1
                    if r in uncounted:
                        finished[0] += n_out
                    results[r] = GenerationResult(toks, self._decode(toks), reason, encoded[r],
                                                  rows[j][3 + L: 3 + L + n], ks[j][:n])
            later.clear()

        total = len(encoded) * max_new_tokens

        def report() -> None:  # tokens committed so far, as last read: finished requests' and the busy slots'
            progress(finished[0] + sum(made[s] for s in range(S) if owner[s] is not None), total)

        idle = 0  # slot-steps the free slots have waited with requests queued, since the last admission
        self.launched_ahead = 0
        unread: list[_Launched] = []  # the replay launched ahead of this one's read, not read yet (at most one)

        def launch(busy: list[int]) -> _Launched:
            B, N = self.config.bucket_for(max(busy) + 1), self.config.steps_per_graph
            K = chooser.pick({s: live[s] for s in busy}) if chooser else self.K
            # an eager span covers what the unread replay may have added to its rows
            longest = max(live[s] for s in busy) + sum(r.grows for r in unread)
            packed = self._run_steps(B, params.greedy, K, longest)
            ran[0] = B
            for s in busy:
                most[s] += N * (K + 1)
            early = ahead(busy)
            counts = _reads_counts(progress is not None, packed is None, early, enough(busy))
            if counts:
                first = self.state["active"][:B].long() if packed is None else packed
                packed = torch.cat((first, self.state["n_out"][:B]))
            rep = _Launched(B, K, N, {s: owner[s] for s in busy}, early, counts, admissions[0])
            self.launched_ahead += bool(unread)
            if rep.ahead:  # read once the next replay is launched: its copy, taken now, waits for nothing
                host, wait = self.platform.to_host_later(self.state["active"][:B] if packed is None else packed)
                rep.read = lambda: (wait(), host.tolist())[1]
            elif packed is not None:
                rep.read = lambda: self._read_after_replay(B, packed)
            else:
                rep.read = lambda: self.state["active"][:B].tolist()
            return rep

        def take(rep: _Launched, behind: _Launched | None) -> None:
            """The read after replay `rep`; `behind`: a replay launched since (before the read), or None."""
            nonlocal steps, idle
            read, B, N, K = rep.read(), rep.B, rep.N, rep.K
            if rep.counts:  # the rows' token counts, after what the replay reads otherwise
                read, n_out = read[:-B], read[-B:]
            rows = _rows_that_ran(rep.owners, owner)
            if not rows:  # every row had ended: it ran for nothing
                return
            steps += N
            if pending and rep.admissions == admissions[0]:
                idle += (S - len(rows)) * N
            k_per_step.extend([K] * N)
            for s in rows:
                slot_ks[s] += [K] * N
            lens = len(read) > B  # active flags, then the rows' lengths and the chooser's counts
            for s in rows:
                if lens:
                    live[s] = read[B + s]
                if lens or rep.counts:
                    # (a row that ends may add tokens past a stop or its max_new to its length, not to its count)
                    made[s] = n_out[s] if rep.counts else live[s] - len(encoded[owner[s]])
                    most[s] = made[s] + (behind.grows if behind else 0)
            if lens and chooser:
                chooser.seen(read[2 * B:], {s: live[s] for s in rows})  # rows [0, B)'s counters
            finish([s for s in rows if not read[s]], behind is not None)
            if progress is not None:
                report()

        while pending or unread or any(o is not None for o in owner):
            if unread and not ahead([s for s in range(S) if owner[s] is not None]):
                take(unread.pop(), None)  # the next launch waits for its read
                continue
            free = [s for s in range(S) if owner[s] is None]
            if admits_now(len(free), len(pending), S - len(free), idle, wait):
                admit = [(s, pending.popleft()) for s in free[: len(pending)]]
                idle = 0
                admissions[0] += 1
                for s, r in admit:
                    owner[s] = r
                    live[s], most[s], made[s] = len(encoded[r]) + 1, 1, 1
                    if chooser:
                        chooser.admit(s)
                # the next K is chosen while the prefill runs, for every row busy after it (one that ends at its
                # prefill leaves that choice a replay stale, as a row that ends in a replay does)
                pick = (lambda: chooser.pick({s: live[s] for s in range(S) if owner[s] is not None})) \
                    if chooser else None
                groups = prefill_groups([len(encoded[r]) for _, r in admit])  # prompts of like length together
                for g, group in enumerate(groups):
                    slots, reqs = [admit[i][0] for i in group], [admit[i][1] for i in group]
                    act = self._prefill(slots, [encoded[r] for r in reqs], [max_new_tokens] * len(reqs),
                                        [req_seeds[r] for r in reqs], params, pick if g == len(groups) - 1 else None)
                    prefills += 1
                    finish([s for s, a in zip(slots, act) if not a], False, counted=False)
            busy = [s for s in range(S) if owner[s] is not None]
            if not busy:
                if progress is not None:
                    report()
                continue
            rep = launch(busy)
            collect()  # while the replay runs
            if chooser:
                chooser.ahead(rep.K, rep.N, {s: live[s] for s in busy})  # while the replay runs
            if unread:
                take(unread.pop(), rep)
            if rep.ahead:
                unread.append(rep)
            else:
                take(rep, None)  # the K chosen during the replay serves the rows left (ChoiceAhead: one replay stale)

        collect()
        if progress is not None:  # exact, where a row ended at its prefill with nothing committed
            progress(sum(len(r.token_ids) for r in results), total)
        return GenerationOutput(results, self._stats(results, steps, prefills, time.perf_counter() - t0, k_per_step))

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([i for i in ids if i not in self.eos_token_ids], skip_special_tokens=True)

    def _stats(self, results, steps: int, prefills: int, wall: float, k_per_step: list[int]) -> GenerationStats:
        counts = [a for r in results for a in r.accepted_counts]
        ks = [k for r in results for k in r.k_per_step]
        n = len(counts)
        proposed = [sum(k > j for k in ks) for j in range(self.K)]  # steps that proposed draft position j
        per_pos = [sum(a > j for a in counts) / m if m else 0.0 for j, m in enumerate(proposed)]
        generated = sum(len(r.token_ids) for r in results)
        request_steps = n + len(results)  # each request's speculative steps, plus its prefill
        return GenerationStats(
            acceptance_rate=sum(counts) / sum(ks) if n else 0.0,
            acceptance_rate_per_position=per_pos,
            tokens_per_step=generated / request_steps if request_steps else 0.0,
            steps=steps,
            prefills=prefills,
            generated_tokens=generated,
            wall_time_s=wall,
            request_steps=request_steps,
            k_per_step=k_per_step,
        )


def _reads_counts(progress: bool, flags_only: bool, ahead: bool, rows_enough: bool) -> bool:
    """Whether a replay's read carries its rows' token counts, after the rest: with a progress callback (which reads
    nothing of its own), and where the read would hold only the active flags (a fixed K's captured step) of a replay
    read first although enough rows are busy. The busy rows' bounds on their tokens (``most``: N * (K + 1) a replay
    while unread) then all say they may have ended: without the counts, no replay would be launched ahead until
    those rows end (the last fifth of their lives where steps commit 4 tokens of K=4's 5, more where drafts are
    rejected)."""
    return progress or (flags_only and rows_enough and not ahead)


def _rows_that_ran(owners: dict[int, int], owner: list[int | None]) -> list[int]:
    """The rows of a replay launched for ``owners`` ({slot: request}) whose requests ran in it, by ``owner`` now: a
    row that ended in the replay before it (read after its launch) is free now, or holds another request."""
    return [s for s, r in owners.items() if owner[s] == r]


@dataclass(eq=False)
class _Launched:
    """A replay of N steps of K drafts over bucket B, launched for the requests of the busy rows ({slot: request});
    ``read()``: the host's read after it; ``ahead``: launched to be read after the next launch."""
    B: int
    K: int
    N: int
    owners: dict
    ahead: bool
    counts: bool = False  # its read ends with the rows' token counts
    admissions: int = 0  # the call's admissions before its launch
    read: Callable[[], list] | None = None

    @property
    def grows(self) -> int:
        return self.N * (self.K + 1)  # positions it may add to a row


def request_seed(seed: int, i: int) -> int:
    """Request i's 63-bit seed from the call's seed: a hash of both, so that any two integer seeds (negative or
    past 2**64 too) give different draws."""
    seed = int(seed)
    raw = seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True) + i.to_bytes(8, "little")
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
