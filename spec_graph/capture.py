"""Static-graph capture per batch bucket, and replay, through the platform seam.

``GraphSet`` records no-argument callables over static buffers (the engine's
state, KV caches and output buffers live at fixed addresses), one graph per
key, all in one memory pool. ``CapturedFunction`` does the same for an
arbitrary compiled function, keyed by its input shapes, for the
``spec_graph`` torch.compile backend.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
from typing import Any, Callable

import torch

from . import platform as _platform

log = logging.getLogger("spec_graph")

WARMUP_RUNS = 2
# Records per capture before the key runs uncaptured: a capture that fails for a passing cause (another thread's
# CUDA call, say) holds the next time; uncaptured, a step runs about 25x slower.
CAPTURE_TRIES = 2


_pause_lock = threading.Lock()
_pauses = 0  # records under way (threads may capture at once); the collector runs again when the last ends
_collector_was_on = False


@contextlib.contextmanager
def _collector_paused():
    """No automatic garbage collection while a graph records. A collection there can destroy a graph that a
    reference cycle kept (one of an engine dropped or recaptured before), and CUDA refuses that while a stream
    captures: the capture fails (cudaErrorStreamCaptureInvalidated). torch's graph context no longer collects
    before a capture (torch 2.9 and later)."""
    global _pauses, _collector_was_on
    with _pause_lock:
        if _pauses == 0:
            _collector_was_on = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _collector_was_on:
                gc.enable()


class GraphSet:
    """Graphs keyed by (e.g.) batch bucket, sharing one memory pool (a failed record moves the set to a fresh
    one).

    ``capture(key, fn)`` warms ``fn`` up, then records it. ``fn`` runs for real
    during warm-up, so capture only while its side effects are harmless (the
    engine captures while every row is inactive). A record that fails is tried
    again (CAPTURE_TRIES in all); a capture that still fails leaves the key
    uncaptured and logs one warning; callers then run ``fn`` directly.
    """

    def __init__(self, plat: "_platform.Platform"):
        self.platform = plat
        self.pool = plat.graph_pool()
        self.graphs: dict[Any, Any] = {}
        self.outputs: dict[Any, Any] = {}
        self.failed: dict[Any, str] = {}

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def capture(self, key, fn: Callable[[], Any], warmup: int = WARMUP_RUNS) -> bool:
        plat = self.platform
        try:
            stream = plat.new_stream()
            with plat.on_side_stream(stream):
                for _ in range(warmup):
                    fn()
            plat.join_stream(stream)
            plat.synchronize()
        except Exception as e:  # noqa: BLE001 - fn itself fails: no capture can hold
            return self._give_up(key, e)
        first = None
        tries = max(1, CAPTURE_TRIES)
        for attempt in range(1, tries + 1):
            try:
                with _collector_paused():
                    graph = plat.new_graph()
                    out = plat.record(graph, fn, pool=self.pool, stream=stream)
                plat.synchronize()
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to the uncaptured path
                first = first or e
                # A fresh pool for what follows: a failed capture can leave its pool unusable for the next one.
                self.pool = plat.graph_pool()
                if attempt == tries:
                    return self._give_up(key, first, e)
                log.info("spec-graph: capture %d of %r failed (%s: %s); capturing again", attempt, key,
                         type(e).__name__, e)
                continue
            self.graphs[key] = graph
            self.outputs[key] = out
            return True

    def _give_up(self, key, first: BaseException, last: BaseException | None = None) -> bool:
        self.failed[key] = f"{type(first).__name__}: {first}"
        if last is not None and str(last) != str(first):
            self.failed[key] += f"; then {type(last).__name__}: {last}"
        log.warning("spec-graph: capture of %r failed (%s); that batch runs uncaptured", key, self.failed[key])
        return False

    def drop(self, key) -> None:
        """Forgets the key's graph (its memory stays in the pool for the graphs recorded after it)."""
        self.graphs.pop(key, None)
        self.outputs.pop(key, None)

    def replay(self, key):
        out = self.platform.replay(self.graphs[key])
        # A real graph refreshes the static outputs in place; a stand-in platform may return fresh ones.
        return self.outputs[key] if out is None else out


