"""Offline export (`spec-graph export`) and `load_exported`: equal output to the engine, no model code, clear errors.

One export (batch sizes 1 and 2, --sampling: three AOTInductor compiles, the prefill and one step artifact per
mode serving both batch sizes) is shared by the whole module; the layout checks of the default (greedy-only)
export and of the per-batch-size fallback run torch.export only, with the compile stubbed out.
"""
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import assert_every_count, hf_greedy, nan_past

from spec_graph import SpecDecoder, SpecGraphConfig, __version__
from spec_graph.cli import main
from spec_graph.export import ExportError, load_exported, metadata_sha256, read_metadata

PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 70], [3], [60, 61, 62, 63]]
K, SIZES, MAX_LEN = 3, (1, 2), 64


@pytest.fixture(scope="module")
def exported(llama_pair, tmp_path_factory):
    """(package path, the export command's stderr, seconds it took, the warnings it gave), exported through the
    CLI."""
    target, draft = llama_pair
    out = tmp_path_factory.mktemp("export") / "pair.pt2"
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(["export", "--target", str(target), "--draft", str(draft), "-k", str(K), "--batch-sizes",
                   ",".join(map(str, SIZES)), "--max-len", str(MAX_LEN), "--dtype", "float32", "--device", "cpu",
                   "--sampling", "-o", str(out)])
    assert rc == 0, err.getvalue()
    return out, err.getvalue(), time.perf_counter() - t0, caught


@pytest.fixture(scope="module")
def engine(llama_pair):
    target, draft = llama_pair
    cfg = SpecGraphConfig(num_speculative_tokens=K, max_batch_size=max(SIZES), max_len=MAX_LEN, dtype="float32",
                          device="cpu", batch_buckets=SIZES)
    return SpecDecoder.from_pretrained(target, draft, cfg)


@pytest.fixture(scope="module")
def reference(engine):
    """``reference(slots)``: the engine's greedy output for PROMPTS (20 new tokens) through that many slots,
    computed once per module (the eager CPU engine is the slow part of these tests)."""
    memo = {}

    def get(slots: int = max(SIZES)):
        if slots not in memo:
            engine.config.max_batch_size = slots  # queue through the same number of slots
            try:
                memo[slots] = engine.generate(PROMPTS, max_new_tokens=20)
            finally:
                engine.config.max_batch_size = max(SIZES)
        return memo[slots]
    return get


@pytest.fixture(scope="module")
def runner(exported):
    return load_exported(exported[0])


def _rewrite(src: Path, dst: Path, members: dict | None = None, drop=(), sign: bool | None = True,
             **meta_changes) -> Path:
    """A copy of the package with some metadata fields changed, some members replaced ({name: bytes}, their
    sha256 recorded as an export would) and the members in ``drop`` left out. ``sign``: the metadata's own sha256
    recorded anew as an export would (True), kept as exported, as a hand edit would (False), or left out, as in
    packages written before it (None)."""
    members = members or {}
    with zipfile.ZipFile(src) as zin:
        meta = json.loads(zin.read("metadata.json"))
        items = [(item, members.get(item.filename, zin.read(item.filename))) for item in zin.infolist()
                 if item.filename not in drop and item.filename != "metadata.json"]
    meta["sha256"].update({n: hashlib.sha256(d).hexdigest() for n, d in members.items()})
    meta.update(meta_changes)
    if sign is None:
        del meta["metadata_sha256"]
    elif sign:
        meta["metadata_sha256"] = metadata_sha256(meta)
    with zipfile.ZipFile(dst, "w") as zout:
        zout.writestr("metadata.json", json.dumps(meta))
        for item, data in items:
            zout.writestr(item, data)
    return dst


def test_export_prints_a_bar_per_artifact_with_eta_and_a_summary(exported):
    _, log, _, _ = exported
    lines = log.strip().splitlines()
    for label, last in (("prefill", False), ("greedy", False), ("sample", True)):
        bar = [ln for ln in lines if ln.strip().startswith(label + " ")]
        assert len(bar) == 1 and "2/2 done" in bar[0] and "#" * 24 in bar[0], log
        assert ("ETA" in bar[0]) != last, bar[0]  # the time left for the rest of the export
    summary = lines[-1]
    assert summary.startswith("spec-graph export: wrote ") and "MiB" in summary and "weights" in summary
    assert "3 artifacts: prefill, step_greedy, step_sample for batch sizes 1, 2" in summary
    assert summary.rstrip().endswith("s") and " in " in summary


