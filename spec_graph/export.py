"""Offline export of the speculative step (``spec-graph export``) and its loader (``load_exported``).

The package is one zip file (conventionally ``.pt2``) holding:

- ``metadata.json``: the format marker, K, the batch sizes, max_len, dtype,
  device, eos ids, vocab size, the KV-cache shapes, the weight names in call
  order, a sha256 of each model's config.json and weights, and the spec-graph
  and torch versions it was built with;
- ``weights.safetensors``: both models' weights, stored ONCE;
- ``aoti/prefill.pt2`` and ``aoti/step_{greedy,sample}_b{B}.pt2``: AOTInductor
  packages (``torch._inductor.aoti_compile_and_package``, generated C++ sources
  emptied: loading needs only the compiled library) with NO constants:
  the weights are inputs of every exported function (``torch.func.functional_call``
  over a flat tuple), so every bucket and the prefill share the one weights file;
- ``tokenizer.json`` when the target has one.

Runner contract (what ``load_exported`` does and any other runner must do):
the runner owns every buffer and passes it on each call; the exported
functions update them IN PLACE and return nothing else (the prefill returns
logits).

- weights: the tensors of ``weights.safetensors`` in ``metadata["weights"]``
  order (target's, then draft's), on the export's device;
- KV caches ``draft_k, draft_v, target_k, target_v``: zeros of the shapes and
  dtypes in ``metadata["kv_cache"]`` (``[layers, rows, kv_heads, cache_len,
  head_dim]``, rows = the largest batch size); a slot is zeroed before its prefill;
- prefill ``(*weights, toks [n,T], pos [n,T], slots [n], lens [n], *kv) ->
  float32 logits [n, V]`` at each prompt's last token; n in 1..rows and T in
  1..cache_len are dynamic (one artifact: a compile per power-of-two length
  would multiply compile time, and the dynamic-shape export compiles reliably);
- step for batch size B ``(*weights, *state, out_buf, acc_log, stop_ids, *kv)``:
  ``state`` is ``step.STATE_FIELDS`` in order, each the first B rows of a
  ``[rows]``-leading buffer; ``out_buf``/``acc_log`` ``[B, max_len]`` int64;
  ``stop_ids [64]`` int64 padded with -1. One speculative step, exactly
  ``step.speculative_step`` with the fused ``spec_graph::`` ops (on CUDA their
  Triton kernels are compiled into the artifact; on CPU they lower to their
  torch references).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from . import __version__, platform
from .config import SpecGraphConfig
from .runtime import WRITEBACK, DecoderBase
from .step import STATE_FIELDS

FORMAT = "spec-graph-export"
FORMAT_VERSION = 1
META, WEIGHTS, TOKENIZER = "metadata.json", "weights.safetensors", "tokenizer.json"
# Line tables only help profilers; without them each artifact's .so is about a third the size.
# Older torch (2.11) lacks the option, and AOTInductor refuses keys it does not know.
_WANTED_INDUCTOR_CONFIGS = {"aot_inductor.enable_line_tables": False}


def _inductor_configs() -> dict:
    """The wanted AOTInductor options this torch knows (an unknown key is an error there)."""
    from torch._inductor import config

    known = {}
    for key, value in _WANTED_INDUCTOR_CONFIGS.items():
        try:
            config.__getattr__(key)  # dotted names resolve through the config module's own lookup
        except AttributeError:
            continue
        known[key] = value
    return known


_KV_NAMES = ("draft_k", "draft_v", "target_k", "target_v")


class ExportError(ValueError):
    """An export that cannot be written or loaded; the message names the problem and the fix."""


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


def _elf_needed(data: bytes) -> list[str] | None:
    """The DT_NEEDED libraries of a 64-bit little-endian ELF shared object; None for anything else."""
    if data[:6] != b"\x7fELF\x02\x01":
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _, sh_type, _, _, off, size, link, _ in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        stroff = sections[link][4]
        for at in range(off, off + size, 16):
            tag, val = struct.unpack_from("<qQ", data, at)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                needed.append(data[stroff + val: data.index(b"\0", stroff + val)].decode())
    return needed


def _process_links_libstdcxx() -> bool:
    try:
        return "libstdc++.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _static_cxx_runtime(package) -> str | None:
    """The AOTInductor library in ``package`` (a path or the bytes of one) with its own libstdc++, if any.

    torch runs on the shared libstdc++; a library built with a statically linked
    one (some toolchains' g++ default to it) resolves part of its C++ runtime to
    the process's copy and crashes on load, in std::regex in the model's
    constructor, with no Python error. So export and load check it first."""
    if not _process_links_libstdcxx():
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(package) if isinstance(package, bytes) else package) as z:
            for name in z.namelist():
                needed = _elf_needed(z.read(name)) if name.endswith(".so") else None
                if needed is not None and not any(n.startswith(("libstdc++.so", "libc++.so")) for n in needed):
                    return Path(name).name
    except (zipfile.BadZipFile, ValueError, IndexError, struct.error):
        return None  # damaged: the loader reports it
    return None


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


class _Progress:
    """One bar per compiled bucket: redrawn in place on a terminal, one line per finished bucket otherwise."""

    def __init__(self, stream, enabled: bool):
        self.stream, self.enabled = stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()

    @contextmanager
    def bucket(self, label: str, n_stages: int):
        """Yields ``stage(what)``, a context manager around one of the bucket's ``n_stages`` stages."""
        t0, done = time.perf_counter(), [0]

        def draw(what: str, final: bool = False):
            if not self.enabled or not (self.tty or final):
                return
            fill = 24 * done[0] // n_stages
            line = (f"  {label:<8} [{'#' * fill}{'.' * (24 - fill)}] {done[0]}/{n_stages} {what:<16} "
                    f"{time.perf_counter() - t0:6.1f}s")
            self.stream.write(("\r" if self.tty else "") + line + ("\n" if final else ""))
            self.stream.flush()

        @contextmanager
        def stage(what: str):
            draw(what)
            yield
            done[0] += 1
            draw(what)

        yield stage
        draw("done", final=True)


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


def export_pair(target_dir, draft_dir, out, num_speculative_tokens: int = 4, batch_sizes=(1, 4, 8),
                max_len: int = 512, dtype: str = "auto", device: str | None = None, progress: bool = True,
                stream=None) -> dict:
    """Export the prefill and both step variants (greedy, sampling) per batch size to ``out``; return the metadata."""
    from .engine import SpecDecoder
    from .step import speculative_step

    stream = stream or sys.stderr
    t_start = time.perf_counter()
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ExportError(f"batch sizes must be positive integers, got {list(batch_sizes)!r}")
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
        wt, wd, (toks, pos, slots, lens, dk, dv, tk, tv) = _split_weights(flat, names_t, names_d)
        fcall(draft, wd, (toks, pos, dk, dv), {"slots": slots})
        logits = fcall(target, wt, (toks, pos, tk, tv), {"slots": slots})
        return logits[torch.arange(toks.shape[0], device=toks.device), lens - 1]

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

    bar = _Progress(stream, progress)
    artifacts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="spec-graph-export-") as tmp, _torch_references_on_cpu(dev):
        def build(name: str, fn, args, stage, dynamic_shapes=None):
            kind = name.split("_")[1] if name.startswith("step_") else name
            with stage(f"export {kind}"):
                ep = torch.export.export(_Fn(fn), args, dynamic_shapes=dynamic_shapes, strict=False)
            fused = sorted({str(n.target) for n in ep.graph.nodes
                            if n.op == "call_function" and str(n.target).startswith("spec_graph.")})
            path = Path(tmp) / f"{name}.pt2"
            with stage(f"compile {kind}"):
                torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=_inductor_configs())
                _check_cxx_runtime(path)
                _strip_sources(path)
            artifacts[name] = {"file": f"aoti/{name}.pt2", "fused_ops": fused}

        n_ex, t_ex = min(2, dec.rows), min(4, dec.cache_len)
        toks = torch.zeros(n_ex, t_ex, dtype=torch.long, device=dev)
        pos = torch.arange(t_ex, device=dev).expand(n_ex, t_ex).contiguous()
        ex = (*weights, toks, pos, torch.arange(n_ex, device=dev), torch.full((n_ex,), t_ex, device=dev),
              *dec.draft_kv, *dec.target_kv)
        n_dim = torch.export.Dim("n", min=1, max=dec.rows) if dec.rows > 1 else None
        t_dim = torch.export.Dim("T", min=1, max=dec.cache_len)
        seq = {0: n_dim, 1: t_dim} if n_dim is not None else {1: t_dim}
        per_row = {0: n_dim} if n_dim is not None else None
        ds = ((None,) * len(weights) + (seq, seq, per_row, per_row) + (None,) * 4,)  # one entry: forward(*flat)
        with bar.bucket("prefill", 2) as stage:
            with torch.no_grad():
                build("prefill", prefill, ex, stage, ds)
        for B in sizes:
            with bar.bucket(f"b={B}", 4) as stage:
                st, out_buf, acc_log, stop_buf, dkv, tkv = dec._step_args(B)
                args = (*weights, *(st[k] for k in STATE_FIELDS), out_buf, acc_log, stop_buf, *dkv, *tkv)
                for greedy in (True, False):
                    with torch.no_grad():
                        build(f"step_{'greedy' if greedy else 'sample'}_b{B}", make_step(greedy), args, stage)

        from safetensors.torch import save as st_save

        state = {n: t.detach().contiguous().cpu() for n, t in {**tw, **dw}.items()}
        blob = st_save(state)
        tok_file = Path(target_dir) / TOKENIZER
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "spec_graph_version": __version__, "torch_version": torch.__version__,
            "num_speculative_tokens": K, "batch_sizes": sizes, "max_len": cfg.max_len, "rows": dec.rows,
            "cache_len": dec.cache_len, "dtype": str(tw[names_t[0]].dtype).removeprefix("torch."),
            "device": dev.type, "vocab_size": dec.vocab_size, "eos_token_ids": list(dec.eos_token_ids),
            "weights": names_t + names_d, "weight_bytes": len(blob),
            "kv_cache": {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                         for n, t in zip(_KV_NAMES, (*dec.draft_kv, *dec.target_kv))},
            "models": {"target": _model_record(target_dir, tw), "draft": _model_record(draft_dir, dw)},
            "artifacts": artifacts,
            "tokenizer": tok_file.is_file(),
        }
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        with zipfile.ZipFile(partial, "w") as z:
            z.writestr(META, json.dumps(meta, indent=1), compress_type=zipfile.ZIP_DEFLATED)
            z.writestr(WEIGHTS, blob, compress_type=zipfile.ZIP_STORED)
            if tok_file.is_file():
                z.write(tok_file, TOKENIZER, compress_type=zipfile.ZIP_DEFLATED)
            for name, a in artifacts.items():
                z.write(Path(tmp) / f"{name}.pt2", a["file"], compress_type=zipfile.ZIP_DEFLATED)
        os.replace(partial, out)
    size = out.stat().st_size
    if progress:
        stream.write(f"spec-graph export: wrote {out} ({size / 2**20:.1f} MiB, {size / len(blob):.2f}x the "
                     f"{len(blob) / 2**20:.1f} MiB of weights; {len(artifacts)} artifacts) "
                     f"in {time.perf_counter() - t_start:.1f}s\n")
        stream.flush()
    return meta


