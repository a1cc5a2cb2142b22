"""Replays launched ahead of the read of the one before (``DecoderBase.launch_ahead``), on a CPU stand-in platform
that records and replays: the same tokens, per-request counts and Ks as the loop that reads each replay first, and
HF's greedy tokens; rows that end in one replay, and new requests in their slots, stay apart."""
import shutil
from pathlib import Path

import pytest
import torch
from helpers import fake_platform, hf_greedy, perturbed_copy

from spec_graph import SpecDecoder, SpecGraphConfig, runtime

# mixed lengths, more prompts than slots: rows end apart, and freed slots take new requests mid-call
PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13], [3], [60, 61, 62, 63], [20, 21, 22],
           [30, 31, 32, 33, 34, 35], [70], [50, 51, 52]]
MAX_NEW = 36


def engine(pair, ahead: bool, graphs: bool = True, **cfg) -> SpecDecoder:
    cfg = {"num_speculative_tokens": 3, "max_len": 64, "max_batch_size": 4, "batch_buckets": (2, 4), **cfg}
    target, draft = pair
    base = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(**cfg))
    if graphs:  # the stand-in platform captures (keeps the step) and replays (calls it): the loop of a device
        base = SpecDecoder(base.target, base.draft, base.config, base.tokenizer, base.eos_token_ids,
                           plat=fake_platform())
        base.compiled = False
        assert base.launch_ahead  # on by default where there are graphs
    base.launch_ahead = ahead
    return base


@pytest.fixture(scope="module")
def serial(llama_pair):
    """Each replay read before the next launch: HF's greedy tokens."""
    dec = engine(llama_pair, ahead=False)
    out = dec.generate(PROMPTS, MAX_NEW)
    assert dec.launched_ahead == 0
    assert [r.token_ids for r in out] == [hf_greedy(llama_pair[0], p, MAX_NEW) for p in PROMPTS]
    return out


def check_same(out, serial) -> None:
    assert [r.token_ids for r in out] == [r.token_ids for r in serial]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in serial]
    # a request's steps do not depend on which rows ran beside it
    assert [r.accepted_counts for r in out] == [r.accepted_counts for r in serial]
    assert [r.k_per_step for r in out] == [r.k_per_step for r in serial]
    assert out.stats.request_steps == serial.stats.request_steps


def test_launched_ahead_equals_the_serial_loop(llama_pair, serial):
    dec = engine(llama_pair, ahead=True)
    out = dec.generate(PROMPTS, MAX_NEW)
    assert dec.launched_ahead >= 5
    check_same(out, serial)
    hist = {a for r in out for a in r.accepted_counts}
    assert hist == {0, 1, 2, 3}  # drafts rejected at every position, and all accepted with the bonus token
    # every step counted ran for some request; a replay launched after its rows had all ended is not a step
    assert len(out.stats.k_per_step) == out.stats.steps
    assert out.stats.steps <= max(len(r.k_per_step) for r in out) * len(PROMPTS)


def test_a_slot_taken_again_behind_a_launch_is_caught(llama_pair, serial, monkeypatch):
    """The broken variant: a replay's read ends every row of its launch whose flag reads inactive, even one freed
    (by the read before it) and given to a new request since: that request ends at its prefill's token."""
    monkeypatch.setattr(runtime, "_rows_that_ran", lambda owners, owner: [s for s in owners if owner[s] is not None])
    out = engine(llama_pair, ahead=True).generate(PROMPTS, MAX_NEW)
    with pytest.raises(AssertionError):
        check_same(out, serial)


def test_launched_ahead_with_several_steps_per_replay(llama_pair, serial):
    dec = engine(llama_pair, ahead=True, steps_per_graph=2)
    out = dec.generate(PROMPTS, MAX_NEW)
    assert dec.launched_ahead >= 2
    assert [r.token_ids for r in out] == [r.token_ids for r in serial]
    assert len(out.stats.k_per_step) == out.stats.steps


def test_eager_span_steps_launched_ahead(llama_pair, serial):
    """Eager steps read the caches up to their rows' span, from lengths read one replay late when launched ahead:
    the span covers what the unread replay may have added."""
    dec = engine(llama_pair, ahead=True, graphs=False)
    assert dec.span_steps and dec.graphs is None
    out = dec.generate(PROMPTS, MAX_NEW)
    assert dec.launched_ahead >= 5
    check_same(out, serial)


def test_sampled_tokens_launched_ahead(llama_pair):
    a, b = engine(llama_pair, ahead=False), engine(llama_pair, ahead=True)
    outs = [d.generate(PROMPTS, MAX_NEW, temperature=1.0, seed=11) for d in (a, b)]
    assert b.launched_ahead >= 5
    check_same(*outs)


