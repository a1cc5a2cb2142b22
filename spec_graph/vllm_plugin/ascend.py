"""spec-graph's drafter on vllm-ascend (patch 3 in ``spec_graph.vllm_plugin``).

Written against vllm-ascend's main branch (the layout has held since
v0.19.1rc1); **not run on Ascend hardware**, only tested with stand-in modules:

- ``vllm_ascend.spec_decode.get_spec_decode_method(method, vllm_config, device,
  runner)`` is the factory the NPU runner (``vllm_ascend.worker.model_runner_v1``,
  which imports it by name) builds its drafter with; for ``"draft_model"`` it
  returns ``AscendDraftModelProposer(vllm_config, device, runner)``.
- ``vllm_ascend.spec_decode.draft_proposer.AscendDraftModelProposer`` subclasses
  vLLM's ``DraftModelProposer`` and vllm-ascend's ``AscendSpecDecodeBaseProposer``;
  the runner's ``isinstance(self.drafter, ... | AscendDraftModelProposer)`` checks
  decide which metadata and calls the drafter gets.
- The runner calls its drafter with vllm-ascend's own signatures:
  ``prepare_next_token_ids_padded(sampled, requests, input_batch,
  discard_request_indices, num_discarded_requests)``,
  ``prepare_inputs_padded(...) -> (metadata, token_indices,
  token_indices_to_sample, num_rejected_tokens_gpu)`` (it then reads
  ``input_ids[token_indices]``), ``_propose(**keywords)`` instead of ``propose``,
  and ``initialize_attn_backend(kv_cache_config, block_size)``; it picks the
  metadata of the KV-cache group that holds ``drafter.attn_layer_names[0]``.

The drafter is one class built from three: ``AscendRunnerAdapter`` (below:
vllm-ascend's call signatures mapped onto spec-graph's), spec-graph's
``SpecGraphProposer`` (all draft logic: own model, static KV cache, counting
kernel, captured draft chain) and vllm-ascend's ``AscendDraftModelProposer``
(its ``__init__`` and, for a draft architecture spec-graph does not cover, its
whole drafter). Its platform is spec-graph's ``"npu"`` one, so the draft chain
is captured with torch_npu's ``NPUGraph``.

Not covered: vllm-ascend's V2 runner (``vllm_ascend/worker/v2``), which drafts
through its own speculator classes, and context parallelism (DCP/PCP), whose
extra ``_propose`` arguments spec-graph's draft ignores.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import sys

import torch

from .. import platform as _platform
from .config import parse

log = logging.getLogger("spec_graph")

FACTORY = "get_spec_decode_method"


def installed() -> bool:
    """Whether vllm-ascend can be imported here (looked up, not imported)."""
    if "vllm_ascend" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("vllm_ascend") is not None
    except (ImportError, ValueError):
        return False


def patch_spec_decode(module) -> None:
    """Patch 3: wrap ``module.get_spec_decode_method`` and rebind it where vllm-ascend imported it by name."""
    original = getattr(module, FACTORY, None)
    if original is None:
        log.warning("spec-graph: %s has no %s(); enable_spec_graph has no effect with this vllm-ascend",
                    module.__name__, FACTORY)
        return
    if getattr(original, "_spec_graph", False):
        return
    wrapper = _wrap(original)
    setattr(module, FACTORY, wrapper)
    # Modules that ran ``from vllm_ascend.spec_decode import get_spec_decode_method`` before this
    # patch hold the original; later importers get the wrapper from the package.
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm_ascend.") and getattr(mod, "__dict__", {}).get(FACTORY) is original:
            setattr(mod, FACTORY, wrapper)


def _wrap(original):
    @functools.wraps(original)
    def get_spec_decode_method(method, vllm_config, *args, **kwargs):
        if method == "draft_model" and parse(getattr(vllm_config, "additional_config", None)).enabled:
            from vllm_ascend.spec_decode.draft_proposer import AscendDraftModelProposer

            return proposer_class(AscendDraftModelProposer)(vllm_config, *args, **kwargs)
        return original(method, vllm_config, *args, **kwargs)

    get_spec_decode_method._spec_graph = True
    return get_spec_decode_method


@functools.lru_cache(maxsize=None)
def proposer_class(ascend_cls: type) -> type:
    """spec-graph's proposer as a subclass of ``ascend_cls`` (vllm-ascend's AscendDraftModelProposer)."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    from .proposer import SpecGraphProposer

    if not issubclass(ascend_cls, DraftModelProposer):
        # Before v0.19.1rc1 it derived from the base proposer only, with another __init__ signature.
        raise RuntimeError(f"spec-graph needs a vllm-ascend whose {ascend_cls.__name__} subclasses vLLM's "
                           "DraftModelProposer (v0.19.1rc1 or later)")
    return type("AscendSpecGraphProposer", (AscendRunnerAdapter, SpecGraphProposer, ascend_cls),
                {"__module__": __name__, "_ascend_cls": ascend_cls,
                 "__doc__": "spec-graph's proposer, driven by vllm-ascend's NPU runner."})


