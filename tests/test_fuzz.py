"""Fuzzing the API and CLI argument space with hypothesis.

Every call ends in a result or a one-line ValueError (API) / exit code 2 with one line on stderr (CLI):
never a traceback, a hang or a wrong token count. An independent predicate says which argument sets are
valid, so a refused valid call fails as surely as an accepted invalid one. Greedy float32 outputs are
compared with Hugging Face's own greedy output. Engines are built once per configuration (a module cache).

Concurrency: two threads calling ``generate`` on one SpecDecoder give what sequential calls give.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import threading

import pytest
import torch
from helpers import make_checkpoint, perturbed_copy
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from spec_graph import SpecDecoder, SpecGraphConfig
from spec_graph.cli import main
from spec_graph.sampling import FLOAT32_MAX

VOCAB, MAX_LEN, EOS = 96, 40, 1
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("fuzz")
    target = make_checkpoint(root / "t", vocab_size=VOCAB, tokenizer=tokenizer, eos_token_id=EOS)
    return target, perturbed_copy(target, root / "d", noise=0.03)


_ENGINES: dict = {}
_HF: dict = {}


def engine(pair, K, max_batch_size, dtype) -> SpecDecoder:
    key = (K, max_batch_size, dtype)
    if key not in _ENGINES:
        cfg = SpecGraphConfig(num_speculative_tokens=K, max_batch_size=max_batch_size, max_len=MAX_LEN, dtype=dtype,
                              device="cpu")
        _ENGINES[key] = SpecDecoder.from_pretrained(*pair, cfg)
    return _ENGINES[key]


def hf_greedy(path, prompt, max_new, stops):
    import transformers

    if "model" not in _HF:
        _HF["model"] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = _HF["model"].generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    toks = out[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(toks) if t in stops), None)
    return toks if cut is None else toks[: cut + 1]


@contextlib.contextmanager
def time_limit(seconds: int):
    """A hang is a failure, not a stuck test run."""
    def fail(*_):
        raise TimeoutError(f"call did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------ the argument space
WORDS = ["def ", "add(a, b)", "class Point:", "import os\n", "the quick brown fox", "print(i)", " ", "x"]
BAD = {  # one argument made invalid per example (None: all valid)
    "max_new_tokens": [0, -3, True, 2.0, "8", None],
    "temperature": [-0.5, math.inf, -math.inf, math.nan, 1e300, True, "0.7", None],
    "top_p": [0.0, -0.1, 1.5, math.nan, math.inf, "1", None],
    "top_k": [-1, True, 2.5, "3", None],
    "seed": ["abc", 1.5, True, [1]],
    "stop_token_ids": [5, "5", [VOCAB], [-1], [True], [2.0]],
    "prompt": [[], [VOCAB], [-1], [True], [1.0], "", b"ab", None, 7],
    "prompts": ["a string, not a list", 5, []],
}


@st.composite
def api_calls(draw):
    n = draw(st.integers(1, 3))
    prompts = [draw(st.one_of(st.sampled_from(WORDS), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)))
               for _ in range(n)]
    temperature = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7]))
    kw = dict(max_new_tokens=draw(st.integers(1, 24)), temperature=temperature,
              top_p=draw(st.sampled_from([1.0, 1.0, 0.9, 0.3])), top_k=draw(st.sampled_from([0, 0, 1, 5, 1000])),
              seed=draw(st.one_of(st.none(), st.integers(-(2**64), 2**64))),
              stop_token_ids=draw(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=3))))
    bad = draw(st.sampled_from([None] * 8 + sorted(BAD)))
    if bad == "prompts":
        prompts = draw(st.sampled_from(BAD["prompts"]))
    elif bad == "prompt":
        prompts[draw(st.integers(0, n - 1))] = draw(st.sampled_from(BAD["prompt"]))
    elif bad is not None:
        kw[bad] = draw(st.sampled_from(BAD[bad]))
    eng = dict(K=draw(st.sampled_from([1, 2, 4, "auto"])), max_batch_size=draw(st.sampled_from([1, 2])),
               dtype=draw(st.sampled_from(["float32", "float32", "bfloat16"])))
    return prompts, kw, eng


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def expected_valid(tokenizer, prompts, kw) -> bool:
    """The contract, written independently of the engine's own checks."""
    m, t, p, k, seed, stops = (kw[x] for x in ("max_new_tokens", "temperature", "top_p", "top_k", "seed",
                                                 "stop_token_ids"))
    if not (_int(m) and m >= 1 and _real(t) and 0 <= t <= FLOAT32_MAX and _real(p) and 0 < p <= 1
            and _int(k) and k >= 0 and (seed is None or _int(seed))):
        return False
    if stops is not None and not (isinstance(stops, list) and all(_int(s) and 0 <= s < VOCAB for s in stops)):
        return False
    if not isinstance(prompts, list) or not prompts:
        return False
    for pr in prompts:
        ids = tokenizer.encode(pr).ids if isinstance(pr, str) else pr
        if not isinstance(ids, list) or not ids or not all(_int(i) and 0 <= i < VOCAB for i in ids):
            return False
        if len(ids) + m > MAX_LEN:
            return False
    return True


