"""The export's progress bars: one per artifact, with the time left for the whole export."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Sequence

# Relative cost of each stage (seconds on an idle 2-core CPU for the tests' tiny pair). The ETA scales them by
# what the finished stages really took, so only their ratios matter.
_STAGE_COST = {"export": 3.0, "compile prefill": 22.0, "compile greedy": 23.0, "compile sample": 33.0}


def _stage_cost(what: str) -> float:
    return _STAGE_COST.get(what, _STAGE_COST.get(what.split(" ")[0], 10.0))


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Progress:
    """One bar per artifact, with the time left for the whole export (ETA): redrawn in place every second on a
    terminal, one line per finished artifact otherwise.

    The ETA is the cost of the stages left (``_STAGE_COST``) scaled by the seconds per unit of cost the
    finished stages took, less what the running stage has already spent of its own estimate."""

    def __init__(self, stream, enabled: bool, planned: Sequence[str] = ()):
        self.stream, self.enabled = stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.cost_left = sum(map(_stage_cost, planned))  # planned stages not finished, the running one included
        self.cost_done = self.time_done = 0.0
        self.running: tuple[float, float] | None = None  # (cost, start) of the running stage
        self.lock = threading.Lock()

    def plan(self, stages: Sequence[str], add: bool = True) -> None:
        """Stages added to (or, ``add=False``, dropped from) what is left to do."""
        with self.lock:
            self.cost_left += (1 if add else -1) * sum(map(_stage_cost, stages))

    def eta(self) -> float | None:
        """Seconds left for the whole export; None before any stage has finished."""
        with self.lock:
            if self.cost_done <= 0:
                return None
            per_cost = self.time_done / self.cost_done
            left = self.cost_left * per_cost
            if self.running is not None:
                cost, start = self.running
                left -= min(time.perf_counter() - start, cost * per_cost)
            return max(left, 0.0)

    @contextmanager
    def bucket(self, label: str, n_stages: int):
        """Yields a bucket ``b``: ``with b.stage(what):`` around each of its ``n_stages`` stages; ``b.status`` is
        the word its last line ends with ("done" unless set; "failed" when the bucket raised)."""
        progress, t0, lock = self, time.perf_counter(), threading.Lock()

        class _Bucket:
            done, what, status = 0, "", None

            @contextmanager
            def stage(self, what: str):
                cost = _stage_cost(what)
                with progress.lock:
                    progress.running = (cost, time.perf_counter())
                self.what = what
                draw()
                start = time.perf_counter()
                try:
                    yield
                finally:
                    with progress.lock:
                        progress.running = None
                        progress.cost_left -= cost
                        progress.cost_done += cost
                        progress.time_done += time.perf_counter() - start
                    self.done += 1
                draw()

        b = _Bucket()

        def draw(final: bool = False):
            if not self.enabled or not (self.tty or final):
                return
            eta = self.eta()
            fill = 24 * min(b.done, n_stages) // n_stages
            what = (b.status or "done") if final else b.what
            left = "" if final and self.cost_left <= 1e-9 else (
                f"  ETA {_clock(eta)}" if eta is not None else "  ETA -:--")
            line = (f"  {label:<10} [{'#' * fill}{'.' * (24 - fill)}] {b.done}/{n_stages} {what:<16} "
                    f"{time.perf_counter() - t0:6.1f}s{left}")
            with lock:  # on a terminal, padded over the longer line it redraws
                self.stream.write((f"\r{line:<96}" if self.tty else line) + ("\n" if final else ""))
                self.stream.flush()

        stop = threading.Event()
        ticker = None
        if self.tty:  # elapsed time and ETA keep moving during a long compile
            def tick():
                while not stop.wait(1.0):
                    draw()
            ticker = threading.Thread(target=tick, name="spec-graph-export-progress", daemon=True)
            ticker.start()
        try:
            yield b
        except BaseException:
            b.status = b.status or "failed"
            raise
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            draw(final=True)
