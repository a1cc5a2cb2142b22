"""Tiny random checkpoints and an offline tokenizer, built with HF transformers / tokenizers."""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_graph.platform import Platform

CORPUS = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "import os\nimport sys\nfor i in range(10):\n    print(i)\nwhile True:\n    break\n"
    "the quick brown fox jumps over the lazy dog. speculative decoding is lossless.\n"
)

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def build_tokenizer(vocab_size: int = 96):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:64], show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return tok


def make_checkpoint(path, arch: str = "LlamaForCausalLM", *, vocab_size: int = 128, hidden_size: int = 64,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate_size: int = 128,
                    seed: int = 0, init_std: float = 0.2, eos_token_id: int | None = 1, tokenizer=None,
                    dtype=torch.float32, **extra) -> Path:
    """Save a random ``arch`` model with ``save_pretrained`` and return its directory."""
    import transformers

    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate_size,
                  max_position_embeddings=512, initializer_range=init_std, eos_token_id=eos_token_id,
                  bos_token_id=None, pad_token_id=None, **extra)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(dtype).eval()
    path = Path(path)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
    return path


def perturbed_copy(src, dst, noise: float, seed: int = 1) -> Path:
    """A draft: the target's weights plus noise, so it agrees with the target often but not always."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            state = load_file(str(f))
            state = {k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
                     for k, v in state.items()}
            save_file(state, str(dst / f.name), metadata={"format": "pt"})
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def hf_greedy(path, prompt: list[int], max_new_tokens: int, eos: int | None = 1) -> list[int]:
    """The target's own greedy output from HF transformers, cut after the first EOS."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    toks = out[0, len(prompt):].tolist()
    if eos is not None and eos in toks:
        toks = toks[: toks.index(eos) + 1]
    return toks


def accepted_histogram(out, K: int) -> list[int]:
    """How many steps accepted 0, 1, .., K drafts, over every request of a generate() output."""
    hist = [0] * (K + 1)
    for r in out:
        for a in r.accepted_counts:
            hist[a] += 1
    return hist


def assert_every_count(out, K: int) -> None:
    """Each accepted count 0..K occurred: a rejection at every draft position and the bonus token decided
    tokens, so the verify positions 1..K were tested, not only position 0."""
    hist = accepted_histogram(out, K)
    assert all(hist), f"accepted counts per step {hist} do not cover 0..{K}"


def write_json(path, obj) -> None:
    Path(path).write_text(json.dumps(obj))


def interpreter_before_triton() -> str | None:
    """A kernel test module's first step, before its imports reach triton: on a CPU machine where nothing has
    imported triton yet, TRITON_INTERPRET=1, so that the kernels build for the interpreter. Returns the value it
    had before (for kernel_setting and interpreter_while_testing)."""
    import sys

    from spec_graph import platform

    before = os.environ.get("TRITON_INTERPRET")
    if "triton" not in sys.modules and before is None and platform.current().name == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return before


def kernel_setting(kernel, env_before: str | None) -> tuple:
    """Once a module's kernels are built (TRITON_INTERPRET goes back to `env_before`: the rest of the session keeps
    its setting): (compiled, interpreter_builds, dev, needs_fresh_process). `kernel` is compiled Triton (a GPU
    runs the tests), else the interpreter's where tl's helpers were built for it too; otherwise triton was
    imported before the interpreter could be set, and the module must run afresh."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from spec_graph import platform

    if env_before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    compiled = isinstance(kernel, JITFunction)
    builds = not compiled and not isinstance(tl.min, JITFunction)
    dev = platform.current().device if (compiled and platform.current().name != "cpu") else torch.device("cpu")
    return compiled, builds, dev, dev.type == "cpu" and not builds


@contextlib.contextmanager
def interpreter_while_testing(on: bool, env_before: str | None):
    """TRITON_INTERPRET=1 while a kernel test module runs (when `on`), then the value it had before
    (`env_before`), so that the other modules run the torch references at full speed."""
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if env_before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env_before


def require_kernel(kernels, kernel, dev, needs_fresh_process: bool, suite_test: str) -> None:
    """A kernel test's precondition: `kernel` (of module `kernels`) really runs on `dev`, not the reference it
    is compared with; where triton was imported before the interpreter could be set, skip (`suite_test` runs
    the module afresh)."""
    import pytest

    from spec_graph import platform

    if needs_fresh_process:
        pytest.skip(f"triton was imported before this module: run by {suite_test}")
    assert platform.use_triton(dev), "kernel tests would compare the reference with itself"
    assert kernels.use_kernel(kernel, torch.zeros(1, device=dev)), f"no kernel on {dev}"


def run_module_in_fresh_process(test_file: str) -> None:
    """Run a kernel test module again in a new process with TRITON_INTERPRET=1 set before triton's import
    (something in this process imported triton first); fail unless its tests pass there."""
    import re
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(test_file).resolve()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here)],
                       cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert re.search(r"\b\d+ passed", r.stdout), r.stdout[-2000:]


class FakeGraph:
    def __init__(self, log):
        self.fn, self.log = None, log

    def replay(self):
        self.log.append("replay")
        return self.fn()


@dataclass(frozen=True)
class FakePlatform(Platform):
    """A CPU platform that 'captures' by keeping the callable and 'replays' by calling it;
    ``events`` logs new_graph / record / replay."""

    events: list = None

    @property
    def supports_graphs(self):
        return True

    def new_graph(self):
        self.events.append("new_graph")
        return FakeGraph(self.events)

    def graph_pool(self):
        return "pool"

    def new_stream(self):
        return None

    def record(self, graph, fn, pool=None, stream=None):
        assert pool == "pool"
        self.events.append("record")
        graph.fn = fn

    def replay(self, graph):
        return graph.replay()

    def synchronize(self):
        pass


def fake_platform(events: list | None = None) -> FakePlatform:
    return FakePlatform("cpu", [] if events is None else events)


def run_compiled_script(script: str, *args, skip_without_ptxas: bool = False):
    """`script` run by a fresh python from the repository root with compiled-kernel objects (not the
    interpreter's), so torch traces them and triton compiles them; its last output line as JSON."""
    import subprocess
    import sys

    import pytest

    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=Path(__file__).resolve().parents[1],
                       env=env, capture_output=True, text=True, timeout=600)
    if skip_without_ptxas and r.returncode and "ptxas" in r.stderr.lower():
        pytest.skip("this triton cannot compile for sm90 here (no ptxas)")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def nan_past(position: int):
    """A ``_zero_slots`` that zeroes a slot's caches, then fills every position from ``position`` on with NaN:
    garbage that a forward reading past its own positions would meet (masked, 0 * NaN is still NaN)."""
    def zero_then_nan(self, slots, upto=None):
        for kc, vc in (self.target_kv, self.draft_kv):
            for c in (kc, vc):
                c[:, slots] = 0
                c[:, slots, :, position:] = float("nan")
    return zero_then_nan


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values as every other element, in each dimension, of a tensor twice as large: no dimension has a unit
    stride (a compiled graph may hand an op any layout where it keeps the op whole)."""
    big = torch.zeros(*(2 * n for n in t.shape), dtype=t.dtype, device=t.device)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def rows_apart(t: torch.Tensor) -> torch.Tensor:
    """t's values with its rows apart and each row's elements adjacent (the first half of rows twice as long)."""
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    big[..., : t.shape[-1]] = t
    return big[..., : t.shape[-1]]