# Graphs per input-shape key that differ only in the values of number arguments; past it such calls run the
# compiled function uncaptured (a number that changes at every call would otherwise record a graph each time).
MAX_VALUE_GRAPHS = 8


def _key(args) -> tuple:
    # A number's value is part of the key: a graph replays the kernel arguments it recorded, so a symbolic int, or
    # a float that Dynamo passes as a CPU scalar tensor and reads with item(), gets a graph per value rather than
    # the first value's results.
    return tuple(_tensor_key(a) if isinstance(a, torch.Tensor)
                 else (type(a), _exact(a)) if isinstance(a, (bool, int, float)) else type(a) for a in args)


def _exact(v):
    # floats by their bits: -0.0 is not 0.0 here, and a NaN is one key
    return float(v).hex() if isinstance(v, float) else v


def _tensor_key(a: torch.Tensor) -> tuple:
    key = (tuple(a.shape), a.dtype, a.device, a.stride())
    return key + ((_VALUE, _exact(a.item())),) if a.device.type == "cpu" and a.dim() == 0 else key


_VALUE = "value"


def _shapes(key: tuple) -> tuple:
    """The key without the numbers' values."""
    def strip(k):
        if isinstance(k, tuple) and len(k) == 2 and k[0] in (bool, int, float):
            return k[0]
        if isinstance(k, tuple) and len(k) == 5 and isinstance(k[4], tuple) and k[4][0] == _VALUE:
            return k[:4]
        return k
    return tuple(strip(k) for k in key)


