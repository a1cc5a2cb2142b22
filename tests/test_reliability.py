"""Reliability: the context window, argument types, malformed checkpoints, non-finite weights.

Each correctness check is paired with the case it must reject (a request past the window, a broken
sampler, a fabricated token). Concurrency and the fuzzed argument space: tests/test_fuzz.py.
"""
import dataclasses
import json
import logging
import math

import numpy as np
import pytest
import torch
from helpers import hf_greedy, make_checkpoint, perturbed_copy

import spec_graph.runtime as runtime_mod
import spec_graph.step as step_mod
from spec_graph import SpecDecoder, SpecGraphConfig
from spec_graph.config import beyond_window_warning, check_window
from spec_graph.kernels import PLACEHOLDER, race_sample
from spec_graph.models import load_model, read_config
from spec_graph.models.config import pair_window, window_source

PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 70], [3]]


def _set_config(path, **fields):
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    for k, v in fields.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    f.write_text(json.dumps(cfg))
    return path


_DROP = object()


def _edit(path, edit):
    """Apply ``edit(state)`` to a checkpoint's tensors, in place."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})
    return path


def _poison(path, tensor: str, rows=None):
    """Set `tensor` (or its `rows`) of a checkpoint to NaN, in place."""
    def nan(state):
        state[tensor][... if rows is None else rows] = float("nan")
    return _edit(path, nan)


def _decoder(target, draft, K=3, **cfg):
    cfg.setdefault("device", "cpu")  # fp32 against HF's fp32 references, on any machine
    return SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=K, **cfg))


# ---------------------------------------------------------------- 1. the context window
@pytest.fixture(scope="module")
def short_pair(tmp_path_factory, tokenizer):
    """A near pair whose draft's config states a 48-position window (the target's: 512)."""
    root = tmp_path_factory.mktemp("short")
    target = make_checkpoint(root / "t", vocab_size=96, tokenizer=tokenizer)
    draft = _set_config(perturbed_copy(target, root / "d", noise=0.03), max_position_embeddings=48)
    return target, draft


def test_check_window_names_both_numbers():
    check_window(40, 8, 48)  # exactly fits
    with pytest.raises(ValueError, match=r"40 tokens; with max_new_tokens=9 it needs 49 positions, past the "
                                         r"model's window of 48"):
        check_window(40, 9, 48)


def test_window_is_the_smaller_of_the_pair(short_pair):
    t, d = (read_config(p)[1] for p in short_pair)
    assert (t.window, d.window, pair_window(t, d)) == (512, 48, 48)


def test_default_max_len_stops_at_the_window(short_pair, caplog):
    with caplog.at_level(logging.WARNING, logger="spec_graph"):
        dec = _decoder(*short_pair)
    assert dec.window == 48 and dec.config.max_len == 48
    assert not [r for r in caplog.records if "window" in r.getMessage()]  # the default warns about nothing
    assert len(dec.generate([[1] * 40], 8)[0].token_ids) == 8  # 48 positions: fits
    with pytest.raises(ValueError, match=r"needs 60 positions, past the model's window of 48") as e:
        dec.generate([[1] * 40], 20)
    # the model that sets the window is named (the target's config.json says 512)
    assert f"the draft's max_position_embeddings in {short_pair[1]}/config.json" in str(e.value)


def test_window_source_names_the_smaller_model(short_pair):
    t, d = (read_config(p)[1] for p in short_pair)
    assert window_source(t, d, "T", "D") == "the draft's max_position_embeddings in D/config.json"
    assert window_source(d, t, "T", "D") == "the target's max_position_embeddings in T/config.json"
    assert window_source(t, t) == "max_position_embeddings in both models' config.json"


def test_explicit_max_len_past_the_window_warns_and_runs(short_pair, caplog):
    with caplog.at_level(logging.WARNING, logger="spec_graph"):
        dec = _decoder(*short_pair, max_len=100)
    msgs = [r.getMessage() for r in caplog.records if r.name == "spec_graph"]
    assert len(msgs) == 1 and "max_len=100 is past the model's window of 48" in msgs[0]
    assert f"the draft's max_position_embeddings in {short_pair[1]}/config.json" in msgs[0]
    assert "no rope scaling" in msgs[0]
    assert len(dec.generate([[1] * 40], 20)[0].token_ids) == 20  # asked for: runs past the window
    with pytest.raises(ValueError, match="max_len=100"):  # max_len still bounds the request
        dec.generate([[1] * 90], 20)


def test_window_warning_with_rope_scaling_says_it_counts():
    msg = beyond_window_warning(9000, 8192, {"factor": 8.0})
    assert "8192" in msg and "rope scaling already counts" in msg
    assert beyond_window_warning(8192, 8192, None) is None


def test_llama3_rope_scaling_extends_nothing(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    path = make_checkpoint(tmp_path / "m", rope_scaling=rope)
    args = read_config(path)[1]
    assert args.rope_scaling is not None and args.window == 512  # max_position_embeddings as stated


# ---------------------------------------------------------------- 2. argument types
@pytest.fixture(scope="module")
def dec(llama_pair):
    return _decoder(*llama_pair, max_len=64)


@pytest.mark.parametrize("kw,name", [
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(temperature=1e300), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=True), "seed"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids="5"), "stop_token_ids"),
    (dict(stop_token_ids=[True]), r"stop token id True \(stop_token_ids\) is not an integer"),
    (dict(stop_token_ids=["a"]), r"stop token id 'a' \(stop_token_ids\) is not an integer"),
    (dict(stop_token_ids=[2.0]), r"stop token id 2.0 \(stop_token_ids\) is not an integer"),
    (dict(stop_token_ids=[10**6]), r"stop token id 1000000 \(stop_token_ids\) is out of range"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=math.inf), "top_p"),
    (dict(top_p=None), "top_p"),
])
def test_bad_argument_is_a_value_error_naming_it(dec, kw, name):
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError, match=name) as e:
        dec.generate([[1, 2]], **kw)
    assert "\n" not in str(e.value)


def test_edge_arguments_are_accepted(dec):
    """The control: the valid ends of each range run (numpy integers too)."""
    out = dec.generate([np.array([1, 2]).tolist(), (3, 4)], np.int64(3), temperature=np.float32(3e38), top_p=1,
                       top_k=10**30, seed=-(2**70), stop_token_ids=(5,))
    assert all(len(r.token_ids) == 3 or r.finish_reason == "stop" for r in out)
    out = dec.generate([[1, 2]], 3, temperature=0, top_p=1e-9, seed=np.int64(7), stop_token_ids=[])
    assert len(out[0].token_ids) == 3 or out[0].finish_reason == "stop"


def test_prompts_as_tensors_and_arrays(dec):
    """1-D tensors or arrays of ids are prompts, and a 2-D one is a batch of them (what HF's generate takes); a
    float tensor, or a 2-D one in the list, is refused naming the prompt."""
    want = [r.token_ids for r in dec.generate([[1, 2], [3, 4]], 3)]
    assert [r.token_ids for r in dec.generate([torch.tensor([1, 2]), np.array([3, 4])], 3)] == want
    assert [r.token_ids for r in dec.generate(torch.tensor([[1, 2], [3, 4]]), 3)] == want
    assert [r.token_ids for r in dec.generate(np.array([[1, 2], [3, 4]]), 3, stop_token_ids=np.array([5]))] == \
        [r.token_ids for r in dec.generate([[1, 2], [3, 4]], 3, stop_token_ids=[5])]
    with pytest.raises(ValueError, match=r"prompt 1 is neither a string nor a list \(or 1-D tensor\) of integer"):
        dec.generate([[1, 2], torch.tensor([3.0, 4.0])], 3)
    with pytest.raises(ValueError, match="prompt 0 .*: it has 2 dimensions"):
        dec.generate([torch.tensor([[1, 2]])], 3)
    with pytest.raises(ValueError, match=r"prompt 0 is neither .*; for one prompt of token ids pass a list of it"):
        dec.generate([1, 2, 3], 3)  # one prompt's ids, not a list of prompts


def test_an_interrupted_call_leaves_no_row_busy(dec):
    """A call cut short (here an exception from progress, as Ctrl-C would) leaves rows marked active. The next
    call must not step them: they are no request's, and under "auto" their counts would reach its chooser. The
    control: the stale row is stepped by a call whose bucket covers it unless the call clears it."""
    calls = []

    def stop_after_a_step(done, total):
        calls.append(done)
        if len(calls) == 2:  # after the prefill and one step
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dec.generate(PROMPTS, 40, progress=stop_after_a_step)  # rows 0-3 busy, 40 tokens to go
    steps = dec.state["steps"][3].item()
    out = dec.generate(PROMPTS[:3], 6)  # rows 0-2: bucket 4 spans row 3
    assert dec.state["steps"][3].item() == steps and not dec.state["active"].any()
    assert [r.token_ids for r in out] == [r.token_ids for r in dec.generate(PROMPTS[:3], 6)]


@pytest.mark.parametrize("field,value,needle", [
    ("max_batch_size", 16, "max_batch_size was set to 16 on a built engine, which was built with 8; values from 1 "
                           "up to 8 run on it"),
    ("max_len", 128, "max_len was set to 128 on a built engine, which was built with 64"),
    ("max_len", 1, "max_len was set to 1"),
    ("num_speculative_tokens", 2, "num_speculative_tokens was set to 2 .*SpecGraphConfig\\(num_speculative_tokens"),
    ("verification", "block", "verification was set to 'block'"),
    ("steps_per_graph", 0, "steps_per_graph must be an integer from 1 to 64 .*, got 0"),
    ("steps_per_graph", 65, "steps_per_graph must be an integer from 1 to 64 .*, got 65"),
    ("batch_buckets", (1, 16), r"batch_buckets \[1, 16\] pads a batch of max_batch_size=8 past the engine's 8 rows"),
    ("batch_buckets", (), "batch_buckets must be a non-empty list"),
])
def test_config_changed_on_a_built_engine(dec, field, value, needle):
    """A field set on a built engine that it cannot take is a ValueError naming it, before anything runs (a
    raised max_batch_size or max_len was an IndexError from inside torch; steps_per_graph=0 looped for ever)."""
    was = getattr(dec.config, field)
    setattr(dec.config, field, value)
    try:
        with pytest.raises(ValueError, match=needle):
            dec.generate([[1, 2]], 3)
    finally:
        setattr(dec.config, field, was)
    assert len(dec.generate([[1, 2]], 3)[0].token_ids) == 3


@pytest.mark.parametrize("value", [None, {"max_len": 32}, "SpecGraphConfig(max_len=32)"])
def test_config_replaced_by_another_kind_of_value(dec, value):
    """`dec.config` set to something that is no SpecGraphConfig is a ValueError that says to set its fields, not
    an AttributeError from inside the checks; the engine runs again once it is put back. Control: a new
    SpecGraphConfig equal to the built one runs."""
    was = dec.config
    dec.config = value
    try:
        with pytest.raises(ValueError, match="config was set to .* on a built engine: set fields of its "
                                             "SpecGraphConfig"):
            dec.generate([[1, 2]], 3)
        dec.config = dataclasses.replace(was)
        assert len(dec.generate([[1, 2]], 3)[0].token_ids) == 3
    finally:
        dec.config = was
    assert len(dec.generate([[1, 2]], 3)[0].token_ids) == 3


@pytest.mark.parametrize("respell", [True, False])
def test_a_field_respelled_on_a_built_engine_is_the_same_value(dec, respell, monkeypatch):
    """String options the constructor takes in any case ("Block", " TOKEN ") are the same value when set on a built
    engine: it runs, and the field reads as the constructor would have stored it. Broken: compared as typed."""
    assert SpecGraphConfig(verification=" Block ").verification == "block"
    if not respell:
        monkeypatch.setattr(runtime_mod, "SPELLED_FIELDS", ())
    was = dec.config.verification
    dec.config.verification = f" {was.upper()} "
    try:
        if respell:
            assert len(dec.generate([[1, 2]], 3)[0].token_ids) == 3 and dec.config.verification == was
        else:
            with pytest.raises(ValueError, match="verification was set to"):
                dec.generate([[1, 2]], 3)
    finally:
        dec.config.verification = was


def test_config_changes_a_built_engine_takes(dec):
    """The control of the refusals: fewer slots, a shorter max_len, other buckets and another steps_per_graph run
    (the graphs follow the last two) and decode the same tokens."""
    want = [r.token_ids for r in dec.generate(PROMPTS, 8)]
    cfg, was = dec.config, dataclasses.replace(dec.config)
    try:
        cfg.max_batch_size, cfg.steps_per_graph, cfg.batch_buckets = 2, 3, [2, 1]
        assert [r.token_ids for r in dec.generate(PROMPTS, 8)] == want
        assert cfg.batch_buckets == (1, 2)
        cfg.max_len = 20
        with pytest.raises(ValueError, match="max_len=20"):
            dec.generate(PROMPTS, 10)
    finally:
        for f in ("max_batch_size", "steps_per_graph", "batch_buckets", "max_len"):
            setattr(cfg, f, getattr(was, f))
    assert [r.token_ids for r in dec.generate(PROMPTS, 8)] == want


@pytest.mark.parametrize("a, b", [(0, 2 ** 63), (-1, 2 ** 64 - 1), (5, 5 + 2 ** 64)])
def test_seeds_that_differ_draw_differently(dec, a, b):
    """Any integer is a seed, and two different ones are two different streams (a seed reduced modulo 2**63 or
    2**64 would repeat a smaller one); the same seed repeats (the control)."""
    from spec_graph.runtime import request_seed

    assert request_seed(a, 0) != request_seed(b, 0) and request_seed(a, 0) != request_seed(a, 1)
    assert 0 <= request_seed(a, 0) < 2 ** 63 and 0 <= request_seed(-(10 ** 5000), 0) < 2 ** 63  # past str()'s limit
    kw = dict(max_new_tokens=24, temperature=1.0)
    toks = lambda s: dec.generate([[1, 2], [3]], seed=s, **kw)  # noqa: E731
    assert [r.token_ids for r in toks(a)] == [r.token_ids for r in toks(a)]
    assert [r.token_ids for r in toks(a)] != [r.token_ids for r in toks(b)]


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=True), dict(max_batch_size=0), dict(max_batch_size=True),
                                dict(max_len=True), dict(max_len=1.5), dict(steps_per_graph=0)])
def test_bad_config_is_a_value_error(kw):
    with pytest.raises(ValueError, match=next(iter(kw)).replace("num_speculative_tokens", "K")):
        SpecGraphConfig(**kw)


def test_numpy_integers_are_config_integers(dec):
    """Integer fields take numpy integers, as prompts and seeds do, and store them as ints; a numpy float or bool
    is still refused (the control)."""
    i = np.int64
    cfg = SpecGraphConfig(num_speculative_tokens=i(3), max_speculative_tokens=np.int32(4), max_batch_size=i(2),
                          max_len=i(64), batch_buckets=[i(2), i(1)], steps_per_graph=i(2), admission_wait=i(0))
    got = [cfg.num_speculative_tokens, cfg.max_speculative_tokens, cfg.max_batch_size, cfg.max_len,
           *cfg.batch_buckets, cfg.steps_per_graph, cfg.slot_steps_waited]
    assert got == [3, 4, 2, 64, 1, 2, 2, 0] and all(type(v) is int for v in got)
    for bad in (dict(max_len=np.float64(64)), dict(steps_per_graph=np.bool_(True)), dict(max_batch_size=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpecGraphConfig(**bad)
    want = [r.token_ids for r in dec.generate(PROMPTS, 6)]
    was = dataclasses.replace(dec.config)
    try:  # set on a built engine: taken at the next call
        dec.config.steps_per_graph, dec.config.max_batch_size = i(2), i(4)
        assert [r.token_ids for r in dec.generate(PROMPTS, 6)] == want
        assert type(dec.config.steps_per_graph) is int
    finally:
        dec.config.steps_per_graph, dec.config.max_batch_size = was.steps_per_graph, was.max_batch_size


@pytest.mark.parametrize("field,value", [("max_batch_size", 0), ("steps_per_graph", 0), ("num_speculative_tokens", 0),
                                         ("max_len", "x"), ("verification", "nope"), ("batch_buckets", ())])
def test_config_fields_set_after_construction_are_checked(llama_pair, field, value):
    """A field set after the config was built is checked when an engine takes the config, as the constructor
    checks it (an unchecked max_batch_size of 0 made generate loop for ever). Control: a good value set so is
    taken."""
    config = SpecGraphConfig(max_len=64)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field.replace("num_speculative_tokens", "K")):
        SpecDecoder.from_pretrained(*llama_pair, config)
    config = SpecGraphConfig(max_len=64)
    config.max_batch_size = 3
    assert SpecDecoder.from_pretrained(*llama_pair, config).config.max_batch_size == 3


def test_config_of_another_type_is_named(llama_pair):
    with pytest.raises(ValueError, match=r"config must be a SpecGraphConfig, got dict: write config=SpecGraphConfig"):
        SpecDecoder.from_pretrained(*llama_pair, {"num_speculative_tokens": 2})


@pytest.mark.parametrize("device,needle", [("npu", "torch_npu"), ("npu:0", "torch_npu"), ("tpu", "unsupported device"),
                                           ("cuda:x", "malformed device"), (3, "device must be")])
def test_bad_device_names_the_project_message(llama_pair, device, needle):
    from spec_graph import platform

    if platform._npu_available() and "npu" in str(device):
        pytest.skip("an NPU is present")
    with pytest.raises(ValueError, match=needle):
        _decoder(*llama_pair, device=device)


# ---------------------------------------------------------------- 3. malformed config.json / tokenizer.json
@pytest.mark.parametrize("fields,needle", [
    (dict(vocab_size=None), "'vocab_size' is null"),
    (dict(hidden_size="abc"), "'hidden_size' must be an integer >= 1, got 'abc'"),
    (dict(num_attention_heads=0), "'num_attention_heads' must be an integer >= 1, got 0"),
    (dict(num_hidden_layers=2.5), "'num_hidden_layers' must be an integer"),
    (dict(intermediate_size=True), "'intermediate_size' must be an integer"),
    (dict(num_key_value_heads=-1), "'num_key_value_heads' must be an integer"),
    (dict(max_position_embeddings="long"), "'max_position_embeddings' must be an integer"),
    (dict(head_dim=15), "'head_dim'.*even"),
    (dict(rope_scaling="llama3"), "'rope_scaling' must be an object"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16}),
     "'rope_scaling' \\(llama3\\) lacks 'low_freq_factor'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": "x", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16}), "'rope_scaling.factor' must be a positive number"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16}), "high_freq_factor .* greater"),
    (dict(rope_parameters=[1]), "'rope_parameters' must be an object"),
    (dict(rope_theta=None, rope_parameters={"rope_theta": -1.0}), "'rope_parameters.rope_theta' must be a positive"),
    (dict(rms_norm_eps="tiny"), "'rms_norm_eps' must be a positive number"),
    (dict(eos_token_id="</s>"), "'eos_token_id' must be a token id"),
    (dict(eos_token_id=2**64), "'eos_token_id' must be a token id"),
    # HF's config classes refuse these; bool("false") would drop the head or ask for biases there are none of
    (dict(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false"),
    (dict(mlp_bias="false"), "'mlp_bias' must be true or false"),
    (dict(attention_bias=0), "'attention_bias' must be true or false"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window="false", sliding_window=4),
     "'use_sliding_window' must be true or false"),  # read as true, it put a window on every layer
    (dict(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=4,
          layer_types=["sliding", "full_attention"]),
     "'layer_types' must list one of full_attention, sliding_attention per layer"),  # a typo read as full
    (dict(max_position_embeddings=1), "'max_position_embeddings' must be an integer >= 2, got 1"),
    (dict(architectures="GPT2LMHeadModel"), "unsupported architecture 'GPT2LMHeadModel'"),
    (dict(architectures={"a": 1}), "'architectures' must be a list"),
])
def test_malformed_config_names_file_and_field(tmp_path, fields, needle):
    path = _set_config(make_checkpoint(tmp_path / "m"), **fields)
    with pytest.raises(ValueError, match=needle) as e:
        load_model(path)
    assert str(path / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_intact_config_still_loads(tmp_path):
    """The control: the same edits with valid values load (null head_dim / kv heads take their defaults)."""
    path = _set_config(make_checkpoint(tmp_path / "m"), head_dim=None, num_key_value_heads=None,
                       hidden_size=64.0, max_position_embeddings=_DROP, mlp_bias=False, attention_bias=None,
                       eos_token_id=2**63 - 1)
    args = read_config(path)[1]
    assert (args.head_dim, args.num_kv_heads, args.window) == (16, 4, 2048)
    assert (args.mlp_bias, args.qkv_bias, args.eos_token_ids) == (False, False, (2**63 - 1,))


def test_malformed_tokenizer_names_the_file(tmp_path, llama_pair):
    target, draft = llama_pair
    bad = perturbed_copy(target, tmp_path / "t", noise=0.0)
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 3}}')
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a valid tokenizer file") as e:
        _decoder(bad, draft)
    assert str(bad / "tokenizer.json") in str(e.value) and "\n" not in str(e.value)
    (bad / "tokenizer.json").unlink()  # the control: without it, token-id prompts run
    assert len(_decoder(bad, draft, max_len=32).generate([[1, 2]], 3)[0].token_ids) <= 3


# ---------------------------------------------------------------- 4. non-finite weights
@pytest.fixture(scope="module")
def nan_setup(tmp_path_factory):
    """A clean target (no EOS), its clean near draft, and the greedy references."""
    root = tmp_path_factory.mktemp("nan")
    target = make_checkpoint(root / "t", vocab_size=96, eos_token_id=None)
    draft = perturbed_copy(target, root / "d", noise=0.03)
    refs = [hf_greedy(target, p, 12, eos=None) for p in PROMPTS]
    return root, target, draft, refs


def _is_prefix_of(toks, ref) -> bool:
    return toks == ref[: len(toks)]


def test_nan_target_at_prefill_commits_nothing(nan_setup, tmp_path):
    root, target, draft, refs = nan_setup
    used = {x for r in refs for x in r} | {x for p in PROMPTS for x in p}
    poison = next(t for t in range(2, 96) if t not in used)
    bad = _poison(perturbed_copy(target, tmp_path / "t", noise=0.0), "model.embed_tokens.weight", poison)
    prompts = [PROMPTS[0], PROMPTS[1][:1] + [poison], PROMPTS[2]]
    out = _decoder(bad, draft, max_len=64).generate(prompts, 12)
    assert out[1].finish_reason == "error" and out[1].token_ids == []  # not [argmax of NaN]
    assert [out[0].token_ids, out[2].token_ids] == [refs[0], refs[2]]
    assert out.stats.generated_tokens == 24
    assert out.stats.tokens_per_step * out.stats.request_steps == pytest.approx(24)


ON_CUDA = pytest.mark.gpu


@pytest.mark.parametrize("K,device", [(1, "cpu"), (2, "cpu"), (4, "cpu"), pytest.param(2, "cuda", marks=ON_CUDA),
                                      pytest.param(4, "cuda", marks=ON_CUDA)])
def test_nan_target_mid_generation_keeps_the_committed_prefix(nan_setup, tmp_path, K, device):
    """The target turns NaN once it is fed a token it generates itself: the request keeps its clean output up to
    and with that token, as a plain decode would (its logits were finite), whatever K is, and no other token;
    the other requests are untouched, and the stats count the kept tokens. On CUDA through the captured step."""
    root, target, draft, refs = nan_setup
    ref = refs[0]
    m = next(i for i in range(3, len(ref)) if ref[i] not in PROMPTS[0] and ref[i] not in ref[:i]
             and all(ref[i] not in r for r in refs[1:]) and all(ref[i] not in p for p in PROMPTS))
    bad = _poison(perturbed_copy(target, tmp_path / "t", noise=0.0), "model.embed_tokens.weight", ref[m])
    dec = _decoder(bad, draft, K=K, max_len=64, device=device, dtype="float32")
    out = dec.generate(PROMPTS, 12)
    assert (dec.graphs is not None) == (device == "cuda")
    r = out[0]
    assert r.finish_reason == "error" and r.token_ids == ref[: m + 1]
    assert [o.token_ids for o in out[1:]] == refs[1:]
    assert out.stats.generated_tokens == m + 1 + sum(map(len, refs[1:]))
    assert out.stats.tokens_per_step * out.stats.request_steps == pytest.approx(out.stats.generated_tokens)


@pytest.mark.parametrize("zeroed", [True, False])
def test_a_slot_left_with_non_finite_values_serves_the_next_request(nan_setup, monkeypatch, zeroed):
    """Caches left full of NaN (by a request whose model overflowed): the next requests in those slots still
    equal HF. This engine attends over whole slots under a mask (the torch path): admission zeroes the slot, and
    a masked non-finite value enters no sum anyway, so either alone serves. The control drops both (admission
    skips the zeroing, and the product is the plain masked one, 0 * NaN) and must be caught."""
    from spec_graph.models import llama

    root, target, draft, refs = nan_setup
    dec = _decoder(target, draft, max_len=64, max_batch_size=2)
    assert not dec._reads_live_only()
    if not zeroed:
        monkeypatch.setattr(dec, "_reads_live_only", lambda: True)

    def fill():
        for kv in (dec.target_kv, dec.draft_kv):
            for c in kv:
                c.fill_(float("nan"))
    fill()
    assert [r.token_ids for r in dec.generate(PROMPTS, 12)] == refs
    fill()
    monkeypatch.setattr(dec, "_reads_live_only", lambda: True)
    monkeypatch.setattr(llama, "masked_values_product", lambda probs, values, mask: probs @ values)
    assert [r.token_ids for r in dec.generate(PROMPTS, 12)] != refs


def test_nan_draft_alone_does_not_end_the_request(nan_setup, tmp_path):
    """Greedy: with an all-NaN draft the output is still the target's greedy output, token for token; the same
    NaN in the target ends the request (the draft's NaN is not hidden by a NaN-free pair)."""
    root, target, draft, refs = nan_setup
    nan_draft = _poison(perturbed_copy(draft, tmp_path / "d", noise=0.0), "model.norm.weight")
    m = load_model(nan_draft)
    assert not torch.isfinite(m(torch.tensor([[1, 2]]), torch.arange(2)[None], *m.new_kv_cache(1, 16))).any()
    out = _decoder(target, nan_draft, max_len=64).generate(PROMPTS, 12)
    assert [r.token_ids for r in out] == refs and all(r.finish_reason == "length" for r in out)
    nan_target = _poison(perturbed_copy(target, tmp_path / "t", noise=0.0), "model.norm.weight")
    out = _decoder(nan_target, draft, max_len=64).generate(PROMPTS, 12)
    assert all(r.finish_reason == "error" and r.token_ids == [] for r in out)


@pytest.fixture(scope="module")
def nan_behind_a_rejection(tmp_path_factory):
    """A target that turns NaN when fed token 0 (its embedding row) and never picks token 0 itself (a zero head
    row: its logit 0 never tops 95 random ones), its greedy references, and two drafts that propose token 0: one
    always (a zero final norm: every logit 0, the first wins), one in place of the target's favourite token (that
    token's head row, scaled), after agreeing with the target elsewhere."""
    root = tmp_path_factory.mktemp("nan_rejected")
    clean = _edit(make_checkpoint(root / "clean", vocab_size=96, eos_token_id=None),
                  lambda st: st["lm_head.weight"][0].zero_())
    refs = [hf_greedy(clean, p, 16, eos=None) for p in PROMPTS]
    assert all(0 not in r and 0 not in p for r, p in zip(refs, PROMPTS))
    target = _poison(perturbed_copy(clean, root / "t", noise=0.0), "model.embed_tokens.weight", 0)
    tokens = sum(refs, [])
    favourite = max(set(tokens), key=tokens.count)
    always = _edit(perturbed_copy(clean, root / "always", noise=0.0), lambda st: st["model.norm.weight"].zero_())
    instead = _edit(perturbed_copy(clean, root / "instead", noise=0.0),
                    lambda st: st["lm_head.weight"][0].copy_(1.5 * st["lm_head.weight"][favourite]))
    return target, refs, {"always": always, "instead": instead}


@pytest.mark.parametrize("K", [2, 5])
@pytest.mark.parametrize("draft", ["always", "instead"])
def test_a_rejected_draft_that_drives_the_target_to_nan_ends_nothing(nan_behind_a_rejection, draft, K):
    """The verify feeds the draft's token 0; the target's logits turn NaN from there on, but the target rejects
    it, and a decode of the committed tokens alone never meets token 0: every request equals HF's greedy output.
    It needs both the masked NaN keys kept out of the rows before them and the finite check kept to the
    positions a row commits (either alone ends every request with "error")."""
    target, refs, drafts = nan_behind_a_rejection
    out = _decoder(target, drafts[draft], K=K, max_len=64).generate(PROMPTS, 16)
    assert [(r.token_ids, r.finish_reason) for r in out] == [(ref, "length") for ref in refs]
    if draft == "instead":  # drafts agreed before the rejection at some steps: deeper positions were reached
        assert max(max(r.accepted_counts) for r in out) >= 1


@pytest.mark.parametrize("verification", ["token", "block"])
def test_a_rejected_draft_that_drives_the_target_to_nan_ends_nothing_sampled(nan_behind_a_rejection, verification):
    """Sampled (top-k 3, where the target's zero logit for token 0 stays out of its top 3), with the draft that
    proposes 0 in place of the target's favourite (its top 3 holds 0 there): verifies do meet NaN logits, yet no
    request fails, and none holds token 0."""
    target, refs, drafts = nan_behind_a_rejection
    dec = _decoder(target, drafts["instead"], K=3, max_len=64, verification=verification)
    forward, verifies_with_nan = dec.target.forward, []

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        verifies_with_nan.append(bool((~torch.isfinite(out)).any()))
        return out
    dec.target.forward = spy
    out = dec.generate(PROMPTS * 4, 16, temperature=1.0, top_k=3, seed=0)
    assert any(verifies_with_nan)
    assert all(r.finish_reason == "length" and 0 not in r.token_ids for r in out)


# Sampling with a NaN draft: the joint law of the first three tokens is still the target's.
V, SAMPLE_PROMPT, N = 6, [1, 4, 2], 6000


def _joint(path, n_tokens):
    import itertools

    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    joint = np.ones(())
    with torch.no_grad():
        for n in range(n_tokens):
            prefixes = list(itertools.product(range(V), repeat=n))
            logits = m(torch.tensor([SAMPLE_PROMPT + list(p) for p in prefixes])).logits[:, -1]
            joint = joint.reshape(-1, 1) * torch.softmax(logits.double(), -1).numpy()
    return joint.reshape((V,) * n_tokens)


def _pvalue(dec, joint, n_tokens):
    from scipy.stats import chisquare

    out = dec.generate([SAMPLE_PROMPT] * N, max_new_tokens=n_tokens, temperature=1.0, seed=99)
    assert all(r.finish_reason == "length" for r in out)
    counts = np.zeros((V,) * n_tokens)
    for r in out:
        counts[tuple(r.token_ids)] += 1
    exp, obs = joint.ravel() * N, counts.ravel()
    big = exp >= 5
    obs, exp = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _always_accept(draft_ids, draft_probs, target_probs, seeds, steps, active):
    B, K = draft_ids.shape
    bonus = race_sample(target_probs[:, K], seeds, steps, torch.arange(B), K)
    sampled = torch.cat((draft_ids, bonus[:, None]), 1)
    return torch.where(active[:, None], sampled, PLACEHOLDER), torch.full((B,), K)


@pytest.fixture(scope="module")
def nan_sampling(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan_sampling")
    kw = dict(vocab_size=V, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64, eos_token_id=None,
              seed=3, init_std=0.5)
    target = make_checkpoint(root / "t", **kw)
    draft = _poison(perturbed_copy(target, root / "d", noise=0.1), "model.norm.weight")
    dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=2, max_batch_size=512,
                                                                     max_len=16, batch_buckets=(512,)))
    return dec, _joint(target, 3)


def test_nan_draft_sampling_keeps_the_target_law(nan_sampling):
    dec, joint = nan_sampling
    assert _pvalue(dec, joint, 3) > 0.01


def test_nan_draft_sampling_rejects_a_broken_sampler(nan_sampling, monkeypatch):
    monkeypatch.setattr(step_mod, "rejection_sample", _always_accept)
    dec, joint = nan_sampling
    assert _pvalue(dec, joint, 3) < 0.01


def test_a_tied_config_with_its_own_head_keeps_that_head_as_transformers_does(tmp_path, caplog):
    """config.json says tie_word_embeddings, but the checkpoint stores an lm_head with other values: transformers
    (5.x) keeps that head apart, with a warning, so its greedy output is that head's; so is spec-graph's, with a
    warning per model. Control: a stored head equal to the embedding is tied without a word."""
    path = _set_config(make_checkpoint(tmp_path / "m", tie_word_embeddings=False), tie_word_embeddings=True)
    prompt = [5, 9, 14, 3]
    with caplog.at_level("WARNING", logger="spec_graph"):
        out = _decoder(path, path, max_len=64).generate([prompt], 12)[0].token_ids
    assert out == hf_greedy(path, prompt, 12)
    # one warning per model read: the target and the draft are this checkpoint
    assert sum("stores a head with other values" in r.getMessage() for r in caplog.records) == 2
    caplog.clear()
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="spec_graph"):
        model = load_model(path)
    assert model.lm_head is None and not any("other values" in r.getMessage() for r in caplog.records)
