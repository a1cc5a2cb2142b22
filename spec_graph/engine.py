"""SpecDecoder: the in-process engine over spec-graph's own models.

The host loop (admission, prefill bookkeeping, step, finish, stats) is
``runtime.DecoderBase``; this class adds the models, the prefill forward and
the one-step function (eager, or compiled by the ``spec_graph`` backend).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from . import platform
from .adaptive import count_acceptance
from .backend import backend_compile
from .config import SpecGraphConfig, beyond_window_warning, check_device, check_path_arg, kv_fit
from .models import load_model, parse_dtype, read_config
from .models.config import eos_token_ids, pair_window, window_source
from .models.llama import kv_cache_bytes
from .prompts import MAX_STOP_IDS
# GenerationOutput/Result/Stats: spec_graph/__init__.py exports them from this module
from .results import GenerationOutput, GenerationResult, GenerationStats  # noqa: F401
from .runtime import WRITEBACK, DecoderBase, load_tokenizer
from .step import speculative_step

log = logging.getLogger("spec_graph")

# The fusion each compiled step must get (greedy: True). The fused ops come only from the passes'
# pattern match, and a step the pass no longer matches still computes the same tokens with the
# unfused reference ops: only the pass's count tells the two apart.
EXPECTED_FUSION = {True: "fuse_greedy_accept", False: "fuse_prepare_next"}
# Compiles of one function: the step's 2 modes x (batch 1, symbolic batch) x each K of "auto", or the prefill's
# (one row, symbolic rows) x each architecture and cache shape in the process, with room to spare.
RECOMPILE_LIMIT = 64


def check_fusions(reports: list, expected: str, mode: str, warned: set) -> None:
    """Warn (once per pass in `warned`) when a compile's pass counts in `reports` (what the backend's
    ``on_passes`` received, one entry per compile) show that `expected` did not fire."""
    for counts in reports:
        if counts is None:
            # The passes did not run: inductor's FX graph cache (or AOT autograd cache) served the graph.
            # Nothing to count, and nothing to fear: a hit means an identical graph was compiled before with
            # passes of identical uuids (the cache key holds PassManager.uuid() and the torch version); that
            # compile ran the passes, and this check saw their count.
            log.debug("spec-graph: the compiled %s step came from inductor's cache: its fusion passes did not run, "
                      "no count to check", mode)
        elif counts.get(expected, 0) < 1 and expected not in warned:
            warned.add(expected)
            log.warning(
                "spec-graph: fusion pass %s replaced nothing in the compiled %s step (counts %s): the step runs "
                "the unfused reference ops instead of the fused kernel -- same tokens, more kernels. The pass "
                "matches the graph torch %s produces from step.py, so a torch change can break the match; "
                "SpecGraphConfig(passes={%r: False}) turns the pass and this check off.",
                expected, mode, counts, torch.__version__, expected)


def _eos_ids(path: str, args) -> set[int]:
    """The ids that end a request, as transformers' generate reads them: generation_config.json's where the file
    exists (config.json's are then not used, and a file without the field names none), else config.json's."""
    gen = Path(path) / "generation_config.json"
    if not gen.is_file():
        return _few_enough({int(i) for i in args.eos_token_ids}, Path(path) / "config.json")
    try:
        cfg = json.loads(gen.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{gen} is not valid JSON ({e}): fix or remove it") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{gen} must hold a JSON object (such as {{\"eos_token_id\": 2}}), got "
                         f"{type(cfg).__name__}")
    return _few_enough({int(i) for i in eos_token_ids(cfg.get("eos_token_id"), str(gen))}, gen)


def _few_enough(ids: set[int], where: Path) -> set[int]:
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"{where}: field 'eos_token_id' names {len(ids)} EOS ids, but a request takes at most "
                         f"{MAX_STOP_IDS} stop ids in all: shorten that list")
    return ids


def _check_kv_memory(config: SpecGraphConfig, models, plat) -> None:
    """Refuse, by its settings, KV caches larger than the device's free memory (instead of the allocator's
    error): both models' caches for the slots of the largest bucket and the cache length."""
    rows, cache_len = config.bucket_for(config.max_batch_size), config.cache_len
    need = sum(kv_cache_bytes(m.args, rows, cache_len, m.model.embed_tokens.weight.element_size()) for m in models)
    have = plat.free_memory()
    if need > have:
        fit_len, fit_rows = kv_fit(need, have, rows, cache_len, config.max_k)
        # the caches hold the bucket of max_batch_size: the largest that fits is a bucket, or a size above them all
        fit_batch = fit_rows if fit_rows > config.batch_buckets[-1] else max(
            (b for b in config.batch_buckets if b <= fit_rows), default=0)
        len_hint = f"at most {fit_len} fits" if fit_len >= 2 else "none fits"
        batch_hint = f"at most {fit_batch} fits" if fit_batch >= 1 else "none fits"
        raise ValueError(f"the KV caches need {need / 2**30:.2f} GiB (max_batch_size={config.max_batch_size}, "
                         f"max_len={config.max_len}) but {have / 2**30:.2f} GiB are free on {plat.name}: lower "
                         f"max_len (--max-len; {len_hint} with max_batch_size={config.max_batch_size}) or "
                         f"max_batch_size (--max-batch-size; {batch_hint} with max_len={config.max_len})")