def test_auto_k_launched_ahead(llama_pair, serial):
    """Adaptive K chooses one replay later when launched ahead: still deterministic on one engine, greedy tokens
    unchanged, and each request's Ks the ones its steps ran."""
    dec = engine(llama_pair, ahead=True, num_speculative_tokens="auto", max_speculative_tokens=4)
    first, again = dec.generate(PROMPTS, MAX_NEW), dec.generate(PROMPTS, MAX_NEW)
    assert dec.launched_ahead >= 5
    assert [r.token_ids for r in first] == [r.token_ids for r in serial]
    assert first.stats.k_per_step == again.stats.k_per_step
    assert [r.accepted_counts for r in first] == [r.accepted_counts for r in again]
    for r in first:
        assert len(r.k_per_step) == len(r.accepted_counts)
        assert all(0 <= a <= k for a, k in zip(r.accepted_counts, r.k_per_step))



@pytest.fixture(scope="module")
def far_draft(llama_pair, tmp_path_factory):
    """A draft the target often overrules: its steps commit well under K + 1 tokens."""
    return perturbed_copy(llama_pair[0], tmp_path_factory.mktemp("far") / "draft", noise=0.3)


@pytest.mark.parametrize("tightened", [True, False])
def test_launched_ahead_until_the_rows_near_their_ends(llama_pair, far_draft, monkeypatch, tightened):
    """At a fixed K, without progress, the host bounds a row's tokens by K + 1 a step. Where that bound alone stops
    launches ahead, the replay read first brings its rows' token counts, and launches ahead go on; the tokens are
    the serial loop's. The broken variant reads the active flags alone: launched ahead far less."""
    if not tightened:
        monkeypatch.setattr(runtime, "_reads_counts", lambda progress, *rest: progress)
    outs, ahead = [], []
    for a in (False, True):
        dec = engine((llama_pair[0], far_draft), ahead=a)
        dec.eos_token_ids = ()  # every row ends by its length
        outs.append(dec.generate(PROMPTS, MAX_NEW))
        ahead.append(dec.launched_ahead)
    serial, out = outs
    assert [r.finish_reason for r in out] == ["length"] * len(PROMPTS)
    accepted = [a for r in out for a in r.accepted_counts]
    assert sum(accepted) < 0.3 * len(accepted) and max(accepted) >= 2  # mostly rejected, not always
    check_same(out, serial)
    assert ahead[0] == 0
    assert (ahead[1] >= 0.4 * out.stats.steps) == tightened, (ahead[1], out.stats.steps)


def test_a_read_taken_after_the_next_launch_is_caught(llama_pair, serial, monkeypatch):
    """The broken variant: the read of a replay launched ahead is not copied at its launch, so it holds the next
    replay's flags: rows that end in that one are counted ended a replay early (their last step's K lost)."""
    monkeypatch.setattr(type(fake_platform()), "to_host_later", lambda self, t: (t, lambda: None))
    out = engine(llama_pair, ahead=True).generate(PROMPTS, MAX_NEW)
    with pytest.raises(AssertionError):
        check_same(out, serial)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [3, "auto"])
def test_launched_ahead_on_the_device(llama_pair, k):
    """Compiled and captured on the device, the read of a replay launched ahead is copied at its launch (an adaptive
    engine's read is an output of the replay's graph, which the next replay writes again): one engine, read each
    replay first and then launched ahead, gives HF's greedy tokens both ways, the same counts per request at a
    fixed K, and at "auto" Ks whose counts fit them."""
    target, draft = llama_pair
    cfg = SpecGraphConfig(num_speculative_tokens=k, max_speculative_tokens=2, max_len=64, dtype="float32",
                          max_batch_size=4, batch_buckets=(2, 4))
    dec = SpecDecoder.from_pretrained(target, draft, cfg)
    assert dec.graphs is not None and dec.launch_ahead
    outs, seen = [], []
    for ahead in (False, True):  # launched ahead with a progress callback, whose counts come with the reads
        dec.launch_ahead = ahead
        outs.append(dec.generate(PROMPTS, MAX_NEW, progress=(lambda d, t: seen.append(d)) if ahead else None))
        assert (dec.launched_ahead >= 5) == ahead
    serial, out = outs
    assert seen[0] >= 2 * 4 and seen == sorted(seen) and seen[-1] == sum(len(r.token_ids) for r in out)
    assert [r.token_ids for r in serial] == [hf_greedy(target, p, MAX_NEW) for p in PROMPTS]
    if k == "auto":
        assert [r.token_ids for r in out] == [r.token_ids for r in serial]
        assert all(len(r.k_per_step) == len(r.accepted_counts) for r in out)
        assert all(0 <= a <= k for r in out for a, k in zip(r.accepted_counts, r.k_per_step))
    else:
        check_same(out, serial)


