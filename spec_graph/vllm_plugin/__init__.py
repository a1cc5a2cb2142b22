"""vLLM general plugin: spec-graph's drafter for ``speculative_config.method == "draft_model"``.

Entry point ``vllm.general_plugins: spec_graph = spec_graph.vllm_plugin:register``.
vLLM calls ``register()`` once in every process it starts (engine core,
workers), so it only installs small patches, is idempotent, and imports
nothing vLLM has not imported by then (``vllm.config``; vllm-ascend is looked up,
not imported): with ``additional_config["enable_spec_graph"]`` unset or false,
vLLM and vllm-ascend behave exactly as without spec-graph.

The patches of vLLM and vllm-ascend (each also documented where it is applied below):

1. ``vllm.v1.worker.gpu_model_runner.DraftModelProposer`` (a module-level name)
   is replaced by ``DraftModelProposerSwitch``.
   Why: the runner builds its drafter as ``DraftModelProposer(vllm_config=...,
   device=..., runner=self)`` from that module-level name and offers no hook to
   choose another class for ``draft_model``.
   How: the switch's metaclass makes calling it build spec-graph's proposer when
   the flag is on and vLLM's own ``DraftModelProposer`` otherwise (so with the
   flag off ``type(runner.drafter) is DraftModelProposer``); ``isinstance`` /
   ``issubclass`` against the switch answer as for ``DraftModelProposer``, so the
   runner's many ``isinstance(self.drafter, ... | DraftModelProposer)`` checks
   hold for both. If the runner module is already imported, the name is swapped
   at once; otherwise a one-shot import hook swaps it right after the module
   runs.
   When it can go: when vLLM lets a plugin choose the drafter class for a
   method (e.g. a proposer registry, or ``method="custom_class"`` accepting a
   draft model plus padded-batch drafting).

2. ``VllmConfig.__post_init__`` is wrapped to check spec-graph's settings.
   Why: the flag lives in ``additional_config``, a free dict vLLM does not
   validate, and a bad combination (another method, a different draft vocab, a
   draft TP different from the target's) should fail when the config is built,
   not in a worker. How: the original runs first; then ``additional_config``
   is parsed (a non-bool flag is refused; with the flag on, unknown or bad
   ``spec_graph`` settings are refused, with it off the section is ignored
   with one warning) and, only when the flag is set,
   ``config.check_vllm_config`` runs (method, vocab, no pipeline or data
   parallelism). A draft TP unlike the target's is accepted for a draft
   spec-graph covers (its draft is replicated whole on each rank); vLLM's own
   draft-TP check runs for a draft that falls back to vLLM's drafter.
   When it can go: when vLLM validates ``additional_config`` through a plugin
   hook.

3. ``vllm_ascend.spec_decode.get_spec_decode_method`` is wrapped, only where
   vllm-ascend is installed (details and the vllm-ascend APIs in ``ascend.py``).
   Why: vllm-ascend's NPU runner builds its drafter through this factory
   (``AscendDraftModelProposer(vllm_config, device, runner)`` for
   ``draft_model``) and offers no hook to choose another class.
   How: with the flag on and method ``draft_model`` the wrapper builds
   ``ascend.AscendSpecGraphProposer``, a subclass of both spec-graph's proposer
   and ``AscendDraftModelProposer`` (so the runner's ``isinstance`` checks hold)
   that captures through spec-graph's NPU platform; otherwise it calls the
   original, so with the flag off the drafter is exactly vllm-ascend's own
   class. The runner imports the factory by name, so the wrapper is also
   rebound in every loaded ``vllm_ascend.*`` module that holds the original.
   Applied at once when ``vllm_ascend.spec_decode`` is loaded, else by a
   one-shot import hook right after it first runs.
   When it can go: when vllm-ascend lets a plugin choose the drafter class for a
   method (e.g. a proposer registry behind ``get_spec_decode_method``).

4. ``VllmConfig.use_v2_model_runner`` (a property) is wrapped.
   Why: vLLM 0.32 picks its V2 model runner whenever Triton is importable (a
   CUDA install, by default). V2 builds its draft-model speculator
   (``StandaloneARSpeculator``) in ``vllm/v1/worker/gpu/spec_decode`` with no
   hook for another drafter class, so patch 1 never runs there and the flag
   would change nothing, silently.
   How: with the flag on, the property answers False (the V1 runner, whose
   drafter patch 1 swaps) and logs once why and how to go back; when something
   forces V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, HiSparse, watermarking) the
   config check refuses the flag instead, naming the cause. With the flag off
   the property is vLLM's own.
   When it can go: when V2 lets a plugin choose the drafter class for
   ``draft_model`` (then spec-graph's drafter is built there), or when V1 is
   removed (then this patch must become that V2 drafter).

5. The runner's ``_input_fits_in_drafter`` is wrapped on each runner whose
   drafter is spec-graph's (an attribute of that instance; the class is left
   alone), in ``SpecGraphProposer.load_model``.
   Why: the runner skips its drafter for a whole step when the batch's longest
   sequence reaches past the draft's window, and tells the drafter nothing, so
   the rows of that step would keep a gap in the draft cache where their
   committed tokens were never fed (their drafts then mostly rejected for the
   rest of the request).
   How: the wrapper returns the original's answer and, when it is False, tells
   the drafter (``DraftCore.drafts_skipped``), which prefills those rows' prefixes
   again at their next step.
   When it can go: when vLLM calls the drafter (or a hook of it) on the steps
   it skips.

Besides these, ``proposer.SpecGraphProposer`` only overrides methods of its
parent class (no patching): it lifts ``_raise_if_padded_drafter_batch_disabled``
(vLLM 0.32 refuses ``disable_padded_drafter_batch`` for draft models; spec-graph
builds its own padded inputs from either form) and keeps the ``runner``
argument, which vLLM 0.32's base class accepts but does not store.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

log = logging.getLogger("spec_graph")

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
ASCEND_MODULE = "vllm_ascend.spec_decode"
_state = {"registered": False, "config_patched": False}


def register() -> None:
    """Install the patches (idempotent, cheap; called by vLLM in every process)."""
    if _state["registered"]:
        return
    _state["registered"] = True
    use_vllm_log_handlers()
    _patch_config()
    _patch_when_imported(_RunnerImportHook)
    from . import ascend

    if ascend.installed():
        _patch_when_imported(_AscendImportHook)


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers vLLM's logger has at that moment (vLLM's logger does not propagate).
    Read at emit time, not copied once: vLLM or a harness may swap those handlers later, and one attached
    for a while (pytest's capture handlers go on every non-propagating logger) must not stay attached here.
    A handler the record also reaches by propagation (on root too) is skipped, so no line is printed twice."""

    def emit(self, record: logging.LogRecord) -> None:
        reached, logger = set(), log.parent if log.propagate else None
        while logger is not None:
            reached.update(logger.handlers)
            logger = logger.parent if logger.propagate else None
        for handler in logging.getLogger("vllm").handlers:
            if handler not in reached and record.levelno >= handler.level:
                handler.handle(record)