# ---------------------------------------------------------------------------------------------- loading
def read_metadata(path) -> dict:
    """The metadata of an export, after checking that it is one, intact, and built by this torch."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist or is not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        raise ExportError(f"{path} is not a spec-graph export (not a zip package); create one with `spec-graph export`")
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            if META not in names:
                raise ExportError(f"{path} is not a spec-graph export (no {META}); create one with `spec-graph export`")
            meta = json.loads(z.read(META))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ExportError(f"{path} is not a spec-graph export ({META} lacks the format marker)")
            bad = z.testzip()  # every member's CRC
            if bad is not None:
                raise ExportError(f"{path} is corrupt: member {bad!r} fails its checksum; export it again")
            missing = [n for n in [WEIGHTS, *(a["file"] for a in meta["artifacts"].values())] if n not in names]
            if missing:
                raise ExportError(f"{path} is corrupt or incomplete: missing {', '.join(missing)}; export it again")
    except (zipfile.BadZipFile, EOFError, OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError,
            zipfile.LargeZipFile) as e:
        raise ExportError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); export it again") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{path} has export format version {meta.get('format_version')!r}; this spec-graph "
                          f"reads version {FORMAT_VERSION}: export it again")
    if meta.get("torch_version") != torch.__version__:
        raise ExportError(f"{path} was built with torch {meta.get('torch_version')}, but this is torch "
                          f"{torch.__version__}: AOTInductor artifacts only load in the torch that built them; "
                          f"export again here or install torch {meta.get('torch_version')}")
    return meta


class ExportedRunner(DecoderBase):
    """``generate(...)`` as ``SpecDecoder``'s, over the AOTInductor artifacts of an export."""

    def __init__(self, meta: dict, weights: tuple, prefill, steps: dict, config: SpecGraphConfig, plat,
                 tokenizer, workdir, path: Path):
        self.metadata, self.path, self.weights = meta, path, weights
        self._prefill_fn, self._steps, self._workdir = prefill, steps, workdir
        self.batch_sizes = tuple(meta["batch_sizes"])
        use_graphs = plat.supports_graphs and config.enable_graph is not False
        super().__init__(config, meta["vocab_size"], plat.device, plat, tokenizer, meta["eos_token_ids"],
                         use_graphs=use_graphs, rows=meta["rows"])

    def _new_kv_caches(self, rows: int, cache_len: int):
        kv = self.metadata["kv_cache"]
        make = lambda n: torch.zeros(kv[n]["shape"], dtype=getattr(torch, kv[n]["dtype"]), device=self.device)  # noqa: E731
        assert kv["target_k"]["shape"][1] == rows and kv["target_k"]["shape"][3] == cache_len
        return (make("target_k"), make("target_v")), (make("draft_k"), make("draft_v"))

    def _prefill_forward(self, toks, pos, slots, lens) -> torch.Tensor:
        with torch.inference_mode():  # the artifact assumes contiguous inputs: pos arrives as an expanded view
            return self._prefill_fn(*self.weights, toks.contiguous(), pos.contiguous(), slots.contiguous(),
                                    lens.contiguous(), *self.draft_kv, *self.target_kv)

    def _step_fn(self, greedy: bool):
        def one_step(st, out_buf, acc_log, stop_ids, draft_kv, target_kv):
            B = st["tail"].shape[0]
            fn = self._steps.get((greedy, B))
            if fn is None:
                raise ExportError(f"no exported step for batch {B}; exported batch sizes: {list(self.batch_sizes)}")
            fn(*self.weights, *(st[k] for k in STATE_FIELDS), out_buf, acc_log, stop_ids, *draft_kv, *target_kv)
        return one_step


