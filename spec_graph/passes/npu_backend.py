"""The Ascend compile path of the ``spec_graph`` backend: torch_npu's graph backends
with spec-graph's passes plugged into their custom FX pass hook.

Three generations of the same backend are tried, newest first (``backend_kind()``):

1. the standalone ``npugraph_ex`` package: ``npugraph_ex.CompilerConfig()`` +
   ``npugraph_ex.get_npu_backend(compiler_config=config)``;
2. ``torch.compile(backend="npugraph_ex", options=...)``, registered by torch_npu /
   torchair (options are mapped onto a torchair CompilerConfig);
3. ``torchair.get_npu_backend(compiler_config=CompilerConfig())`` with
   ``config.mode = "reduce-overhead"`` (ACL graph, no Ascend IR conversion).

All three call ``config.post_grad_custom_pre_pass(gm, example_inputs, config)`` on the
AOT (functionalized aten) graph before their built-in FX passes (re-inplacing among
them), which is where spec-graph's fusion passes must run: they insert
``auto_functionalized`` ops that those passes then turn into in-place calls.

torchair traces with its own, small decomposition table (not inductor's), so the
passes are retargeted to it (``PassManager.use_decompositions``) to trace their
patterns the same way.

No device API here (``torch.npu`` lives in spec_graph/platform.py only).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

HOOK = "post_grad_custom_pre_pass"
MODE = "reduce-overhead"


def _import(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception:  # ImportError, or a package that fails to initialise without its device
        return None


def _default_decompositions(pkg) -> dict | None:
    """The decomposition table `pkg`'s get_npu_backend hands AOT (None if it cannot be known)."""
    utils = _import(f"{pkg.__name__}._utils")
    fn = getattr(utils, "get_npu_default_decompositions", None) if utils is not None else None
    if fn is None:
        return None
    try:
        return dict(fn())
    except Exception as e:  # pragma: no cover - depends on the installed torchair
        log.debug("%s._utils.get_npu_default_decompositions failed: %s", pkg.__name__, e)
        return None


def _process_options(config, options: dict, pkg_name: str) -> None:
    """Apply torch.compile-style options ({"post_grad_custom_pre_pass": fn, ...}) to a config:
    through the package's own option mapper where it has one, else as attributes."""
    for mod in (f"{pkg_name}.configs.compiler_config", f"{pkg_name}.configs.npugraphex_config"):
        fn = getattr(_import(mod), "_process_kwargs_options", None)
        if fn is not None:
            fn(config, {"options": dict(options)})
            return
    for key, value in options.items():
        setattr(config, key, value)


def _registered_npugraph_ex():
    """The "npugraph_ex" torch.compile backend that torch_npu registers, if it is there."""
    if _import("torch_npu") is None:
        return None
    try:
        from torch._dynamo import list_backends, lookup_backend

        if "npugraph_ex" in list_backends(exclude_tags=()):
            return lookup_backend("npugraph_ex")
    except Exception as e:  # pragma: no cover - depends on torch_npu
        log.debug("no registered npugraph_ex backend: %s", e)
    return None


def _as_tuple_graph(gm, example_inputs, compile_fn):
    """torch_npu's backends require a graph that returns a tuple (Dynamo's do)."""
    from torch._inductor.compile_fx import graph_returns_tuple, make_graph_return_tuple

    if graph_returns_tuple(gm):
        return compile_fn(gm, example_inputs)
    return make_graph_return_tuple(gm, example_inputs, compile_fn)


def backend_kind() -> str | None:
    """Which Ascend backend `compile_npu` would use here."""
    if getattr(_import("npugraph_ex"), "get_npu_backend", None) is not None:
        return "npugraph_ex"
    if _registered_npugraph_ex() is not None:
        return "torch_npu:npugraph_ex"
    if getattr(_import("torchair"), "get_npu_backend", None) is not None:
        return "torchair"
    return None


def compile_npu(gm, example_inputs, passes, options: dict | None = None) -> Callable[..., Any]:
    """Compile a Dynamo graph for Ascend (ACL graph mode) with `passes` (a PassManager)
    as the custom FX pass. options: further npugraph_ex options (torch.compile style)."""
    kind = backend_kind()
    if kind is None:
        raise RuntimeError(
            "the Ascend path of the spec_graph backend needs torch_npu with torchair, or npugraph_ex; "
            "install torch_npu, or compile with options={'device': 'cpu'}")
    opts = dict(options or {})
    pkg = _import("npugraph_ex" if kind == "npugraph_ex" else "torchair")
    decomps = _default_decompositions(pkg) if pkg is not None else None
    passes.use_decompositions(decomps if decomps is not None else {})
    hook = passes.as_torchair_pass()
    log.debug("spec_graph: Ascend backend %s, passes %s", kind, passes)

    if kind == "npugraph_ex":  # 1. the standalone package
        config = pkg.CompilerConfig()
        _process_options(config, {HOOK: hook, **opts}, "npugraph_ex")
        return _as_tuple_graph(gm, example_inputs, pkg.get_npu_backend(compiler_config=config))
    if kind == "torch_npu:npugraph_ex":  # 2. torch.compile(backend="npugraph_ex", options=...)
        backend = _registered_npugraph_ex()
        return _as_tuple_graph(gm, example_inputs,
                               lambda g, ex: backend(g, ex, options={HOOK: hook, **opts}))
    # 3. torchair's reduce-overhead (ACL graph) backend
    config = pkg.CompilerConfig()
    config.mode = MODE
    setattr(config, HOOK, hook)
    for key, value in opts.items():
        setattr(config, key, value)
    return _as_tuple_graph(gm, example_inputs, pkg.get_npu_backend(compiler_config=config))


__all__ = ["backend_kind", "compile_npu"]