class AscendRunnerAdapter:
    """vllm-ascend's runner-facing calls, served by spec-graph's proposer (next in the MRO); with
    ``fallback`` set (a draft architecture spec-graph does not cover) they go to vllm-ascend's own drafter."""

    _ascend_cls: type  # vllm-ascend's AscendDraftModelProposer, set by proposer_class()
    # vllm-ascend's runner only drives NPUs: the draft chain is captured through spec-graph's NPU seam.
    draft_platform = _platform.Platform("npu")

    def _ascend(self):
        """vllm-ascend's own implementation of a method: lookup from its class on, in this object's MRO."""
        mro = type(self).__mro__
        return super(mro[mro.index(self._ascend_cls) - 1], self)

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        if not self.fallback:
            self.core.platform = self.draft_platform

    def initialize_attn_backend(self, kv_cache_config, *args, **kwargs):
        if self.fallback:
            return self._ascend().initialize_attn_backend(kv_cache_config, *args, **kwargs)
        # The runner hands its drafter the metadata of the KV-cache group holding attn_layer_names[0].
        # spec-graph's draft has no vLLM attention layers and reads only the batch layout, which every
        # group shares: point it at the target's first group.
        self.attn_layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names[:1])
        return None

    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch,
                                      discard_request_indices, num_discarded_requests):
        """vllm-ascend passes the discarded rows as indices plus a count; spec-graph's kernel takes a mask."""
        if self.fallback:
            return self._ascend().prepare_next_token_ids_padded(
                sampled_token_ids, requests, gpu_input_batch, discard_request_indices, num_discarded_requests)
        mask = torch.zeros(sampled_token_ids.shape[0], dtype=torch.bool, device=sampled_token_ids.device)
        mask.index_fill_(0, discard_request_indices[:num_discarded_requests].to(mask.device), True)
        return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch, mask)

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count):
        """(metadata, token_indices, None, None): the runner slices the target's tokens with
        ``token_indices`` (all scheduled tokens); the rejected counts are computed in the draft chain."""
        if self.fallback:
            return self._ascend().prepare_inputs_padded(common_attn_metadata, spec_decode_metadata,
                                                        valid_sampled_tokens_count)
        meta, _, _ = super().prepare_inputs_padded(common_attn_metadata, spec_decode_metadata,
                                                   valid_sampled_tokens_count)
        return meta, self.arange[:meta.num_actual_tokens], None, None

    def _propose(self, **kwargs):
        """vllm-ascend's runner calls ``_propose`` with keywords only (some of them its own)."""
        if self.fallback:
            return self._ascend()._propose(**kwargs)
        k = kwargs.get("num_speculative_tokens")  # per step with vllm-ascend's dynamic K; older runners omit it
        k = self.num_speculative_tokens if k is None else int(k)
        drafts = self.propose(max(k, 1), kwargs["target_token_ids"], kwargs["target_positions"],
                              kwargs.get("target_hidden_states"), kwargs["next_token_ids"],
                              kwargs.get("token_indices_to_sample"), kwargs["common_attn_metadata"],
                              kwargs.get("sampling_metadata"), mm_embed_inputs=kwargs.get("mm_embed_inputs"),
                              num_rejected_tokens_gpu=kwargs.get("num_rejected_tokens_gpu"))
        # K == 0 still feeds the step's tokens to the draft cache, so the next step needs no re-prefill.
        return drafts[:, :k]