def check_result(out, prompts, kw, tokenizer, pair, eng):
    stops = {EOS} | set(kw["stop_token_ids"] or [])
    assert len(out) == len(prompts)
    for pr, r in zip(prompts, out):
        assert r.finish_reason in ("length", "stop"), r.finish_reason  # finite weights: never "error"
        assert all(0 <= t < VOCAB for t in r.token_ids)
        if r.finish_reason == "length":
            assert len(r.token_ids) == kw["max_new_tokens"] and not stops & set(r.token_ids)
        else:
            assert 1 <= len(r.token_ids) <= kw["max_new_tokens"] and r.token_ids[-1] in stops
            assert not stops & set(r.token_ids[:-1])
        ids = tokenizer.encode(pr).ids if isinstance(pr, str) else pr
        assert r.prompt_token_ids == ids
        if kw["temperature"] == 0 and eng["dtype"] == "float32":
            assert r.token_ids == hf_greedy(pair[0], ids, kw["max_new_tokens"], stops)
    for r in out:
        assert len(r.k_per_step) == len(r.accepted_counts) and all(0 <= a <= k for a, k in zip(r.accepted_counts,
                                                                                              r.k_per_step))
    s = out.stats
    assert len(s.k_per_step) == s.steps
    assert s.generated_tokens == sum(len(r.token_ids) for r in out)
    assert s.tokens_per_step * s.request_steps == pytest.approx(s.generated_tokens)


@settings(max_examples=40, **SETTINGS)
@given(call=api_calls())
def test_api_argument_space(pair, tokenizer, call):
    prompts, kw, eng = call
    dec = engine(pair, **eng)
    valid = expected_valid(tokenizer, prompts, kw)
    with time_limit(60):
        try:
            out = dec.generate(prompts, **kw)
        except ValueError as e:
            event("refused")
            assert not valid, f"a valid call was refused: {e}"
            assert str(e) and "\n" not in str(e)
            return
    assert valid, "an invalid call was accepted"
    check_result(out, prompts, kw, tokenizer, pair, eng)


# settings that are only ever drawn with a value to refuse
ALWAYS_BAD = {"batch_buckets": [(), (0, 2), (1.5, 2), "12", None, (True,)], "enable_graph": ["no", 1],
              "passes": [None, {"fuse_greedy_acept": False}, {"fuse_greedy_accept": "false"}],
              "steps_per_graph": [0, True], "verification": ["blocks"]}


@st.composite
def engine_configs(draw):
    kw = dict(num_speculative_tokens=draw(st.sampled_from([1, 4, 16, "auto"])),
              max_batch_size=draw(st.sampled_from([1, 3])),
              max_len=draw(st.sampled_from([None, 2, 24])),
              dtype=draw(st.sampled_from(["float32", "bfloat16", "auto"])),
              device=draw(st.sampled_from([None, "cpu"])))
    bad = {"num_speculative_tokens": [0, 17, True, 2.0, "fast", None], "max_speculative_tokens": [0, 17, "8"],
           "max_batch_size": [0, -1, True], "max_len": [1, 0, 1.5],
           "dtype": ["int3", 5], "device": ["cuda", "npu", "tpu", "cuda:x", ""], **ALWAYS_BAD}
    field = draw(st.sampled_from([None, None, None, *sorted(bad)]))
    if field is not None:
        kw[field] = draw(st.sampled_from(bad[field]))
    return kw


@settings(max_examples=15, **SETTINGS)
@given(cfg=engine_configs())
def test_engine_config_space(pair, cfg):
    """Building an engine: a decoder, or a one-line ValueError; a built one generates."""
    from spec_graph import platform

    k, b, m, dt, dev = (cfg[x] for x in ("num_speculative_tokens", "max_batch_size", "max_len", "dtype", "device"))
    plat_ok = dev in (None, "cpu") or (dev == "cuda" and torch.cuda.is_available()) or \
        (dev == "npu" and platform._npu_available())
    mk = cfg.get("max_speculative_tokens", 8)
    valid = ((k == "auto" or _int(k) and 1 <= k <= 16) and _int(mk) and 1 <= mk <= 16 and _int(b) and b >= 1
             and (m is None or (_int(m) and m >= 2)) and dt in ("float32", "bfloat16", "auto") and plat_ok
             and not set(cfg) & set(ALWAYS_BAD))
    with time_limit(60):
        try:
            dec = SpecDecoder.from_pretrained(*pair, SpecGraphConfig(**cfg))
        except ValueError as e:
            event("refused")
            assert not valid, f"a valid config was refused: {e}"
            assert str(e) and "\n" not in str(e)
            return
        assert valid, "an invalid config was accepted"
        n = min(dec.config.max_len - 1, 16)  # up to max_len where it is small
        out = dec.generate([[5]], n, temperature=0.5, seed=1)
    assert len(out[0].token_ids) == n or out[0].finish_reason == "stop"