def use_vllm_log_handlers() -> None:
    """Print spec-graph's log lines where vLLM prints its own (vLLM configures only its "vllm" logger), so that
    a server's start-up says which drafter serves it. Called again before those lines: vLLM may configure its
    logger (and so the level to take) after the plugin registered. A logger the user configured is left alone."""
    vllm_log = logging.getLogger("vllm")
    if not log.handlers:
        log.addHandler(_ToVllmHandlers())
    elif not all(isinstance(h, _ToVllmHandlers) for h in log.handlers):
        return
    if log.level == logging.NOTSET and vllm_log.handlers:
        log.setLevel(vllm_log.getEffectiveLevel())


def _patch_runner(module) -> None:
    # Patch 1 (see the module docstring): swap the module-level name the runner builds its drafter from.
    if getattr(module, "_spec_graph_patched", False):
        return
    from .switch import make_switch

    module.DraftModelProposer = make_switch(module.DraftModelProposer)
    module._spec_graph_patched = True


def _patch_ascend(module) -> None:
    # Patch 3 (see the module docstring): wrap vllm-ascend's drafter factory.
    from .ascend import patch_spec_decode

    patch_spec_decode(module)


def _patch_when_imported(hook_cls) -> None:
    """Patch the hook's module now if it is loaded, else right after its first import."""
    if hook_cls.module_name in sys.modules:
        hook_cls.patch(sys.modules[hook_cls.module_name])
    else:
        sys.meta_path.insert(0, hook_cls())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after module ``module_name`` is first executed, then removes itself."""

    module_name: str  # set by each subclass, with
    patch: staticmethod  # the function that patches that module

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module_name:
            return None
        sys.meta_path.remove(self)  # find the real spec without this hook in the way
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        real_exec = loader.exec_module
        patch = self.patch

        def exec_module(module):
            real_exec(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


class _RunnerImportHook(_PatchOnImport):
    """Patch 1, for vLLM's GPU model runner module."""

    module_name = RUNNER_MODULE
    patch = staticmethod(_patch_runner)


class _AscendImportHook(_PatchOnImport):
    """Patch 3, for vllm-ascend's spec_decode package."""

    module_name = ASCEND_MODULE
    patch = staticmethod(_patch_ascend)


