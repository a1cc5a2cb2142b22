"""Adaptive K's price list: the seconds each (batch bucket, K) step takes, and the host's own work per replay,
measured once when the graphs are captured and fixed from then on (so the chooser stays deterministic).

``StepTimes`` is a part of ``runtime.DecoderBase``: it times the engine's own captured steps, with every row
made active as a request would be, and puts the state back afterwards. An engine that names what its steps
depend on (``_timing_identity``: the models' shapes, the config, the device, the versions) keeps the table in
a file under ``$SPEC_GRAPH_CACHE_DIR`` (default ``~/.cache/spec_graph``; "" or "0": none), and a later engine
with the same identity reads it instead of timing: the same seed then gives the same Ks, and so the same sampled
tokens, across engines and processes on one machine.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from . import platform as _platform
from .config import is_real
from .adaptive import ChoiceAhead, KChooser

# each K's step is timed at a short and at this live length (or max_len / 2 if shorter), and interpolated
TIME_LENGTH = 1024
HOST_REPLAYS = 8  # replays per timing of the host's work per replay
# Seconds of timed runs per measurement past the first run: long steps (eager on a CPU, where attention covers
# the whole cache) are timed fewer times; their noise is small against their length. Without it "auto" at
# max_len 32768 on a CPU spent 70 s timing before its first token.
TIMING_BUDGET_S = 0.25
# ... but at least this many timed runs each (the least of them is kept): one run that a hiccup of the machine
# stretched (50-100x a CPU step's time was seen) would otherwise price its K for the engine's life.
MIN_TIMED_RUNS = 2


CACHE_ENV = "SPEC_GRAPH_CACHE_DIR"
log = logging.getLogger("spec_graph")


def cache_dir() -> Path | None:
    """Where measured tables are kept, or None where the environment turns that off."""
    d = os.environ.get(CACHE_ENV, "~/.cache/spec_graph")
    if d.strip() in ("", "0"):
        return None
    try:
        return Path(d).expanduser() / "step_times"
    except RuntimeError:  # no home to expand ~ into: nothing is kept
        return None


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plausible_step(v) -> bool:
    """A step's price as a timing gives it: seconds, or (base_s, per_position_s) with a slope >= 0, positive at
    length 16 (a steep fit's base may be negative)."""
    base, per = v if isinstance(v, tuple) and len(v) == 2 else (v, 0.0)
    return is_real(base) and is_real(per) and per >= 0 and base + 16 * per > 0


def plausible_host(v) -> bool:
    return is_real(v) and v >= 0


class StepTimes:
    """``step_times`` {(greedy, bucket, K): (base_s, per_position_s) or seconds} and ``host_times``
    {(greedy, bucket): seconds per replay}, both measured where the engine captured the steps; entries a caller
    set beforehand are kept (``_timed`` holds the keys measured here)."""

    def _timing_identity(self) -> str | None:
        """A digest of everything the steps' times depend on (None: the table is not kept in a file)."""
        return None

    def _times_file(self) -> Path | None:
        ident, d = self._timing_identity(), cache_dir()
        return None if ident is None or d is None else d / f"{ident}.json"

    def _read_times(self, path: Path, warn: bool = True) -> tuple[dict, dict]:
        """(step entries, host entries) of a table's file; empty where it is missing, unreadable or malformed (its
        steps are then timed again and the file rewritten; `warn`: say so, as a load does once, not the save that
        replaces it)."""
        if not path.is_file():
            return {}, {}
        try:
            data = json.loads(path.read_text())
            steps = {(bool(g), int(b), int(k)): (float(v[0]), float(v[1])) if isinstance(v, list) else float(v)
                     for g, b, k, v in data["steps"]}
            host = {(bool(g), int(b)): float(v) for g, b, v in data["host"]}
            for key, v in steps.items():
                if not plausible_step(v):
                    raise ValueError(f"step {list(key)} priced {v}")
            for key, v in host.items():
                if not plausible_host(v):
                    raise ValueError(f"host share {list(key)} of {v}")
        except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
            if warn:
                log.warning("spec-graph: ignoring the step-time table %s (%s); its steps are timed again", path, e)
            return {}, {}
        return steps, host

    def _check_time_tables(self) -> None:
        """The tables a caller may set (``step_times`` {(greedy, bucket, K): seconds or (base_s, per_position_s)},
        ``host_times`` {(greedy, bucket): seconds}) hold prices a timing could give, or a ValueError names the
        entry (a string or NaN there would fail deep in the chooser, or steer K with nothing behind it)."""
        for name, table, key_len, ok, form in (
                ("step_times", self.step_times, 3, plausible_step,
                 "seconds per step, or (base_s, per_position_s) with per_position_s >= 0, positive at length 16"),
                ("host_times", self.host_times, 2, plausible_host, "seconds >= 0")):
            if not isinstance(table, dict):
                raise ValueError(f"{name} must be a dict, got {type(table).__name__}: clear it or set entries of it")
            for key, v in table.items():
                if not (isinstance(key, tuple) and len(key) == key_len) or not ok(v):
                    raise ValueError(f"{name}[{key!r}] = {v!r} is no price: a key is a tuple of {key_len}, a value "
                                     f"finite {form}")

    def _load_times(self, overwrite: bool = False, kept: tuple[dict, dict] | None = None) -> None:
        """Entries the table's file holds for this identity (or ``kept``, as read from it), where the caller has
        set none (``overwrite``: over the entries measured here too, so that an engine that timed a step another
        process kept first prices it as that one does)."""
        path = self._times_file()
        if path is None:
            return
        for table, entries in zip((self.step_times, self.host_times), kept or self._read_times(path)):
            for key, value in entries.items():
                if key not in table or (overwrite and key in self._timed):
                    table[key] = value
                    self._timed.add(key)

    def _save_times(self) -> None:
        """The entries measured (or read) here, joined with what the file holds by then (its entries win: another
        engine may already price steps by them), written whole and renamed into place."""
        path = self._times_file()
        if path is None:
            return
        file_steps, file_host = kept = self._read_times(path, warn=False)
        self._load_times(overwrite=True, kept=kept)
        # the file's entries whole (a key the caller set here is not this engine's to write, but stays the file's)
        steps = {**{k: v for k, v in self.step_times.items() if k in self._timed}, **file_steps}
        host = {**{k: v for k, v in self.host_times.items() if k in self._timed}, **file_host}
        steps = [[*k, list(v) if isinstance(v, tuple) else v] for k, v in steps.items()]
        host = [[*k, v] for k, v in host.items()]
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                tmp = f.name
                json.dump({"steps": steps, "host": host}, f)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:  # a read-only home, say: the table stays this engine's own
            log.info("spec-graph: the step-time table was not kept (%s)", e)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _time_steps(self, greedy: bool, repeats: int = 3, upto: int | None = None) -> None:
        """Each (bucket, K)'s step as ``(base_s, per_position_s)``: seconds per step = base + per_position x the
        rows' mean live length. Timed with every row active (drafting, verifying, attending as a request would)
        at two lengths (one where attention covers the whole cache anyway), then the state is put back (no
        request is active during capture: the scratch tokens written go to free slots, which a prefill resets).
        Fixed from here on: the chooser stays deterministic. `upto`: the buckets up to it alone."""
        plat = self.platform

        def left():  # the buckets with a step left to time (a call of an engine without graphs asks at every generate)
            return [b for b in self._buckets() if (upto is None or b <= upto)
                    and any((greedy, b, K) not in self.step_times for K in self.k_choices)]
        buckets = left()
        if buckets:
            self._load_times()
            buckets = left()
        if not buckets:
            return
        lo = 16
        hi = max(lo + 16, min(self.config.max_len // 2, TIME_LENGTH))
        # attention's work follows the live length where its kernel runs or an eager step reads a span (else it
        # covers the whole cache)
        lengths = (lo, hi) if _platform.use_triton(self.device) or self.span_steps else (lo,)
        with self._state_kept() as snap:
            def seconds(run, L):  # the least of the timed runs, the first (uncaptured: it may compile) not counted
                times = []
                for i in range(repeats + 1):
                    self._as_if_live(snap, L)
                    plat.synchronize()
                    t0 = time.perf_counter()
                    run()
                    plat.synchronize()
                    times.append(time.perf_counter() - t0)
                    if i >= MIN_TIMED_RUNS and sum(times[1:]) >= TIMING_BUDGET_S:
                        break
                return min(times[1:])

            for b in buckets:
                for K in self.k_choices:
                    key = (greedy, b, K)
                    if key not in self.step_times:
                        self.step_times[key] = self._fitted(key, lengths, seconds)
                        self._timed.add(key)
                if (greedy, b, self.k_choices[0]) in self._timed and (greedy, b) not in self.host_times:
                    self.host_times[(greedy, b)] = self._time_host(greedy, b, snap, lo, repeats)
                    self._timed.add((greedy, b))
        self._save_times()

    @contextlib.contextmanager
    def _state_kept(self):
        """Yields a snapshot of the engine's state to time steps from (``_as_if_live`` makes every row live from it),
        and puts the state back afterwards: no request is active during capture, and the scratch tokens the timed
        steps write go to free slots, whose caches are marked touched (a prefill resets them)."""
        snap = {k: v.clone() for k, v in self.state.items()}
        try:
            yield snap
        finally:
            for k, v in snap.items():
                self.state[k].copy_(v)
            self._caches_touched()

    def _fitted(self, key, lengths: tuple[int, ...], seconds) -> tuple[float, float]:
        """``(base_s, per_position_s)`` of the step of ``key`` (greedy, bucket, K) from ``seconds(run, length)``, its
        seconds per replay with every row live at each of ``lengths`` (the first and last fit the line; one length:
        no slope)."""
        at = [seconds(self._timed_run(key, L), L) / self.config.steps_per_graph for L in lengths]
        per = max(at[-1] - at[0], 0.0) / (lengths[-1] - lengths[0]) if len(lengths) > 1 else 0.0
        return at[0] - per * lengths[0], per

    def _time_host(self, greedy: bool, b: int, snap: dict, length: int, repeats: int) -> float:
        """Seconds per replay that the engine's host work adds to a replay of bucket `b` (the smallest K): replays
        each followed, as in the loop, by the chooser's work while it runs (``ChoiceAhead``) and the device read
        after it, against the same replays followed by a sync (where the replays run on a device, the chooser's
        work shows only where it outlasts them). Where HOST_REPLAYS replays would pass TIMING_BUDGET_S (eager
        steps over a long cache), the read alone, after a sync: the replays' own jitter would be larger than the
        difference."""
        plat = self.platform
        run = self._timed_run((greedy, b, self.k_choices[0]), length)
        lens = {r: length for r in range(b)}  # every row busy
        ahead = ChoiceAhead(KChooser(self.k_choices), lambda c, ln: c.choose(self._times_for(greedy, b, length), ln))

        def with_read():
            packed = run()
            ahead.ahead(self.k_choices[0], self.config.steps_per_graph, lens)
            ahead.seen(self._read_after_replay(b, packed)[2 * b:], lens)

        def with_sync():
            run()
            plat.synchronize()

        replay_s = self._times_for(greedy, b, length)[self.k_choices[0]] * self.config.steps_per_graph
        if replay_s * HOST_REPLAYS > TIMING_BUDGET_S:  # long replays: their jitter would swamp the host's work
            self._as_if_live(snap, length)
            plat.synchronize()
            return min(_seconds(lambda: self._read_after_replay(b)) for _ in range(HOST_REPLAYS))
        best = {}
        for _ in range(repeats):
            for name, fn in (("read", with_read), ("sync", with_sync)):
                self._as_if_live(snap, length)
                plat.synchronize()
                t0 = time.perf_counter()
                for _ in range(HOST_REPLAYS):
                    fn()
                plat.synchronize()
                t = (time.perf_counter() - t0) / HOST_REPLAYS
                best[name] = min(best.get(name, t), t)
        return max(best["read"] - best["sync"], 0.0)

    def _timed_run(self, key, length: int):
        """The step of key (greedy, bucket, K) as the engine runs it at live length `length`: its graph's replay,
        or uncaptured."""
        if self.graphs is not None and key in self.graphs:
            return lambda: self.graphs.replay(key)
        return self._steps_fn(*key, length)

    def _read_tensor(self, B: int) -> torch.Tensor:
        """What the host reads after a replay of an adaptive engine, or of one whose eager steps read a span, in one
        tensor: rows [0, B)'s active flags and lengths, then the chooser's counts. The steps return it from inside
        their graph (``_steps_fn``), so that the read is one copy with no launch of its own."""
        return torch.cat((self.state["active"][:B].long(), self.state["seq_lens"][:B], self.k_counts[:B].flatten()))

    def _read_after_replay(self, B: int, packed: torch.Tensor | None = None) -> list[int]:
        """The one host read per replay: ``packed``, the replay's own ``_read_tensor(B)``, else packed here."""
        return (self._read_tensor(B) if packed is None else packed).tolist()

    def _as_if_live(self, snap: dict, length: int) -> None:
        """Every row active at committed length `length`, with room to generate (for timing only)."""
        st = self.state
        for k, v in snap.items():
            st[k].copy_(v)
        st["active"].fill_(True)
        st["error"].fill_(False)
        st["seq_lens"].fill_(length)
        st["n_out"].fill_(1)
        st["max_new"].fill_(self.config.max_len)
        st["steps"].fill_(1)

    def _times_for(self, greedy: bool, B: int, length: float) -> dict[int, float]:
        """{K: seconds per step} at mean live length `length`, from the measured bucket nearest above B (else the
        largest): a ``step_times`` entry, ``(base_s, per_position_s)`` or plain seconds, plus the bucket's
        ``host_times`` share per step (none where it was not measured)."""
        return self._prices(greedy, B)(length)

    def _prices(self, greedy: bool, B: int, host_waits: bool = True):
        """``_times_for(greedy, B, length)`` as a function of `length`, with the table read once (the engine prices
        every choice of a call with it, several per replay with one busy row). ``host_waits=False``: without the
        host's share, for a replay launched before the read of the one before it (the device does not wait)."""
        measured = sorted({b for (g, b, _) in self.step_times if g == greedy})
        b = next((m for m in measured if m >= B), measured[-1] if measured else B)
        host = self.host_times.get((greedy, b), 0.0) / self.config.steps_per_graph if host_waits else 0.0
        entries = [(K, t) for K in self.k_choices if (t := self.step_times.get((greedy, b, K))) is not None]

        def at(length: float) -> dict[int, float]:
            return {K: (t[0] + t[1] * length if isinstance(t, tuple) else t) + host for K, t in entries}
        return at
