"""The backend's warning when a plain ``torch.compile(fn, backend="spec_graph")`` (no ``fullgraph``) split ``fn``
at a graph break: once per function, naming the break's ``file:line`` and what it is."""
from __future__ import annotations

import linecache
import re
import warnings

import torch

from .host_reads import _RESUME_RE, GraphSplitWarning, _frames_of_summaries, _parse_stack_trace, _user_frame
from .host_sync import _classify_break

__all__ = ["warn_if_split", "reset_split_warnings"]

_SPLIT_WARNED: set = set()


def reset_split_warnings() -> None:
    """Forget which functions :func:`warn_if_split` already warned about (tests; long-lived processes)."""
    _SPLIT_WARNED.clear()


def _root_name(name: str) -> tuple[str, int | None]:
    """``torch_dynamo_resume_in_f_at_12`` -> ("f", 12); a plain name -> (name, None)."""
    line = None
    while (m := _RESUME_RE.match(name)) is not None:
        name, line = m.group("name"), (int(m.group("line")) if line is None else line)
    return name, line


def _def_line(file: str, name: str, line: int | None) -> int | None:
    """The line of the ``def name(`` at or above ``line`` of ``file``: which of a file's functions of one name
    (two modules' ``forward``) a frame is in."""
    pattern = re.compile(rf"\s*(async\s+)?def\s+{re.escape(name)}\s*[(\[]")
    for at in range(int(line or 0), 0, -1):
        if pattern.match(linecache.getline(file, at)):
            return at
    return None


def _split_info(gm: torch.fx.GraphModule):
    """(file, root function, a line inside it, break file, break line, reason) when ``gm`` is a piece of a split
    function."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = list(getattr(reason, "user_stack", None) or [])
    if reason is not None and getattr(reason, "graph_break", False) and stack:
        root, _ = _root_name(stack[0].name)
        fr = _user_frame(_frames_of_summaries(stack))
        op, detail = _classify_break(getattr(reason, "reason", ""), fr[3])
        return stack[0].filename, root, stack[0].lineno, fr[0], fr[1], f"{op}: {detail}"
    for fs in stack:  # the piece after a break: Dynamo compiles a resume function
        root, line = _root_name(fs.name)
        if line is not None:
            return fs.filename, root, line, fs.filename, line, _source_reason(fs.filename, line)
    # Fallbacks where the reason carries no stack: the compile's frame name, then node stack traces.
    names: list[tuple[str, str]] = []
    try:
        from torch._guards import TracingContext

        tc = TracingContext.try_get()
        loc = getattr(tc, "loc_in_frame", None) if tc is not None else None
        if loc:
            names.append((loc[0], loc[2]))
    except Exception:
        pass
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            fr = _parse_stack_trace(trace)
            if fr:
                names.append((fr[0][0], fr[0][2]))
            break
    for file, name in names:
        root, line = _root_name(name)
        if line is not None:
            return file, root, line, file, line, _source_reason(file, line)
    return None


def _source_reason(file: str, line: int) -> str | None:
    """What the break's source line shows (a print, a log, .tolist(), ...), where it shows one."""
    op, detail = _classify_break("", linecache.getline(file, line).strip())
    return None if op == "graph break" else f"{op}: {detail}"


def warn_if_split(gm: torch.fx.GraphModule) -> bool:
    """Warn (once per function) when ``gm`` is one piece of a function Dynamo split at a graph break.

    Seen from the backend, a split shows as a graph compiled because of a break (its
    ``compile_subgraph_reason.graph_break``) or as a graph of a resume function
    (``torch_dynamo_resume_in_<fn>_at_<line>``). Returns True when it warned."""
    try:
        info = _split_info(gm)
    except Exception:
        return False
    if info is None:
        return False
    file, root, inside, bfile, bline, why = info
    key = (file, root, _def_line(file, root, inside))  # two functions of one name in a file are two
    if key in _SPLIT_WARNED:
        return False
    _SPLIT_WARNED.add(key)
    where = f"{bfile}:{bline}" + (f" ({why})" if why else "")
    msg = (f"spec_graph: '{root}' was split by a graph break at {where}; each piece is compiled and replayed "
           "separately and the host syncs between them. Compile it with spec_graph.compile(fn) (fullgraph) or run "
           "spec_graph.check(fn, *args) to list every sync point.")
    try:
        warnings.warn_explicit(msg, GraphSplitWarning, bfile, int(bline or 0))
    except Exception:  # pragma: no cover - odd file names
        warnings.warn(msg, GraphSplitWarning, stacklevel=2)
    return True
