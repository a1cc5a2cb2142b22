"""Host-sync check: a step compiled by spec-graph must never read a device value on the host.

A host read (``.item()``, ``.tolist()``, ``nonzero``, a data-dependent shape, a
device->host copy, a Python branch on a tensor value) either splits the Dynamo
graph (a graph break) or survives into a graph as an op that stalls the stream.
Both are errors here, each reported with the user's ``file:line``:

- :func:`find_host_reads` is an FX pass over a graph a backend receives (Dynamo
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
import sysconfig
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

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

FIX_HINT = (
    "keep the step on the device: use masks and torch.where instead of a Python `if` on a tensor "
    "(e.g. torch.where(n == K, a, b)); keep counts such as n = mask.sum() as tensors instead of .item()/.tolist(); "
    "replace nonzero / boolean-mask indexing / data-dependent slicing with fixed-size (static-shape) tensors plus "
    "a mask or padding (cumsum/cumprod, argmax, gather, scatter); and return device tensors instead of copying "
    "with .cpu()/.to('cpu')/.numpy() inside the step. `spec_graph.check(fn, *args)` lists every sync point."
)

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)
# Python's own library (logging, say) is no user's line either; installed packages under it are
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_PACKAGE_DIRS = tuple(os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib"))
_RESUME_RE = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_(?P<line>\d+)$")
_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>[^\n]*)')


# --------------------------------------------------------------------------------------------------------------
# Findings, error, report, warnings
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One host sync point: ``op`` (e.g. ``item``, ``nonzero``, ``branch``, ``cpu``) at the user's ``file:line``."""

    op: str
    file: str
    line: int
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.op}" + (f" ({self.detail})" if self.detail else "")


def _format(findings: Sequence[Finding]) -> str:
    return "\n".join(f"  {f}" for f in findings)


class HostSyncError(ValueError):
    """A spec-graph-compiled function reads device values on the host (or was split by a graph break).

    ``findings`` lists every sync point found, each as ``file:line: op (detail)``.
    """

    def __init__(self, findings: Iterable[Finding], message: str | None = None):
        self.findings: list[Finding] = list(findings)
        n = len(self.findings)
        head = message or (
            f"{n} host sync point{'s' if n != 1 else ''} in a function compiled by spec_graph "
            "(each one splits the graph or stalls the device until the host has read a value):"
        )
        super().__init__(f"{head}\n{_format(self.findings)}\nHint: {FIX_HINT}")

    def __reduce__(self):  # picklable across processes despite the custom __init__
        return (type(self), (self.findings,))


class HostSyncReport:
    """What ``spec_graph.check`` returns: ``findings`` (list of :class:`Finding`), ``ok`` and a readable ``str``."""

    def __init__(self, findings: Iterable[Finding], graph_count: int | None = None):
        self.findings: list[Finding] = list(findings)
        self.graph_count = graph_count  # graphs Dynamo made of the function (1 when it was not split)

    @property
    def ok(self) -> bool:
        return not self.findings

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def raise_if_any(self) -> None:
        if self.findings:
            raise HostSyncError(self.findings)

    def __str__(self) -> str:
        if self.ok:
            return "spec_graph host-sync check: OK (one graph, no host reads)"
        n = len(self.findings)
        return (f"spec_graph host-sync check: {n} sync point{'s' if n != 1 else ''}\n"
                f"{_format(self.findings)}\nHint: {FIX_HINT}")

    def __repr__(self) -> str:
        return f"HostSyncReport(findings={self.findings!r})"


class SpecGraphWarning(UserWarning):
    """Base class of spec-graph's warnings."""


class GraphSplitWarning(SpecGraphWarning):
    """A function compiled with the spec_graph backend was split by graph breaks (it syncs with the host)."""


