"""The engine end to end: lossless greedy output against HF, acceptance bookkeeping, bad input."""
import dataclasses
import json
import re

import pytest
import torch
from helpers import ARCHS, assert_every_count, hf_greedy, make_checkpoint, nan_past, perturbed_copy

from spec_graph import SpecDecoder, SpecGraphConfig

PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 70], [3], [60, 61, 62, 63]]


def decoder(target, draft, K=3, **cfg):
    cfg.setdefault("max_len", 64)
    return SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=K, **cfg))


@pytest.fixture(scope="module")
def references(llama_pair):
    target, _ = llama_pair
    return [hf_greedy(target, p, 20) for p in PROMPTS]


@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_equals_hf_with_different_draft(llama_pair, references, K):
    target, draft = llama_pair
    out = decoder(target, draft, K, max_batch_size=8).generate(PROMPTS, max_new_tokens=20)
    for r, ref in zip(out, references):
        assert r.token_ids == ref
        assert r.finish_reason == ("stop" if ref[-1] == 1 else "length")
    assert 0.0 < out.stats.acceptance_rate < 1.0  # the draft really differs, and often agrees
    assert_every_count(out, K)


def test_every_count_rejects_a_draft_that_never_agrees(llama_pair, tmp_path):
    """The control of the histogram check: a far draft never reaches the all-accepted path."""
    target, _ = llama_pair
    far = perturbed_copy(target, tmp_path / "far", noise=0.6)
    out = decoder(target, far, 3).generate(PROMPTS, max_new_tokens=20)
    with pytest.raises(AssertionError, match="do not cover"):
        assert_every_count(out, 3)


# Architecture-specific features, each reached by the generated lengths below: Qwen2 with a sliding window
# on its upper layer, Qwen3's q/k norms, Mistral's sliding window on every layer.
ARCH_VARIANTS = {
    "LlamaForCausalLM": dict(),
    "Qwen2ForCausalLM": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "Qwen3ForCausalLM": dict(head_dim=16),
    "MistralForCausalLM": dict(sliding_window=7),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate_per_architecture(tmp_path, arch):
    """HF ``generate`` is the reference for every supported architecture, with a near draft of its own."""
    target = make_checkpoint(tmp_path / "t", arch, vocab_size=96, layers=2, **ARCH_VARIANTS[arch])
    draft = perturbed_copy(target, tmp_path / "d", noise=0.03)
    K = 3
    out = decoder(target, draft, K).generate(PROMPTS, max_new_tokens=24)
    for p, r in zip(PROMPTS, out):
        assert r.token_ids == hf_greedy(target, p, 24), (arch, p)
    assert_every_count(out, K)


def test_queued_prompts_continuous_batching(llama_pair, references):
    target, draft = llama_pair
    out = decoder(target, draft, 3, max_batch_size=2, batch_buckets=(1, 2)).generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == references
    assert out.stats.prefills >= 3  # five prompts through two slots


def test_unrelated_draft_architecture(tmp_path, llama_pair, references):
    """A pair whose draft is an unrelated Qwen3 model: still the target's output, token for token."""
    target, _ = llama_pair
    draft = make_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM", vocab_size=96, hidden_size=32, layers=1,
                            heads=2, kv_heads=1, head_dim=16, seed=7)
    out = decoder(target, draft, 4).generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == references


def test_draft_equal_to_target_accepts_everything(llama_pair):
    target, _ = llama_pair
    out = decoder(target, target, 4).generate(PROMPTS, max_new_tokens=25)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.acceptance_rate_per_position == [1.0] * 4
    s = out.stats
    assert s.tokens_per_step == pytest.approx(s.generated_tokens / s.request_steps)


def test_tokens_per_step_counts_the_prefill(tmp_path):
    """Without EOS and with every draft accepted, 21 tokens are the prefill's and 4 steps of 5: 21 / 5 per
    request-step. The old definition (accepted + 1 per step, the prefill left out) says 5, and 5 x 4 steps is
    not 21."""
    tgt = make_checkpoint(tmp_path / "t", vocab_size=96, eos_token_id=None)
    out = decoder(tgt, tgt, 4).generate(PROMPTS, max_new_tokens=21)
    s = out.stats
    assert all(r.accepted_counts == [4] * 4 for r in out)
    assert (s.request_steps, s.generated_tokens, s.steps) == (5 * len(PROMPTS), 21 * len(PROMPTS), 4)
    assert s.tokens_per_step == pytest.approx(21 / 5)
    counts = [a for r in out for a in r.accepted_counts]
    old = (sum(counts) + len(counts)) / len(counts)
    assert old == 5.0 and old * s.steps != 21


