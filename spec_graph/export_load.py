"""The export package's format and its loader (``load_exported``); export.py writes it."""
from __future__ import annotations

import hashlib
import json
import tempfile
import zipfile
from pathlib import Path

import torch

from . import platform
from .config import SpecGraphConfig, cache_length, check_device, check_path_arg, is_int
from .elf import static_cxx_runtime
from .runtime import DecoderBase
from .step import STATE_FIELDS

FORMAT = "spec-graph-export"
# 2: one step artifact per mode (dynamic batch), optional sampling step, sha256 of every member; 3: the prefill's
# span input (it reads its own positions of the caches, not all of them)
FORMAT_VERSION = 3
META, WEIGHTS, TOKENIZER = "metadata.json", "weights.safetensors", "tokenizer.json"
# The sha256 of the rest of metadata.json (metadata_sha256): every other member's is in it. Packages written
# before it lack it and still load (a new key of format 3, not a new format): cross-checks alone guard those.
META_SHA256 = "metadata_sha256"
KV_NAMES = ("draft_k", "draft_v", "target_k", "target_v")  # the caches, in the exported functions' order


class ExportError(ValueError):
    """An export that cannot be written or loaded; the message names the problem and the fix."""


def metadata_sha256(meta: dict) -> str:
    """The sha256 of ``meta`` less its own ``metadata_sha256``, as canonical JSON (sorted keys, no spaces)."""
    rest = {k: v for k, v in meta.items() if k != META_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _positive_int(v) -> bool:
    return is_int(v) and v >= 1


def _inconsistency(meta: dict) -> str | None:
    """What in the metadata disagrees with itself or with the artifacts' fixed shapes (K, max_len and rows set
    the caches' and buffers' shapes the artifacts were compiled for), or None."""
    K, max_len, rows, sizes = (meta.get(k) for k in ("num_speculative_tokens", "max_len", "rows", "batch_sizes"))
    for name, v in (("num_speculative_tokens", K), ("max_len", max_len), ("rows", rows)):
        if not _positive_int(v):
            return f"{name} is {v!r}, not a positive integer"
    if not isinstance(sizes, list) or not sizes or not all(map(_positive_int, sizes)) or sizes != sorted(set(sizes)):
        return f"batch_sizes is {sizes!r}, not an ascending list of positive integers"
    if rows != sizes[-1]:
        return f"rows {rows} is not the largest batch size {sizes[-1]}"
    want = cache_length(max_len, K)
    if meta.get("cache_len") != want:
        return f"cache_len {meta.get('cache_len')!r} does not fit max_len {max_len} and K {K} (it would be {want})"
    kv = meta.get("kv_cache") if isinstance(meta.get("kv_cache"), dict) else {}
    for n in KV_NAMES:
        entry = kv.get(n) if isinstance(kv.get(n), dict) else {}
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if not isinstance(shape, list) or len(shape) != 5 or not all(map(_positive_int, shape)) \
                or shape[1] != rows or shape[3] != want:
            return f"kv_cache {n} has shape {shape!r}, not [layers, {rows} rows, heads, {want} positions, head_dim]"
        if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
            return f"kv_cache {n} has dtype {dtype!r}"
    return None


def read_metadata(path) -> dict:
    """The metadata of an export, after checking that it is one, intact, and built by this torch."""
    check_path_arg(path, "the export must be the path of a .pt2 package")
    path = Path(path)
    if path.is_dir():
        raise ExportError(f"{path} is a directory, not a package written by `spec-graph export`: pass the .pt2 "
                          "file, or run a checkpoint pair with --target and --draft")
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
            wanted = [WEIGHTS, *(a["file"] for a in meta["artifacts"].values()),
                      *([TOKENIZER] if TOKENIZER in meta.get("sha256", ()) else [])]  # else no text prompts
            missing = [n for n in wanted if n not in names]
            if missing:
                raise ExportError(f"{path} is corrupt or incomplete: missing {', '.join(missing)}; export it again")
    except (zipfile.BadZipFile, EOFError, OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
            AttributeError, zipfile.LargeZipFile) as e:
        raise ExportError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); export it again") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{path} has export format version {meta.get('format_version')!r}; this spec-graph "
                          f"reads version {FORMAT_VERSION}: export it again")
    if META_SHA256 in meta and meta[META_SHA256] != metadata_sha256(meta):
        raise ExportError(f"{path} is damaged: its {META} does not match the sha256 it records (edited or "
                          "corrupted after export); export it again")
    if meta.get("torch_version") != torch.__version__:
        raise ExportError(f"{path} was built with torch {meta.get('torch_version')}, but this is torch "
                          f"{torch.__version__}: AOTInductor artifacts only load in the torch that built them; "
                          f"export again here or install torch {meta.get('torch_version')}")
    sums, steps = meta.get("sha256"), meta.get("steps")
    files = [WEIGHTS, *(a["file"] for a in meta["artifacts"].values())]
    if not isinstance(sums, dict) or any(not isinstance(sums.get(n), str) for n in files) \
            or not isinstance(steps, dict) or "greedy" not in steps \
            or any(name not in meta["artifacts"] for per in steps.values() for name in per.values()):
        raise ExportError(f"{path} is corrupt: its {META} lacks the sha256 of its files or the steps it holds; "
                          "export it again")
    wrong = _inconsistency(meta)
    if wrong is not None:
        raise ExportError(f"{path} is damaged: its {META} does not match its artifacts ({wrong}); export it again")
    return meta