# --------------------------------------------------------------------------------------------------------------
# Source locations
# --------------------------------------------------------------------------------------------------------------
def _is_internal(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    return path.startswith(_TORCH_DIR) or (path.startswith(_STDLIB_DIR) and not path.startswith(_PACKAGE_DIRS))


def _parse_stack_trace(text: str) -> list[tuple[str, int, str, str]]:
    """``node.meta["stack_trace"]`` -> [(file, line, function, source segment)], outermost first.

    The segment is the part of the line the carets (``^~``) under it mark where the trace has them
    (Python >= 3.11), else the whole source line."""
    frames = []
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        m = _FRAME_RE.search(ln)
        if not m:
            continue
        code = lines[i + 1] if i + 1 < len(lines) and not _FRAME_RE.search(lines[i + 1]) else ""
        seg = code.strip()
        caret = lines[i + 2] if code and i + 2 < len(lines) else ""
        if caret.strip() and set(caret.strip()) <= set("^~"):
            start = len(caret) - len(caret.lstrip())
            seg = code[start:len(caret.rstrip())].strip() or seg
        frames.append((m.group("file"), int(m.group("line")), m.group("name").strip(), seg))
    return frames


def _user_frame(frames: Sequence[tuple[str, int, str, str]]):
    """The innermost frame outside torch itself (the user's line), else the innermost one."""
    for fr in reversed(frames):
        if not _is_internal(fr[0]):
            return fr
    return frames[-1] if frames else None


def _frames_of_summaries(stack) -> list[tuple[str, int, str, str]]:
    frames = []
    for fs in stack or ():
        seg = ""
        try:
            line = fs.line or linecache.getline(fs.filename, fs.lineno).strip()
            src = linecache.getline(fs.filename, fs.lineno)
            col, end = getattr(fs, "colno", None), getattr(fs, "end_colno", None)
            if src and col is not None:
                same_line = getattr(fs, "end_lineno", fs.lineno) == fs.lineno
                seg = src[col:end if (end is not None and same_line) else None].strip()
            seg = seg or line or ""
        except Exception:  # pragma: no cover - best effort
            pass
        frames.append((fs.filename, int(fs.lineno or 0), fs.name, seg))
    return frames


def _node_location(node: torch.fx.Node) -> tuple[str, int, str]:
    trace = node.meta.get("stack_trace") if hasattr(node, "meta") else None
    fr = _user_frame(_parse_stack_trace(trace)) if trace else None
    if fr is None:
        return "<unknown>", 0, ""
    return fr[0], fr[1], fr[3] or linecache.getline(fr[0], fr[1]).strip()


# --------------------------------------------------------------------------------------------------------------
# The FX pass
# --------------------------------------------------------------------------------------------------------------
_DETAIL = {
    "item": "Tensor.item() reads a device value on the host",
    "tolist": "Tensor.tolist() reads the whole tensor on the host",
    "nonzero": "output shape depends on tensor values; the host must read it",
    "cpu": "device->host copy",
    "numpy": "Tensor.numpy() copies to a host array",
    "branch": "Python control flow on a tensor value",
    "data-dependent shape": "output shape depends on tensor values; the host must read it",
    "host read": "the result is a Python value computed from tensor data",
    "print": "print() runs on the host; print after the call, or add print to "
             "torch._dynamo.config.reorderable_logging_functions (it then prints once the graph has run)",
    "synchronize": "the host waits for the device (a synchronize, which a graph capture also refuses)",
    "histc": "histc without min and max reads the input's minimum and maximum on the host; pass min < max",
    "logging": "a logging call runs on the host; log after the call, or skip it while compiling (under "
               "`if not torch.compiler.is_compiling():`)",
}
# A call to print or to a logger's method, at the start of the line that broke
_LOG_CALL_RE = re.compile(r"^\s*(?:(?P<print>print)|(?:[\w.]*\.)?(?:getLogger\([^)]*\)|_*(?:log|logger|logging)\w*)\."
                          r"(?:debug|info|warning|warn|error|exception|critical|log))\s*\(", re.IGNORECASE)
_SCALAR_READS = {"item", "_local_scalar_dense"}
_DYNAMIC_SHAPE_OPS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique",
                      "_unique2", "unique_dim", "repeat_interleave", "bincount", "histc", "where"}
