"""SpecDecoder: the in-process engine over spec-graph's own models.

The host loop (admission, prefill bookkeeping, step, finish, stats) is
``runtime.DecoderBase``; this class adds the models, the prefill forward and
the one-step function (eager, or compiled by the ``spec_graph`` backend).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import platform
from .config import SpecGraphConfig
from .models import load_model, parse_dtype, read_config
from .runtime import (MAX_STOP_IDS, WRITEBACK, DecoderBase, GenerationOutput, GenerationResult,  # noqa: F401
                      GenerationStats, load_tokenizer)
from .step import speculative_step

_load_tokenizer = load_tokenizer  # kept for callers of the old private name


def _eos_ids(path: str, args) -> set[int]:
    ids = set(args.eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError):
            eos = None
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return {int(i) for i in ids}


def resolve_dtype(dtype: str | torch.dtype, plat) -> torch.dtype:
    """"auto" is bfloat16 where the platform has graphs (accelerators), float32 on CPU."""
    if dtype == "auto":
        dtype = "bfloat16" if plat.supports_graphs else "float32"
    return parse_dtype(dtype)


class SpecDecoder(DecoderBase):
    capture_prefill = True  # the eager prefill launches every layer's kernels from Python

    def __init__(self, target, draft, config: SpecGraphConfig, tokenizer=None, eos_token_ids=(), plat=None):
        self.target, self.draft = target, draft
        vocab = target.args.vocab_size
        if draft.args.vocab_size != vocab:
            raise ValueError(
                f"draft vocab size {draft.args.vocab_size} differs from the target's {vocab}: "
                "speculative decoding needs a draft that shares the target's tokenizer"
            )
        device = target.model.embed_tokens.weight.device
        plat = plat or platform.get(device)
        # Graphs: compiled by the spec_graph backend; captured per bucket where the platform can.
        self.compiled = config.enable_graph if config.enable_graph is not None else plat.supports_graphs
        self._fns: dict = {}
        super().__init__(config, vocab, device, plat, tokenizer, eos_token_ids,
                         use_graphs=bool(self.compiled and plat.supports_graphs))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, target_dir, draft_dir, config: SpecGraphConfig | None = None) -> "SpecDecoder":
        config = config or SpecGraphConfig()
        _, targs = read_config(target_dir)
        _, dargs = read_config(draft_dir)
        if targs.vocab_size != dargs.vocab_size:
            raise ValueError(
                f"draft vocab size {dargs.vocab_size} ({draft_dir}) differs from the target's "
                f"{targs.vocab_size} ({target_dir}): the draft must share the target's vocabulary"
            )
        plat = platform.get(config.device)
        dtype = resolve_dtype(config.dtype, plat)
        target = load_model(target_dir, dtype, plat.device)
        draft = load_model(draft_dir, dtype, plat.device)
        return cls(target, draft, config, load_tokenizer(str(target_dir)), _eos_ids(str(target_dir), targs))

    # ------------------------------------------------------------------ the forwards
    def _new_kv_caches(self, rows: int, cache_len: int):
        return self.target.new_kv_cache(rows, cache_len), self.draft.new_kv_cache(rows, cache_len)

    def _prefill_forward(self, toks, pos, slots, lens) -> torch.Tensor:
        with torch.inference_mode():
            self.draft(toks, pos, *self.draft_kv, slots=slots)
            logits = self.target(toks, pos, *self.target_kv, slots=slots)
            return logits[torch.arange(toks.shape[0], device=toks.device), lens - 1]

    def _step_fn(self, greedy: bool):
        """The one-step function over static buffers: eager, or compiled by the spec_graph backend."""
        fn = self._fns.get(greedy)
        if fn is None:
            draft, target, K, compiled = self.draft, self.target, self.K, self.compiled

            def one_step(st, out_buf, acc_log, stop_ids, draft_kv, target_kv):
                new = speculative_step(draft, target, draft_kv, target_kv, st, out_buf, acc_log, stop_ids, K,
                                       greedy, fused=not compiled)
                for k in WRITEBACK:
                    st[k].copy_(new[k])

            fn = one_step
            if compiled:
                from .backend import spec_graph_backend

                compiled_step = torch.compile(one_step, backend=spec_graph_backend, fullgraph=True, dynamic=False,
                                              options={"capture": False, "device": self.platform.name,
                                                       "passes": dict(self.config.passes)})

                def fn(st, out_buf, acc_log, *rest):
                    # Every bucket above 1 shares one compile (size 1 is specialised anyway): the batch
                    # dimension is symbolic there, and each bucket's graph is still captured at its own size.
                    if st["tail"].shape[0] > 1:
                        for t in (*st.values(), out_buf, acc_log):
                            torch._dynamo.maybe_mark_dynamic(t, 0)
                    return compiled_step(st, out_buf, acc_log, *rest)

            self._fns[greedy] = fn
        return fn

