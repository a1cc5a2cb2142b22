"""Offline export (`spec-graph export`) and `load_exported`: equal output to the engine, no model code, clear errors.

One export (batch sizes 1 and 2: five AOTInductor compiles) is shared by the whole module.
"""
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import assert_every_count, hf_greedy

from spec_graph import SpecDecoder, SpecGraphConfig, __version__
from spec_graph.cli import main
from spec_graph.export import ExportError, load_exported, read_metadata

PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 70], [3], [60, 61, 62, 63]]
K, SIZES, MAX_LEN = 3, (1, 2), 64


@pytest.fixture(scope="module")
def exported(llama_pair, tmp_path_factory):
    """(package path, the export command's stderr, seconds it took), exported through the CLI."""
    target, draft = llama_pair
    out = tmp_path_factory.mktemp("export") / "pair.pt2"
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        rc = main(["export", "--target", str(target), "--draft", str(draft), "-k", str(K), "--batch-sizes",
                   ",".join(map(str, SIZES)), "--max-len", str(MAX_LEN), "--dtype", "float32", "--device", "cpu",
                   "-o", str(out)])
    assert rc == 0, err.getvalue()
    return out, err.getvalue(), time.perf_counter() - t0


@pytest.fixture(scope="module")
def engine(llama_pair):
    target, draft = llama_pair
    cfg = SpecGraphConfig(num_speculative_tokens=K, max_batch_size=max(SIZES), max_len=MAX_LEN, dtype="float32",
                          device="cpu", batch_buckets=SIZES)
    return SpecDecoder.from_pretrained(target, draft, cfg)


@pytest.fixture(scope="module")
def runner(exported):
    return load_exported(exported[0])


def _rewrite(src: Path, dst: Path, **meta_changes) -> Path:
    """A copy of the package with some metadata fields changed."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "metadata.json":
                meta = json.loads(data)
                meta.update(meta_changes)
                data = json.dumps(meta).encode()
            zout.writestr(item, data)
    return dst


def test_export_prints_a_bar_per_bucket_and_a_summary(exported):
    _, log, _ = exported
    lines = log.strip().splitlines()
    for label, stages in (("prefill", 2), ("b=1", 4), ("b=2", 4)):
        bar = [ln for ln in lines if ln.strip().startswith(label + " ")]
        assert len(bar) == 1 and f"{stages}/{stages} done" in bar[0] and "#" * 24 in bar[0], log
    summary = lines[-1]
    assert summary.startswith("spec-graph export: wrote ") and "MiB" in summary and "weights" in summary
    assert summary.rstrip().endswith("s") and " in " in summary


def test_package_holds_weights_once_and_the_metadata(exported, llama_pair, engine):
    path, _, _ = exported
    target, draft = llama_pair
    meta = read_metadata(path)
    assert meta["num_speculative_tokens"] == K and meta["batch_sizes"] == list(SIZES)
    assert meta["max_len"] == MAX_LEN and meta["dtype"] == "float32" and meta["device"] == "cpu"
    assert meta["eos_token_ids"] == [1]
    assert meta["torch_version"] == torch.__version__ and meta["spec_graph_version"] == __version__
    for role, d in (("target", target), ("draft", draft)):
        assert meta["models"][role]["config_sha256"] == hashlib.sha256((Path(d) / "config.json").read_bytes()).hexdigest()
        assert len(meta["models"][role]["weights_sha256"]) == 64
    assert meta["models"]["target"]["weights_sha256"] != meta["models"]["draft"]["weights_sha256"]
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        assert sorted(n for n in names if n.startswith("aoti/")) == sorted(
            ["aoti/prefill.pt2"] + [f"aoti/step_{g}_b{b}.pt2" for b in SIZES for g in ("greedy", "sample")])
        assert [n for n in names if n.endswith(".safetensors")] == ["weights.safetensors"]
        assert "tokenizer.json" in names
        weight_bytes = z.getinfo("weights.safetensors").file_size
        inner = zipfile.ZipFile(io.BytesIO(z.read("aoti/step_greedy_b1.pt2"))).infolist()
    assert any(i.filename.endswith(".so") for i in inner)
    assert all(i.file_size == 0 for i in inner if i.filename.endswith(".cpp"))  # sources emptied
    params = sum(t.numel() * t.element_size() for m in (engine.target, engine.draft)
                 for t in (*m.parameters(), *m.buffers()))
    assert params <= weight_bytes < params + 64 * 1024  # the tensors, plus the safetensors header
    # No artifact embeds a weight: every one takes them as inputs.
    runner = load_exported(path)
    for fn in (runner._prefill_fn, *runner._steps.values()):
        assert list(fn.get_constant_fqns()) == []


def test_fused_triton_ops_survive_export(exported):
    arts = read_metadata(exported[0])["artifacts"]
    for b in SIZES:
        assert "spec_graph.greedy_accept_prepare.default" in arts[f"step_greedy_b{b}"]["fused_ops"]
        assert {"spec_graph.rejection_sample.default", "spec_graph.prepare_next.default"} <= set(
            arts[f"step_sample_b{b}"]["fused_ops"])


@pytest.mark.parametrize("slots", [1, 2])
def test_greedy_equals_engine_token_for_token(exported, engine, llama_pair, slots):
    runner = load_exported(exported[0], max_batch_size=slots)
    engine.config.max_batch_size = slots  # queue through the same number of slots
    try:
        ref = engine.generate(PROMPTS, max_new_tokens=20)
    finally:
        engine.config.max_batch_size = max(SIZES)
    out = runner.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in ref]
    assert [r.accepted_counts for r in out] == [r.accepted_counts for r in ref]
    assert 0.0 < out.stats.acceptance_rate < 1.0 and out.stats.steps == ref.stats.steps
    assert_every_count(out, K)
    assert [r.token_ids for r in out] == [hf_greedy(llama_pair[0], p, 20) for p in PROMPTS]


def test_sampling_equals_engine(runner, engine):
    kw = dict(max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    out, ref = runner.generate(PROMPTS, **kw), engine.generate(PROMPTS, **kw)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert out[0].token_ids != runner.generate(PROMPTS, **{**kw, "seed": 4})[0].token_ids


def test_text_prompts_use_the_packaged_tokenizer(runner, engine):
    out, ref = runner.generate(["def add"], max_new_tokens=8), engine.generate(["def add"], max_new_tokens=8)
    assert out[0].token_ids == ref[0].token_ids and out[0].text == ref[0].text


_BLOCKED = """
import json, sys
roots = [p for p in sys.argv[3:]]
opened = []
sys.addaudithook(lambda ev, args: opened.append(str(args[0])) if ev == "open" and args and isinstance(args[0], str) else None)
class Block:
    def find_spec(self, name, path=None, target=None):
        if name in ("spec_graph.models", "spec_graph.engine", "transformers") or name.startswith(
                ("spec_graph.models.", "transformers.")):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import spec_graph