def _needs_autograd(args) -> bool:
    """Whether this call builds an autograd graph: replays would copy into recorded leaves and leave the gradients
    on the recorded call's tensors, so such calls run uncaptured."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


class CapturedFunction:
    """Wraps a compiled function: one static graph per input-shape key, replayed thereafter.

    The first call with a new key runs for real (warm-up); the second records
    the graph and replays it once, so every call's side effects happen exactly
    once. A tensor passed at the same address in both calls (a parameter, a
    buffer, a persistent state) is recorded as itself; any other is recorded
    through a private copy, which each later call fills from its own tensor
    and copies back from afterwards (the function may update inputs in place),
    so no caller's tensor is ever written by another call. An input recorded
    as itself that a later call passes at another address gets a private copy
    and the graph is recorded again. Outputs that view an input are returned
    as views of the caller's tensor; other outputs are returned as copies (one
    copy for outputs that view one another).
    """

    def __init__(self, fn: Callable, plat: "_platform.Platform", graphs: GraphSet | None = None,
                 absolute: frozenset = frozenset()):
        self.fn = fn
        self.platform = plat
        self.graphs = graphs or GraphSet(plat)
        # inputs the function reaches by absolute storage offsets (as_strided): no private copy can stand in
        self.absolute = absolute
        self.seen: set = set()
        self.static_args: dict[tuple, list] = {}
        self.private: dict[tuple, frozenset[int]] = {}  # per key: the inputs recorded through private copies
        self.warmup_ptrs: dict[tuple, list] = {}  # per key: the warm-up call's tensor addresses
        self.written: dict[tuple, set[int]] = {}  # per key: the private inputs the function writes
        self.warned: set[str] = set()  # the uncaptured fallbacks warned about ("autograd", "values", "moved")
        self.values_seen: dict[tuple, int] = {}  # number-valued keys seen per shape key (MAX_VALUE_GRAPHS)

    def __call__(self, *args):
        if _needs_autograd(args):
            self._warn_once("autograd", "spec-graph: inputs that require grad run uncaptured (a graph replay cannot "
                            "carry autograd); call under torch.no_grad() or torch.inference_mode() to replay graphs")
            return self.fn(*args)
        key = _key(args)
        if key in self.graphs:
            return self._replay(key, args)
        if key not in self.seen and key != _shapes(key):
            shapes = _shapes(key)
            self.values_seen[shapes] = self.values_seen.get(shapes, 0) + 1
            if self.values_seen[shapes] > MAX_VALUE_GRAPHS:
                self._warn_once("values", "spec-graph: a number argument took over %d values at one input shape; "
                                "further values run uncaptured (pass a changing number as a tensor to replay one "
                                "graph)", MAX_VALUE_GRAPHS)
                return self.fn(*args)
        if key not in self.seen:
            self.seen.add(key)
            self.warmup_ptrs[key] = [_ptr(a) for a in args]
            return self.fn(*args)
        if key in self.graphs.failed:
            return self.fn(*args)
        first = self.warmup_ptrs.pop(key, None)
        if first is None:  # a record of this key raised before its capture: warm up again
            self.warmup_ptrs[key] = [_ptr(a) for a in args]
            return self.fn(*args)
        own = _apart(args) - self.absolute
        return self._record(key, args, frozenset(i for i in own if _ptr(args[i]) != first[i]))

    def _warn_once(self, what: str, msg: str, *fmt) -> None:
        if what not in self.warned:
            self.warned.add(what)
            log.warning(msg, *fmt)

    def _record(self, key, args, private: frozenset):
        static = [_private_copy(a) if i in private else a for i, a in enumerate(args)]
        before = _versions(static, private)
        if not self.graphs.capture(key, lambda: self.fn(*static), warmup=0):
            return self.fn(*args)
        self.static_args[key], self.private[key] = static, private
        # the inputs the function writes: a recorded in-place update bumps its tensor's version while it records
        self.written[key] = {i for i, v in _versions(static, private).items() if v != before[i]}
        return self._replay(key, args)

    def _replay(self, key, args):
        static, private = self.static_args[key], self.private[key]
        moved = {i for i, (s, a) in enumerate(zip(static, args)) if i not in private and _ptr(a) != _ptr(s)}
        apart = _apart(args) - self.absolute if moved or private else set()
        if not (moved | private) <= apart:  # an overlapping view, or inputs sharing memory: no copy keeps that
            self._warn_once("moved", "spec-graph: an input whose elements overlap (an expanded view, say), that "
                            "shares memory with another input, or that the function reaches by storage offset "
                            "(as_strided), is not where its graph recorded it; such calls run uncaptured")
            return self.fn(*args)
        if moved:
            self.graphs.drop(key)
            return self._record(key, args, private | moved)
        with torch.no_grad():  # the copies carry no autograd history (a replay records none)
            for i in private:
                static[i].copy_(args[i])
        before = _versions(static, private)
        out = self.graphs.replay(key)
        # (a stand-in platform runs the function again at a replay: its writes show here)
        written = self.written[key] = self.written[key] | {i for i, v in _versions(static, private).items()
                                                           if v != before[i]}
        with torch.no_grad():
            for i in written:  # copied back only where written: a caller's tensor is not written otherwise
                args[i].copy_(static[i])
        return _returned(out, static, args)


def _versions(static: list, private: frozenset) -> dict:
    return {i: static[i]._version for i in private}


def _apart(args) -> set:
    """The tensor inputs a private copy can stand in for: no two of their elements share memory, and they share
    no memory with another input (a private copy each would part what the function reads as one)."""
    storages: dict[int, int] = {}
    for a in args:
        if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes():
            ptr = a.untyped_storage().data_ptr()
            storages[ptr] = storages.get(ptr, 0) + 1
    return {i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and _copyable(a)
            and (not a.untyped_storage().nbytes() or storages[a.untyped_storage().data_ptr()] == 1)}


def _ptr(a):
    return a.data_ptr() if isinstance(a, torch.Tensor) else None


def _copyable(a: torch.Tensor) -> bool:
    """Whether no two elements share memory (an expanded view's do), so that a private copy can be written."""
    reach = 0  # the furthest element offset the dims of smaller strides reach
    for stride, size in sorted((st, sz) for st, sz in zip(a.stride(), a.size()) if sz > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def _private_copy(a: torch.Tensor) -> torch.Tensor:
    # the graph's own buffer: no autograd history of the caller's tensor, and a normal tensor even under
    # inference_mode (an inference tensor has no version counter to tell the function's writes by)
    with torch.no_grad(), torch.inference_mode(False):
        return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device).copy_(a)


def _returned(out, static: list, args: tuple):
    """The replay's outputs for the caller: a view of a recorded input as the same view of the caller's tensor
    (its in-place updates reach the caller's, as in eager), anything else as a copy (the next replay rewrites the
    graph's outputs). Outputs that share a graph buffer share their copy too, so a write through one shows in the
    others, as in eager; an output returned twice comes back as one tensor twice."""
    given: dict[int, torch.Tensor] = {}  # id(output) -> what the caller gets
    buffers: dict[tuple, dict[int, torch.Tensor]] = {}  # the graph's own buffers -> the outputs in them
    for o in _tensors(out):
        if id(o) in given:
            continue
        if o.numel() == 0 or not o.untyped_storage().nbytes():  # nothing to share (empty storages share an address)
            given[id(o)] = o.clone()
        else:
            view = _input_view(o, static, args)
            if view is not None:
                given[id(o)] = view
            else:
                buffers.setdefault((o.device, o.untyped_storage().data_ptr()), {})[id(o)] = o
    for group in buffers.values():
        given.update(_copied_together(list(group.values())))
    return _rebuilt(out, given)


def _tensors(out):
    if isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, torch.Tensor):
        yield out