# ------------------------------------------------------------------ the command line
@st.composite
def cli_calls(draw):
    argv = ["generate"]
    if draw(st.booleans()):
        argv += ["--prompt", draw(st.sampled_from(WORDS[:6] + ["", "é"]))]
    else:
        ids = draw(st.lists(st.integers(-1, VOCAB), min_size=0, max_size=8))
        argv += ["--prompt-ids", ",".join(map(str, ids))]
    opts = {
        "-k": ["1", "3", "auto", "0", "17", "x"],
        "--max-new-tokens": ["1", "7", "16", "0", "-2", "abc"],
        "--temperature": ["0", "0.8", "-1", "inf", "nan", "1e300"],
        "--top-p": ["1", "0.5", "0", "1.5", "nan"],
        "--top-k": ["0", "3", "-1"],
        "--seed": ["0", "7", "-5", "abc"],
        "--max-batch-size": ["1", "4", "0", "-1"],
        "--max-len": ["64", "10", "1"],
        "--dtype": ["float32", "bfloat16", "int3"],
        "--device": ["cpu", "cuda", "npu", "tpu"],
        "--threads": ["1", "0"],
        "--max-speculative-tokens": ["3", "0"],
    }
    for flag in draw(st.lists(st.sampled_from(sorted(opts)), max_size=4, unique=True)):
        argv += [flag, draw(st.sampled_from(opts[flag]))]
    return argv + ["--json"]


@settings(max_examples=20, **SETTINGS)
@given(argv=cli_calls())
def test_cli_argument_space(pair, capsys, argv):
    t, d = pair
    argv = argv + ["--target", str(t), "--draft", str(d)]
    threads = torch.get_num_threads()
    with time_limit(60):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        finally:
            torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    event(f"exit {code}")
    assert "Traceback" not in err
    if code == 0:
        obj = json.loads(out)
        n = int(argv[argv.index("--max-new-tokens") + 1]) if "--max-new-tokens" in argv else 64
        for o in obj["outputs"]:
            assert len(o["token_ids"]) == n or (o["finish_reason"] == "stop" and 1 <= len(o["token_ids"]) <= n)
        s = obj["stats"]
        assert s["tokens_per_step"] * s["request_steps"] == pytest.approx(s["generated_tokens"])
        assert len(s["k_per_step"]) == s["steps"]
    else:
        assert code == 2, (code, err)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("spec-graph: error:"), err


# ------------------------------------------------------------------ concurrency
def _concurrent(dec, a, b, kw_a, kw_b, pause=0.5):
    """A and B on two threads, A pausing after its first step until B has made progress (at most `pause` s):
    without serialization, B's prefill lands in A's slots while A waits; with it, B waits for A to finish."""
    b_moved, results, errors = threading.Event(), {}, {}

    def run(name, prompts, kw, progress):
        try:
            results[name] = dec.generate(prompts, progress=progress, **kw)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors[name] = e

    first = []

    def a_progress(done, total):  # once, after A's first prefill and step
        if not first:
            first.append(1)
            b_moved.wait(pause)

    ta = threading.Thread(target=run, args=("a", a, kw_a, a_progress))
    tb = threading.Thread(target=run, args=("b", b, kw_b, lambda done, total: b_moved.set()))
    ta.start()
    tb.start()
    ta.join(60)
    tb.join(60)
    assert not ta.is_alive() and not tb.is_alive(), "generate hung"
    return results, errors


PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 70], [3]]


@settings(max_examples=4, **SETTINGS)
@given(ta=st.sampled_from([0.0, 0.8]), tb=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 99),
       split=st.integers(1, 3))
def test_concurrent_generate_equals_sequential(pair, ta, tb, seed, split):
    dec = engine(pair, K=2, max_batch_size=2, dtype="float32")
    a, b = PROMPTS[:split], PROMPTS[split:]
    kw_a = dict(max_new_tokens=12, temperature=ta, seed=seed)
    kw_b = dict(max_new_tokens=9, temperature=tb, seed=seed + 1, stop_token_ids=[7])
    want_a, want_b = dec.generate(a, **kw_a), dec.generate(b, **kw_b)
    results, errors = _concurrent(dec, a, b, kw_a, kw_b, pause=0.3)
    assert not errors
    assert [r.token_ids for r in results["a"]] == [r.token_ids for r in want_a]
    assert [r.token_ids for r in results["b"]] == [r.token_ids for r in want_b]


def test_unserialized_generate_corrupts_output(pair):
    """The broken variant the test above rejects: with the lock taken out, the same interleaving changes A's
    output (or fails)."""
    dec = SpecDecoder.from_pretrained(*pair, SpecGraphConfig(num_speculative_tokens=2, max_batch_size=2,
                                                             max_len=MAX_LEN))
    a, b = PROMPTS[:2], PROMPTS[2:]
    kw = dict(max_new_tokens=12, temperature=0.8, seed=5)
    want_a = dec.generate(a, **kw)
    dec._generate_lock = contextlib.nullcontext()
    results, errors = _concurrent(dec, a, b, kw, kw, pause=10)  # B does move here: A waits for it
    assert errors or [r.token_ids for r in results["a"]] != [r.token_ids for r in want_a]
