"""Host-sync check: a step compiled by spec-graph must never read a device value on the host.

A host read (``.item()``, ``.tolist()``, ``nonzero``, a data-dependent shape, a
device->host copy, a Python branch on a tensor value) either splits the Dynamo
graph (a graph break) or survives into a graph as an op that stalls the stream.
Both are errors here, each reported with the user's ``file:line``:

- :func:`find_host_reads` (in ``host_reads`` with the findings' classes, both
  importable from here) is an FX pass over a graph a backend receives (Dynamo
  level, or aten level after AOT autograd). It finds the host reads that got
  *into* a graph: ``item`` / ``_local_scalar_dense`` (with
  ``capture_scalar_outputs``), ``nonzero`` and other ops with data-dependent
  output shapes (with ``capture_dynamic_output_shape_ops``), ``tolist``, copies
  to the CPU and ``numpy()``.
- :func:`collect_sync_points` runs ``torch._dynamo.explain`` (twice: once with
  scalar / dynamic-shape capture on, so that everything after the first break
  is traced as well, and once as Dynamo is configured by default) and merges
  its graph breaks with :func:`find_host_reads` over every graph it produced.
  ``spec_graph.check`` and ``spec_graph.compile`` report through it.
- ``graph_split.warn_if_split`` (beside this module, importable from it too) lets the backend warn once when a
  plain ``torch.compile(fn, backend="spec_graph")`` (no ``fullgraph``) split ``fn``.
"""
from __future__ import annotations

import contextlib
import linecache
import logging
import os
import re
from typing import Callable, Iterable, Sequence

import torch

# the findings' classes and the FX pass, importable from here too
from .host_reads import (_DETAIL, _LOG_CALL_RE, _RESUME_RE, FIX_HINT, Finding,  # noqa: F401
                         GraphSplitWarning, HostSyncError, HostSyncReport, SpecGraphWarning, _frames_of_summaries,
                         _is_internal, _parse_stack_trace, _refine, _target_name, _user_frame, find_host_reads)

__all__ = [
    "Finding",
    "HostSyncError",
    "HostSyncReport",
    "SpecGraphWarning",
    "GraphSplitWarning",
    "find_host_reads",
    "collect_sync_points",
    "warn_if_split",
    "reset_split_warnings",
    "FIX_HINT",
]

_THIS_FILE = os.path.abspath(__file__)  # frames up to this module's explain call are its callers'


# --------------------------------------------------------------------------------------------------------------
# Graph breaks (through Dynamo's explain)
# --------------------------------------------------------------------------------------------------------------
_ITEM_RE = re.compile(r"Tensor\.item\(\)|\bitem\(\)|call_method \S+ item\b|\bTensor\.item\b")


def _first_line(text: str) -> str:
    for ln in str(text).splitlines():
        if ln.strip():
            return ln.strip()[:160]
    return ""


def _classify_break(reason: str, segment: str) -> tuple[str, str]:
    """(op, detail) of a graph break from its reason text, then from the user's source (the segment of
    the line that broke) where the reason says too little."""
    r = str(reason)
    low = r.lower()
    head = low.split("\n", 1)[0]
    seg = segment or ""
    first = _first_line(r)
    is_branch_line = seg.lstrip().startswith(("if ", "elif ", "while ", "assert "))
    # 1. what Dynamo says
    if "generic_jump" in low or "data-dependent branching" in low or "jump" in head:
        on_scalar = "symnode" in low or "data-dependent expression" in low
        return "branch", _DETAIL["branch"] + (" read on the host" if on_scalar else "")
    if "tolist" in low:
        return "tolist", _DETAIL["tolist"]
    if _ITEM_RE.search(r) or "_local_scalar_dense" in r:
        op = _refine("item", seg)  # Dynamo reports tolist() as a data-dependent _local_scalar_dense
        return op, _DETAIL[op]
    if "nonzero" in low or "argwhere" in low:
        return "nonzero", _DETAIL["nonzero"]
    if "dynamic shape operator" in low or "dynamic output shape" in low:
        m = re.search(r"aten\.([A-Za-z0-9_]+)", r)
        return (m.group(1) if m else "data-dependent shape"), _DETAIL["data-dependent shape"]
    if "numpy" in low:
        return "numpy", _DETAIL["numpy"]
    if "data dependent" in low or "data-dependent" in low:
        if is_branch_line:
            return "branch", _DETAIL["branch"] + " read on the host"
        return "data-dependent value", first
    # 2. what the source says (a reason Dynamo did not record, or one not recognised above)
    if is_branch_line:
        return "branch", _DETAIL["branch"]
    if (m := _LOG_CALL_RE.match(seg)) is not None:
        op = "print" if m.group("print") else "logging"
        if "attempted to reorder" in low:  # registered as reorderable, but with arguments Dynamo cannot defer
            return op, "a reorderable logging call is deferred only where its arguments are tensors and constants"
        return op, _DETAIL[op]
    for pat, op in ((".tolist(", "tolist"), (".item(", "item"), ("nonzero(", "nonzero"), (".numpy(", "numpy"),
                    (".cpu(", "cpu")):
        if pat in seg:
            return op, _DETAIL[op]
    if "generator" in seg and "proxy" in low:
        return "graph break", ("Dynamo cannot trace a torch.Generator argument; seed the default generator "
                               "(torch.manual_seed) or draw from counter-based random numbers instead")
    return "graph break", first or (f"Dynamo split the function at `{seg}`" if seg
                                    else "Dynamo split the function here")