def test_tokens_per_step_adds_up(llama_pair):
    """tokens_per_step x request_steps == generated_tokens, with prompts queued, stopped early and cut by
    max_new_tokens; the old definition (accepted + 1 per step, the prefill left out) does not add up."""
    target, draft = llama_pair
    out = decoder(target, draft, 3, max_batch_size=2, batch_buckets=(1, 2)).generate(PROMPTS, max_new_tokens=17)
    s = out.stats
    assert s.generated_tokens == sum(len(r.token_ids) for r in out)
    assert s.request_steps == sum(len(r.accepted_counts) + 1 for r in out)
    assert s.tokens_per_step * s.request_steps == pytest.approx(s.generated_tokens)
    one = decoder(target, draft, 3).generate([PROMPTS[2]], max_new_tokens=17)
    assert one.stats.request_steps == one.stats.steps + 1
    assert one.stats.tokens_per_step * (one.stats.steps + 1) == pytest.approx(len(one[0].token_ids))


def _independent_greedy_counts(target, draft, prompt, max_new, K):
    """Plain-Python speculative greedy loop with HF models: per step, drafts accepted by the target."""
    import transformers

    t = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    d = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    seq, counts, generated = list(prompt), [], 0
    with torch.no_grad():
        seq.append(int(t(torch.tensor([seq])).logits[0, -1].argmax()))  # the prefill's token
        generated = 1
        while generated < max_new:
            props = []
            for _ in range(K):
                props.append(int(d(torch.tensor([seq + props])).logits[0, -1].argmax()))
            targ = t(torch.tensor([seq + props])).logits[0, len(seq) - 1:].argmax(-1).tolist()
            n = 0
            while n < K and props[n] == targ[n]:
                n += 1
            counts.append(n)
            new = props[:n] + [targ[n]]
            seq += new
            generated += len(new)
    return counts


def test_accepted_counts_match_independent_loop(tmp_path):
    tgt = make_checkpoint(tmp_path / "t", vocab_size=96, eos_token_id=None)  # no EOS: every request runs full length
    drf = perturbed_copy(tgt, tmp_path / "d", noise=0.15)
    K, max_new = 3, 18
    dec = decoder(tgt, drf, K)
    calls = []
    dec.target.register_forward_hook(lambda *a: calls.append(1))
    out = dec.generate(PROMPTS[:3], max_new_tokens=max_new)
    for p, r in zip(PROMPTS[:3], out):
        assert len(r.token_ids) == max_new
        assert r.accepted_counts == _independent_greedy_counts(tgt, drf, p, max_new, K)
        assert 0 < sum(r.accepted_counts) < K * len(r.accepted_counts)
    # One target forward per step (plus prefills): an engine decoding with the target alone would need more.
    assert len(calls) == out.stats.steps + out.stats.prefills
    longest = max(len(r.accepted_counts) for r in out)
    assert out.stats.steps == longest < max_new - 1


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_max_new_tokens_is_exact(tmp_path, max_new):
    tgt = make_checkpoint(tmp_path / "t", vocab_size=96, eos_token_id=None)
    out = decoder(tgt, tgt, 4).generate(PROMPTS, max_new_tokens=max_new)
    assert all(len(r.token_ids) == max_new and r.finish_reason == "length" for r in out)


@pytest.mark.parametrize("at", [0, 5])  # 0: the prefill's token is the stop
def test_stop_token_ids(llama_pair, references, at):
    target, draft = llama_pair
    ref = references[0]
    stop = ref[at]
    out = decoder(target, draft, 3).generate(PROMPTS[:2], max_new_tokens=20, stop_token_ids=[stop])
    assert out[0].token_ids == ref[: ref.index(stop) + 1]
    assert out[0].finish_reason == "stop"
    other = references[1]
    assert out[1].token_ids == other[: other.index(stop) + 1 if stop in other else 20]


