"""Offline export of the speculative step (``spec-graph export``); its loader, ``load_exported``, is in
export_load.py (and importable from here).

The package is one zip file (conventionally ``.pt2``) holding:

- ``metadata.json``: the format marker, K, the batch sizes, max_len, dtype,
  device, eos ids, vocab size, the KV-cache shapes, the weight names in call
  order, the steps it holds (``steps``: mode -> batch size -> artifact), a
  sha256 of every other member (``sha256``, checked before anything is
  loaded), a sha256 of each model's config.json and weights, the seconds each
  artifact took to build, the spec-graph and torch versions it was built with,
  and ``metadata_sha256``: the sha256 of the rest of this file as canonical JSON
  (``export_load.metadata_sha256``), checked at load;
- ``weights.safetensors``: both models' weights, stored ONCE;
- ``aoti/prefill.pt2``, ``aoti/step_greedy.pt2`` and, exported with
  ``sampling=True`` (``--sampling``), ``aoti/step_sample.pt2``: AOTInductor
  packages (``torch._inductor.aoti_compile_and_package``, generated C++
  sources emptied: loading needs only the compiled library) with NO constants:
  the weights are inputs of every exported function (``torch.func.functional_call``
  over a flat tuple), so every artifact shares the one weights file. A step's
  batch dimension is symbolic (1..rows), so one artifact serves every exported
  batch size; where torch cannot export it so, the step is exported once per
  batch size instead (``step_{mode}_b{B}``), and ``steps`` says which;
- ``tokenizer.json`` when the target has one.

Runner contract (what ``load_exported`` does and any other runner must do):
the runner owns every buffer and passes it on each call; the exported
functions update them IN PLACE and return nothing else (the prefill returns
logits).

- weights: the tensors of ``weights.safetensors`` in ``metadata["weights"]``
  order (target's, then draft's), on the export's device. Among them each
  model's ``linear_sync`` (int32 zeros: the fused linear kernels' split-K
  counters), which a CUDA step writes in place and leaves zero: calls that
  may run at the same time (two streams) each need their own copy of it;
- KV caches ``draft_k, draft_v, target_k, target_v``: zeros of the shapes and
  dtypes in ``metadata["kv_cache"]`` (``[layers, rows, kv_heads, cache_len,
  head_dim]``, rows = the largest batch size); a slot is zeroed before its prefill;
- prefill ``(*weights, toks [n,T], pos [n,T], slots [n], lens [n], span [T], *kv) ->
  float32 logits [n, V]`` at each prompt's last token; n in 1..rows and T in
  1..cache_len - 1 are dynamic (one artifact: a compile per power-of-two length
  would multiply compile time, and the dynamic-shape export compiles reliably);
  ``span``: any int64 tensor of length T (its length alone is read), the cache
  positions attention reads: a second symbolic length, as the prompt's own
  would need guards over [T, T] shapes that export cannot prove;
- step for batch size B ``(*weights, *state, out_buf, acc_log, stop_ids, *kv)``:
  ``state`` is ``step.STATE_FIELDS`` in order, each the first B rows of a
  ``[rows]``-leading buffer; ``out_buf``/``acc_log`` ``[B, max_len]`` int64;
  ``stop_ids [64]`` int64 padded with -1. One speculative step, exactly
  ``step.speculative_step`` with the fused ``spec_graph::`` ops (on CUDA their
  Triton kernels are compiled into the artifact; on CPU they lower to their
  torch references); sampled drafts are verified token by token.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from . import __version__
from .backend import known_inductor_configs, lazy_operator_text
from .config import SpecGraphConfig
from .elf import _elf_needed, static_cxx_runtime as _static_cxx_runtime  # noqa: F401
from .export_load import (FORMAT, FORMAT_VERSION, KV_NAMES, META, META_SHA256, TOKENIZER, WEIGHTS,  # noqa: F401
                          ExportedRunner, ExportError, load_exported, metadata_sha256, read_metadata)
from .export_progress import _Progress
from .runtime import WRITEBACK
from .step import STATE_FIELDS

MODES = ("greedy", "sample")  # the step variants, by their artifact names (step_greedy, step_sample)
# Line tables only help profilers; without them each artifact's .so is about a third the size.
# Older torch (2.11) lacks the option, and AOTInductor refuses keys it does not know.
_WANTED_INDUCTOR_CONFIGS = {"aot_inductor.enable_line_tables": False}
# CPU exports only. Inductor inlines a pointwise computation of up to realize_opcount_threshold ops (default 30)
# into each of its consumers; the sampling step's counter-based hash (kernels/rng.py) then makes the C++ codegen
# trace huge loop bodies again and again: 170 s of Python codegen for the tiny test pair's sampling step, 20 s
# at 16 (greedy step and prefill unchanged). CUDA exports keep the default (their kernels' fusion is untested
# with it).
_WANTED_CPU_INDUCTOR_CONFIGS = {"realize_opcount_threshold": 16}
log = logging.getLogger("spec_graph")


def _inductor_configs(device_type: str | None = None) -> dict:
    """The wanted AOTInductor options for ``device_type`` that this torch knows (an unknown key is an error there)."""
    wanted = dict(_WANTED_INDUCTOR_CONFIGS)
    if device_type == "cpu":
        wanted.update(_WANTED_CPU_INDUCTOR_CONFIGS)
    return known_inductor_configs(wanted)


def check_output_path(out) -> Path:
    """``out`` as a Path, after checking that an export can be written there: a ``.pt2`` file name in an
    existing, writable folder. Called before any work, so that a bad ``-o`` does not fail after the compile."""
    if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
        raise ExportError(f"the output must be a file name ending in .pt2 (e.g. pair.pt2), got {out!r}")
    out = Path(out)
    if out.is_dir():
        raise ExportError(f"the output {str(out)!r} is a folder: name the package file, e.g. {str(out / 'pair.pt2')!r}")
    if out.suffix != ".pt2":
        raise ExportError(f"the output {str(out)!r} must be a file name ending in .pt2 (e.g. pair.pt2)")
    folder = out.parent
    if not folder.is_dir():
        raise ExportError(f"the output folder {str(folder)!r} does not exist: create it first "
                          f"(mkdir -p {folder}) or write the package elsewhere")
    try:  # the real test (permissions, a read-only file system, root's exemption from the mode bits)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{out.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise ExportError(f"cannot write into the output folder {str(folder)!r} ({e.strerror or e}): "
                          "choose a writable folder") from None
    return out


def _model_tensors(model, prefix: str) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.{n}": p for n, p in model.named_parameters()}
    out.update({f"{prefix}.{n}": b for n, b in model.named_buffers()})
    return out


def _sha256_tensors(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _model_record(ckpt_dir, tensors: dict[str, torch.Tensor]) -> dict:
    from .models import read_config

    return {"architecture": read_config(ckpt_dir)[1].architecture,
            "config_sha256": hashlib.sha256((Path(ckpt_dir) / "config.json").read_bytes()).hexdigest(),
            "weights_sha256": _sha256_tensors(tensors)}


def _strip_sources(package: Path) -> None:
    """Empty the generated C++ sources of an AOTInductor package: loading needs only the compiled library.

    The entries stay, empty: older loaders (torch 2.11) find the model's metadata by the source's name."""
    kept = package.with_suffix(".stripped")
    with zipfile.ZipFile(package) as zin, zipfile.ZipFile(kept, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, b"" if item.filename.endswith(".cpp") else zin.read(item.filename))
    os.replace(kept, package)


def _check_cxx_runtime(package: Path) -> None:
    lib = _static_cxx_runtime(package)
    if lib is None:
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
    except Exception:  # noqa: BLE001 - only for the message
        cxx = os.environ.get("CXX", "g++")
    raise ExportError(
        f"the C++ compiler {cxx!r} linked libstdc++ statically into the AOTInductor library {lib}; torch uses "
        "the shared libstdc++, and such a library crashes the process when it is loaded. Set CXX to a g++ that "
        "links libstdc++ dynamically (usually the system one: CXX=/usr/bin/g++) and export again"
    )


class _Fn(torch.nn.Module):
    """A module around a plain function, so that torch.export lifts no parameters (the weights are inputs)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *flat):
        return self.fn(*flat)