def _checked(config) -> SpecGraphConfig:
    if not isinstance(config, SpecGraphConfig):
        raise ValueError(f"config must be a SpecGraphConfig, got {type(config).__name__}: write "
                         f"config=SpecGraphConfig(...), e.g. SpecGraphConfig(num_speculative_tokens=4)")
    return config.checked()


def _check_checkpoint_path(name: str, path) -> None:
    # read_config would fail inside pathlib (None, an int) or read "" as the current folder
    check_path_arg(path, f"{name} must be a checkpoint directory")
    if not str(path).strip():
        raise ValueError(f"{name} must name a checkpoint directory, got {path!r}")


def resolve_dtype(dtype: str | torch.dtype, plat) -> torch.dtype:
    """"auto" is bfloat16 where the platform has graphs (accelerators), float32 on CPU."""
    if dtype == "auto":
        dtype = "bfloat16" if plat.supports_graphs else "float32"
    return parse_dtype(dtype)


def prefill_models(draft, target, toks, pos, slots, lens, draft_k, draft_v, target_k, target_v,
                   any_len: bool = False) -> torch.Tensor:
    """Both models' prefill forwards over positions [0, T) (attention reads that much of the caches, not
    max_len): writes their caches at the rows' slots and returns the target's float32 logits at lens - 1.
    any_len: no branch on T (compiled with T symbolic)."""
    T = toks.shape[1]
    kw = dict(slots=slots, kv_len=T, logits_at=lens - 1, any_len=any_len, causal=True)
    draft(toks, pos, draft_k, draft_v, **kw)
    return target(toks, pos, target_k, target_v, **kw)


_COMPILED_PREFILLS: dict = {}


def compiled_prefill(device: str, passes: dict):
    """prefill_models compiled by the spec_graph backend, one wrapper per (device, passes): a wrapper of its own
    per engine would compile the same forward again for each."""
    key = (device, tuple(sorted(passes.items())))
    fn = _COMPILED_PREFILLS.get(key)
    if fn is None:
        # emulate_precision_casts: inductor rounds where the eager modules round (RMSNorm's casts, say), so that
        # the compiled prefill computes what the eager one does
        fn = _COMPILED_PREFILLS[key] = backend_compile(prefill_models, device, passes,
                                                       {"emulate_precision_casts": True})
    return fn