def test_text_prompts_use_target_tokenizer(llama_pair, tokenizer):
    target, draft = llama_pair
    dec = decoder(target, draft, 2)
    text = "def add(a, b):"
    ids = tokenizer.encode(text).ids
    by_text, by_ids = dec.generate([text], 8), dec.generate([ids], 8)
    assert by_text[0].token_ids == by_ids[0].token_ids
    assert by_text[0].text == tokenizer.decode(by_text[0].token_ids)
    assert by_text[0].prompt_token_ids == ids


def test_nan_logits_fail_one_request_only(tmp_path, references):
    tgt = make_checkpoint(tmp_path / "t", vocab_size=96, tokenizer=None)
    clean = [hf_greedy(tgt, p, 12) for p in PROMPTS]
    poison = next(t for t in range(2, 96) if t not in {x for r in clean for x in r} and t not in sum(PROMPTS, []))
    from safetensors.torch import load_file, save_file

    f = tgt / "model.safetensors"
    state = load_file(str(f))
    state["model.embed_tokens.weight"][poison] = float("nan")
    save_file(state, str(f), metadata={"format": "pt"})
    bad = PROMPTS[2][:4] + [poison] + PROMPTS[2][4:]
    prompts = [PROMPTS[0], bad, PROMPTS[1], PROMPTS[3]]
    out = decoder(tgt, tgt, 3, max_batch_size=2, batch_buckets=(2,)).generate(prompts, max_new_tokens=12)
    assert out[1].finish_reason == "error"
    assert out[1].token_ids == []  # its prefill was NaN: no made-up token (the argmax of NaN logits)
    assert [out[i].token_ids for i in (0, 2, 3)] == [clean[0], clean[1], clean[3]]


def _prefill_over_the_whole_caches(self, toks, pos, slots, lens):
    """The prefill as it was: both models over the whole caches (max_len positions, masked past the prompt)."""
    with torch.inference_mode():
        self.draft(toks, pos, *self.draft_kv, slots=slots)
        logits = self.target(toks, pos, *self.target_kv, slots=slots)
        return logits[torch.arange(toks.shape[0], device=toks.device), lens - 1]


def _attended_lengths(monkeypatch) -> list[int]:
    """The cache positions each masked-attention product of the models reads, recorded as they run."""
    from spec_graph.models import llama

    seen, product = [], llama.masked_values_product
    monkeypatch.setattr(llama, "masked_values_product", lambda p, v, m: seen.append(v.shape[2]) or product(p, v, m))
    return seen


@pytest.mark.parametrize("whole_caches", [False, True])
def test_prefill_reads_the_prompts_positions_alone(llama_pair, references, monkeypatch, whole_caches):
    """A prefill's attention covers the prompt's length bucket (16 here), not max_len (its work follows the
    prompt): its products read the longest prompt's positions, and with every cache position past 16 NaN before
    the prefill the first tokens are still HF's. Control: a prefill over the whole caches reads all of them."""
    import spec_graph.engine as engine_mod

    monkeypatch.setattr(engine_mod.SpecDecoder, "_zero_slots", nan_past(16))
    if whole_caches:
        monkeypatch.setattr(engine_mod.SpecDecoder, "_prefill_forward", _prefill_over_the_whole_caches)
    target, draft = llama_pair
    # on CPU: a device's 16-token prefill of this pair takes the live-length attention kernel whatever it is given
    dec = decoder(target, draft, 3, max_len=1024, max_batch_size=8, device="cpu")
    seen = _attended_lengths(monkeypatch)
    out = dec.generate(PROMPTS, max_new_tokens=1)
    assert max(len(p) for p in PROMPTS) <= 16
    assert [r.token_ids for r in out] == [ref[:1] for ref in references]
    assert seen and max(seen) == (dec.cache_len if whole_caches else max(len(p) for p in PROMPTS)), set(seen)