def _spans(sizes: list[int]) -> str:
    return f"1 to {sizes[-1]}" if len(sizes) > 2 and sizes == list(range(1, sizes[-1] + 1)) else \
        ", ".join(map(str, sizes))


class ExportedRunner(DecoderBase):
    """``generate(...)`` as ``SpecDecoder``'s, over the AOTInductor artifacts of an export."""

    FRESH = "load the export again (load_exported)"

    def __init__(self, meta: dict, weights: tuple, prefill, steps: dict, config: SpecGraphConfig, plat,
                 tokenizer, workdir, path: Path):
        self.metadata, self.path, self.weights = meta, path, weights
        self._prefill_fn, self._steps, self._workdir = prefill, steps, workdir
        self.batch_sizes = tuple(meta["batch_sizes"])
        self.sampling = "sample" in meta["steps"]  # exported with --sampling
        use_graphs = plat.supports_graphs and config.enable_graph is not False
        super().__init__(config, meta["vocab_size"], plat.device, plat, tokenizer, meta["eos_token_ids"],
                         use_graphs=use_graphs, rows=meta["rows"])
        self.window = meta.get("window")  # the pair's max_position_embeddings

    def _rebuild_hint(self, field: str, value=None) -> str:
        if field == "max_batch_size" and is_int(value) and value > self.batch_sizes[-1]:
            return f"export again with larger --batch-sizes (the largest exported is {self.batch_sizes[-1]})"
        if field in ("max_batch_size", "enable_graph", "device"):
            return f"load the export again for this value (load_exported({str(self.path)!r}, {field}=...))"
        return f"export again for this value (spec-graph export with the {field} you want)"

    def _check_config(self) -> None:
        super()._check_config()
        served = self._served_sizes()
        unserved = [b for b in self.config.batch_buckets if b not in served]
        if unserved:
            raise ValueError(f"batch_buckets {list(self.config.batch_buckets)} holds {unserved}, for which {self.path} "
                             f"has no step (its steps serve batch sizes {_spans(served)}): give buckets among those, "
                             f"or export again with --batch-sizes that include {unserved[0]}")

    def _served_sizes(self) -> list[int]:
        """The batch sizes every exported step (greedy, and sampled where exported) runs at."""
        modes = {g for g, _ in self._steps}
        return [b for b in range(1, self.rows + 1) if all((g, b) in self._steps for g in modes)]

    def _no_sampling(self) -> ExportError:
        return ExportError(f"{self.path} holds only the greedy step (it was exported without --sampling): use "
                           "temperature 0, or export again with --sampling for temperature > 0")

    def generate(self, prompts, max_new_tokens, *args, **kwargs):
        temperature = args[0] if args else kwargs.get("temperature", 0.0)
        if not self.sampling:
            from .sampling import SamplingParams

            try:
                greedy = SamplingParams(temperature=temperature).greedy
            except (ValueError, TypeError):
                greedy = True  # not a valid temperature: generate names it
            if not greedy:
                raise self._no_sampling()
        return super().generate(prompts, max_new_tokens, *args, **kwargs)

    def _too_long(self, i: int, n: int, max_new_tokens: int) -> None:
        # The base advises raising max_len (--max-len), which an export fixes: here, to export again.
        need, exported = n + max_new_tokens, self.metadata["max_len"]
        if need <= exported:  # max_len lowered on the runner: it may be raised back that far
            return super()._too_long(i, n, max_new_tokens)
        msg = f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs {need} > max_len=" \
              f"{exported}, which the export fixed: "
        if self.window is not None and need > self.window:  # past what the models were trained on
            raise ValueError(msg + f"that is past the models' window ({self.window} positions): shorten the prompt "
                                   "or lower max_new_tokens")
        raise ValueError(msg + f"export again with a larger --max-len (spec-graph export --max-len {need} or "
                               "more), or shorten the prompt or lower max_new_tokens")

    def _new_kv_caches(self, rows: int, cache_len: int):
        kv = self.metadata["kv_cache"]
        make = lambda n: torch.zeros(kv[n]["shape"], dtype=getattr(torch, kv[n]["dtype"]),  # noqa: E731
                                     device=self.device)
        # rows and cache_len come from the same metadata, whose shapes read_metadata checked against them
        return (make("target_k"), make("target_v")), (make("draft_k"), make("draft_v"))

    def _prefill_forward(self, toks, pos, slots, lens) -> torch.Tensor:
        with torch.inference_mode():  # the artifact assumes contiguous inputs: pos arrives as an expanded view
            return self._prefill_fn(*self.weights, toks.contiguous(), pos.contiguous(), slots.contiguous(),
                                    lens.contiguous(), pos[0].contiguous(), *self.draft_kv, *self.target_kv)

    def _step_fn(self, greedy: bool, K: int | None = None):
        if not greedy and not self.sampling:
            raise self._no_sampling()

        def one_step(st, out_buf, acc_log, stop_ids, draft_kv, target_kv):
            B = st["tail"].shape[0]
            fn = self._steps.get((greedy, B))
            if fn is None:
                raise ExportError(f"no exported step for batch {B}; exported batch sizes: {list(self.batch_sizes)}")
            fn(*self.weights, *(st[k] for k in STATE_FIELDS), out_buf, acc_log, stop_ids, *draft_kv, *target_kv)
        return one_step