_HOST_BOOL_OPS = {"equal", "is_nonzero", "allclose"}
# the host waits for the device (torch.cuda.synchronize() and the like, as Dynamo records them)
_HOST_WAIT_OPS = {"synchronize_device", "synchronize_stream", "synchronize_event"}
_TO_CPU_NAMES = {"cpu", "_to_cpu"}
_TO_NAMES = {"to", "_to_copy", "to_copy", "_to_copy_functional"}


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    packet = getattr(t, "overloadpacket", None)  # aten OpOverload
    if packet is not None:
        return getattr(packet, "__name__", str(packet)).split(".")[-1]
    name = getattr(t, "__name__", None) or str(t)
    return name.split(".")[-1]


def _value(node: Any):
    if not isinstance(node, torch.fx.Node):
        return None
    meta = node.meta
    return meta.get("val", meta.get("example_value"))


def _is_cpu_device(dev: Any) -> bool:
    if isinstance(dev, str):
        try:
            dev = torch.device(dev)
        except Exception:
            return False
    return isinstance(dev, torch.device) and dev.type == "cpu"


def _device_of(v: Any):
    return v.device if isinstance(v, torch.Tensor) else None


def _unbacked(v: Any) -> set:
    if v is None:
        return set()
    try:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        return set(free_unbacked_symbols(v))
    except Exception:
        return set()


def _to_own_device(node: torch.fx.Node) -> bool:
    """A ``.to`` whose device is a ``torch.device`` equal to its input's, as ``x.to(y.device)`` traces where both
    live on one device (Hugging Face's RoPE does it): no copy at all. A device written out ("cpu") is taken at its
    word, for what the code does on an accelerator."""
    src = _device_of(_value(node.args[0])) if node.args else None
    devs = [a for a in (*node.args[1:], node.kwargs.get("device")) if isinstance(a, torch.device)]
    return src is not None and bool(devs) and all(d == src for d in devs)


def _copy_to_cpu(node: torch.fx.Node, name: str) -> bool:
    """An explicit copy to the CPU: ``.cpu()``, ``.to("cpu")``, ``_to_copy(..., device=cpu)``, a ``copy_`` from a
    device tensor into a CPU one, or any op whose CPU output comes from a tensor on another device."""
    if name in _TO_CPU_NAMES:
        return True
    if name in _TO_NAMES and not _to_own_device(node):
        if _is_cpu_device(node.kwargs.get("device")):
            return True
        if node.op == "call_method" and any(_is_cpu_device(a) for a in node.args[1:]):
            return True
    out_dev = _device_of(_value(node))
    if out_dev is not None and out_dev.type == "cpu" and not (name.endswith("_like") or name.startswith("new_")):
        in_devs = [_device_of(_value(a)) for a in node.all_input_nodes]
        if any(d is not None and d.type not in ("cpu", "meta") for d in in_devs):
            return True
    if name in ("copy_", "copy") and len(node.args) >= 2:
        dst, src = _device_of(_value(node.args[0])), _device_of(_value(node.args[1]))
        if dst is not None and src is not None and dst.type == "cpu" and src.type not in ("cpu", "meta"):
            return True
    return False


def _written_as_view_as(node: torch.fx.Node) -> bool:
    """Whether the source line the node came from calls view_as and not numpy (the user's own ``t.view_as(t)``)."""
    lines = (node.meta.get("stack_trace") or "").rstrip().splitlines()
    code = next((ln for ln in reversed(lines) if ln.strip() and not ln.lstrip().startswith(("File ", "^", "~"))), "")
    code = code.split("#", 1)[0]  # a comment may say anything
    return "view_as" in code and "numpy" not in code


def _histc_range(node: torch.fx.Node):
    """(min, max) of a histc node where they are constants (defaults 0, 0), else None."""
    args = list(node.args[1:]) + [None] * 3
    lo = node.kwargs.get("min", args[1] if args[1] is not None else 0)
    hi = node.kwargs.get("max", args[2] if args[2] is not None else 0)
    return (lo, hi) if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else None


