"""``spec_graph.compile`` and ``spec_graph.check``: torch.compile with the ``spec_graph`` backend, where a
graph break or a host read is an error that names every sync point, never a silent split.

    step = spec_graph.compile(step)            # torch.compile(step, backend="spec_graph", fullgraph=True)
    step(*args)                                # HostSyncError listing file:line: op (detail) for each sync

    report = spec_graph.check(step_fn, *args)  # the same findings, without raising
    assert report.ok, str(report)
"""
from __future__ import annotations

import types
from typing import Any, Callable, Mapping

import torch

from .passes.host_sync import HostSyncError, HostSyncReport, collect_sync_points

__all__ = ["compile", "check", "CompiledFunction", "HostSyncError", "HostSyncReport"]


def _graph_break_types() -> tuple[type, ...]:
    """The exceptions by which Dynamo with ``fullgraph=True`` reports a graph break or a data-dependent guard."""
    found: list[type] = []
    try:
        from torch._dynamo import exc as dexc

        for name in ("Unsupported", "UserError", "DataDependentOutputException"):
            t = getattr(dexc, name, None)
            if isinstance(t, type):
                found.append(t)
    except Exception:  # pragma: no cover
        pass
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        found.append(GuardOnDataDependentSymNode)
    except Exception:  # pragma: no cover
        pass
    try:
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        found += [DataDependentOutputException, DynamicOutputShapeException]
    except Exception:  # pragma: no cover
        pass
    return tuple(found)


def _chain(exc: BaseException, context: bool = True):
    """``exc`` and what it wraps: Dynamo's ``inner_exception``, ``__cause__`` and (``context``) ``__context__``."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [getattr(e, "inner_exception", None), e.__cause__] + ([e.__context__] if context else [])


def _original(fn: Callable) -> Callable:
    """The plain function or module behind a spec_graph / torch.compile wrapper."""
    while True:
        if isinstance(fn, CompiledFunction):
            fn = fn.fn
        elif isinstance(fn, torch.nn.Module) and hasattr(fn, "_orig_mod"):  # OptimizedModule
            fn = fn._orig_mod
        elif getattr(fn, "_torchdynamo_orig_callable", None) is not None:
            fn = fn._torchdynamo_orig_callable
        else:
            return fn


def _drop_earlier_compiles(fn: Callable) -> None:
    """Forget what an earlier ``torch.compile(fn, backend="spec_graph")`` left on fn's code: Dynamo keys its
    cache by code, guards and backend, not by ``fullgraph``, so a split graph compiled before would run here
    with no error. Entries of other backends cannot serve this call and are kept (a reset would recompile
    them). Checked before the first call: a split compile made later, elsewhere, is not seen."""
    from .backend import BACKEND_NAME, spec_graph_backend

    fn = _original(fn)
    code = getattr(getattr(fn, "forward", fn), "__code__", None)
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(code) if code is not None else []
        if any(getattr(e.backend, "compiler_name", None) == BACKEND_NAME
               or getattr(e.backend, "compiler_fn", None) is spec_graph_backend for e in entries):
            torch._dynamo.reset_code(code)
    except (ImportError, AttributeError):  # pragma: no cover - a torch without these helpers
        pass


class CompiledFunction:
    """What :func:`compile` returns: calls the ``torch.compile``'d function and turns Dynamo's graph-break
    errors into :class:`HostSyncError` (every sync point, found with ``torch._dynamo.explain``) and a
    :class:`HostSyncError` the backend raised (wrapped by Dynamo) back into itself.

    ``fn`` is the original callable, ``compiled`` the ``torch.compile`` result; other attributes are looked up
    on ``compiled`` (so a compiled ``nn.Module``'s attributes stay reachable)."""

    def __init__(self, fn: Callable, compiled: Callable):
        self.fn = fn
        self.compiled = compiled
        self.__wrapped__ = fn
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                object.__setattr__(self, attr, getattr(fn, attr))
            except (AttributeError, TypeError):
                pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.__dict__.get("_fresh"):
            _drop_earlier_compiles(self.fn)
            self._fresh = True
        try:
            return self.compiled(*args, **kwargs)
        except HostSyncError:
            raise
        except Exception as exc:
            for inner in _chain(exc):
                if isinstance(inner, HostSyncError):  # raised by the backend, wrapped by Dynamo
                    raise inner from None
            # A graph break or data-dependent guard (not, say, a shape error Dynamo found in the user's code).
            if not any(isinstance(e, _graph_break_types()) for e in _chain(exc, context=False)):
                raise
            report = None
            try:
                report = collect_sync_points(self.fn, args, kwargs)
            except Exception:  # explain could not run fn: Dynamo's own error is the better one
                pass
            if report is None or report.ok:
                raise
            raise HostSyncError(report.findings) from exc

    def check(self, *args: Any, **kwargs: Any) -> HostSyncReport:
        """``spec_graph.check`` of the original function."""
        return collect_sync_points(self.fn, args, kwargs)

    def __get__(self, obj, objtype=None):  # usable as a method decorator
        return self if obj is None else types.MethodType(self, obj)

    def __getattr__(self, name: str):
        if name.startswith("__") or "compiled" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["compiled"], name)

    def __repr__(self) -> str:
        return f"<spec_graph compiled {getattr(self.fn, '__qualname__', self.fn)!r}>"