def load_exported(path, device: str | None = None, max_batch_size: int | None = None,
                  enable_graph: bool | None = None, steps_per_graph: int = 1,
                  admission_wait: int | None = None) -> ExportedRunner:
    """Load an export written by ``spec-graph export``; imports no model code and reads no checkpoint.

    ``max_batch_size`` (request slots) defaults to the largest exported batch
    size and may not exceed it; ``admission_wait`` is ``SpecGraphConfig``'s.
    Every member's sha256 is checked against the metadata before anything
    is loaded (a damaged library would crash the process). On CUDA/NPU the
    step is captured in a static graph per batch size unless
    ``enable_graph=False``.
    """
    from safetensors.torch import load as st_load

    check_device(device)
    meta = read_metadata(path)
    path = Path(path)
    want, built = (torch.device(device).type if device else meta["device"]), meta["device"]
    if want != built:
        if device:
            platform.get(device)  # a device this machine lacks is named as such: no export would run on it
        raise ExportError(f"{path} was exported for device {built!r}, not {want!r}: run it on {built}, or export "
                          f"again with --device {want}")
    try:
        plat = platform.get(built)
    except ValueError as e:
        raise ExportError(f"{path} was exported for device {built!r}, which this machine lacks ({e})") from None
    sizes = meta["batch_sizes"]
    S = sizes[-1] if max_batch_size is None else max_batch_size
    if not is_int(S) or S < 1:
        raise ExportError(f"max_batch_size (--max-batch-size) must be a positive integer (request slots, at most "
                          f"{sizes[-1]} for this export), got {S!r}")
    if S > sizes[-1]:
        raise ExportError(f"max_batch_size (--max-batch-size) {S} is over the largest exported batch size "
                          f"{sizes[-1]} (exported batch sizes: {', '.join(map(str, sizes))}); export again with "
                          "larger --batch-sizes")
    cfg = SpecGraphConfig(num_speculative_tokens=meta["num_speculative_tokens"], max_batch_size=int(S),
                          max_len=meta["max_len"], dtype=meta["dtype"], device=built, batch_buckets=tuple(sizes),
                          enable_graph=enable_graph, steps_per_graph=steps_per_graph, admission_wait=admission_wait)
    use_graphs = plat.supports_graphs and enable_graph is not False
    with zipfile.ZipFile(path) as z:
        # Every file is checked before any is loaded: a library truncated inside an intact zip would kill the
        # process (SIGBUS) with no message.
        data = {}
        for name in [WEIGHTS, *(a["file"] for a in meta["artifacts"].values()),
                     *([TOKENIZER] if TOKENIZER in z.namelist() and TOKENIZER in meta["sha256"] else [])]:
            data[name] = z.read(name)
            if hashlib.sha256(data[name]).hexdigest() != meta["sha256"][name]:
                what = "artifact " if name.startswith("aoti/") else ""
                raise ExportError(f"{path} is damaged: {what}{name} does not match the sha256 its {META} records; "
                                  "export it again")
    tensors = st_load(data.pop(WEIGHTS))
    names = meta["weights"]
    if sorted(tensors) != sorted(names):
        raise ExportError(f"{path} is corrupt: {WEIGHTS} does not hold the weights {META} names; export it again")
    for role in ("target", "draft"):  # prompt ids are checked against vocab_size: it must index the embeddings
        emb = tensors.get(f"{role}.model.embed_tokens.weight")
        rows = emb.shape[0] if emb is not None and emb.dim() == 2 else None
        if rows != meta["vocab_size"]:
            raise ExportError(f"{path} is damaged: its {META} does not match its artifacts (vocab_size "
                              f"{meta['vocab_size']!r}, but the {role}'s embedding has {rows} rows); export it again")
    weights = tuple(tensors[n].to(plat.device) for n in names)
    del tensors
    tokenizer = None
    if TOKENIZER in data:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(data.pop(TOKENIZER).decode())
    workdir = tempfile.TemporaryDirectory(prefix="spec-graph-load-")
    models = {}
    for name, a in meta["artifacts"].items():
        blob = data.pop(a["file"])
        lib = static_cxx_runtime(blob)
        if lib is not None:
            raise ExportError(f"{path}: artifact {a['file']} was built with libstdc++ linked statically into "
                              f"{lib}, and loading it would crash this process; export it again with "
                              "CXX set to a g++ that links libstdc++ dynamically (e.g. CXX=/usr/bin/g++)")
        dst = Path(workdir.name) / f"{name}.pt2"
        dst.write_bytes(blob)
        try:
            models[name] = torch._inductor.aoti_load_package(str(dst), run_single_threaded=use_graphs)
        except Exception as e:  # noqa: BLE001 - a broken artifact, whatever the loader raises
            raise ExportError(f"{path}: artifact {a['file']} does not load ({type(e).__name__}: {e}); "
                              "export it again") from None
    steps = {(mode == "greedy", B): models[name] for (mode, B), name in step_per_size(meta).items()}
    return ExportedRunner(meta, weights, models["prefill"], steps, cfg, plat, tokenizer, workdir, path)


def step_per_size(meta: dict) -> dict[tuple[str, int], str]:
    """{(mode, batch size): step artifact} for every size an export's steps run at: the sizes exported, and every
    size up to ``rows`` where one artifact serves several (its batch dimension is symbolic over 1..rows)."""
    out = {}
    for mode, per in meta["steps"].items():
        names = set(per.values())
        sizes = range(1, meta["rows"] + 1) if len(per) > 1 and len(names) == 1 else sorted(map(int, per))
        out.update({(mode, B): per.get(str(B)) or next(iter(names)) for B in sizes})
    return out