def _break_finding(reason: str, user_stack) -> Finding | None:
    fr = _user_frame(_frames_of_summaries(user_stack))
    if fr is None:
        return None
    op, detail = _classify_break(reason, fr[3])
    return Finding(op, fr[0], fr[1], detail)


def _resume_breaks(names: Iterable[str], known_files: dict[str, str], default_file: str) -> list[Finding]:
    """Breaks known only from the resume functions Dynamo created for them (``torch_dynamo_resume_in_f_at_N``):
    explain drops the reason of a break whose preceding graph was empty."""
    out = []
    for name in names:
        m = _RESUME_RE.match(name)
        if not m:
            continue
        fn, line = m.group("name"), int(m.group("line"))
        while (inner := _RESUME_RE.match(fn)) is not None:
            fn = inner.group("name")
        file = known_files.get(fn) or (default_file if _defines(default_file, fn, line) else None)
        if not file or _is_internal(file):  # only the user's lines; a break inside torch has a recorded reason
            continue  # (nor one inside a library the step calls, such as logging's Logger.info)
        seg = linecache.getline(file, line).strip()
        op, detail = _classify_break("", seg)
        out.append(Finding(op, file, line, detail))
    return out


def _defines(file: str, name: str, line: int) -> bool:
    """Whether `file` has a def of `name` spanning `line` (a resume function's line is then that file's)."""
    import ast

    try:
        tree = ast.parse("".join(linecache.getlines(file))) if file else None
    except (SyntaxError, ValueError):
        return False
    return tree is not None and any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        and n.lineno <= line <= (n.end_lineno or n.lineno) for n in ast.walk(tree))


_BREAK_LOG = "torch._dynamo.symbolic_convert.__graph_breaks"


class _BreakLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        try:
            self.messages.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that does not format is no break we can place
            pass


@contextlib.contextmanager
def _graph_break_log():
    """Dynamo's graph-break log while explain runs, kept here and not printed: it places the breaks that explain
    leaves out (a break at a function's first op, where Dynamo skips the whole frame and records no graph)."""
    lg = logging.getLogger(_BREAK_LOG)
    handler, level, propagate = _BreakLog(), lg.level, lg.propagate
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    try:
        yield handler.messages
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
        lg.propagate = propagate


def _logged_breaks(messages: Iterable[str]) -> list[Finding]:
    """Findings from Dynamo's graph-break log: the reason, at the innermost user frame of its traceback."""
    out = []
    for msg in messages:
        head, _, trace = msg.partition("User code traceback:")
        # the frames up to this module's explain call are its callers', not the user's function's
        frames = _parse_stack_trace(trace)
        ours = [i for i, f in enumerate(frames) if os.path.abspath(f[0]) == _THIS_FILE]
        frames = frames[ours[-1] + 1:] if ours else frames
        fr = _user_frame(frames) if frames else None
        if fr is None:
            m = re.search(r"in user code at (?P<file>.+):(?P<line>\d+)", head)
            if m is None:
                continue
            fr = (m.group("file"), int(m.group("line")), "", linecache.getline(m.group("file"),
                                                                               int(m.group("line"))).strip())
        if _is_internal(fr[0]):
            continue
        reason = head.partition("Graph Break Reason:")[2].strip()
        reason = re.sub(r"^Encountered graph break when attempting to trace [^\n]*\n+", "", reason)
        op, detail = _classify_break(reason, fr[3] or linecache.getline(fr[0], fr[1]).strip())
        out.append(Finding(op, fr[0], fr[1], detail))
    return out


@contextlib.contextmanager
def _quiet_dynamo():
    """Silence Dynamo's own graph-break warnings while explain runs (the findings carry them)."""
    lg = logging.getLogger("torch._dynamo")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