@pytest.mark.parametrize("span,steps_per_graph", [(True, 1), (True, 3), (False, 1)])
def test_eager_steps_read_their_span_alone(llama_pair, references, monkeypatch, span, steps_per_graph):
    """An eager step (CPU) reads the caches up to its rows' lengths plus what its replay can write, not all of
    max_len, so its work follows the context: its products read under 64 positions, and with every position past
    128 NaN in each slot, each prompt's 20 tokens are still HF's, one step or three per replay. Control: the
    same engine reading the whole caches reads all of them."""
    import spec_graph.engine as engine_mod

    monkeypatch.setattr(engine_mod.SpecDecoder, "_zero_slots", nan_past(128))
    target, draft = llama_pair
    dec = decoder(target, draft, 3, max_len=1024, max_batch_size=8, device="cpu", steps_per_graph=steps_per_graph)
    assert dec.span_steps  # eager on a CPU
    dec.span_steps = span
    seen = _attended_lengths(monkeypatch)
    out = dec.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == references
    assert seen and (max(seen) < 64 if span else max(seen) == dec.cache_len), sorted(set(seen))


class _BoundWithoutSteps(SpecDecoder):
    """Broken: a slot's writes bounded by its prompt and max_new alone, without what a step writes past them."""

    def _admitted(self, slots, lens, max_new, T):
        upto = super()._admitted(slots, lens, max_new, T)
        for s, n, m in zip(slots, lens, max_new):
            self._written_below[s] = max(T, n + m)
        return upto


def _written_past_bound(dec) -> list[int]:
    """The slots with a nonzero cache value at or past the position their bookkeeping says nothing was written."""
    caches = (*dec.target_kv, *dec.draft_kv)
    return [s for s, hi in enumerate(dec._written_below) if any(c[:, s, :, hi:].count_nonzero() for c in caches)]


@pytest.mark.parametrize("cls", [SpecDecoder, _BoundWithoutSteps])
def test_admission_clears_only_what_earlier_requests_wrote(llama_pair, references, monkeypatch, cls):
    """Zeroing a slot at admission covers the positions its earlier requests (or the step's scratch writes once
    they finished) may have written, not max_len: past that bound every cache position is still the zeros it was
    made with, after calls that reuse slots, cut requests short, take three steps per replay and choose K per
    step; later admissions clear no more than that bound, and tokens stay HF's. Broken: a bound without the
    positions a step writes past a request's length (a finished row's steps still write there)."""
    import spec_graph.engine as engine_mod

    cleared = []
    real = engine_mod.SpecDecoder._zero_slots
    monkeypatch.setattr(engine_mod.SpecDecoder, "_zero_slots",
                        lambda self, slots, upto=None: (cleared.append(upto), real(self, slots, upto))[1])
    target, draft = llama_pair
    bad = []
    for K, n in ((3, 1), ("auto", 3)):
        dec = cls.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=K, max_len=1024,
                                                                 max_batch_size=2, steps_per_graph=n,
                                                                 max_speculative_tokens=4))
        assert not dec._reads_live_only()  # eager on a CPU: old positions are read, masked
        for new in (20, 7):
            cleared.clear()
            out = dec.generate(PROMPTS, max_new_tokens=new)
            assert [r.token_ids for r in out] == [ref[:new] for ref in references]
            bad += _written_past_bound(dec)
            if cls is SpecDecoder and new == 7:  # the second call: every slot's bound is known
                assert cleared and all(u is not None and u <= 11 + 20 + 2 * 4 + 2 for u in cleared), cleared
    assert (bad == []) == (cls is SpecDecoder), bad


def test_slots_left_uncleared_keep_their_old_bound(llama_pair):
    """Where forwards read live positions alone, admission clears nothing: a slot's bound then stays at least what
    its earlier requests wrote (longer prompts first, shorter after), so that an engine which later reads old
    positions (TRITON_INTERPRET unset, say) clears them."""
    target, draft = llama_pair
    dec = decoder(target, draft, 3, max_len=1024, max_batch_size=2)
    dec._reads_live_only = lambda: True
    dec.generate(sorted(PROMPTS, key=len, reverse=True), max_new_tokens=20)
    assert _written_past_bound(dec) == []


