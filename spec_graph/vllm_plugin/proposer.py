"""spec-graph's drafter for vLLM: a ``DraftModelProposer`` subclass drafting with spec-graph's own model.

The draft is ``spec_graph.models.load_model`` on the draft checkpoint directory
vLLM was given, with its own static KV cache ``[layers, max_num_seqs + 1,
kv_heads, max_model_len + K + 2, head_dim]`` (the last slot is scratch for
padding rows). vLLM's attention backends, block tables and slot mappings are
not used by the draft. vLLM request rows map to cache slots by request id, so
rows that vLLM reorders or removes between steps never mix caches.

Per step and row ``i`` the draft is fed the row's committed scheduled tokens
(``q_i - num_rejected_i`` of them, at their own positions), then the row's
next token; its logits give draft 1, and K-1 single-token forwards give the
rest. A request seen for the first time, resumed after preemption, or missed
by the previous step (a prefix-cache hit, a recomputation) first gets its
whole prefix ``[0, first scheduled position)`` prefilled from the request's own
token ids, so the cache has no holes. Drafts are greedy (the draft's argmax):
vLLM's rejection sampler then treats them as one-hot proposals, which keeps
sampling lossless.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from vllm.v1.spec_decode.draft_model import DraftModelProposer

from .. import platform as _platform
from ..capture import GraphSet
from ..models import load_model, read_config
from .config import parse
from .kernels import count_valid

log = logging.getLogger("spec_graph")

_warned_fallback = False


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` (host memory for cpu)."""
    if device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    free, _ = getattr(torch, device.type).mem_get_info(device)
    return int(free)


