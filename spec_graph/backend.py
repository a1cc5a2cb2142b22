"""The ``spec_graph`` torch.compile backend: host-sync check -> fusion passes -> inductor
(or torch_npu's backend) -> one static graph per input-shape bucket.

The installed package registers it through the ``torch_dynamo_backends``
entry point, so ``torch.compile(fn, backend="spec_graph")`` works without
importing spec_graph first; ``register()`` does the same for a source tree.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from . import platform as _platform
from .capture import CapturedFunction
from .config import check_device
from .passes.graph_split import warn_if_split
from .passes.host_reads import HostSyncError, _target_name, find_host_reads
from .passes.manager import PassManager, check_enabled

BACKEND_NAME = "spec_graph"
_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class BackendOptions:
    """``options={...}`` of ``torch.compile(backend="spec_graph")``.

    passes: {pass name: bool} to turn passes on or off (see ``PassManager.names()``).
    capture: record static graphs on CUDA/NPU (default True); False returns the compiled function.
    device: "cuda" | "npu" | "cpu", default: where the graph's inputs live.
    inductor: extra inductor config patches (the engine and the vLLM drafter pass kernels.INDUCTOR_CONFIGS).
    on_passes: called once per compiled graph, when its compile returns, with the passes'
        {pass name: replacements}, or with None when they did not run during the compile, in this
        process: inductor's FX graph cache or AOT autograd cache served the graph (post-grad passes
        do not run on a cache hit), or TORCHINDUCTOR_FX_COMPILE_MODE compiled in a subprocess.
    opaque_kernels: keep the project's Triton ops whole in the graph (launched by their own bodies) instead of
        decomposing them into inductor's user-kernel nodes (default False). Inductor fuses nothing into those
        kernels either way, but each decomposed call site costs the compile a trace and analysis of the kernel's
        source (over half of a speculative step's compile); an opaque op costs a Python launch per call, which a
        captured graph does not replay: for functions replayed from graphs (the engine's steps).
    mode: torch.compile's mode, for callers that pass options too (torch.compile takes one or the other).
    """

    passes: dict = field(default_factory=dict)
    capture: bool = True
    device: str | None = None
    inductor: dict = field(default_factory=dict)
    on_passes: Callable[[dict | None], Any] | None = None
    opaque_kernels: bool = False
    mode: str | None = None

    @classmethod
    def parse(cls, options: dict | None) -> "BackendOptions":
        known = set(cls.__dataclass_fields__)
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"options must be a dict of spec_graph backend options (keys {sorted(known)}), got "
                             f"{type(options).__name__} {options!r}")
        options = dict(options or {})
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown spec_graph backend option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**options)
        if opts.on_passes is not None and not callable(opts.on_passes):
            raise ValueError(f"options['on_passes'] must be callable, got {opts.on_passes!r}")
        for name in ("capture", "opaque_kernels"):
            if not isinstance(getattr(opts, name), bool):
                raise ValueError(f"options[{name!r}] must be True or False, got {getattr(opts, name)!r}")
        for name in ("passes", "inductor"):
            if not isinstance(getattr(opts, name), dict):
                raise ValueError(f"options[{name!r}] must be a dict, got {getattr(opts, name)!r}")
        check_mode(opts.mode)
        check_device(opts.device)
        check_enabled(opts.passes, "options['passes']")
        check_inductor_keys(opts.inductor)
        return opts


def check_mode(mode) -> None:
    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r} for the spec_graph backend; use one of {_MODES[1:]}")


def spec_graph_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
                       options: dict | None = None, **kwargs: Any):
    check_mode(mode)
    opts = BackendOptions.parse(options)
    mode = mode or opts.mode
    warn_if_split(gm)
    findings = find_host_reads(gm)
    if findings:
        raise HostSyncError(findings)
    plat = _platform.get(opts.device or _input_device(example_inputs))
    passes = PassManager(enabled=opts.passes)
    if plat.compile_backend() == "npu":
        from .passes.npu_backend import compile_npu

        compiled = compile_npu(gm, example_inputs, passes)
    else:
        from torch._inductor.compile_fx import compile_fx

        patches = {"post_grad_custom_post_pass": passes, **opts.inductor}
        if mode and mode.startswith("max-autotune"):
            patches.setdefault("max_autotune", True)
        with opaque_ops() if opts.opaque_kernels else contextlib.nullcontext(), lazy_operator_text():
            compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if opts.on_passes is not None:
        # the passes run inside compile_fx (on the forward graph); a manager that never ran: see on_passes
        counts = passes.last_counts
        opts.on_passes(None if counts is None else dict(counts))
    if plat.supports_graphs and opts.capture:
        return CapturedFunction(compiled, plat, absolute=absolute_inputs(gm))
    return compiled


_ABSOLUTE_OPS = ("as_strided", "as_strided_", "as_strided_scatter")


def absolute_inputs(gm: torch.fx.GraphModule) -> frozenset:
    """The inputs (by position) that the graph reaches by absolute storage offsets: an ``as_strided`` of the input or
    of a tensor made from it may read memory outside the input's own elements, which a private copy lacks."""
    places = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found = set()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and _target_name(node) in _ABSOLUTE_OPS and node.args:
            seen, todo = set(), [node.args[0]]
            while todo:
                n = todo.pop()
                if not isinstance(n, torch.fx.Node) or n in seen:
                    continue
                seen.add(n)
                if n.op == "placeholder":
                    found.add(places[n])
                elif n.args:
                    todo.append(n.args[0])
    return frozenset(found)


def opaque_ops():
    """A context in which AOT autograd keeps custom Triton ops (torch.library.triton_op) whole, as torch.export does,
    and inductor passes custom ops the layouts it has (flexible_layout): the default (exact eager strides) makes it
    recompute a small input, such as the positions, into a fresh buffer for each op that reads it (62 kernels more
    in a K=4 step). Every op of this project reads its inputs through their strides or makes them contiguous."""
    from torch._functorch import config

    wanted = {"decompose_custom_triton_ops": False, "custom_op_default_layout_constraint": "flexible_layout"}
    return config.patch({k: v for k, v in wanted.items() if hasattr(config, k)})


@contextlib.contextmanager
def lazy_operator_text():
    """Inductor's text of an op's arguments built only when read.

    Why: torch before 2.13 formats the arguments of each op it first lowers as an implicit fallback (every op kept
    whole, as opaque_kernels and AOTInductor keep ours), for a log line that is off. A node's text nests the text
    of the nodes it reads, so an op first met after a forward's layers (a fused head's greedy choice) is formatted
    in time exponential in the layers: the compile never ends.
    How: the formatting (OperatorIssue.operator_str) returns an object whose str() formats, as torch 2.13 defers it
    (LazyString); every caller formats it into a string or a log record.
    When it can go: once torch 2.13 is the oldest supported."""
    from torch._inductor import exc

    original = exc.OperatorIssue.__dict__["operator_str"]
    text = original.__func__

    class _Deferred:
        def __init__(self, *args):
            self.args = args

        def __str__(self):
            return text(*self.args)

    exc.OperatorIssue.operator_str = staticmethod(lambda target, args, kwargs: _Deferred(target, args, kwargs))
    try:
        yield
    finally:
        exc.OperatorIssue.operator_str = original


def _inductor_knows(key) -> bool:
    from torch._inductor import config

    try:
        config.__getattr__(key)  # dotted names resolve through the config module's own lookup
    except (AttributeError, TypeError):
        return False
    return True


def known_inductor_configs(wanted: dict) -> dict:
    """The entries of ``wanted`` whose keys this torch's inductor config knows (an unknown key is an error)."""
    return {key: value for key, value in wanted.items() if _inductor_knows(key)}


def check_inductor_keys(patches: dict) -> None:
    """Refuse, by name, the keys of ``options['inductor']`` that this torch's inductor config lacks: inductor
    would raise a bare AttributeError from inside the compile."""
    unknown = [k for k in patches if not _inductor_knows(k)]
    if not unknown:
        _check_inductor_types(patches)
        return
    import difflib

    from torch._inductor import config

    keys = list(config.get_config_copy())
    named = []
    for k in unknown:
        near = difflib.get_close_matches(str(k), keys, n=1)
        named.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    raise ValueError(f"unknown inductor option(s) in options['inductor']: {', '.join(named)}; torch "
                     f"{torch.__version__}'s torch._inductor.config has no such key: fix the name or drop it")


def _check_inductor_types(patches: dict) -> None:
    """Refuse a value whose type is not its key's (a bool, int, float or str setting, one of them or None, or one
    of a Literal's values), as inductor's own config does for backend="inductor": without it
    {"max_autotune": "false"} would read as on."""
    from torch._inductor import config

    get_type = getattr(config, "get_type", None)  # the declared type, where this torch has one
    defaults = config.get_config_copy()
    for key, value in patches.items():
        declared = None
        if get_type is not None:
            try:
                declared = get_type(key)
            except Exception:  # noqa: BLE001 - an odd key: inductor's own check has the last word
                pass
        kinds, values = _allowed(declared, defaults.get(key))
        if value is None or (kinds is None and values is None) or any(_is(value, k) for k in kinds or ()) \
                or any(type(value) is type(v) and value == v for v in values or ()) \
                or (values is not None and isinstance(value, bool)):  # False: a Literal setting switched off
            continue
        want = " or ".join([k.__name__ for k in kinds or ()] + [repr(v) for v in values or ()])
        raise ValueError(f"options['inductor'][{key!r}] must be {'of type ' if kinds else 'one of '}{want} (as "
                         f"torch._inductor.config.{key} is), got {value!r}")


_SCALARS = (bool, int, float, str)


def _allowed(declared, default) -> tuple[tuple | None, tuple | None]:
    """(types, Literal values) a setting may take; (None, None) where its declared type says nothing checkable."""
    import types
    import typing

    if declared in _SCALARS:
        return (declared,), None
    origin = typing.get_origin(declared)
    if origin is typing.Literal:
        return None, typing.get_args(declared)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(declared) if a is not type(None)]
        literals = [a for a in args if typing.get_origin(a) is typing.Literal]
        plain = tuple(a for a in args if a in _SCALARS)
        if len(literals) + len(plain) == len(args):
            return plain, tuple(v for lit in literals for v in typing.get_args(lit)) or None
        return None, None
    if declared is None and isinstance(default, _SCALARS):  # a torch without declared types
        return (type(default),), None
    return None, None


def _is(value, kind) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def backend_compile(fn: Callable, device: str, passes: dict | None = None, inductor: dict | None = None,
                    **options: Any):
    """fn compiled whole by this backend, shapes static unless marked dynamic, left uncaptured (the caller
    captures it): INDUCTOR_CONFIGS plus ``inductor``, the ``passes`` switches and any other backend ``options``."""
    from .kernels import INDUCTOR_CONFIGS

    return torch.compile(fn, backend=spec_graph_backend, fullgraph=True, dynamic=False,
                         options={"capture": False, "device": device, "passes": dict(passes or {}),
                                  "inductor": known_inductor_configs({**INDUCTOR_CONFIGS, **(inductor or {})}),
                                  **options})


def _input_device(example_inputs) -> str | None:
    """The device the graph's tensors live on (None: the platform found)."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device.type
    return None


def register() -> None:
    """Register the backend by name; idempotent. Not run on import: torch's entry-point loader
    registers the function itself after importing this module, and a second registration is an error."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(spec_graph_backend, name=BACKEND_NAME)