def _code_files(fn: Callable) -> tuple[dict[str, str], str]:
    """{function name: file} for ``fn`` (or a module's forward) and the code objects nested in it."""
    target = fn
    if isinstance(fn, torch.nn.Module):
        target = type(fn).forward
    target = getattr(target, "__wrapped__", target)
    code = getattr(getattr(target, "__func__", target), "__code__", None)
    files: dict[str, str] = {}
    if code is None:
        return files, ""
    todo = [code]
    while todo:
        c = todo.pop()
        files.setdefault(c.co_name, c.co_filename)
        todo.extend(k for k in c.co_consts if hasattr(k, "co_code"))
    return files, code.co_filename


def _explain_once(fn: Callable, args: tuple, kwargs: dict, capture: bool):
    """One explain run: (findings, graph_count). Always leaves Dynamo reset."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    before = dict(counters.get("resumes", {}))
    try:
        with _quiet_dynamo(), _graph_break_log() as logged, dynamo.config.patch(
                capture_scalar_outputs=capture, capture_dynamic_output_shape_ops=capture):
            ex = dynamo.explain(fn)(*args, **kwargs)
    finally:
        dynamo.reset()  # explain resets on success only; never leave compiled state behind
    after = counters.get("resumes", {})
    new_resumes = [k for k, v in after.items() if v > before.get(k, 0)]

    findings: list[Finding] = []
    covered: set = set()
    for br in getattr(ex, "break_reasons", []) or []:
        f = _break_finding(getattr(br, "reason", ""), getattr(br, "user_stack", None))
        if f is not None:
            findings.append(f)
        covered.update((fs.filename, fs.lineno) for fs in getattr(br, "user_stack", None) or [])
    graphs = list(getattr(ex, "graphs", []) or [])
    for g in graphs:
        findings.extend(find_host_reads(g))

    # Breaks whose reason explain did not record: learn them from the resume functions.
    files, default_file = _code_files(fn)
    for g in graphs:
        reason = getattr(g, "compile_subgraph_reason", None)
        for fs in getattr(reason, "user_stack", None) or []:
            files.setdefault(fs.name, fs.filename)
            new_resumes.append(fs.name)
    covered.update((f.file, f.line) for f in findings)
    for f in _resume_breaks(dict.fromkeys(new_resumes), files, default_file) + _logged_breaks(logged):
        if (f.file, f.line) not in covered:
            findings.append(f)
            covered.add((f.file, f.line))
    return _dedupe(findings), len(graphs)


def _dedupe(findings: Iterable[Finding]) -> list[Finding]:
    seen: dict[tuple, Finding] = {}
    for f in findings:
        seen.setdefault((f.op, f.file, f.line), f)
    return list(seen.values())


def collect_sync_points(fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> HostSyncReport:
    """Every graph break and host read of ``fn(*args, **kwargs)``, without compiling anything for real.

    Runs ``torch._dynamo.explain`` twice (``fn`` runs eagerly each time, as explain does): first with
    ``capture_scalar_outputs`` and ``capture_dynamic_output_shape_ops`` on, so that ``.item()``, ``nonzero`` and
    the rest enter the graphs (found by :func:`find_host_reads`) and tracing goes on past them, turning what
    depends on their values (``if n == K:``) into graph breaks; then with them off, as a safety net for breaks
    the first run did not see. Findings of the second run are added only at source lines the first did not
    report. Dynamo is reset before and after, so nothing compiled here survives. Findings come sorted by
    (file, line)."""
    kwargs = dict(kwargs or {})
    primary, graph_count, errors = [], None, []
    for capture in (True, False):
        try:
            found, n = _explain_once(fn, tuple(args), kwargs, capture)
        except Exception as exc:  # e.g. a hard data-dependent error with capture on; fn's own errors
            errors.append(exc)
            continue
        if graph_count is None or not capture:
            graph_count = n  # the default configuration's count, where it ran: how fn really splits
        if not primary:
            primary = list(found)
        else:
            covered = {(f.file, f.line) for f in primary}
            primary.extend(f for f in found if (f.file, f.line) not in covered)
    if len(errors) == 2:
        raise errors[-1]  # fn itself fails (in both configurations): the user's error, not ours
    order = {f: i for i, f in enumerate(primary)}
    findings = sorted(_dedupe(primary), key=lambda f: (f.file, f.line, order[f]))
    return HostSyncReport(findings, graph_count=graph_count)


def __getattr__(name: str):
    """The split warnings' functions, which live in ``graph_split`` (it imports this module's helpers)."""
    if name in ("warn_if_split", "reset_split_warnings"):
        from . import graph_split

        return getattr(graph_split, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