# ---------------------------------------------------------------- bad input
def test_error_vocab_mismatch(tmp_path, llama_pair):
    target, _ = llama_pair
    other = make_checkpoint(tmp_path / "v", vocab_size=100)
    with pytest.raises(ValueError, match="vocab size 100 .* differs"):
        decoder(target, other)


@pytest.mark.parametrize("which, value, error, match", [
    ("target", None, TypeError, r"target_dir must be a checkpoint directory \(a str or os.PathLike\), got None"),
    ("target", 5, TypeError, "target_dir must be a checkpoint directory .*got 5"),
    ("draft", None, TypeError, "draft_dir must be a checkpoint directory .*got None"),
    ("draft", b"/tmp", TypeError, "draft_dir must be a checkpoint directory"),
    ("target", "", ValueError, "target_dir must name a checkpoint directory, got ''"),
])
def test_error_checkpoint_path_of_the_wrong_type(llama_pair, which, value, error, match):
    """Named by argument, not a TypeError from inside pathlib ("" is not read as the current folder)."""
    target, draft = llama_pair
    args = (value, draft) if which == "target" else (target, value)
    with pytest.raises(error, match=match):
        SpecDecoder.from_pretrained(*args)


@pytest.mark.parametrize("K", [0, 17, -1])
def test_error_k_out_of_range(K):
    with pytest.raises(ValueError, match="1..16"):
        SpecGraphConfig(num_speculative_tokens=K)


@pytest.mark.parametrize("field,value,match", [
    ("batch_buckets", (1.5, 2), "batch_buckets must be a non-empty list of positive integers"),
    ("batch_buckets", "12", "batch_buckets"), ("batch_buckets", (), "batch_buckets"),
    ("batch_buckets", (True,), "batch_buckets"), ("batch_buckets", None, "batch_buckets"),
    ("enable_graph", "no", "enable_graph must be True, False or None"),
    ("passes", None, "passes must be a dict"),
    ("passes", {"fuse_greedy_acept": False}, r"unknown pass name\(s\) \['fuse_greedy_acept'\].*fuse_greedy_accept"),
    ("passes", {"fuse_greedy_accept": "false"}, "True or False"),
])
def test_error_bad_engine_settings(field, value, match):
    """Each is refused by name: a float bucket is not truncated, "no" does not read as on, a misspelled pass
    or a string "false" does not leave the pass silently on."""
    with pytest.raises(ValueError, match=match):
        SpecGraphConfig(**{field: value})


def test_engine_settings_accepted_as_given():
    """The control: valid values of the same settings build, buckets sorted and deduplicated."""
    cfg = SpecGraphConfig(batch_buckets=[4, 1, 2, 2], enable_graph=False, passes={"fuse_greedy_accept": False})
    assert cfg.batch_buckets == (1, 2, 4) and cfg.enable_graph is False
    assert SpecGraphConfig(passes={}).passes == {}


def test_error_kv_caches_past_free_memory(llama_pair, monkeypatch):
    """A max_len whose KV caches cannot fit is refused by name before any allocation; the control: the same
    engine builds when the caches fit exactly in what is free."""
    import spec_graph.engine as engine
    from spec_graph import platform

    with pytest.raises(ValueError, match=r"KV caches need .* lower max_len \(--max-len; at most \d+ fits with "
                                         r"max_batch_size=8\) or max_batch_size"):
        decoder(*llama_pair, max_len=10**9)
    cfg = SpecGraphConfig(num_speculative_tokens=3, max_len=64)
    dec = SpecDecoder.from_pretrained(*llama_pair, cfg)
    need = sum(kv.numel() * kv.element_size() for pair in (dec.target_kv, dec.draft_kv) for kv in pair)
    for free, ok in ((need, True), (need - 1, False)):
        monkeypatch.setattr(platform.Platform, "free_memory", lambda self, free=free: free)
        if ok:
            engine.SpecDecoder(dec.target, dec.draft, cfg)
        else:
            with pytest.raises(ValueError, match="KV caches need") as err:
                engine.SpecDecoder(dec.target, dec.draft, cfg)
    # the settings the message names fit, and one step past them does not (max_batch_size 8 holds 8 rows; 7 fit,
    # but 7 and 5 round up to the bucket of 8: the largest that fits is the bucket of 4)
    fit_len, fit_batch = map(int, re.search(r"--max-len; at most (\d+) fits with max_batch_size=8\) or "
                                            r"max_batch_size \(--max-batch-size; at most (\d+) fits",
                                            str(err.value)).groups())
    assert 2 <= fit_len < cfg.max_len and fit_batch == 4 == cfg.batch_buckets[2]
    for changes, ok in (({"max_len": fit_len}, True), ({"max_len": fit_len + 1}, False),
                        ({"max_batch_size": fit_batch}, True), ({"max_batch_size": fit_batch + 1}, False)):
        small = dataclasses.replace(cfg, **changes)
        if ok:
            engine.SpecDecoder(dec.target, dec.draft, small)
        else:
            with pytest.raises(ValueError, match="KV caches need"):
                engine.SpecDecoder(dec.target, dec.draft, small)
    monkeypatch.setattr(platform.Platform, "free_memory", lambda self: 1)
    with pytest.raises(ValueError, match=r"--max-len; none fits .*--max-batch-size; none fits"):
        engine.SpecDecoder(dec.target, dec.draft, cfg)