@pytest.mark.parametrize("counted", [True, False])
def test_progress_launched_ahead(llama_pair, serial, monkeypatch, counted):
    """A progress callback leaves replays launched ahead (its counts come with each replay's read): it rises as
    the call runs and ends at the tokens made. The broken variant takes the read's token counts for lengths."""
    if not counted:
        _without_counts(monkeypatch)
    seen = []
    dec = engine(llama_pair, ahead=True)
    out = dec.generate(PROMPTS, MAX_NEW, progress=lambda done, total: seen.append((done, total)))
    assert [r.token_ids for r in out] == [r.token_ids for r in serial]
    assert dec.launched_ahead >= 5
    made = sum(len(r.token_ids) for r in out)
    assert seen[-1] == (made, len(PROMPTS) * MAX_NEW)
    # rising, and from the first read: four rows, each with its prefill's token and at least one more from the step
    right = all(a[0] <= b[0] for a, b in zip(seen, seen[1:])) and seen[0][0] >= 2 * 4
    assert right == counted


def _without_counts(monkeypatch):
    """The broken variant: each replay's read of the rows' token counts ignored, their counts taken from their
    lengths (which a row's last step may carry past a stop token or its max_new)."""
    real = runtime._Launched
    monkeypatch.setattr(runtime, "_Launched", lambda *a: real(*a[:5], False, *a[6:]))


AUTO = {"num_speculative_tokens": "auto", "max_speculative_tokens": 4}


@pytest.mark.parametrize("kw,counted", [({}, True), ({"graphs": False}, True), (AUTO, True),
                                        ({"graphs": False}, False)], ids=["graphs", "eager", "auto", "broken"])
@pytest.mark.parametrize("ahead", [False, True])
def test_progress_never_passes_the_tokens_made(llama_pair, monkeypatch, kw, counted, ahead):
    """Rows that end by their length on a step of K drafts: progress rises, never past the tokens made."""
    if not counted:
        _without_counts(monkeypatch)
    seen = []
    out = engine(llama_pair, ahead, **kw).generate(PROMPTS[:4], 4, progress=lambda d, t: seen.append(d))
    assert [r.finish_reason for r in out] == ["length"] * 4
    made = sum(len(r.token_ids) for r in out)
    assert (seen == sorted(seen) and max(seen) == seen[-1] == made) == counted, seen


def test_progress_with_a_request_ended_at_its_prefill(llama_pair, tmp_path):
    """A request whose prompt gives non-finite logits ends at its prefill with nothing: progress still only rises."""
    from safetensors.torch import load_file, save_file

    target, draft = llama_pair
    bad = Path(tmp_path) / "t"
    shutil.copytree(target, bad)
    f = bad / "model.safetensors"
    state = load_file(str(f))
    state["model.embed_tokens.weight"][95] = float("nan")  # no prompt here holds it
    save_file(state, str(f), metadata={"format": "pt"})
    seen = []
    out = engine((str(bad), draft), True).generate(PROMPTS + [[95, 3, 4]], MAX_NEW,
                                                    progress=lambda d, t: seen.append(d))
    assert out[-1].finish_reason == "error" and out[-1].token_ids == []
    assert seen == sorted(seen) and seen[-1] == sum(len(r.token_ids) for r in out)


@pytest.mark.parametrize("clears", [True, False])
def test_a_call_cut_short_behind_a_launch(llama_pair, serial, monkeypatch, clears):
    """A call stopped (an exception from progress) while a replay launched ahead is unread leaves the engine ready:
    the next call gives its requests' tokens and steps no row the cut call left. The broken variant skips the next
    call's clearing of the rows left active (such a row is then stepped again)."""
    dec = engine(llama_pair, ahead=True, batch_buckets=(4,))  # every call's replays span rows 0-3
    calls = []

    def stop_after_three_reads(done, total):
        calls.append(done)
        if len(calls) == 3:
            assert dec.launched_ahead >= 2  # stopped with a replay launched ahead, unread
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dec.generate(PROMPTS, MAX_NEW, progress=stop_after_three_reads)
    row = max(s for s in range(1, 4) if dec.state["active"][s])  # left active; the next call's one request takes 0
    steps = dec.state["steps"][row].item()
    if not clears:
        active = dec.state["active"]
        monkeypatch.setitem(dec.state, "active", type("Kept", (torch.Tensor,), {"zero_": lambda self: self})(active))
    out = dec.generate(PROMPTS[:1], MAX_NEW)
    assert out[0].token_ids == serial[0].token_ids
    assert (dec.state["steps"][row].item() == steps) == clears
