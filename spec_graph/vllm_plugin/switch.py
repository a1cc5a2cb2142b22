"""The stand-in for vLLM's ``DraftModelProposer`` name in the runner module (patch 1 in ``__init__``)."""
from __future__ import annotations

import logging

log = logging.getLogger("spec_graph")


def make_switch(vllm_cls):
    """A class object that builds spec-graph's proposer (flag on) or ``vllm_cls`` (flag off) when called,

    and that ``isinstance`` / ``issubclass`` treat exactly like ``vllm_cls``.
    """

    class _SwitchMeta(type(vllm_cls)):
        def __call__(cls, vllm_config, *args, **kwargs):
            from .config import parse

            if parse(getattr(vllm_config, "additional_config", None)).enabled:
                from .proposer import SpecGraphProposer

                return SpecGraphProposer(vllm_config, *args, **kwargs)
            return vllm_cls(vllm_config, *args, **kwargs)

        def __instancecheck__(cls, obj):
            return isinstance(obj, vllm_cls)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, vllm_cls)

    class DraftModelProposerSwitch(metaclass=_SwitchMeta):
        """Calls build spec-graph's proposer or vLLM's DraftModelProposer (see spec_graph.vllm_plugin)."""

        wrapped = vllm_cls

    return DraftModelProposerSwitch