def _patch_config() -> None:
    # Patch 2 (see the module docstring): config-time checks of spec-graph's settings.
    if _state["config_patched"]:
        return
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_spec_graph", False):
        _state["config_patched"] = True
        return

    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        check_config(self)

    __post_init__._spec_graph = True
    __post_init__.__wrapped__ = original
    VllmConfig.__post_init__ = __post_init__
    _patch_runner_choice(VllmConfig)
    _state["config_patched"] = True


def _patch_runner_choice(config_cls) -> None:
    # Patch 4 (see the module docstring): with the flag on, vLLM's V1 model runner.
    original = config_cls.__dict__.get("use_v2_model_runner")
    if not isinstance(original, property) or getattr(original.fget, "_spec_graph", False):
        return

    def use_v2_model_runner(self) -> bool:
        if not _flag_on(self):
            return original.fget(self)
        why = _forced_v2(self)
        if why:
            raise ValueError(f"additional_config['enable_spec_graph'] needs vLLM's V1 model runner, but {why} "
                             "forces the V2 runner; remove it, or turn the flag off")
        if not _state.get("v1_logged") and original.fget(self):  # said only where the flag changes the runner
            _state["v1_logged"] = True
            log.info("spec-graph: enable_spec_graph runs this engine on vLLM's V1 model runner, where "
                     "spec-graph's drafter replaces DraftModelProposer (the V2 runner's draft-model speculator "
                     "has no hook for it); turn the flag off for the V2 runner")
        return False

    use_v2_model_runner._spec_graph = True
    use_v2_model_runner.__wrapped__ = original.fget
    config_cls.use_v2_model_runner = property(use_v2_model_runner, doc=original.__doc__)


def covered_draft(spec, cache_dir=None):
    """(covered, args): whether spec-graph's own models cover the draft (else: vLLM's drafter serves it), by its
    architecture and, where its checkpoint is at hand (a directory, or a hub id's snapshot), all of it (a rope
    type or activation spec-graph lacks, or weights in another format than safetensors, fall back too); and its
    ModelArgs as the drafter reads them, None where there is no checkpoint to read or a malformed config.json
    (the drafter's load names either). A hub id whose snapshot cannot be read is refused (ValueError)."""
    from ..models import SUPPORTED_ARCHITECTURES, UnsupportedModelError, read_config
    from .checkpoint import check_readable, draft_dir

    cfg = getattr(spec, "draft_model_config", None)
    archs = getattr(cfg, "architectures", None) or getattr(getattr(cfg, "hf_config", None), "architectures", None)
    if not (archs and archs[0] in SUPPORTED_ARCHITECTURES):
        return False, None
    if not getattr(cfg, "model", None):
        return True, None
    path = draft_dir(cfg, cache_dir)
    try:
        check_readable(path)
        return True, read_config(path)[1]
    except UnsupportedModelError:
        return False, None
    except ValueError:  # CheckpointError too
        return True, None


def _flag_on(vllm_config) -> bool:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return isinstance(extra, dict) and extra.get("enable_spec_graph") is True


def _forced_v2(vllm_config) -> str | None:
    """What forces vLLM's V2 model runner on this config (None: nothing)."""
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER is True:
        return "VLLM_USE_V2_MODEL_RUNNER=1"
    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
        return "attention_config.hisparse_config (HiSparse)"
    if getattr(vllm_config, "watermark_config", None) is not None:
        return "watermark_config (watermarking)"
    return None


def check_config(vllm_config):
    """The config-time checks; returns the parsed settings (flag off: only the flag's type is checked)."""
    from types import SimpleNamespace

    from .config import FLAG, check_covered_draft, check_vllm_config

    settings = check_vllm_config(vllm_config)
    if settings.enabled:
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        # spec-graph's draft is replicated whole on every rank (its own model, no collective in the chain), so a
        # draft TP unlike the target's is fine for it; a draft it does not cover falls back to vLLM's own
        # drafter, which needs equal TP: vLLM's own check and message then (it would only fire in the worker).
        spec = vllm_config.speculative_config
        covered, args = covered_draft(spec, getattr(getattr(vllm_config, "load_config", None), "download_dir", None))
        if not covered:
            DraftModelProposer._raise_if_draft_tp_mismatch(SimpleNamespace(speculative_config=spec))
            if getattr(spec, "disable_padded_drafter_batch", False):
                raise ValueError(f"additional_config[{FLAG!r}]: spec-graph does not cover the draft "
                                 f"{getattr(spec.draft_model_config, 'model', None)!r}, so vLLM's own drafter "
                                 f"serves it, and that drafter needs padded batches: unset "
                                 f"disable_padded_drafter_batch in the speculative_config")
        else:  # refused here, not in a worker at load time
            check_covered_draft(vllm_config, args)
        if hasattr(type(vllm_config), "use_v2_model_runner"):
            vllm_config.use_v2_model_runner  # noqa: B018 - refuses a config that forces the V2 runner, now
    return settings


__all__ = ["register", "check_config"]