def compile(fn: Callable | None = None, *, mode: str | None = None, options: dict | None = None,
            dynamic: bool | None = None, **kwargs: Any):
    """``torch.compile(fn, backend="spec_graph", fullgraph=True, mode=..., options=..., dynamic=...)``, where a
    graph break or a host read raises :class:`HostSyncError` naming every sync point as ``file:line: op``.

    ``options`` are the backend's (``spec_graph.backend.BackendOptions``: ``passes``, ``capture``, ``device``,
    ``inductor``), checked here; ``mode`` may come with them. Other keyword arguments go to ``torch.compile``
    (``fullgraph`` must stay True). Usable as ``@spec_graph.compile`` or ``@spec_graph.compile(mode=...)``.

    On a graph break the original ``fn`` is run (eagerly, twice, as ``torch._dynamo.explain`` does) on the
    failing call's arguments to collect every sync point, and Dynamo is reset."""
    if kwargs.pop("backend", "spec_graph") != "spec_graph":
        raise TypeError("spec_graph.compile always uses the spec_graph backend; call torch.compile for another one")
    if not kwargs.pop("fullgraph", True):
        raise TypeError("spec_graph.compile always compiles with fullgraph=True: a graph break is an error here")
    if fn is None:
        return lambda f: compile(f, mode=mode, options=options, dynamic=dynamic, **kwargs)

    from . import backend

    if isinstance(options, Mapping) and mode is not None:  # torch.compile takes one of the two: mode rides in options
        if options.get("mode", mode) != mode:
            raise ValueError(f"mode={mode!r} and options['mode']={options['mode']!r} disagree: give the mode once")
        options, mode = {**options, "mode": mode}, None
    backend.BackendOptions.parse(options)  # a bad option is refused here, not at the first call
    backend.check_mode(mode)
    backend.register()  # resolvable by name from a source tree too (the package registers an entry point)
    compiled = torch.compile(fn, backend=backend.BACKEND_NAME, fullgraph=True, mode=mode, options=options,
                             dynamic=dynamic, **kwargs)
    return CompiledFunction(fn, compiled)


def check(fn: Callable, /, *example_args: Any, **example_kwargs: Any) -> HostSyncReport:
    """Every host sync point of ``fn(*example_args, **example_kwargs)`` as a :class:`HostSyncReport`
    (``.findings``, ``.ok``, ``str()``), without raising and without compiling for real.

    ``fn`` runs eagerly (twice, as ``torch._dynamo.explain`` does) on the example arguments. Dynamo is reset
    before and after, so the check leaves no compiled state behind (other compiled functions recompile on
    their next call). A ``spec_graph.compile``/``torch.compile`` result is checked as its original function."""
    return collect_sync_points(_original(fn), example_args, example_kwargs)