def _classify_node(node: torch.fx.Node) -> tuple[str, str] | None:
    """(op, detail) when ``node`` is a host read, else None."""
    name = _target_name(node)
    if name in _SCALAR_READS:
        return "item", _DETAIL["item"]
    if name == "tolist":
        return "tolist", _DETAIL["tolist"]
    if name == "numpy" or (name == "view_as" and node.op == "call_method" and len(node.args) >= 2
                           and node.args[0] is node.args[1] and not _written_as_view_as(node)):
        # Dynamo records ``t.numpy()`` as ``t.view_as(t)`` (the view then stands for the ndarray).
        return "numpy", _DETAIL["numpy"]
    if name in ("nonzero", "argwhere"):
        return "nonzero", _DETAIL["nonzero"]
    if name in _HOST_BOOL_OPS:
        return name, _DETAIL["host read"]
    if name in _HOST_WAIT_OPS:
        return "synchronize", _DETAIL["synchronize"]
    if name == "histc" and (bounds := _histc_range(node)) is not None and bounds[0] == bounds[1]:
        return "histc", _DETAIL["histc"]
    if _copy_to_cpu(node, name):
        if name in _TO_NAMES and node.op != "call_method":
            return f"{name}(device=cpu)", _DETAIL["cpu"]
        return ("to(cpu)" if name == "to" else "cpu"), _DETAIL["cpu"]
    # Generic: a node that introduces an unbacked symbol (a size or a scalar only the data determines).
    new = _unbacked(_value(node))
    if new:
        for a in node.all_input_nodes:
            new -= _unbacked(_value(a))
        if new:
            out = _value(node)
            if _holds_tensors(out):
                if name in ("getitem", "index", "__getitem__"):
                    return _index_kind(node), _DETAIL["nonzero"]
                return name, _DETAIL["nonzero" if name in _DYNAMIC_SHAPE_OPS else "data-dependent shape"]
            return name, _DETAIL["host read"]
    return None


def _index_kind(node) -> str:
    """How an indexing node's result came to have a size only the data decides: a boolean mask among its indices,
    or a slice bound read from a tensor."""
    leaves = torch.utils._pytree.tree_leaves(list(node.args[1:]), is_leaf=lambda x: isinstance(x, slice))
    if any(isinstance(_value(a), torch.Tensor) and _value(a).dtype == torch.bool
           for a in leaves if isinstance(a, torch.fx.Node)):
        return "mask indexing"
    if any(isinstance(a, slice) for a in leaves):
        return "data-dependent slicing"
    return "mask indexing"


def _holds_tensors(out) -> bool:
    """A tensor, or a tuple of them (``torch.where(cond)``'s indices)."""
    return isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list))
                                             and any(isinstance(o, torch.Tensor) for o in out))


def _refine(op: str, segment: str) -> str:
    """Name the user's call, where Dynamo lowered it to something else (``tolist`` -> ``item`` per element,
    ``numpy(force=True)`` -> ``cpu``)."""
    if op == "item" and ".tolist(" in segment and ".item(" not in segment:
        return "tolist"
    if op in ("cpu", "item") and ".numpy(" in segment:
        return "numpy"
    return op


def find_host_reads(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[Finding]:
    """Host reads that survived into ``gm`` (a Dynamo graph, or an aten graph after AOT autograd).

    One :class:`Finding` per (op, user source line), in graph order; the location comes from
    ``node.meta["stack_trace"]`` (the innermost frame outside torch). Nodes without a trace get
    ``<unknown>:0`` and their node name in the detail."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    found: dict[tuple, Finding] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or _reads_a_wrapped_number(node):
            continue
        try:
            hit = _classify_node(node)
        except Exception:  # a pass must not crash on an odd node
            hit = None
        if hit is None:
            continue
        op, detail = hit
        file, line, seg = _node_location(node)
        op = _refine(op, seg)
        detail = _DETAIL.get(op, detail)
        if file == "<unknown>":
            detail = f"{detail}; node {node.name}"
        key = (op, file, line)
        if key not in found:
            found[key] = Finding(op, file, line, detail)
    return list(found.values())


def _reads_a_wrapped_number(node: torch.fx.Node) -> bool:
    """An item() of an input that Dynamo made from a Python number (a float it left unspecialized travels as a
    CPU scalar tensor and is read back so): the value came from the host, and reading it syncs nothing."""
    if node.target != "item" and node.target is not torch.ops.aten._local_scalar_dense.default:
        return False
    src = node.args[0] if node.args else None
    grapharg = src.meta.get("grapharg") if isinstance(src, torch.fx.Node) and src.op == "placeholder" else None
    return bool(getattr(grapharg, "pass_arg_as_tensor", False))


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