class SpecGraphProposer(DraftModelProposer):
    """vLLM's ``DraftModelProposer`` contract, served by spec-graph's model and static KV cache."""

    def __init__(self, vllm_config, device, runner=None):
        # vLLM's checks (draft TP == target TP, equal vocab sizes) run in the parent with vLLM's messages.
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.runner = runner  # vLLM 0.32's base takes the runner but keeps no reference to it
        self.settings = parse(vllm_config.additional_config)
        self.fallback = False
        self.sg_model = None
        self.k_cache = self.v_cache = None
        self.max_slots = vllm_config.scheduler_config.max_num_seqs
        self.slot_of: dict[str, int] = {}
        self.free_slots: list[int] = list(range(self.max_slots))
        self.slot_last_pos0: dict[int, int] = {}
        self.slot_last_step: dict[int, int] = {}
        self.step = 0
        self._last_draft_probs = None
        self._pending_counts = None  # (valid count, drafts per row) from prepare_inputs_padded, for propose
        self.platform = _platform.get(torch.device(device))
        self.graphs = None  # GraphSet of the draft chain per padded batch (CUDA/NPU), built on first use
        self.static: dict = {}

    def _raise_if_padded_drafter_batch_disabled(self):
        # vLLM refuses disable_padded_drafter_batch for draft models because its drafter needs padded
        # inputs; spec-graph builds its own padded inputs from either form, so both settings work.
        # (The fallback to vLLM's drafter happens later, at load_model, and re-checks it there.)
        return None

    # ------------------------------------------------------------------ loading
    def load_model(self, target_model) -> None:
        global _warned_fallback
        path = self.draft_model_config.model
        try:
            _, args = read_config(path)
        except ValueError as e:
            if "unsupported architecture" not in str(e):
                raise
            if not _warned_fallback:
                log.warning("spec-graph: %s; drafting with vLLM's own DraftModelProposer instead", e)
                _warned_fallback = True
            self.fallback = True
            super()._raise_if_padded_drafter_batch_disabled()
            return super().load_model(target_model)
        K = self.num_speculative_tokens
        cache_len = self.max_model_len + K + 2
        slots = self.max_slots + 1
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        need = 2 * args.num_layers * slots * args.num_kv_heads * cache_len * args.head_dim * itemsize
        have = available_memory(torch.device(self.device))
        if need > have:
            raise ValueError(
                f"spec-graph: the draft KV cache needs {need / 2**20:.1f} MiB (max_num_seqs={self.max_slots}, "
                f"max_model_len={self.max_model_len}, K={K}) but only {have / 2**20:.1f} MiB are free on "
                f"{self.device}; lower max_num_seqs or max_model_len")
        self.sg_model = load_model(path, dtype=self.dtype, device=self.device)
        self.k_cache, self.v_cache = self.sg_model.new_kv_cache(slots, cache_len)
        self.cache_len = cache_len

    # The runner wires vLLM's attention machinery into its drafter; spec-graph's draft has none.
    def dummy_run(self, *args, **kwargs):
        if self.fallback:
            return super().dummy_run(*args, **kwargs)
        return None

    def initialize_attn_backend(self, *args, **kwargs):
        if self.fallback:
            return super().initialize_attn_backend(*args, **kwargs)
        return None

    def initialize_cudagraph_keys(self, *args, **kwargs):
        if self.fallback:
            return super().initialize_cudagraph_keys(*args, **kwargs)
        return None

    def validate_same_kv_cache_group(self, *args, **kwargs):
        if self.fallback:
            return super().validate_same_kv_cache_group(*args, **kwargs)
        return None

    def take_last_draft_probs(self):
        if self.fallback:
            return super().take_last_draft_probs()
        return None

    # ------------------------------------------------------- next tokens, counts
    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
        """(next_token_ids, valid_sampled_tokens_count), int32 [num_reqs]; one kernel launch, final on return."""
        if self.fallback:
            return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                         discard_request_mask)
        R = sampled_token_ids.shape[0]
        # Backup tokens (the request's last known token) in one vectorised gather, then one copy.
        rows = np.arange(R)
        last = gpu_input_batch.num_tokens_no_spec[:R].astype(np.int64) - 1
        backup = torch.from_numpy(gpu_input_batch.token_ids_cpu[rows, np.maximum(last, 0)].astype(np.int32))
        backup = backup.to(sampled_token_ids.device, non_blocking=True)
        return count_valid(sampled_token_ids, discard_request_mask[:R], backup, gpu_input_batch.vocab_size)

    # ------------------------------------------------------------------ propose
    def _slots_for(self, req_ids, pos0_cpu, input_batch) -> list[int]:
        """Cache slot per row; prefill the whole prefix of requests that are new, resumed or were missed."""
        live = self.runner.requests if self.runner is not None else None
        if live is not None:
            for rid in [r for r in self.slot_of if r not in live]:
                self.free_slots.append(self.slot_of.pop(rid))
        slots = []
        for i, rid in enumerate(req_ids):
            p0 = int(pos0_cpu[i])
            slot = self.slot_of.get(rid)
            fresh = slot is None
            if fresh:
                if not self.free_slots:
                    self._evict(set(req_ids))
                slot = self.free_slots.pop(0)
                self.slot_of[rid] = slot
            restart = (fresh or p0 <= self.slot_last_pos0.get(slot, -1)
                       or self.slot_last_step.get(slot) != self.step - 1)
            if restart and p0 > 0:
                toks = torch.from_numpy(input_batch.token_ids_cpu[i, :p0].astype(np.int64)).to(self.device)
                pos = torch.arange(p0, device=self.device)
                self.sg_model(toks[None], pos[None], self.k_cache, self.v_cache,
                              torch.tensor([slot], device=self.device))
            self.slot_last_pos0[slot] = p0
            self.slot_last_step[slot] = self.step
            slots.append(slot)
        return slots

    # ------------------------------------------------ padded inputs + draft chain
    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count):
        """Keeps the per-row counts for ``propose``; the rejected counts are computed inside the draft graph.

        Returns (metadata with ``num_actual_tokens`` = all scheduled tokens, None, None): the runner only
        slices the target's tokens with the metadata and hands the other two to ``propose``.
        """
        if self.fallback:
            return super().prepare_inputs_padded(common_attn_metadata, spec_decode_metadata,
                                                 valid_sampled_tokens_count)
        cu = spec_decode_metadata.cu_num_draft_tokens
        B = common_attn_metadata.num_reqs
        num_draft = torch.diff(cu[:B].to(torch.int64), prepend=cu.new_zeros(1, dtype=torch.int64))
        self._pending_counts = (valid_sampled_tokens_count[:B], num_draft)
        total = int(common_attn_metadata.query_start_loc_cpu[B])
        meta = dataclasses.replace(common_attn_metadata, num_actual_tokens=total,
                                   slot_mapping=common_attn_metadata.slot_mapping[:total])
        return meta, None, None

    def _evict(self, keep: set) -> None:
        """Free the slot of the live request outside this batch that ran least recently (preempted ones
        stay in ``runner.requests``); when it comes back its prefix is prefilled again."""
        victims = [(self.slot_last_step.get(slot, -1), rid) for rid, slot in self.slot_of.items() if rid not in keep]
        if not victims:
            raise RuntimeError(f"spec-graph: more than max_num_seqs={self.max_slots} requests in one batch")
        _, rid = min(victims)
        slot = self.slot_of.pop(rid)
        self.slot_last_step.pop(slot, None)
        self.slot_last_pos0.pop(slot, None)
        self.free_slots.append(slot)

    def draft_chain(self, target_token_ids, target_positions, query_start_loc, valid_count, num_draft,
                    next_token_ids, slots, T: int, K: int) -> torch.Tensor:
        """Pure tensor function (static shapes, no host sync): padded input prep + the K draft forwards.

        Row ``i`` has ``q_i = query_start_loc[i+1] - query_start_loc[i]`` scheduled tokens of which
        ``num_rejected_i = num_draft_i + 1 - valid_count_i`` (0 without drafts) were rejected. It feeds
        its ``v_i = q_i - num_rejected_i`` committed tokens from ``target_token_ids[query_start_loc[i]:]``
        at positions ``p0_i + j``, then ``next_token_ids[i]`` at ``p0_i + v_i``; padding columns
        (j > v_i) write KV past the committed length only, which the position mask hides until later
        steps overwrite it. Draft 1 is the argmax at column ``v_i``, then K-1 single-token forwards.
        Returns int64 drafts [B, K].
        """
        dev = target_token_ids.device
        B = slots.shape[0]
        N = target_token_ids.shape[0]
        j = torch.arange(T, device=dev)[None, :]
        qsl = query_start_loc[: B + 1].to(torch.int64)
        start = qsl[:-1, None]
        num_draft = num_draft.to(torch.int64)
        rejected = torch.where(num_draft > 0, num_draft + 1 - valid_count.to(torch.int64), 0)
        v = ((qsl[1:] - qsl[:-1]) - rejected)[:, None]
        src = (start + j).clamp(0, N - 1)
        nxt = next_token_ids.to(torch.int64)[:, None]
        tokens = torch.where(j < v, target_token_ids.to(torch.int64)[src], nxt)
        p0 = target_positions.to(torch.int64)[start.clamp(0, N - 1)]
        last_pos = self.cache_len - 1
        pos = (p0 + j).clamp(0, last_pos)
        logits = self.sg_model(tokens, pos, self.k_cache, self.v_cache, slots)
        d = logits.gather(1, v[:, :, None].expand(B, 1, logits.shape[-1]))[:, 0].argmax(-1)
        drafts = [d]
        for k in range(1, K):
            pk = (p0 + v + k).clamp(0, last_pos)
            d = self.sg_model(d[:, None], pk, self.k_cache, self.v_cache, slots)[:, 0].argmax(-1)
            drafts.append(d)
        return torch.stack(drafts, dim=1)

    # ------------------------------------------------------------ captured path
    def buckets(self) -> tuple[int, ...]:
        if self.settings.batch_buckets:
            return self.settings.batch_buckets
        out, b = [], 1
        while b < self.max_slots:
            out.append(b)
            b *= 2
        return (*out, self.max_slots)

    def _static_inputs(self, Bp: int):
        """Static input buffers of bucket ``Bp``, every row pointing at the scratch slot (harmless warm-up)."""
        K = self.num_speculative_tokens
        i64 = dict(dtype=torch.int64, device=self.k_cache.device)
        N = Bp * (K + 1)
        return {"tokens": torch.zeros(N, **i64), "positions": torch.zeros(N, **i64),
                "qsl": torch.zeros(Bp + 1, **i64), "valid": torch.zeros(Bp, **i64),
                "num_draft": torch.zeros(Bp, **i64), "next": torch.zeros(Bp, **i64),
                "slots": torch.full((Bp,), self.max_slots, **i64)}

    def _run_captured(self, Bp: int, inputs: dict) -> torch.Tensor:
        """Copy this step's inputs into bucket ``Bp``'s static buffers and replay its graph (capturing it once)."""
        K = self.num_speculative_tokens
        if self.graphs is None:
            self.graphs = GraphSet(self.platform)
            self.static = {}
        if Bp not in self.static:
            st = self._static_inputs(Bp)
            self.static[Bp] = st
            self.graphs.capture(Bp, lambda: self.draft_chain(st["tokens"], st["positions"], st["qsl"], st["valid"],
                                                               st["num_draft"], st["next"], st["slots"], K + 2, K))
        st = self.static[Bp]
        if Bp not in self.graphs:
            return None
        B = inputs["slots"].shape[0]
        n = inputs["tokens"].shape[0]
        st["tokens"][:n].copy_(inputs["tokens"])
        st["positions"][:n].copy_(inputs["positions"])
        st["qsl"][: B + 1].copy_(inputs["qsl"])
        st["qsl"][B + 1:].fill_(n)
        for name in ("valid", "num_draft", "next", "slots"):
            st[name][:B].copy_(inputs[name])
        st["valid"][B:].zero_()
        st["num_draft"][B:].zero_()
        st["slots"][B:].fill_(self.max_slots)
        return self.graphs.replay(Bp)[:B]

    @torch.inference_mode()
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        """Draft tokens [batch, K]; ``target_hidden_states`` is unused (may be None).

        Decode-only steps (every row schedules at most K+1 tokens) of at most the largest bucket run as
        one captured graph per padded batch on CUDA/NPU; steps with prefill chunks run the same
        function uncaptured.
        """
        if self.fallback:
            return super().propose(num_speculative_tokens, target_token_ids, target_positions,
                                   target_hidden_states, next_token_ids, token_indices_to_sample,
                                   common_attn_metadata, sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                                   num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings)
        B = common_attn_metadata.num_reqs
        K = int(num_speculative_tokens)
        dev = self.k_cache.device
        qsl_cpu = common_attn_metadata.query_start_loc_cpu[: B + 1]
        max_q = int((qsl_cpu[1:] - qsl_cpu[:-1]).max()) if B else 0
        input_batch = self.runner.input_batch
        slots = self._slots_for(input_batch.req_ids[:B], input_batch.num_computed_tokens_cpu[:B], input_batch)
        self.step += 1
        counts, self._pending_counts = self._pending_counts, None
        if counts is not None:
            valid, num_draft = counts
        elif num_rejected_tokens_gpu is not None:  # vLLM's own prepare_inputs_padded ran (not ours)
            num_draft = num_rejected_tokens_gpu[:B].to(torch.int64)
            valid = torch.ones_like(num_draft)  # num_draft + 1 - valid == num_rejected
        else:  # no drafts this step, or the unpadded path (only committed tokens were scheduled for us)
            valid = num_draft = torch.zeros(B, dtype=torch.int64, device=dev)
        positions = target_positions if target_positions.dim() == 1 else target_positions[0]
        inputs = {"tokens": target_token_ids, "positions": positions[: target_token_ids.shape[0]],
                  "qsl": common_attn_metadata.query_start_loc[: B + 1], "valid": valid, "num_draft": num_draft,
                  "next": next_token_ids[:B], "slots": torch.tensor(slots, dtype=torch.int64, device=dev)}
        if self.platform.supports_graphs and B and max_q <= K + 1 and K == self.num_speculative_tokens:
            Bp = next((b for b in self.buckets() if b >= B), None)
            if Bp is not None:
                out = self._run_captured(Bp, inputs)
                if out is not None:
                    return out.clone()
        return self.draft_chain(inputs["tokens"], inputs["positions"], inputs["qsl"], inputs["valid"],
                                inputs["num_draft"], inputs["next"], inputs["slots"], max_q + 1, K)