def load_exported(path, device: str | None = None, max_batch_size: int | None = None,
                  enable_graph: bool | None = None, steps_per_graph: int = 1) -> ExportedRunner:
    """Load an export written by ``spec-graph export``; imports no model code and reads no checkpoint.

    ``max_batch_size`` (request slots) defaults to the largest exported batch
    size and may not exceed it. On CUDA/NPU the step is captured in a static
    graph per batch size unless ``enable_graph=False``.
    """
    from safetensors.torch import load as st_load

    path = Path(path)
    meta = read_metadata(path)
    want, built = (torch.device(device).type if device else meta["device"]), meta["device"]
    if want != built:
        raise ExportError(f"{path} was exported for device {built!r}, not {want!r}: run it on {built}, or export "
                          f"again with --device {want}")
    try:
        plat = platform.get(built)
    except ValueError as e:
        raise ExportError(f"{path} was exported for device {built!r}, which this machine lacks ({e})") from None
    sizes = meta["batch_sizes"]
    S = sizes[-1] if max_batch_size is None else max_batch_size
    if not isinstance(S, int) or S < 1 or S > sizes[-1]:
        raise ExportError(f"batch of {S} requests is over the largest exported batch size {sizes[-1]} (exported "
                          f"batch sizes: {', '.join(map(str, sizes))}); export again with larger --batch-sizes")
    cfg = SpecGraphConfig(num_speculative_tokens=meta["num_speculative_tokens"], max_batch_size=S,
                          max_len=meta["max_len"], dtype=meta["dtype"], device=built, batch_buckets=tuple(sizes),
                          enable_graph=enable_graph, steps_per_graph=steps_per_graph)
    workdir = tempfile.TemporaryDirectory(prefix="spec-graph-load-")
    use_graphs = plat.supports_graphs and enable_graph is not False
    with zipfile.ZipFile(path) as z:
        names = meta["weights"]
        tensors = st_load(z.read(WEIGHTS))
        if sorted(tensors) != sorted(names):
            raise ExportError(f"{path} is corrupt: {WEIGHTS} does not hold the weights {META} names; export it again")
        weights = tuple(tensors[n].to(plat.device) for n in names)
        tokenizer = None
        if TOKENIZER in z.namelist():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(z.read(TOKENIZER).decode())
        models = {}
        for name, a in meta["artifacts"].items():
            dst = Path(workdir.name) / f"{name}.pt2"
            data = z.read(a["file"])
            dst.write_bytes(data)
            lib = _static_cxx_runtime(data)
            if lib is not None:
                raise ExportError(f"{path}: artifact {a['file']} was built with libstdc++ linked statically into "
                                  f"{lib}, and loading it would crash this process; export it again with "
                                  "CXX set to a g++ that links libstdc++ dynamically (e.g. CXX=/usr/bin/g++)")
            try:
                models[name] = torch._inductor.aoti_load_package(str(dst), run_single_threaded=use_graphs)
            except Exception as e:  # noqa: BLE001 - a broken artifact, whatever the loader raises
                raise ExportError(f"{path}: artifact {a['file']} does not load ({type(e).__name__}: {e}); "
                                  "export it again") from None
    steps = {(g == "greedy", B): models[f"step_{g}_b{B}"] for B in sizes for g in ("greedy", "sample")}
    return ExportedRunner(meta, weights, models["prefill"], steps, cfg, plat, tokenizer, workdir, path)


__all__ = ["ExportError", "ExportedRunner", "export_pair", "load_exported", "read_metadata"]