def test_an_export_passes_on_no_notice_of_torch_internals(exported):
    """torch's copy of each exported graph in aoti_compile_and_package warns of torch's own deprecated pytree
    class: the export drops that notice alone. Control: the notice as torch gives it is shown outside the filter,
    and another FutureWarning is shown inside it."""
    from torch.utils._pytree import LeafSpec

    from spec_graph.export import _without_torch_treespec_notice

    assert not [w for w in exported[3] if "LeafSpec" in str(w.message)], [str(w.message) for w in exported[3]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _without_torch_treespec_notice():
            LeafSpec()
            warnings.warn("another deprecation", FutureWarning)
        inside = [str(w.message) for w in caught]
        LeafSpec()
    assert inside == ["another deprecation"], inside
    if len(caught) == 2:  # torch versions whose LeafSpec warns: the filter matches its words
        assert "isinstance(treespec, LeafSpec)" in str(caught[1].message)


def test_progress_eta_counts_down_on_a_terminal():
    from spec_graph.export_progress import _STAGE_COST, _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = _Progress(tty, True, ["export", "compile greedy"])
    with bar.bucket("greedy", 2) as b:
        t0 = time.perf_counter()
        with b.stage("export greedy"):
            time.sleep(0.05)
        spent = time.perf_counter() - t0
        ratio = _STAGE_COST["compile greedy"] / _STAGE_COST["export"]
        assert 0.05 * ratio <= bar.eta() <= spent * ratio  # the compile, at the export's pace
        with b.stage("compile greedy"):
            time.sleep(2.2)  # the bar is redrawn every second while a stage runs
            assert bar.eta() == 0.0  # over its estimate: nothing else is left
    text = tty.getvalue()
    frames = text.split("\r")
    assert "ETA -:--" in frames[1] and "ETA 0:00" in text and "1/2 compile greedy" in text
    assert len([f for f in frames if "1/2 compile greedy" in f]) >= 2
    assert frames[-1].rstrip().endswith("s") and "2/2 done" in frames[-1] and text.endswith("\n")


def test_package_holds_weights_once_and_the_metadata(exported, llama_pair, engine):
    path, _, _, _ = exported
    target, draft = llama_pair
    meta = read_metadata(path)
    assert meta["num_speculative_tokens"] == K and meta["batch_sizes"] == list(SIZES)
    assert meta["max_len"] == MAX_LEN and meta["dtype"] == "float32" and meta["device"] == "cpu"
    assert meta["eos_token_ids"] == [1]
    assert meta["torch_version"] == torch.__version__ and meta["spec_graph_version"] == __version__
    for role, d in (("target", target), ("draft", draft)):
        config_sha = hashlib.sha256((Path(d) / "config.json").read_bytes()).hexdigest()
        assert meta["models"][role]["config_sha256"] == config_sha
        assert len(meta["models"][role]["weights_sha256"]) == 64
    assert meta["models"]["target"]["weights_sha256"] != meta["models"]["draft"]["weights_sha256"]
    # one step artifact per mode serves every batch size (its batch dimension is symbolic)
    assert meta["steps"] == {m: {str(b): f"step_{m}" for b in SIZES} for m in ("greedy", "sample")}
    assert all(a["batch_sizes"] == list(SIZES) for a in meta["artifacts"].values())
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        assert sorted(n for n in names if n.startswith("aoti/")) == [
            "aoti/prefill.pt2", "aoti/step_greedy.pt2", "aoti/step_sample.pt2"]
        assert [n for n in names if n.endswith(".safetensors")] == ["weights.safetensors"]
        assert "tokenizer.json" in names
        assert meta["sha256"] == {n: hashlib.sha256(z.read(n)).hexdigest() for n in names if n != "metadata.json"}
        weight_bytes = z.getinfo("weights.safetensors").file_size
        inner = zipfile.ZipFile(io.BytesIO(z.read("aoti/step_greedy.pt2"))).infolist()
    assert any(i.filename.endswith(".so") for i in inner)
    assert all(i.file_size == 0 for i in inner if i.filename.endswith(".cpp"))  # sources emptied
    params = sum(t.numel() * t.element_size() for m in (engine.target, engine.draft)
                 for t in (*m.parameters(), *m.buffers()))
    assert params <= weight_bytes < params + 64 * 1024  # the tensors, plus the safetensors header
    # No artifact embeds a weight: every one takes them as inputs.
    runner = load_exported(path)
    assert runner.sampling and len({id(fn) for fn in runner._steps.values()}) == 2  # greedy, sample
    for fn in (runner._prefill_fn, *runner._steps.values()):
        assert list(fn.get_constant_fqns()) == []


def test_fused_triton_ops_survive_export(exported):
    arts = read_metadata(exported[0])["artifacts"]
    assert "spec_graph.greedy_accept_prepare.default" in arts["step_greedy"]["fused_ops"]
    assert {"spec_graph.rejection_sample.default", "spec_graph.prepare_next.default"} <= set(
        arts["step_sample"]["fused_ops"])


@pytest.mark.parametrize("slots", [1, 2])
def test_greedy_equals_engine_token_for_token(exported, reference, llama_pair, slots):
    """Through 1 slot the step runs at batch 1, through 2 at batch 2: one artifact serves both sizes."""
    runner = load_exported(exported[0], max_batch_size=slots)
    ref = reference(slots)
    out = runner.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in ref]
    assert [r.accepted_counts for r in out] == [r.accepted_counts for r in ref]
    assert 0.0 < out.stats.acceptance_rate < 1.0 and out.stats.steps == ref.stats.steps
    assert_every_count(out, K)
    assert [r.token_ids for r in out] == [hf_greedy(llama_pair[0], p, 20) for p in PROMPTS]