def _split_weights(flat, names_t, names_d):
    nt, nd = len(names_t), len(names_d)
    strip = lambda names: [n.split(".", 1)[1] for n in names]  # noqa: E731
    return (dict(zip(strip(names_t), flat[:nt])), dict(zip(strip(names_d), flat[nt:nt + nd])), flat[nt + nd:])


# torch's own copy of an exported graph inside aoti_compile_and_package warns of its own deprecated pytree check,
# once per artifact; nothing a caller can change. Other warnings pass.
TREESPEC_NOTICE = r".*isinstance\(treespec, LeafSpec\)` is deprecated"


@contextmanager
def _without_torch_treespec_notice():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TREESPEC_NOTICE, category=FutureWarning)
        yield


@contextmanager
def _torch_references_on_cpu(device: torch.device):
    # The interpreter would trace the Triton kernels, which a CPU AOTInductor artifact cannot run.
    old = os.environ.get("TRITON_INTERPRET")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if device.type == "cpu":
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def export_pair(target_dir, draft_dir, out, num_speculative_tokens: int = 4, batch_sizes=(1, 4, 8),
                max_len: int | None = None, dtype: str = "auto", device: str | None = None, progress: bool = True,
                stream=None, sampling: bool = False) -> dict:
    """Export the prefill and the greedy step (and, with ``sampling=True``, the sampling step) to ``out``.

    Each step is one artifact for every batch size (its batch dimension symbolic); returns the metadata."""
    from .engine import SpecDecoder
    from .step import speculative_step

    out = check_output_path(out)
    stream = stream or sys.stderr
    t_start = time.perf_counter()
    try:
        sizes = sorted({int(b) for b in batch_sizes})
    except (TypeError, ValueError):
        raise ExportError(f"batch sizes must be positive integers, got {batch_sizes!r}") from None
    if not sizes or sizes[0] < 1:
        raise ExportError(f"batch sizes must be positive integers, got {list(batch_sizes)!r}")
    if isinstance(num_speculative_tokens, str) and num_speculative_tokens.strip().lower() == "auto":
        raise ExportError("an exported package fixes K: num_speculative_tokens='auto' (-k auto) needs the in-process "
                          "engine; export with a fixed K, such as -k 4")
    modes = MODES if sampling else MODES[:1]
    cfg = SpecGraphConfig(num_speculative_tokens=num_speculative_tokens, max_batch_size=sizes[-1], max_len=max_len,
                          dtype=dtype, device=device, batch_buckets=tuple(sizes), enable_graph=False)
    dec = SpecDecoder.from_pretrained(target_dir, draft_dir, cfg)
    K, dev = dec.K, dec.device
    tw, dw = _model_tensors(dec.target, "target"), _model_tensors(dec.draft, "draft")
    names_t, names_d = list(tw), list(dw)
    weights = (*tw.values(), *dw.values())
    target, draft = dec.target, dec.draft
    fcall = torch.func.functional_call

    def prefill(*flat):
        wt, wd, (toks, pos, slots, lens, span, dk, dv, tk, tv) = _split_weights(flat, names_t, names_d)
        kv_len = span.shape[0]  # positions [0, T): attention reads that much of the caches, not max_len
        last = {"slots": slots, "kv_len": kv_len, "logits_at": lens - 1, "causal": True}
        fcall(draft, wd, (toks, pos, dk, dv), last)
        return fcall(target, wt, (toks, pos, tk, tv), last)

    def make_step(greedy: bool):
        def step(*flat):
            wt, wd, rest = _split_weights(flat, names_t, names_d)
            st = dict(zip(STATE_FIELDS, rest[:len(STATE_FIELDS)]))
            out_buf, acc_log, stop_ids, dk, dv, tk, tv = rest[len(STATE_FIELDS):]
            new = speculative_step(lambda *a, **k: fcall(draft, wd, a, k), lambda *a, **k: fcall(target, wt, a, k),
                                   (dk, dv), (tk, tv), st, out_buf, acc_log, stop_ids, K, greedy, fused=True)
            for k in WRITEBACK:
                st[k].copy_(new[k])
        return step

    def step_args(B: int) -> tuple:
        st, out_buf, acc_log, stop_buf, dkv, tkv = dec._step_args(B)
        return (*weights, *(st[k] for k in STATE_FIELDS), out_buf, acc_log, stop_buf, *dkv, *tkv)

    # The step's batch dimension: symbolic over 1..rows where there is more than one row, so that one artifact
    # serves every batch size (the example has all rows: a size-1 example would specialise it).
    dynamic = dec.rows > 1
    bdim = torch.export.Dim("B", min=1, max=dec.rows) if dynamic else None
    per_row = {0: bdim}
    step_ds = ((None,) * len(weights) + (per_row,) * len(STATE_FIELDS) + (per_row, per_row, None) + (None,) * 4,)
    bar = _Progress(stream, progress, ["export", "compile prefill"]
                    + [s for m in modes for s in ("export", f"compile {m}")])
    configs = _inductor_configs(dev.type)
    artifacts: dict[str, dict] = {}
    steps: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="spec-graph-export-") as tmp, _torch_references_on_cpu(dev):
        def export_program(b, kind: str, fn, args, dynamic_shapes=None):
            t0 = time.perf_counter()
            with b.stage(f"export {kind}"), torch.no_grad():
                ep = torch.export.export(_Fn(fn), args, dynamic_shapes=dynamic_shapes, strict=False)
            return ep, time.perf_counter() - t0

        def compile_program(b, kind: str, name: str, ep, export_s: float, served: list[int]) -> None:
            fused = sorted({str(n.target) for n in ep.graph.nodes
                            if n.op == "call_function" and str(n.target).startswith("spec_graph.")})
            path = Path(tmp) / f"{name}.pt2"
            t0 = time.perf_counter()
            with b.stage(f"compile {kind}"), lazy_operator_text(), _without_torch_treespec_notice():
                torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=dict(configs))
                _check_cxx_runtime(path)
                _strip_sources(path)
            artifacts[name] = {"file": f"aoti/{name}.pt2", "fused_ops": fused, "batch_sizes": served,
                               "seconds": {"export": round(export_s, 1), "compile": round(time.perf_counter() - t0, 1)}}

        n_ex, t_ex = min(2, dec.rows), min(4, dec.cache_len)
        toks = torch.zeros(n_ex, t_ex, dtype=torch.long, device=dev)
        pos = torch.arange(t_ex, device=dev).expand(n_ex, t_ex).contiguous()
        ex = (*weights, toks, pos, torch.arange(n_ex, device=dev), torch.full((n_ex,), t_ex, device=dev),
              torch.arange(t_ex, device=dev), *dec.draft_kv, *dec.target_kv)
        n_dim = torch.export.Dim("n", min=1, max=dec.rows) if dec.rows > 1 else None
        t_dim = torch.export.Dim("T", min=1, max=dec.cache_len)
        seq = {0: n_dim, 1: t_dim} if n_dim is not None else {1: t_dim}
        per_prompt = {0: n_dim} if n_dim is not None else None
        span = {0: torch.export.Dim("L", min=1, max=dec.cache_len - 1)}  # below cache_len: a slice, not all of it
        ds = ((None,) * len(weights) + (seq, seq, per_prompt, per_prompt, span) + (None,) * 4,)  # forward(*flat)
        with bar.bucket("prefill", 2) as b:
            compile_program(b, "prefill", "prefill", *export_program(b, "prefill", prefill, ex, ds), served=sizes)

        for mode in modes:
            fn = make_step(mode == "greedy")
            if dynamic:
                with bar.bucket(mode, 2) as b:
                    try:
                        ep, export_s = export_program(b, mode, fn, step_args(dec.rows), step_ds)
                        compile_program(b, mode, f"step_{mode}", ep, export_s, sizes)
                    except ExportError:
                        raise  # the toolchain's fault: a per-size compile would fail alike
                    except Exception as e:  # noqa: BLE001 - any reason: a per-size export fails with its own
                        b.status = "batch not dynamic"
                        log.warning("spec-graph export: the %s step's batch dimension cannot be symbolic (%s); "
                                    "exporting it once per batch size (%d compiles)", mode, _one_line(e), len(sizes))
                        if b.done < 2:  # the compile did not run
                            bar.plan([f"compile {mode}"], add=False)
                        bar.plan(["export", f"compile {mode}"] * len(sizes))
                    else:
                        steps[mode] = {str(B): f"step_{mode}" for B in sizes}
                        continue
            steps[mode] = {}
            for B in sizes:
                name, label = (f"step_{mode}", mode) if len(sizes) == 1 else (f"step_{mode}_b{B}", f"{mode} b={B}")
                with bar.bucket(label, 2) as b:
                    compile_program(b, mode, name, *export_program(b, mode, fn, step_args(B)), served=[B])
                steps[mode][str(B)] = name

        from safetensors.torch import save as st_save

        state = {n: t.detach().contiguous().cpu() for n, t in {**tw, **dw}.items()}
        blob = st_save(state)
        tok_file = Path(target_dir) / TOKENIZER
        tok = tok_file.read_bytes() if tok_file.is_file() else None
        members = {WEIGHTS: blob, **({TOKENIZER: tok} if tok is not None else {}),
                   **{a["file"]: (Path(tmp) / f"{name}.pt2").read_bytes() for name, a in artifacts.items()}}
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "spec_graph_version": __version__, "torch_version": torch.__version__,
            "num_speculative_tokens": K, "batch_sizes": sizes, "max_len": dec.config.max_len, "window": dec.window,
            "rows": dec.rows,
            "cache_len": dec.cache_len, "dtype": str(tw[names_t[0]].dtype).removeprefix("torch."),
            "device": dev.type, "vocab_size": dec.vocab_size, "eos_token_ids": list(dec.eos_token_ids),
            "weights": names_t + names_d, "weight_bytes": len(blob),
            "kv_cache": {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                         for n, t in zip(KV_NAMES, (*dec.draft_kv, *dec.target_kv))},
            "models": {"target": _model_record(target_dir, tw), "draft": _model_record(draft_dir, dw)},
            "steps": steps,
            "artifacts": artifacts,
            "sha256": {n: hashlib.sha256(data).hexdigest() for n, data in members.items()},
            "inductor_configs": configs,
            "tokenizer": tok is not None,
        }
        meta = json.loads(json.dumps(meta))  # as the loader will read it back (string keys, lists)
        meta[META_SHA256] = metadata_sha256(meta)
        partial = out.with_name(out.name + ".partial")
        try:
            with zipfile.ZipFile(partial, "w") as z:
                z.writestr(META, json.dumps(meta, indent=1), compress_type=zipfile.ZIP_DEFLATED)
                for n, data in members.items():
                    z.writestr(n, data, compress_type=zipfile.ZIP_STORED if n == WEIGHTS else zipfile.ZIP_DEFLATED)
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
    size = out.stat().st_size
    if progress:
        batch = f"batch {sizes[0]}" if len(sizes) == 1 else f"batch sizes {', '.join(map(str, sizes))}"
        only = "" if sampling else "; greedy only: --sampling adds the sampling step"
        stream.write(f"spec-graph export: wrote {out} ({size / 2**20:.1f} MiB, {size / len(blob):.2f}x the "
                     f"{len(blob) / 2**20:.1f} MiB of weights; {len(artifacts)} artifacts: {', '.join(artifacts)} "
                     f"for {batch}{only}) in {time.perf_counter() - t_start:.1f}s\n")
        stream.flush()
    return meta


__all__ = ["ExportError", "ExportedRunner", "check_output_path", "export_pair", "load_exported", "read_metadata"]
