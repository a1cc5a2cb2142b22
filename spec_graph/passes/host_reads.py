"""Host reads inside a graph: the findings' vocabulary (:class:`Finding`, :class:`HostSyncError`,
:class:`HostSyncReport`), the user's source line of an FX node, and :func:`find_host_reads`, the FX pass over a
graph a backend receives (Dynamo level, or aten level after AOT autograd) that finds the host reads that got
*into* it: ``item`` / ``_local_scalar_dense`` (with ``capture_scalar_outputs``), ``nonzero`` and other ops with
data-dependent output shapes (with ``capture_dynamic_output_shape_ops``), ``tolist``, copies to the CPU and
``numpy()``. ``host_sync`` adds the graph breaks and re-exports these names."""
from __future__ import annotations

import linecache
import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

FIX_HINT = (
    "keep the step on the device: use masks and torch.where instead of a Python `if` on a tensor "
    "(e.g. torch.where(n == K, a, b)); keep counts such as n = mask.sum() as tensors instead of .item()/.tolist(); "
    "replace nonzero / boolean-mask indexing / data-dependent slicing with fixed-size (static-shape) tensors plus "
    "a mask or padding (cumsum/cumprod, argmax, gather, scatter); and return device tensors instead of copying "
    "with .cpu()/.to('cpu')/.numpy() inside the step. `spec_graph.check(fn, *args)` lists every sync point."
)

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
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