def test_admission_wait_of_a_loaded_export(exported, reference):
    """An export's runner groups admissions as the engine does: the same tokens whether it waits or not, fewer
    prefills where it waits; a bad wait is refused at load."""
    outs = [load_exported(exported[0], max_batch_size=2, admission_wait=w).generate(PROMPTS, max_new_tokens=20)
            for w in (0, 10**6)]
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]] == [r.token_ids for r in reference(2)]
    assert outs[1].stats.prefills < outs[0].stats.prefills
    with pytest.raises(ValueError, match="admission_wait must be a non-negative integer"):
        load_exported(exported[0], admission_wait=-1)


@pytest.mark.parametrize("new_tokens", [1, 8])
def test_exported_graphs_ignore_garbage_past_their_positions(exported, reference, monkeypatch, new_tokens):
    """With every cache position past 16 NaN before each prefill (these prompts are at most 16 long), the
    exported prefill (which reads its span, the first T positions) and the exported step (which on a CPU attends
    over the whole buffer under a mask, where a masked non-finite value enters no sum) give the engine's tokens.
    The NaNs are still in the caches afterwards: the graphs met them and left them out."""
    import spec_graph.export as export_mod

    monkeypatch.setattr(export_mod.ExportedRunner, "_zero_slots", nan_past(16))
    runner = load_exported(exported[0])
    out = runner.generate(PROMPTS, max_new_tokens=new_tokens)
    assert max(len(p) for p in PROMPTS) <= 16
    assert [r.token_ids for r in out] == [r.token_ids[:new_tokens] for r in reference()]
    assert runner.target_kv[1][:, :len(PROMPTS), :, -1].isnan().all()


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
sys.addaudithook(lambda ev, args: opened.append(str(args[0]))
                 if ev == "open" and args and isinstance(args[0], str) else None)
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


def test_loads_and_runs_without_model_code_or_checkpoint(exported, reference, llama_pair):
    ref = reference()
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


