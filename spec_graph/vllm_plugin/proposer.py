"""spec-graph's drafter for vLLM: ``DraftCore`` (no vLLM import) and ``SpecGraphProposer``, its thin adapter.

``DraftCore`` drafts with ``spec_graph.models`` and its own static KV cache
``[layers, max_num_seqs + 1, kv_heads, cache_length(max_model_len, K), head_dim]``
(``config.cache_length``, as the engine's; the last slot is scratch for padding rows); it takes plain tensors,
arrays and request ids, so it runs (and replays recorded steps) without vLLM. Requests
map to cache slots by request id, so rows that vLLM reorders or removes
between steps never mix caches. A device table holds each slot's last known
token (vLLM's "backup" token for rows without a valid sampled token): the
counting kernel reads and updates it in the same launch, and a request's
token is uploaded only when it first gets a slot.

Per step and row ``i`` the draft is fed the row's committed scheduled tokens
(``q_i - num_rejected_i`` of them, at their own positions), then the row's
next token; its logits give draft 1, and K-1 single-token forwards give the
rest. A request seen for the first time, resumed after preemption, or missed
by the previous step (a prefix-cache hit, a recomputation) first gets its
whole prefix ``[0, first scheduled position)`` prefilled from the request's own
token ids, so the cache has no holes. Drafts are greedy (the draft's argmax):
vLLM's rejection sampler then treats them as one-hot proposals, which keeps
sampling lossless. Attention reads only the cache span a step can reach.

Decode steps run as one captured graph per (padded batch, cache span) on
CUDA/NPU. On CPU, where vLLM compiles its models (no ``enforce_eager``), they
run the chain compiled by the ``spec_graph`` backend, compiled during the
runner's warm-up; otherwise, and for steps with prefill chunks, eagerly.

``SpecGraphProposer`` (a subclass of vLLM's ``DraftModelProposer``, built on
first access so that importing this module does not import vLLM) unpacks the
runner's arguments for the core.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from .. import platform as _platform
from ..capture import GraphSet
from ..config import cache_length, kv_fit
from ..models import UnsupportedModelError, load_model, read_config
from ..models.llama import kv_cache_bytes
from . import use_vllm_log_handlers
from .checkpoint import check_readable, draft_dir
from .config import parse
from .kernels import count_valid

log = logging.getLogger("spec_graph")

_warned_fallback = False
MIN_SPAN = 32  # shortest cache span attended over (a power of two)
# Tokens per prefill forward of a row's prefix or chunk: its attention mask and scores grow with this times the
# prefix, not with the prefix squared (a 64k-token prefix in one forward: a 4 GiB mask).
FEED_TOKENS = 2048


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` (host memory for cpu)."""
    return _platform.Platform(device.type).free_memory()


def target_sequence_bytes(vllm_config) -> int:
    """Bytes of the target's KV cache for one max_model_len sequence on this rank: vLLM refuses to start
    without room for it."""
    mc, pc, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    kv_dtype = str(cache.cache_dtype)
    if kv_dtype == "auto":
        itemsize = mc.dtype.itemsize
    elif "fp8" in kv_dtype or "int8" in kv_dtype:
        itemsize = 1
    else:
        itemsize = getattr(torch, kv_dtype, mc.dtype).itemsize
    per_token = mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size() * itemsize
    return per_token * (1 if mc.use_mla else 2) * mc.max_model_len


def vllm_keeps(vllm_config, device: torch.device) -> tuple[int, str]:
    """Bytes of `device`'s free memory that the draft cache must leave to vLLM when the drafter loads (before
    vLLM sizes its own KV cache), and why. With kv_cache_memory_bytes set, that KV cache; else the share
    gpu_memory_utilization leaves to other processes, and one max_model_len sequence of the target's cache."""
    cache = vllm_config.cache_config
    if cache.kv_cache_memory_bytes:
        return int(cache.kv_cache_memory_bytes), f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    util = cache.gpu_memory_utilization
    others = int((1 - util) * _platform.Platform(device.type).total_memory())
    one_seq = target_sequence_bytes(vllm_config)
    return others + one_seq, (f"{others / 2**20:.1f} MiB that gpu_memory_utilization={util} leaves to other "
                              f"processes, {one_seq / 2**20:.1f} MiB for one max_model_len sequence of the "
                              f"target's KV cache")