def _rebuilt(out, given: dict):
    if isinstance(out, (list, tuple)):
        return type(out)(_rebuilt(o, given) for o in out)
    return given[id(out)] if isinstance(out, torch.Tensor) else out


def _input_view(out: torch.Tensor, static: list, args: tuple) -> torch.Tensor | None:
    """``out`` as a view of the caller's tensor where it views a recorded input, else None."""
    for s, a in zip(static, args):
        if isinstance(s, torch.Tensor) and s.device == out.device and \
                s.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            # in bytes: the output may view the input as another dtype
            at = a.storage_offset() * a.element_size() + (out.storage_offset() * out.element_size()
                                                           - s.storage_offset() * s.element_size())
            if at % out.element_size():
                return None
            if out is s:  # the input itself (a view of it, even of one layout, is another tensor, as in eager)
                return a
            return torch.empty(0, dtype=out.dtype, device=a.device).set_(
                a.untyped_storage(), at // out.element_size(), out.size(), out.stride())
    return None


def _copied_together(group: list) -> dict:
    """Copies of outputs in one graph buffer: one copy of the bytes they span, each output its view in it (with
    the strides it had: a strided view of an intermediate stays strided, an expanded one stays unwritable)."""
    first = {id(o): o.storage_offset() * o.element_size() for o in group}
    start = min(first.values())
    end = max(first[id(o)] + (1 + sum((n - 1) * st for n, st in zip(o.size(), o.stride()))) * o.element_size()
              for o in group)
    if any((first[id(o)] - start) % o.element_size() for o in group):  # views no one buffer can hold
        return {id(o): o.clone() for o in group}
    dev = group[0].device
    span = torch.empty(0, dtype=torch.uint8, device=dev).set_(group[0].untyped_storage(), start, (end - start,), (1,))
    copy = span.clone().untyped_storage()
    return {id(o): torch.empty(0, dtype=o.dtype, device=dev).set_(copy, (first[id(o)] - start) // o.element_size(),
                                                                  o.size(), o.stride()) for o in group}