def test_cli_generate_exported(exported, reference, capsys):
    ref = [r.token_ids[:12] for r in reference()[:2]]  # greedy: the first 12 of the same requests' 20
    rc = main(["generate", "--exported", str(exported[0]), "--prompt-ids", "5,9,17,33,2", "--prompt-ids", "40,41",
               "--max-new-tokens", "12", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in got["outputs"]] == ref


def test_cli_generate_exported_refuses_fixed_options(exported, capsys):
    assert main(["generate", "--exported", str(exported[0]), "--prompt-ids", "5", "-k", "2"]) == 2
    assert "drop -k" in capsys.readouterr().err


def test_greedy_only_package_refuses_sampling(tmp_path, exported, reference, capsys):
    """What an export without --sampling holds: the greedy step only; a sampling request is refused up front."""
    meta = read_metadata(exported[0])
    del meta["steps"]["sample"], meta["artifacts"]["step_sample"], meta["sha256"]["aoti/step_sample.pt2"]
    greedy_only = _rewrite(exported[0], tmp_path / "greedy.pt2", drop=("aoti/step_sample.pt2",), steps=meta["steps"],
                           artifacts=meta["artifacts"], sha256=meta["sha256"])
    runner = load_exported(greedy_only)
    assert not runner.sampling
    with pytest.raises(ExportError, match="exported without --sampling.*export again with --sampling"):
        runner.generate(PROMPTS, max_new_tokens=4, temperature=0.8)
    with pytest.raises(ValueError, match="temperature"):  # an invalid temperature keeps its own message
        runner.generate(PROMPTS, max_new_tokens=4, temperature=-1.0)
    out = runner.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == [r.token_ids for r in reference()]
    capsys.readouterr()
    assert main(["generate", "--exported", str(greedy_only), "--prompt-ids", "5", "--temperature", "0.7"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--sampling" in lines[0], lines


def test_too_many_new_tokens_says_to_export_again(runner, exported, capsys):
    with pytest.raises(ValueError, match=rf"needs {5 + MAX_LEN} > max_len={MAX_LEN}, which the export fixed: "
                                         "export again with a larger --max-len"):
        runner.generate(PROMPTS, max_new_tokens=MAX_LEN)
    import spec_graph
    from spec_graph.export import export_pair

    assert spec_graph.export_pair is export_pair and "export_pair" in spec_graph.__all__  # the README's Python form
    assert isinstance(runner.window, int) and runner.window > MAX_LEN + 5
    # past the models' window a larger export would not help: the advice is to ask for less
    with pytest.raises(ValueError, match=rf"past the models' window \({runner.window} positions\): shorten"):
        runner.generate(PROMPTS, max_new_tokens=runner.window)
    with pytest.raises(ValueError, match="out of range"):  # the base checks keep their order and messages
        runner.generate([[10**6] * 70], max_new_tokens=10)
    assert main(["generate", "--exported", str(exported[0]), "--prompt-ids", "5,6", "--max-new-tokens",
                 str(MAX_LEN)]) == 2
    err = capsys.readouterr().err
    assert "export again with a larger --max-len" in err and "raise max_len" not in err
    # max_len lowered on the runner: a request within the export's is told to raise it back, one past it to
    # export again (raising max_len that far is refused; the old check sent both to the first advice)
    runner.config.max_len = MAX_LEN // 2
    try:
        with pytest.raises(ValueError, match=rf"> max_len={MAX_LEN // 2}: raise max_len"):
            runner.generate(PROMPTS, max_new_tokens=MAX_LEN // 2)
        with pytest.raises(ValueError, match=rf"needs {5 + MAX_LEN} > max_len={MAX_LEN}, which the export fixed: "
                                             "export again with a larger --max-len"):
            runner.generate(PROMPTS, max_new_tokens=MAX_LEN)
    finally:
        runner.config.max_len = MAX_LEN


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
    with pytest.raises(ExportError, match="is a directory, not a package written by `spec-graph export`.*--target"):
        load_exported(tmp_path)  # a checkpoint directory passed as --exported


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


@pytest.mark.parametrize("field, value", [("max_len", 1000), ("num_speculative_tokens", 5), ("max_len", MAX_LEN + 1)])
def test_error_edited_metadata_is_damaged(tmp_path, exported, capsys, field, value):
    """metadata.json edited after export (its recorded sha256 left as it was) is refused in one line: K=5 loaded
    and counted acceptance at the wrong K, max_len=1000 failed an assert inside the loader. The control: the
    package rewritten unedited, its sha256 kept, loads."""
    assert read_metadata(exported[0])["metadata_sha256"] == metadata_sha256(read_metadata(exported[0]))
    assert load_exported(_rewrite(exported[0], tmp_path / "same.pt2", sign=False)).K == K
    pkg = _rewrite(exported[0], tmp_path / "edited.pt2", sign=False, **{field: value})
    with pytest.raises(ExportError, match=r"is damaged: its metadata.json does not match the sha256 it records "
                                          r"\(edited or corrupted after export\); export it again"):
        load_exported(pkg)
    assert main(["generate", "--exported", str(pkg), "--prompt-ids", "5,6"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "damaged" in lines[0], lines


@pytest.mark.parametrize("changes, match", [
    ({"max_len": 1000}, "cache_len 80 does not fit max_len 1000 and K 3"),
    ({"num_speculative_tokens": 15}, "cache_len 80 does not fit max_len 64 and K 15"),
    ({"rows": 1}, "rows 1 is not the largest batch size 2"),
    ({"num_speculative_tokens": "3"}, "num_speculative_tokens is '3', not a positive integer"),
    ({"kv_cache": {}}, "kv_cache draft_k has shape None"),
    ({"vocab_size": 200}, "vocab_size 200, but the target's embedding has 96 rows"),
])
def test_package_without_its_metadata_sha256_is_cross_checked(tmp_path, exported, changes, match):
    """Packages written before metadata_sha256 still load (format 3 gained a key); their metadata is checked
    against the shapes the artifacts were compiled for, by name, instead of an assert inside the loader."""
    old = _rewrite(exported[0], tmp_path / "old.pt2", sign=None)
    assert "metadata_sha256" not in read_metadata(old) and load_exported(old).K == K
    bad = _rewrite(exported[0], tmp_path / "bad.pt2", sign=None, **changes)
    with pytest.raises(ExportError, match=rf"is damaged: its metadata.json does not match its artifacts \({match}"):
        load_exported(bad)


def test_error_missing_tokenizer(tmp_path, exported):
    """The tokenizer the metadata records is a member like the others: without it text prompts would fail later."""
    with pytest.raises(ExportError, match="corrupt or incomplete: missing tokenizer.json; export it again"):
        load_exported(_rewrite(exported[0], tmp_path / "notok.pt2", drop=("tokenizer.json",)))


@pytest.mark.parametrize("path", [None, 5])
def test_error_package_path_of_the_wrong_type(path):
    with pytest.raises(TypeError, match=rf"the export must be the path of a .pt2 package .*got {path!r}"):
        load_exported(path)


def test_error_other_torch_version(tmp_path, exported):
    other = _rewrite(exported[0], tmp_path / "old.pt2", torch_version="2.0.0")
    with pytest.raises(ExportError) as e:
        load_exported(other)
    assert "2.0.0" in str(e.value) and torch.__version__ in str(e.value)


def test_error_batch_over_the_largest_size(exported, capsys):
    with pytest.raises(ExportError, match=r"max_batch_size \(--max-batch-size\) 3 is over the largest exported "
                                          r"batch size 2 \(exported batch sizes: 1, 2\)"):
        load_exported(exported[0], max_batch_size=3)
    assert main(["generate", "--exported", str(exported[0]), "--prompt-ids", "5", "--max-batch-size", "3"]) == 2
    assert "exported batch sizes: 1, 2" in capsys.readouterr().err
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ExportError, match=rf"max_batch_size \(--max-batch-size\) must be a positive integer.*"
                                              rf"got {bad!r}") as e:
            load_exported(exported[0], max_batch_size=bad)
        assert "over the largest" not in str(e.value)


def test_fields_set_on_a_loaded_export_name_the_fix_for_an_export(exported):
    """A field a loaded export cannot take, set on its config, says to load it again (a field load_exported takes)
    or to export again (one the package fixes), not to build a SpecGraphConfig."""
    runner = load_exported(exported[0], max_batch_size=1)
    runner.config.max_batch_size = 2
    with pytest.raises(ValueError, match=r"load the export again for this value \(load_exported\(.*"
                                         r"max_batch_size=\.\.\.\)\)") as e:
        runner.generate([[5, 6]], 2)
    assert "SpecGraphConfig" not in str(e.value)
    runner.config.max_batch_size = 1
    runner.config.num_speculative_tokens += 1
    with pytest.raises(ValueError, match="export again for this value"):
        runner.generate([[5, 6]], 2)
    runner.config.num_speculative_tokens -= 1
    assert len(runner.generate([[5, 6]], 2)[0].token_ids) == 2  # the control: as loaded, it runs
    runner.config.max_batch_size = 3  # past every exported size: loading again cannot give it
    with pytest.raises(ValueError, match=r"export again with larger --batch-sizes \(the largest exported is 2\)"):
        runner.generate([[5, 6]], 2)


def test_step_per_size():
    """One artifact named for several sizes is symbolic in its batch and serves every size up to rows; artifacts
    per size serve theirs; a lone size's artifact only its own (it may have been compiled for that size alone)."""
    from spec_graph.export_load import step_per_size

    def steps(per, rows):
        return step_per_size({"steps": {"greedy": per}, "rows": rows})
    assert steps({"1": "step_greedy", "4": "step_greedy"}, 4) == {("greedy", b): "step_greedy" for b in (1, 2, 3, 4)}
    assert steps({"1": "step_greedy_b1", "4": "step_greedy_b4"}, 4) == {("greedy", 1): "step_greedy_b1",
                                                                        ("greedy", 4): "step_greedy_b4"}
    assert steps({"4": "step_greedy"}, 4) == {("greedy", 4): "step_greedy"}


def test_buckets_a_loaded_export_has_no_step_for_are_refused_by_name(exported, reference):
    """Batch buckets set on a loaded export are checked against the sizes its steps run at before anything runs
    (a step per exported size here, as where the batch could not be symbolic), naming the fix. Control: buckets
    among them run, with the engine's output."""
    from spec_graph.export import ExportedRunner

    base = load_exported(exported[0])
    only_2 = {key: fn for key, fn in base._steps.items() if key[1] == 2}
    runner = ExportedRunner(base.metadata, base.weights, base._prefill_fn, only_2, base.config, base.platform,
                            base.tokenizer, base._workdir, base.path)
    with pytest.raises(ValueError, match=r"batch_buckets \[1, 2\] holds \[1\], for which .* has no step \(its steps "
                                         r"serve batch sizes 2\): give buckets among those, or export again with "
                                         r"--batch-sizes that include 1"):
        runner.generate(PROMPTS, max_new_tokens=20)
    runner.config.batch_buckets = (2,)
    out = runner.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == [r.token_ids for r in reference()]
    runner.config.batch_buckets = (4,)  # past the rows it was loaded with: the fix for a runner is a load
    with pytest.raises(ValueError, match=r"pads a batch .* or load the export again \(load_exported\)$"):
        runner.generate(PROMPTS, max_new_tokens=20)


def test_cli_nan_request_of_an_export_says_to_export_again(tmp_path, exported, capsys):
    """A package whose target turns NaN fails its requests (exit 1) with advice an export can take."""
    from safetensors.torch import load, save

    with zipfile.ZipFile(exported[0]) as z:
        state = load(z.read("weights.safetensors"))
    state["target.model.norm.weight"][...] = float("nan")
    bad = _rewrite(exported[0], tmp_path / "nan.pt2", members={"weights.safetensors": save(state)})
    assert main(["generate", "--exported", str(bad), "--prompt-ids", "5,6,7", "--max-new-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert "logits turned NaN/inf" in err and "or export again with --dtype float32" in err, err
    assert "run with --dtype" not in err


def _cut_library(artifact: bytes) -> bytes:
    """The AOTInductor package ``artifact`` with its compiled library cut to half, as a valid zip."""
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(artifact)) as zin, zipfile.ZipFile(buf, "w") as zout:
        cut = 0
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith(".so"):
                data, cut = data[: len(data) // 2], cut + 1
            zout.writestr(item, data)
    assert cut == 1
    return buf.getvalue()


def test_error_damaged_library_is_refused_before_loading(tmp_path, exported):
    """A library truncated inside an intact zip kills the loading process (SIGBUS, no message) once loaded: the
    sha256 recorded at export refuses it first, naming the artifact (checked in a child process, so that a
    regression cannot take the test session down)."""
    pkg = tmp_path / "damaged.pt2"
    with zipfile.ZipFile(exported[0]) as zin, zipfile.ZipFile(pkg, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            zout.writestr(item, _cut_library(data) if item.filename == "aoti/step_greedy.pt2" else data)
    assert zipfile.ZipFile(pkg).testzip() is None  # the zip's own CRCs hold
    proc = subprocess.run([sys.executable, "-m", "spec_graph.cli", "generate", "--exported", str(pkg),
                           "--prompt-ids", "5,6"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "damaged: artifact aoti/step_greedy.pt2 does not match the sha256" in lines[0]
    assert "export it again" in lines[0]


def test_error_other_device(tmp_path, exported):
    """A package of another device: where this machine has the device asked for, the error says to export again
    for it; where it lacks it, that it lacks it (an export for it would not run here either)."""
    if torch.cuda.is_available():
        with pytest.raises(ExportError, match="exported for device 'cpu', not 'cuda'.*export again with --device"):
            load_exported(exported[0], device="cuda")
    else:
        with pytest.raises(ValueError, match="no CUDA GPU is available; use device 'cpu'") as e:
            load_exported(exported[0], device="cuda")
        assert "export again" not in str(e.value)
    if not torch.cuda.is_available():
        cuda_pkg = _rewrite(exported[0], tmp_path / "cuda.pt2", device="cuda")
        with pytest.raises(ExportError, match="exported for device 'cuda'"):
            load_exported(cuda_pkg)


def test_loaded_step_is_captured_per_bucket(exported, reference):
    """Through the platform seam (a stand-in graph platform on CPU): one graph per (mode, batch size), all replayed."""
    from helpers import fake_platform

    from spec_graph.export import ExportedRunner

    plat = fake_platform()
    base = load_exported(exported[0])
    runner = ExportedRunner(base.metadata, base.weights, base._prefill_fn, base._steps, base.config, plat,
                            base.tokenizer, base._workdir, base.path)
    out = runner.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == [r.token_ids for r in reference()]
    assert set(runner.graphs.graphs) == {(True, b, K) for b in SIZES}
    assert plat.events.count("record") == len(SIZES)
    # every step a replay; more only where a replay launched ahead of the last one's read found its rows all ended
    assert out.stats.steps <= plat.events.count("replay") <= out.stats.steps + runner.launched_ahead


def test_inductor_options_unknown_to_this_torch_are_left_out(monkeypatch):
    from spec_graph import export

    assert export._inductor_configs("cpu")["realize_opcount_threshold"] == 16  # the CPU sampling step's codegen
    assert "realize_opcount_threshold" not in export._inductor_configs("cuda")
    monkeypatch.setattr(export, "_WANTED_INDUCTOR_CONFIGS",
                        {"aot_inductor.no_such_option": True, "aot_inductor.debug_compile": False})
    monkeypatch.setattr(export, "_WANTED_CPU_INDUCTOR_CONFIGS", {"no_such_cpu_option": 1, "compile_threads": 1})
    assert export._inductor_configs() == {"aot_inductor.debug_compile": False}
    assert export._inductor_configs("cpu") == {"aot_inductor.debug_compile": False, "compile_threads": 1}


# ------------------------------------------------------------- layout and output path, without compiling
def _stub_compile(monkeypatch, fail_call: int | None = None):
    """aoti_compile_and_package writes a tiny zip instead of compiling (and raises at call ``fail_call``, counted
    from 0); returns the exported programs it got."""
    got = []

    def fake(ep, package_path, inductor_configs=None):
        got.append(ep)
        if len(got) - 1 == fail_call:
            raise RuntimeError("Constraints violated (B)! the compile specialised the batch")
        with zipfile.ZipFile(package_path, "w") as z:
            z.writestr("model/model.wrapper.cpp", "// generated")
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake)
    return got


def test_default_export_is_greedy_only_with_a_dynamic_batch(tmp_path, llama_pair, monkeypatch):
    from spec_graph.export import export_pair

    programs = _stub_compile(monkeypatch)
    err = io.StringIO()
    meta = export_pair(*llama_pair, tmp_path / "g.pt2", num_speculative_tokens=K, batch_sizes=(2, 1, 4),
                       max_len=MAX_LEN, dtype="float32", device="cpu", stream=err)
    assert meta["steps"] == {"greedy": {"1": "step_greedy", "2": "step_greedy", "4": "step_greedy"}}
    assert sorted(meta["artifacts"]) == ["prefill", "step_greedy"] and meta["batch_sizes"] == [1, 2, 4]
    step = programs[1]  # the batch dimension is symbolic, 1..4: one artifact for the three sizes
    tail = [n for n in step.graph.nodes if n.op == "placeholder"][len(meta["weights"])]
    b = tail.meta["val"].shape[0]
    assert isinstance(b, torch.SymInt)
    assert step.range_constraints[b.node.expr].lower == 1 and step.range_constraints[b.node.expr].upper == 4
    assert "greedy only: --sampling adds the sampling step" in err.getvalue().splitlines()[-1]
    assert read_metadata(tmp_path / "g.pt2")["steps"] == meta["steps"]


@pytest.mark.parametrize("fails_in", ["export", "compile"])
def test_step_falls_back_to_one_artifact_per_batch_size(tmp_path, llama_pair, monkeypatch, caplog, fails_in):
    """Where torch cannot export or compile the batch dimension as symbolic, each batch size gets its own step
    artifact."""
    from spec_graph.export import export_pair

    _stub_compile(monkeypatch, fail_call=1 if fails_in == "compile" else None)  # call 0 is the prefill
    real_export = torch.export.export

    def no_dynamic_batch(mod, args, dynamic_shapes=None, **kw):
        if fails_in == "export" and "Dim('B'" in str(dynamic_shapes):
            raise RuntimeError("Constraints violated (B)! a guard specialised the batch")
        return real_export(mod, args, dynamic_shapes=dynamic_shapes, **kw)

    monkeypatch.setattr(torch.export, "export", no_dynamic_batch)
    err = io.StringIO()
    meta = export_pair(*llama_pair, tmp_path / "s.pt2", num_speculative_tokens=K, batch_sizes=SIZES,
                       max_len=MAX_LEN, dtype="float32", device="cpu", stream=err)
    assert meta["steps"] == {"greedy": {str(b): f"step_greedy_b{b}" for b in SIZES}}
    assert [meta["artifacts"][f"step_greedy_b{b}"]["batch_sizes"] for b in SIZES] == [[b] for b in SIZES]
    assert "batch dimension cannot be symbolic (Constraints violated (B)!" in caplog.text
    lines = err.getvalue().splitlines()
    assert any(ln.strip().startswith("greedy ") and "batch not dynamic" in ln for ln in lines), lines
    assert [ln.split()[0:2] for ln in lines if "b=" in ln] == [["greedy", "b=1"], ["greedy", "b=2"]]


@pytest.mark.gpu
def test_cuda_export_serves_every_batch_size_with_one_step(tmp_path, llama_pair):
    """On CUDA the fused ops' Triton kernels are compiled into the step: its batch dimension stays symbolic too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from spec_graph.export import export_pair

    pkg = tmp_path / "cuda.pt2"
    meta = export_pair(*llama_pair, pkg, num_speculative_tokens=K, batch_sizes=SIZES, max_len=MAX_LEN,
                       dtype="float32", device="cuda", progress=False)
    assert meta["steps"] == {"greedy": {str(b): "step_greedy" for b in SIZES}}
    eager = SpecDecoder.from_pretrained(*llama_pair, SpecGraphConfig(
        num_speculative_tokens=K, max_batch_size=max(SIZES), max_len=MAX_LEN, dtype="float32", device="cuda",
        batch_buckets=SIZES, enable_graph=False))
    for slots in SIZES:
        runner = load_exported(pkg, max_batch_size=slots)
        eager.config.max_batch_size = slots
        out = runner.generate(PROMPTS, max_new_tokens=20)
        assert [r.token_ids for r in out] == [r.token_ids for r in eager.generate(PROMPTS, max_new_tokens=20)]
        assert set(runner.graphs.graphs) == {(True, b, K) for b in SIZES} and not runner.graphs.failed


@pytest.mark.parametrize("output, needle", [
    ("missing/pair.pt2", "does not exist: create it first"),
    ("pair.zip", "must be a file name ending in .pt2"),
    ("folder", "is a folder"),
    ("file.txt/pair.pt2", "does not exist"),
])
def test_export_checks_the_output_before_any_work(tmp_path, llama_pair, monkeypatch, capsys, output, needle):
    from spec_graph import engine

    (tmp_path / "folder").mkdir()
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setattr(engine.SpecDecoder, "from_pretrained", lambda *a, **k: pytest.fail("loaded the models"))
    rc = main(["export", "--target", str(llama_pair[0]), "--draft", str(llama_pair[1]), "--device", "cpu",
               "-o", str(tmp_path / output)])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("spec-graph: error:") and needle in lines[0], lines


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into any folder")
def test_export_refuses_an_unwritable_folder(tmp_path):
    from spec_graph.export import check_output_path

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ExportError, match="cannot write into the output folder"):
            check_output_path(locked / "pair.pt2")
    finally:
        locked.chmod(0o700)


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

    # every artifact of the real export links the shared runtime; a doctored one (its sha256 recorded, as a
    # toolchain that links libstdc++ statically would have produced it) is refused at load
    with zipfile.ZipFile(exported[0]) as zin:
        for name in zin.namelist():
            if name.startswith("aoti/"):
                (tmp_path / "artifact.pt2").write_bytes(zin.read(name))
                assert export._static_cxx_runtime(tmp_path / "artifact.pt2") is None, name
    pkg = _rewrite(exported[0], tmp_path / "doctored.pt2", members={"aoti/prefill.pt2": static.read_bytes()})
    with pytest.raises(ExportError, match=r"aoti/prefill.pt2 was built with libstdc\+\+ linked statically"):
        load_exported(pkg)