def test_error_empty_prompt(llama_pair):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder(*llama_pair).generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="prompts is empty"):
        decoder(*llama_pair).generate([], 4)


def test_error_too_long(llama_pair):
    with pytest.raises(ValueError, match="max_len=64"):
        decoder(*llama_pair).generate([[1] * 60], 10)


def test_error_token_out_of_range(llama_pair):
    with pytest.raises(ValueError, match="out of range"):
        decoder(*llama_pair).generate([[1, 96]], 4)
    with pytest.raises(ValueError, match="out of range"):
        decoder(*llama_pair).generate([[1, -1]], 4)


def test_error_unknown_architecture(tmp_path, llama_pair):
    target, _ = llama_pair
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'FalconForCausalLM'"):
        decoder(target, bad)


def test_error_sampling_params(llama_pair):
    dec = decoder(*llama_pair)
    for kw in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            dec.generate([[1, 2]], 4, **kw)


def test_bad_request_does_not_disturb_the_next_call(llama_pair, references):
    dec = decoder(*llama_pair)
    with pytest.raises(ValueError):
        dec.generate([PROMPTS[0], []], 20)
    assert dec.generate([PROMPTS[0]], 20)[0].token_ids == references[0]


def test_an_eager_prefill_runs_at_its_prompts_own_length(llama_pair, monkeypatch):
    """Without prefill graphs (CPU) the prefill is not padded to a power of two: a long prompt would pay up to
    2x its positions (4x its attention) for nothing. The tokens are HF's."""
    target, draft = llama_pair
    dec = decoder(target, draft, 3)
    assert dec.prefill_graphs is None
    seen = []
    run = dec._prefill_forward
    monkeypatch.setattr(dec, "_prefill_forward", lambda toks, *a: (seen.append(tuple(toks.shape)), run(toks, *a))[1])
    prompts = [list(range(2, 35)), [3, 4, 5]]
    out = dec.generate(prompts, 6)
    assert seen == [(2, 33)]
    assert [r.token_ids for r in out] == [hf_greedy(target, p, 6) for p in prompts]


def test_only_padded_prefill_shapes_replay_graphs(llama_pair, monkeypatch):
    """3 prompts of 300 positions pad to 3 x 512, over the graphs' 1024 positions: they run eagerly at 3 x 300,
    and that unpadded shape must not get a graph of its own (one per odd length), though 900 positions fit."""
    import spec_graph.prefill as rt

    target, draft = llama_pair
    dec = decoder(target, draft, 3, max_len=1024)
    monkeypatch.setattr(dec, "prefill_graphs", object())  # as on a device with graphs
    assert rt.PREFILL_GRAPH_TOKENS == 1024 and rt.PREFILL_GRAPH_LEN == 512
    assert not dec._prefill_replays(3, 512) and not dec._prefill_replays(3, 300)
    assert dec._prefill_replays(3, 256) and dec._prefill_replays(1, 512) and dec._prefill_replays(8, 128)
    assert not dec._prefill_replays(1, 1023) and not dec._prefill_replays(8, 100)
