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
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code
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


def test_explicit_pair(capsys, llama_pair):
    t, d = llama_pair
    code, out, _ = run_cli(capsys, "generate", "--target", str(t), "--draft", str(d), "--prompt-ids", "5,6,7",
                           "--json", "--max-new-tokens", "5")
    assert code == 0 and len(json.loads(out)["outputs"][0]["token_ids"]) <= 5


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "x", "-k", "0"], "1..16"),
    (["generate", "--prompt", "x", "--target", "/nonexistent", "--draft", "/nonexistent"], "does not exist"),
    (["generate", "--prompt", "x", "--target", "/nonexistent"], "both --target and --draft"),
    (["generate", "--prompt-ids", "1,99999"], "out of range"),
    (["generate", "--prompt-ids", ""], "empty"),
    (["generate", "--prompt", "x", "--dtype", "int3"], "unknown dtype"),
    (["generate", "--prompt", "x", "--max-new-tokens", "50", "--max-len", "10"], "max_len=10"),
])
def test_errors_are_one_line(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("spec-graph: error:") and needle in lines[0]
    assert "Traceback" not in err


def test_info(capsys):
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    assert "torch" in out and "platform: cpu" in out and "static graphs:" in out


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