runner = spec_graph.load_exported(sys.argv[1])
out = runner.generate(json.loads(sys.argv[2]), max_new_tokens=20)
bad = [m for m in sys.modules if m.startswith(("spec_graph.models", "spec_graph.engine", "transformers"))]
touched = [p for p in opened if any(p.startswith(r) for r in roots)]
print(json.dumps({"tokens": [r.token_ids for r in out], "modules": bad, "touched": touched}))
"""


def test_loads_and_runs_without_model_code_or_checkpoint(exported, engine, llama_pair):
    ref = engine.generate(PROMPTS, max_new_tokens=20)
    roots = [str(Path(d).resolve()) for d in llama_pair]
    proc = subprocess.run([sys.executable, "-c", _BLOCKED, str(exported[0]), json.dumps(PROMPTS), *roots],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["modules"] == [] and res["touched"] == []
    assert res["tokens"] == [r.token_ids for r in ref]


def test_blocked_import_really_blocks(exported):
    code = _BLOCKED.split("import spec_graph")[0] + "import spec_graph.engine\n"
    proc = subprocess.run([sys.executable, "-c", code, str(exported[0]), "[]"], capture_output=True, text=True)
    assert proc.returncode != 0 and "blocked: spec_graph.engine" in proc.stderr


def test_cli_generate_exported(exported, engine, capsys):
    ref = engine.generate([[5, 9, 17, 33, 2], [40, 41]], max_new_tokens=12)
    rc = main(["generate", "--exported", str(exported[0]), "--prompt-ids", "5,9,17,33,2", "--prompt-ids", "40,41",
               "--max-new-tokens", "12", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in got["outputs"]] == [r.token_ids for r in ref]


def test_cli_generate_exported_refuses_fixed_options(exported, capsys):
    assert main(["generate", "--exported", str(exported[0]), "--prompt-ids", "5", "-k", "2"]) == 1
    assert "drop -k" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- errors
def test_error_not_an_export(tmp_path, exported):
    text = tmp_path / "notes.pt2"
    text.write_text("hello")
    with pytest.raises(ExportError, match="not a spec-graph export"):
        load_exported(text)
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("model.bin", b"\0" * 16)
    with pytest.raises(ExportError, match="not a spec-graph export"):
        load_exported(other)
    with pytest.raises(ExportError, match="not a spec-graph export"):
        load_exported(_rewrite(exported[0], tmp_path / "marker.pt2", format="something-else"))


def test_error_truncated_or_corrupt(tmp_path, exported):
    data = exported[0].read_bytes()
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match="corrupt or truncated"):
        load_exported(cut)
    with zipfile.ZipFile(exported[0]) as z:
        info = z.getinfo("weights.safetensors")
    flipped = bytearray(data)
    at = info.header_offset + 30 + len(info.filename) + info.file_size // 2  # inside the stored weights
    flipped[at] ^= 0xFF
    bad = tmp_path / "flipped.pt2"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(ExportError, match="corrupt.*weights.safetensors"):
        load_exported(bad)


def test_error_other_torch_version(tmp_path, exported):
    other = _rewrite(exported[0], tmp_path / "old.pt2", torch_version="2.0.0")
    with pytest.raises(ExportError) as e:
        load_exported(other)
    assert "2.0.0" in str(e.value) and torch.__version__ in str(e.value)


def test_error_batch_over_the_largest_size(exported, capsys):
    with pytest.raises(ExportError, match=r"largest exported batch size 2 \(exported batch sizes: 1, 2\)"):
        load_exported(exported[0], max_batch_size=3)
    assert main(["generate", "--exported", str(exported[0]), "--prompt-ids", "5", "--max-batch-size", "3"]) == 1
    assert "exported batch sizes: 1, 2" in capsys.readouterr().err


def test_error_other_device(tmp_path, exported):
    with pytest.raises(ExportError, match="exported for device 'cpu', not 'cuda'"):
        load_exported(exported[0], device="cuda")
    if not torch.cuda.is_available():
        cuda_pkg = _rewrite(exported[0], tmp_path / "cuda.pt2", device="cuda")
        with pytest.raises(ExportError, match="exported for device 'cuda'"):
            load_exported(cuda_pkg)


def test_loaded_step_is_captured_per_bucket(exported, engine):
    """Through the platform seam (a stand-in graph platform on CPU): one graph per (mode, batch size), all replayed."""
    from helpers import fake_platform

    from spec_graph.export import ExportedRunner

    plat = fake_platform()
    base = load_exported(exported[0])
    runner = ExportedRunner(base.metadata, base.weights, base._prefill_fn, base._steps, base.config, plat,
                            base.tokenizer, base._workdir, base.path)
    out = runner.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=20)]
    assert set(runner.graphs.graphs) == {(True, b) for b in SIZES}
    assert plat.events.count("record") == len(SIZES) and plat.events.count("replay") == out.stats.steps


def test_inductor_options_unknown_to_this_torch_are_left_out(monkeypatch):
    from spec_graph import export

    monkeypatch.setattr(export, "_WANTED_INDUCTOR_CONFIGS",
                        {"aot_inductor.no_such_option": True, "aot_inductor.debug_compile": False})
    assert export._inductor_configs() == {"aot_inductor.debug_compile": False}


def _package_holding(tmp_path, library) -> Path:
    pkg = tmp_path / f"{Path(library).stem}.pt2"
    with zipfile.ZipFile(pkg, "w") as z:
        z.write(library, "lib/data/aotinductor/model/model.wrapper.so")
    return pkg


def test_elf_needed_reads_the_libraries_a_shared_object_links():
    from spec_graph.export import _elf_needed

    assert "libstdc++.so.6" in _elf_needed((Path(torch.__file__).parent / "lib" / "libc10.so").read_bytes())
    assert _elf_needed(b"#!/bin/sh\n") is None


def test_export_and_load_refuse_a_library_with_its_own_libstdcxx(tmp_path, exported, monkeypatch):
    """A C++ runtime linked statically into the AOTInductor library crashes the loading process (std::regex in
    the model constructor): export stops with the fix, and load refuses such an artifact instead of crashing."""
    import _ctypes  # a shared object of the interpreter that links no C++ runtime

    from spec_graph import export

    static = _package_holding(tmp_path, _ctypes.__file__)
    with pytest.raises(ExportError, match=r"linked libstdc\+\+ statically .*CXX=/usr/bin/g\+\+"):
        export._check_cxx_runtime(static)
    export._check_cxx_runtime(_package_holding(tmp_path, Path(torch.__file__).parent / "lib" / "libc10.so"))

    # every artifact of the real export links the shared runtime; a doctored one is refused at load
    pkg = tmp_path / "doctored.pt2"
    with zipfile.ZipFile(exported[0]) as zin, zipfile.ZipFile(pkg, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.startswith("aoti/"):
                (tmp_path / "artifact.pt2").write_bytes(data)
                assert export._static_cxx_runtime(tmp_path / "artifact.pt2") is None, item.filename
            if item.filename == "aoti/prefill.pt2":
                data = static.read_bytes()
            zout.writestr(item, data)
    with pytest.raises(ExportError, match=r"aoti/prefill.pt2 was built with libstdc\+\+ linked statically"):
        load_exported(pkg)