class SpecDecoder(DecoderBase):
    capture_prefill = True  # the eager prefill launches every layer's kernels from Python
    # and a compiled engine on a graph platform compiles it (some 45 kernels a layer become a handful): one
    # compile with rows and length symbolic (two: one row is a shape of its own), on the first long prefill
    compile_prefill = True

    def __init__(self, target, draft, config: SpecGraphConfig, tokenizer=None, eos_token_ids=(), plat=None):
        config = _checked(config)
        self.target, self.draft = target, draft
        vocab = target.args.vocab_size
        if draft.args.vocab_size != vocab:
            raise ValueError(
                f"draft vocab size {draft.args.vocab_size} differs from the target's {vocab}: "
                "speculative decoding needs a draft that shares the target's tokenizer"
            )
        device = target.model.embed_tokens.weight.device
        plat = plat or platform.get(device)
        # The pair's window: the default max_len is lowered to it; one chosen above it is kept, with a warning.
        self.window = pair_window(target.args, draft.args)
        self.window_source = window_source(target.args, draft.args, getattr(target, "checkpoint_dir", None),
                                           getattr(draft, "checkpoint_dir", None))
        if config.max_len > self.window:
            if getattr(config, "max_len_given", True):
                scaled = target.args.rope_scaling or draft.args.rope_scaling
                log.warning("spec-graph: %s", beyond_window_warning(config.max_len, self.window, scaled,
                                                                    self.window_source))
            else:
                config = dataclasses.replace(config, max_len=self.window)
        _check_kv_memory(config, (target, draft), plat)
        # Graphs: compiled by the spec_graph backend; captured per bucket where the platform can.
        self.compiled = config.enable_graph if config.enable_graph is not None else plat.supports_graphs
        self._fns: dict = {}
        # {"greedy" | "sampling": the passes' counts of each compile of that step (None: served from cache)}
        self.pass_counts: dict[str, list] = {}
        self._fusion_warned: set = set()  # passes warned about (once per engine and pass)
        super().__init__(config, vocab, device, plat, tokenizer, eos_token_ids,
                         use_graphs=bool(self.compiled and plat.supports_graphs))
        self.span_steps = not self.compiled  # an eager step reads the caches up to its rows' span alone

    def _timing_identity(self) -> str:
        """What adaptive K's step times depend on: both models' shapes (not their weights), the config, the device
        and the versions of what compiles and runs the steps, and the kernels' launch settings."""
        import hashlib
        import sys

        from . import __version__
        from .kernels import launch_key

        weights = [str(m.model.embed_tokens.weight.dtype) for m in (self.target, self.draft)]
        parts = [repr(self.target.args), repr(self.draft.args), repr(self.config), weights, str(self.device),
                 self.platform.device_name(), torch.get_num_threads() if self.device.type == "cpu" else None,
                 self.compiled, self.graphs is not None, torch.__version__,
                 getattr(sys.modules.get("triton"), "__version__", None), __version__, launch_key()]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, target_dir, draft_dir, config: SpecGraphConfig | None = None) -> "SpecDecoder":
        for name, d in (("target_dir", target_dir), ("draft_dir", draft_dir)):
            _check_checkpoint_path(name, d)
        config = _checked(config or SpecGraphConfig())
        check_device(config.device)
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
    def _reads_live_only(self) -> bool:
        # Prefills read [0, kv_len), all written by that prefill; steps of up to K + 2 positions attend through
        # the live-length kernel where both models take it (positions past a row's length are never loaded).
        return all(m.model.layers[0].self_attn.decode_attention_for(self.K + 2, self.device)
                   for m in (self.target, self.draft))

    def _new_kv_caches(self, rows: int, cache_len: int):
        return self.target.new_kv_cache(rows, cache_len), self.draft.new_kv_cache(rows, cache_len)

    def _compiles_prefill(self, n: int, T: int) -> bool:
        """Whether a prefill of n rows of T positions runs the compiled forward: on a compiled engine with graphs,
        at the shapes that replay a graph (a long prompt's own kernels outlast their launches), past the few
        positions that attend through the decode kernels (their forward is already a few kernels a layer)."""
        return (self.compile_prefill and self.compiled and self.graphs is not None and self._graph_shape(n, T)
                and not any(m.model.layers[0].self_attn.decode_attention_for(T, self.device)
                            for m in (self.target, self.draft)))

    def _prefill_forward(self, toks, pos, slots, lens) -> torch.Tensor:
        with torch.inference_mode():
            if self._compiles_prefill(*toks.shape):
                try:
                    return self._compiled_prefill_forward(toks, pos, slots, lens)
                except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
                    # a compile failed before anything ran: this engine's prefills run the eager forward from now on
                    self.compile_prefill = False
                    log.warning("spec-graph: the prefill's compile failed (%s: %s); prefills run the eager forward",
                                type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return prefill_models(self.draft, self.target, toks, pos, slots, lens, *self.draft_kv, *self.target_kv)

    def _compiled_prefill_forward(self, toks, pos, slots, lens) -> torch.Tensor:
        fwd = compiled_prefill(self.platform.name, self.config.passes)
        # inference tensors all (guards tell them from normal ones: a mix would compile again)
        toks, pos, slots, lens = (t if t.is_inference() else t.clone() for t in (toks, pos, slots, lens))
        for t in (toks, pos, slots, lens):  # rows and length symbolic: one compile serves every graph shape
            for d in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, d)
        # Engines of one architecture share the compile; others (and cache shapes) add entries to it.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return fwd(self.draft, self.target, toks, pos, slots, lens, *self.draft_kv, *self.target_kv, True)

    def _step_fn(self, greedy: bool, K: int | None = None):
        """The one-step function of K drafts (default: the largest) over static buffers: eager, or compiled by
        the spec_graph backend."""
        K = self.K if K is None else K
        fn = self._fns.get((greedy, K))
        if fn is None:
            draft, target, compiled = self.draft, self.target, self.compiled
            verification = self.config.verification

            rows = self.rows

            def one_step(st, out_buf, acc_log, stop_ids, draft_kv, target_kv, kv_len=None):
                # No batch exceeds the engine's rows: said inside the graph, so that what holds for every batch up
                # to them (the fused decode layers' row limit, say) is known from the symbolic batch's range
                torch._check(st["tail"].shape[0] <= rows)
                new = speculative_step(draft, target, draft_kv, target_kv, st, out_buf, acc_log, stop_ids, K,
                                       greedy, fused=not compiled, verification=verification, kv_len=kv_len)
                if "k_counts" in st:  # "auto": inside the compiled step, where it fuses into a kernel or two
                    count_acceptance(st["k_counts"], new["accepted"], K)
                for k in WRITEBACK:
                    st[k].copy_(new[k])

            fn = one_step
            if compiled:
                mode, expected = ("greedy" if greedy else "sampling"), EXPECTED_FUSION[greedy]
                check = bool(self.config.passes.get(expected, True))  # a pass turned off is not expected
                seen, warned = self.pass_counts.setdefault(mode, []), self._fusion_warned
                reports: list = []  # filled by the backend during a compile, drained right after it
                # the step is replayed from graphs: its kernels stay opaque, for a compile per K less than half as
                # long (the backend's opaque_kernels)
                compiled_step = backend_compile(one_step, self.platform.name, self.config.passes,
                                                on_passes=reports.append,
                                                opaque_kernels=self.platform.supports_graphs)

                def fn(st, out_buf, acc_log, *rest):
                    # Every bucket above 1 shares one compile (size 1 is specialised anyway): the batch
                    # dimension is symbolic there, and each bucket's graph is still captured at its own size.
                    if st["tail"].shape[0] > 1:
                        for t in (*st.values(), out_buf, acc_log):
                            torch._dynamo.maybe_mark_dynamic(t, 0)
                    # One function compiled per (mode, K, batch 1 or symbolic): past dynamo's default limit
                    # on recompiles of one function with "auto", so the limit is raised for these calls only.
                    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                        out = compiled_step(st, out_buf, acc_log, *rest)
                    # A compile happens inside a call (the first, a new bucket shape, a recompile) and leaves its
                    # counts here. Host-side Python only, no device read; any other call: one empty-list test.
                    if reports:
                        seen.extend(reports)
                        if check:
                            check_fusions(reports, expected, mode, warned)
                        reports.clear()
                    return out

            self._fns[(greedy, K)] = fn
        return fn