def default_buckets(max_slots: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < max_slots:
        out.append(b)
        b *= 2
    return (*out, max_slots)


class DraftCore:
    """The draft side of vLLM's padded drafter path on spec-graph's model; no vLLM needed.

    Per step the caller runs ``next_tokens`` (after the target's sampler) and then ``propose``, with the
    step's rows in the runner's order. ``live`` (optional, both calls) lists every request still alive
    (running or preempted); slots of the others are freed.
    """

    def __init__(self, model, num_speculative_tokens: int, max_slots: int, max_model_len: int,
                 buckets: tuple[int, ...] | None = None, plat=None, compile_chain: bool = False):
        self.model = model
        self.K = int(num_speculative_tokens)
        self.max_slots = int(max_slots)
        self.cache_len = cache_length(int(max_model_len), self.K)
        self.k_cache, self.v_cache = model.new_kv_cache(self.max_slots + 1, self.cache_len)
        self.device = self.k_cache.device
        self.backup = torch.zeros(self.max_slots + 1, dtype=torch.int32, device=self.device)
        self.buckets = tuple(buckets) if buckets else default_buckets(self.max_slots)
        self.platform = plat or _platform.get(self.device)
        self.slot_of: dict[str, int] = {}
        self.free_slots: list[int] = list(range(self.max_slots))
        self.seeded: set[int] = set()  # slots whose backup-table entry is the request's own token
        self.slot_last_pos0: dict[int, int] = {}
        self.slot_last_step: dict[int, int] = {}
        self.step = 0
        self.graphs = None  # GraphSet: the draft chain per (padded batch, cache span) on CUDA/NPU
        self.static: dict = {}  # static input buffers per padded batch
        # Without graphs (CPU), decode steps can run the chain compiled by the spec_graph backend instead.
        self.compiled = None
        self.compile_chain = bool(compile_chain) and not self.platform.supports_graphs
        self._slot_tensor = (None, None)  # (slots, device tensor): steps with the same rows reuse it
        # Where decode attention runs the live-length kernel (its work follows each row's length, not the
        # cache's), static steps attend over the whole cache: one graph per padded batch, no cache spans.
        self.live_span = model.model.layers[0].self_attn.decode_attention_for(self.K + 2, self.device)

    # ------------------------------------------------------------------ slots
    def _release(self, live) -> None:
        if live is None:
            return
        live = set(live)
        for rid in [r for r in self.slot_of if r not in live]:
            self._free(rid)

    def _free(self, rid: str) -> None:
        slot = self.slot_of.pop(rid)
        self.slot_last_step.pop(slot, None)
        self.slot_last_pos0.pop(slot, None)
        self.seeded.discard(slot)
        self.free_slots.append(slot)

    def _evict(self, keep: set) -> None:
        """Free the slot of the live request outside this batch that ran least recently (preempted ones
        stay live); when it comes back its prefix is prefilled again."""
        victims = [(self.slot_last_step.get(slot, -1), rid) for rid, slot in self.slot_of.items() if rid not in keep]
        if not victims:
            raise RuntimeError(f"spec-graph: more than max_num_seqs={self.max_slots} requests in one batch")
        self._free(min(victims)[1])

    def slots(self, req_ids) -> tuple[list[int], torch.Tensor]:
        """Cache slot per row (new requests get a free one) and the same as a device tensor."""
        slots = []
        for rid in req_ids:
            slot = self.slot_of.get(rid)
            if slot is None:
                if not self.free_slots:
                    self._evict(set(req_ids))
                slot = self.free_slots.pop(0)
                self.slot_of[rid] = slot
            slots.append(slot)
        key = tuple(slots)
        if self._slot_tensor[0] != key:
            self._slot_tensor = (key, torch.tensor(slots, dtype=torch.int64, device=self.device))
        return slots, self._slot_tensor[1]

    # ------------------------------------------------------- next tokens, counts
    @torch.inference_mode()
    def next_tokens(self, sampled, discard, req_ids, num_tokens, token_ids, vocab_size: int, live=None):
        """(next_token_ids, valid_count), int32 [R], in one kernel launch; final on return.

        ``sampled`` int32 [R, S] (-1 placeholders), ``discard`` bool [R]. ``num_tokens`` / ``token_ids`` (host
        arrays: tokens per row before this step's sampling, and the rows' token ids) are read only for rows
        whose slot has no backup token yet: once per request.
        """
        self._release(live)
        slots, slot_t = self.slots(req_ids)
        new = [i for i, s in enumerate(slots) if s not in self.seeded]
        if new:
            last = np.maximum(np.asarray(num_tokens)[new].astype(np.int64) - 1, 0)
            vals = np.asarray(token_ids)[new, last].astype(np.int32)
            self.backup[torch.tensor([slots[i] for i in new], device=self.device)] = torch.from_numpy(vals).to(
                self.device)
            self.seeded.update(slots[i] for i in new)
        return count_valid(sampled, discard, self.backup, slot_t, vocab_size)

    # ------------------------------------------------------------------ propose
    def drafts_skipped(self) -> None:
        """The target ran a step without this drafter (vLLM's runner skips it for a whole batch whose longest
        sequence reaches past the draft's window): that step's rows committed tokens whose keys and values the
        draft cache never got, so each counts as missed by the previous step and is prefilled again."""
        self.step += 1

    def _prefill_missing(self, slots, pos0, token_ids) -> None:
        """Prefill the whole prefix of rows that are new, resumed, or were missed by the previous step."""
        for i, slot in enumerate(slots):
            p0 = int(pos0[i])
            restart = p0 <= self.slot_last_pos0.get(slot, -1) or self.slot_last_step.get(slot) != self.step - 1
            if restart and p0 > 0:
                toks = torch.from_numpy(np.asarray(token_ids[i, :p0]).astype(np.int64)).to(self.device)
                self._feed(toks, torch.arange(p0, device=self.device), torch.tensor([slot], device=self.device), p0)
            self.slot_last_pos0[slot] = p0
            self.slot_last_step[slot] = self.step

    def _feed(self, tokens, positions, slot, end: int) -> None:
        """Write the KV of one row's tokens (int64 [n] at consecutive ``positions``, the last ``end - 1``; every
        position below them already written) into cache slot ``slot`` ([1]): prefill forwards of at most
        FEED_TOKENS tokens, each attending over the cache up to its last position alone (kv_len), with one row of
        logits."""
        n = tokens.shape[0]
        for a in range(0, n, FEED_TOKENS):
            b = min(a + FEED_TOKENS, n)
            self.model(tokens[a:b][None], positions[a:b][None], self.k_cache, self.v_cache, slot,
                       kv_len=end - (n - b), logits_at=torch.tensor([b - a - 1], device=self.device))

    @torch.inference_mode()
    def propose(self, req_ids, pos0, token_ids, target_token_ids, positions, query_start_loc, query_start_loc_cpu,
                valid_count, num_draft, next_token_ids, num_speculative_tokens: int, live=None) -> torch.Tensor:
        """Draft tokens int64 [B, K] for the rows ``req_ids`` (B of them).

        ``pos0`` (host) is each row's first scheduled position (its computed tokens), ``token_ids`` (host) the
        rows' token ids (read for prefix prefills only), ``target_token_ids`` / ``positions`` the scheduled
        tokens, ``query_start_loc`` [B+1] their row offsets (``query_start_loc_cpu`` the same on the host),
        ``valid_count`` / ``num_draft`` [B] the step's counts (zeros without drafts), ``next_token_ids`` [B].
        Decode-only steps (every row at most K+1 tokens) of at most the largest bucket replay one captured
        graph per (padded batch, cache span) where the platform has graphs, or run the compiled chain where
        it is enabled; other steps run the same function eagerly. Every path attends over the span only.
        """
        B, K = len(req_ids), int(num_speculative_tokens)
        self._release(live)
        slots, slot_t = self.slots(req_ids)
        self._prefill_missing(slots, pos0, token_ids)
        self.step += 1
        inputs = {"tokens": target_token_ids, "positions": positions[: target_token_ids.shape[0]],
                  "qsl": query_start_loc[: B + 1], "valid": valid_count[:B], "num_draft": num_draft[:B],
                  "next": next_token_ids[:B], "slots": slot_t}
        inputs, starts, max_q = self._feed_long_rows(inputs, np.asarray(query_start_loc_cpu[: B + 1]), pos0, K)
        static = (self.platform.supports_graphs or self.compile_chain) and B and max_q <= K + 1 and K == self.K
        # Attend over the cache prefix this step can reach, not the whole buffer (static steps: T = K + 2),
        # unless the live-length kernel already reads no more than that.
        if static and self.live_span:
            L = self.cache_len
        else:
            L = self.cache_span(max(starts, default=0), K + 1 if static else max_q, K)
        if static:
            Bp = next((b for b in self.buckets if b >= B), None)
            if Bp is not None:
                run = self._run_captured if self.platform.supports_graphs else self._run_compiled
                out = run((Bp, L), inputs)
                if out is not None:
                    return out.clone()
        return self.draft_chain(inputs["tokens"], inputs["positions"], inputs["qsl"], inputs["valid"],
                                inputs["num_draft"], inputs["next"], inputs["slots"], max_q + 1, K, *self.span(L))

    def _feed_long_rows(self, inputs: dict, qsl_cpu: np.ndarray, pos0, K: int) -> tuple[dict, list[int], int]:
        """(inputs, first chain position per row, most tokens a row) once rows of more than a decode row's
        ``self.K + 1`` tokens (prefill chunks, which carry no drafts) have fed all but their last K + 1 tokens here:
        one prefill forward each, attending over the row's prefix alone, with one row of logits. So the chain's
        forwards stay [B, K + 2], and the captured graph can serve the step, however long a chunk is (unfed, a
        chunk of T tokens made [B, T, vocab] logits and [B, heads, T, cache] scores for every row)."""
        q = np.diff(qsl_cpu).astype(np.int64)
        pre = np.where(q > max(self.K, K) + 1, q - (K + 1), 0)
        starts = (np.asarray(pos0)[: len(q)].astype(np.int64) + pre).tolist()
        if not pre.any():
            return inputs, starts, int(q.max(initial=0))
        keep = []
        for i, (s, n, p) in enumerate(zip(qsl_cpu[:-1].tolist(), q.tolist(), pre.tolist())):
            if p:
                self._feed(inputs["tokens"][s: s + p].to(torch.int64), inputs["positions"][s: s + p].to(torch.int64),
                           inputs["slots"][i: i + 1], starts[i])
            keep.extend(range(s + p, s + n))
        idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
        qsl = np.concatenate(([0], np.cumsum(q - pre)))
        inputs = dict(inputs, tokens=inputs["tokens"][idx], positions=inputs["positions"][idx],
                      qsl=torch.from_numpy(qsl).to(device=self.device, dtype=inputs["qsl"].dtype))
        return inputs, starts, int((q - pre).max())

    def cache_span(self, max_pos0: int, max_q: int, K: int) -> int:
        """Cache positions a step writes or reads (up to ``max_pos0 + max_q + K``), rounded up to a power of two
        (so static graphs come in few lengths), at least ``MIN_SPAN`` and at most the whole cache."""
        reach = max_pos0 + max_q + K + 1
        return min(self.cache_len, max(MIN_SPAN, 1 << (reach - 1).bit_length()))

    def span(self, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``L`` positions of the K and V caches (writes through them land in the caches)."""
        return self.k_cache[..., :L, :], self.v_cache[..., :L, :]

    def draft_chain(self, target_token_ids, target_positions, query_start_loc, valid_count, num_draft,
                    next_token_ids, slots, T: int, K: int, k_cache=None, v_cache=None) -> torch.Tensor:
        """Pure tensor function (static shapes, no host sync): padded input prep + the K draft forwards.

        Row ``i`` has ``q_i = query_start_loc[i+1] - query_start_loc[i]`` scheduled tokens of which
        ``num_rejected_i = num_draft_i + 1 - valid_count_i`` (0 without drafts) were rejected. It feeds
        its ``v_i = q_i - num_rejected_i`` committed tokens from ``target_token_ids[query_start_loc[i]:]``
        at positions ``p0_i + j``, then ``next_token_ids[i]`` at ``p0_i + v_i``; padding columns
        (j > v_i) write KV past the committed length only, which the position mask hides until later
        steps overwrite it. Draft 1 is the argmax at column ``v_i``, then K-1 single-token forwards.
        ``k_cache`` / ``v_cache`` (default: the whole cache) may be a prefix span of it (``span``): attention
        then reads only those positions. Returns int64 drafts [B, K].
        """
        dev = target_token_ids.device
        B = slots.shape[0]
        N = target_token_ids.shape[0]
        kc, vc = (self.k_cache, self.v_cache) if k_cache is None else (k_cache, v_cache)
        last_pos = kc.shape[3] - 1
        j = torch.arange(T, device=dev)[None, :]
        qsl = query_start_loc[: B + 1].to(torch.int64)
        start = qsl[:-1, None]
        num_draft = num_draft.to(torch.int64)
        rejected = torch.where(num_draft > 0, num_draft + 1 - valid_count.to(torch.int64), 0)
        v = ((qsl[1:] - qsl[:-1]) - rejected)[:, None]
        src = (start + j).clamp(0, N - 1)
        tokens = torch.where(j < v, target_token_ids.to(torch.int64)[src], next_token_ids.to(torch.int64)[:, None])
        p0 = target_positions.to(torch.int64)[start.clamp(0, N - 1)]
        pos = (p0 + j).clamp(0, last_pos)
        logits = self.model(tokens, pos, kc, vc, slots)
        d = logits.gather(1, v[:, :, None].expand(B, 1, logits.shape[-1]))[:, 0].argmax(-1)
        drafts = [d]
        for k in range(1, K):
            pk = (p0 + v + k).clamp(0, last_pos)
            d = self.model(d[:, None], pk, kc, vc, slots)[:, 0].argmax(-1)
            drafts.append(d)
        return torch.stack(drafts, dim=1)[:, :K]  # K == 0: the forward above still fed the cache

    # ------------------------------------------------------------ captured path
    def _static_inputs(self, Bp: int):
        """Static input buffers of bucket ``Bp``, every row pointing at the scratch slot (harmless warm-up)."""
        i64 = dict(dtype=torch.int64, device=self.device)
        N = Bp * (self.K + 1)
        return {"tokens": torch.zeros(N, **i64), "positions": torch.zeros(N, **i64),
                "qsl": torch.zeros(Bp + 1, **i64), "valid": torch.zeros(Bp, **i64),
                "num_draft": torch.zeros(Bp, **i64), "next": torch.zeros(Bp, **i64),
                "slots": torch.full((Bp,), self.max_slots, **i64)}

    def _static_for(self, Bp: int) -> dict:
        if Bp not in self.static:
            self.static[Bp] = self._static_inputs(Bp)
        return self.static[Bp]

    def _fill_static(self, Bp: int, inputs: dict) -> dict:
        """Copy this step's inputs into bucket ``Bp``'s static buffers; padding rows use the scratch slot."""
        st = self._static_for(Bp)
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
        return st

    def _chain_on(self, st: dict, caches, chain=None):
        """A no-argument call of ``chain`` (default: the eager draft chain) over static buffers ``st``."""
        chain = chain or self.draft_chain
        return lambda: chain(st["tokens"], st["positions"], st["qsl"], st["valid"], st["num_draft"], st["next"],
                             st["slots"], self.K + 2, self.K, *caches)

    def _run_captured(self, key: tuple[int, int], inputs: dict) -> torch.Tensor | None:
        """Replay the graph of ``key`` = (padded batch, cache span) on this step's inputs, capturing it first if
        new; None if it cannot be captured. Graphs of one batch share its static input buffers."""
        Bp, L = key
        if self.graphs is None:
            self.graphs = GraphSet(self.platform)
        st = self._static_for(Bp)
        if key not in self.graphs and key not in self.graphs.failed:
            # Capture runs the chain for real (warm-up): reset the buffers to empty rows on the scratch slot.
            for name, t in st.items():
                t.fill_(self.max_slots if name == "slots" else 0)
            self.graphs.capture(key, self._chain_on(st, self.span(L)))
        if key not in self.graphs:
            return None
        self._fill_static(Bp, inputs)
        return self.graphs.replay(key)[: inputs["slots"].shape[0]]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the chain now (vLLM's warm-up, not a request's first step) for bucket 1 and for the shared
        compile of the larger buckets, on empty rows: only the scratch slot is written. Once; no-op uncompiled."""
        if not self.compile_chain or self.compiled is not None:
            return
        empty = {name: torch.zeros(1 if name == "qsl" else 0, dtype=torch.int64, device=self.device)
                 for name in ("tokens", "positions", "qsl", "valid", "num_draft", "next", "slots")}
        sizes = sorted({self.buckets[0], self.buckets[-1]})
        log.info("spec-graph: compiling the draft chain for batch %s (a first start on CPU can take minutes; "
                 "inductor's on-disk cache makes later starts fast)", " and ".join(map(str, sizes)))
        t0 = time.perf_counter()
        for Bp in sizes:
            self._run_compiled((Bp, MIN_SPAN), empty)
        if self.compile_chain:
            log.info("spec-graph: draft chain compiled in %.1f s", time.perf_counter() - t0)

    def _run_compiled(self, key: tuple[int, int], inputs: dict) -> torch.Tensor | None:
        """The chain compiled by the spec_graph backend, over the static buffers of ``key`` = (padded batch,
        cache span), where there are no graphs (CPU). The span's cache views are inputs with a symbolic
        length (sliced inside the graph, a written view would make functionalization copy it), and buckets
        above 1 share one compile with a symbolic batch. A failed compile warns once and leaves the eager
        chain in charge (None)."""
        if self.compiled is None:
            from ..backend import backend_compile

            self.compiled = backend_compile(self.draft_chain, self.platform.name)
        Bp, L = key
        if Bp not in self.static and Bp > 1:
            for t in self._static_for(Bp).values():
                torch._dynamo.maybe_mark_dynamic(t, 0)
        caches = self.span(L)
        for t in caches:
            torch._dynamo.maybe_mark_dynamic(t, 3)
        try:
            out = self._chain_on(self._fill_static(Bp, inputs), caches, self.compiled)()
        except Exception as e:  # noqa: BLE001 - the eager chain gives the same tokens
            log.warning("spec-graph: compiling the draft chain failed (%s: %s); it runs eagerly", type(e).__name__, e)
            self.compile_chain = False
            return None
        return out[: inputs["slots"].shape[0]]


class VllmAdapter:
    """vLLM's ``DraftModelProposer`` contract served by a ``DraftCore`` (mixed into ``SpecGraphProposer``)."""

    def __init__(self, vllm_config, device, runner=None):
        # vLLM's checks (equal vocab sizes) run in the parent with vLLM's messages.
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.runner = runner  # vLLM 0.32's base takes the runner but keeps no reference to it
        self.settings = parse(vllm_config.additional_config)
        self.fallback = False
        self.core: DraftCore | None = None
        self.max_slots = vllm_config.scheduler_config.max_num_seqs
        self._pending_counts = None  # (valid count, drafts per row) from prepare_inputs_padded, for propose

    def _raise_if_draft_tp_mismatch(self):
        # vLLM refuses a draft TP unlike the target's (its ranks would share one draft compile); spec-graph's
        # draft is its own whole model on every rank, so any draft TP works. The fallback re-checks it.
        return None

    def _raise_if_padded_drafter_batch_disabled(self):
        # vLLM refuses disable_padded_drafter_batch for draft models because its drafter needs padded
        # inputs; spec-graph builds its own padded inputs from either form, so both settings work.
        # (The fallback to vLLM's drafter happens later, at load_model, and re-checks it there.)
        return None

    def load_model(self, target_model) -> None:
        global _warned_fallback
        path = draft_dir(self.draft_model_config, getattr(self.vllm_config.load_config, "download_dir", None))
        try:
            check_readable(path)
            _, args = read_config(path)
        except UnsupportedModelError as e:
            if not _warned_fallback:
                use_vllm_log_handlers()
                log.warning("spec-graph: %s; drafting with vLLM's own DraftModelProposer instead", e)
                _warned_fallback = True
            self.fallback = True
            super()._raise_if_draft_tp_mismatch()
            super()._raise_if_padded_drafter_batch_disabled()
            return super().load_model(target_model)
        K = self.num_speculative_tokens
        slots, cache_len = self.max_slots + 1, cache_length(self.max_model_len, K)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        need = kv_cache_bytes(args, slots, cache_len, itemsize)
        free = available_memory(torch.device(self.device))
        keep, why = vllm_keeps(self.vllm_config, torch.device(self.device))
        have = max(free - keep, 0)
        if need > have:
            fit_len, fit_slots = kv_fit(need, have, slots, cache_len, K)
            fit_seqs = fit_slots - 1  # one slot more than max_num_seqs
            seqs_hint = f"at most {fit_seqs} fit" if fit_seqs >= 1 else "none fits"
            len_hint = f"at most {fit_len} fits" if fit_len >= 2 else "none fits"
            raise ValueError(
                f"spec-graph: the draft KV cache needs {need / 2**20:.1f} MiB (max_num_seqs={self.max_slots}, "
                f"max_model_len={self.max_model_len}, K={K}) but only {have / 2**20:.1f} MiB of the "
                f"{free / 2**20:.1f} MiB free on {self.device} are left to it (vLLM keeps {why}); lower "
                f"max_num_seqs ({seqs_hint} at this max_model_len) or max_model_len ({len_hint} "
                f"{self.max_slots} sequences)")
        model = load_model(path, dtype=self.dtype, device=self.device)
        # Compile the chain where vLLM compiles its models (not under enforce_eager); graphs capture it anyway.
        compiles = int(getattr(self.vllm_config.compilation_config, "mode", 0) or 0) != 0
        self.core = DraftCore(model, K, self.max_slots, self.max_model_len, buckets=self.settings.batch_buckets,
                              compile_chain=compiles)
        self._watch_skipped_drafts()
        how = ("captured graphs" if self.core.platform.supports_graphs else
               "a compiled chain" if self.core.compile_chain else "eager forwards")
        use_vllm_log_handlers()  # an offline LLM configures vLLM's log output after the plugin registered
        log.info("spec-graph: drafting with SpecGraphProposer: draft %s (%s), K=%d, batch buckets %s, %s on %s",
                 path, args.architecture, K, list(self.core.buckets), how, self.device)

    def _watch_skipped_drafts(self) -> None:
        # Patch 5 (vllm_plugin/__init__.py): this runner's fit check, wrapped so that the core hears of the steps
        # the runner takes without calling the drafter.
        fits = getattr(self.runner, "_input_fits_in_drafter", None)
        if fits is None:
            return
        fits = getattr(fits, "__wrapped__", fits)
        core = self.core

        def _input_fits_in_drafter(common_attn_metadata):
            ok = fits(common_attn_metadata)
            if not ok:
                core.drafts_skipped()
            return ok

        _input_fits_in_drafter.__wrapped__ = fits
        self.runner._input_fits_in_drafter = _input_fits_in_drafter

    # The runner wires vLLM's attention machinery into its drafter; spec-graph's draft has none.
    def dummy_run(self, *args, **kwargs):
        if self.fallback:
            return super().dummy_run(*args, **kwargs)
        self.core.warm_up()  # the runner's warm-up: compile the draft chain before serving, where it compiles
        return None

    def initialize_attn_backend(self, *args, **kwargs):
        return super().initialize_attn_backend(*args, **kwargs) if self.fallback else None

    def initialize_cudagraph_keys(self, *args, **kwargs):
        return super().initialize_cudagraph_keys(*args, **kwargs) if self.fallback else None

    def validate_same_kv_cache_group(self, *args, **kwargs):
        return super().validate_same_kv_cache_group(*args, **kwargs) if self.fallback else None

    def take_last_draft_probs(self):
        return super().take_last_draft_probs() if self.fallback else None

    def _live(self):
        return self.runner.requests.keys() if self.runner is not None else None

    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
        """(next_token_ids, valid_sampled_tokens_count), int32 [num_reqs]; one kernel launch, final on return."""
        if self.fallback:
            return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                         discard_request_mask)
        R = sampled_token_ids.shape[0]
        return self.core.next_tokens(
            sampled=sampled_token_ids, discard=discard_request_mask[:R], req_ids=list(gpu_input_batch.req_ids[:R]),
            num_tokens=gpu_input_batch.num_tokens_no_spec[:R], token_ids=gpu_input_batch.token_ids_cpu[:R],
            vocab_size=gpu_input_batch.vocab_size, live=self._live())

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

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        """Draft tokens [batch, K]; ``target_hidden_states`` is unused (may be None)."""
        if self.fallback:
            return super().propose(num_speculative_tokens, target_token_ids, target_positions,
                                   target_hidden_states, next_token_ids, token_indices_to_sample,
                                   common_attn_metadata, sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                                   num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings)
        B = common_attn_metadata.num_reqs
        counts, self._pending_counts = self._pending_counts, None
        if counts is not None:
            valid, num_draft = counts
        elif num_rejected_tokens_gpu is not None:  # vLLM's own prepare_inputs_padded ran (not ours)
            num_draft = num_rejected_tokens_gpu[:B].to(torch.int64)
            valid = torch.ones_like(num_draft)  # num_draft + 1 - valid == num_rejected
        else:  # no drafts this step, or the unpadded path (only committed tokens were scheduled for us)
            valid = num_draft = torch.zeros(B, dtype=torch.int64, device=self.core.device)
        batch = self.runner.input_batch
        positions = target_positions if target_positions.dim() == 1 else target_positions[0]
        return self.core.propose(
            req_ids=list(batch.req_ids[:B]), pos0=batch.num_computed_tokens_cpu[:B], token_ids=batch.token_ids_cpu[:B],
            target_token_ids=target_token_ids, positions=positions,
            query_start_loc=common_attn_metadata.query_start_loc,
            query_start_loc_cpu=common_attn_metadata.query_start_loc_cpu, valid_count=valid, num_draft=num_draft,
            next_token_ids=next_token_ids, num_speculative_tokens=num_speculative_tokens, live=self._live())


def _build_proposer_class():
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    return type("SpecGraphProposer", (VllmAdapter, DraftModelProposer), {
        "__module__": __name__,
        "__qualname__": "SpecGraphProposer",
        "__doc__": "vLLM's DraftModelProposer, drafting with spec-graph's model and static KV cache (DraftCore)."})


def __getattr__(name):
    # SpecGraphProposer needs vLLM's base class: build it on first access, so DraftCore imports without vLLM.
    if name == "SpecGraphProposer":
        cls = globals()["SpecGraphProposer"] = _build_proposer_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
