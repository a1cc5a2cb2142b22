"""Admission: freed slots wait (config.admission_wait slot-replays) so that queued requests share a prefill."""
import pytest
from helpers import hf_greedy

import spec_graph.runtime as runtime_mod
from spec_graph import SpecDecoder, SpecGraphConfig
from spec_graph.admission import admits_now

# Eight prompts through four slots: the first four finish apart (their lengths and stop tokens differ).
PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 70], [3], [60, 61, 62, 63],
           [11, 12], [90, 4, 4], [21, 22, 23, 24, 25, 26]]
NEW = 20


def decoder(pair, wait, **cfg):
    cfg = {"num_speculative_tokens": 3, "max_len": 64, "max_batch_size": 4, "batch_buckets": (1, 2, 4), **cfg}
    return SpecDecoder.from_pretrained(*pair, SpecGraphConfig(admission_wait=wait, **cfg))


@pytest.fixture(scope="module")
def references(llama_pair):
    return [hf_greedy(llama_pair[0], p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("free, pending, busy, idle, wait, admit", [
    (0, 3, 4, 99, 0, False),   # no slot free
    (2, 0, 2, 99, 0, False),   # nothing queued
    (1, 3, 3, 0, 0, True),     # no wait
    (1, 3, 3, 7, 8, False),    # still waiting for another slot
    (1, 3, 3, 8, 8, True),     # waited its slot-replays
    (2, 3, 2, 0, 8, False),
    (2, 2, 2, 0, 8, True),     # every queued request has a slot: nothing to wait for
    (4, 9, 0, 0, 8, True),     # no row busy: a wait would idle the device
])
def test_the_rule(free, pending, busy, idle, wait, admit):
    assert admits_now(free, pending, busy, idle, wait) is admit


def test_config_refuses_a_bad_wait():
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(ValueError, match="admission_wait must be a non-negative integer"):
            SpecGraphConfig(admission_wait=bad)


def test_the_default_wait_is_one_replay_of_the_batch():
    import dataclasses

    cfg = SpecGraphConfig(max_batch_size=8)
    assert cfg.admission_wait is None and cfg.slot_replays_waited == 8
    assert dataclasses.replace(cfg, max_batch_size=32).slot_replays_waited == 32  # follows the slots it is for
    assert SpecGraphConfig(max_batch_size=8, admission_wait=0).slot_replays_waited == 0


def _trace(monkeypatch):
    """Records each admission check's arguments and answer."""
    calls, real = [], runtime_mod.admits_now

    def traced(*args):
        calls.append((*args, real(*args)))
        return calls[-1][-1]
    monkeypatch.setattr(runtime_mod, "admits_now", traced)
    return calls


def check_waits_share_prefills(pair, references):
    at_once = decoder(pair, 0).generate(PROMPTS, NEW)
    waited = decoder(pair, 10**6).generate(PROMPTS, NEW)
    assert at_once.stats.prefills > 2, "the requests must finish apart for this test to mean anything"
    # four rows, then the four queued once all four slots are free (never before: nothing else ends the wait)
    assert waited.stats.prefills == 2
    assert [r.token_ids for r in at_once] == references
    assert [r.token_ids for r in waited] == references


def test_freed_slots_wait_to_share_a_prefill(llama_pair, references):
    check_waits_share_prefills(llama_pair, references)


def test_a_rule_without_the_wait_is_caught(llama_pair, references, monkeypatch):
    monkeypatch.setattr(runtime_mod, "admits_now", lambda free, pending, busy, idle, wait: bool(free and pending))
    with pytest.raises(AssertionError):
        check_waits_share_prefills(llama_pair, references)


def check_idle_counts_slot_replays(pair, references, monkeypatch, wait=3):
    calls = _trace(monkeypatch)
    out = decoder(pair, wait).generate(PROMPTS, NEW)
    assert [r.token_ids for r in out] == references
    # Between admissions, each check's idle count grows by the slots that were free over the replay before it
    # (all of them waiting: more requests were queued than slots free).
    for (f0, p0, b0, i0, _, a0), (f1, p1, b1, i1, _, _) in zip(calls, calls[1:]):
        if p0 == 0 or a0:
            continue
        assert i1 == i0 + f0, (calls, wait)
    admitted = [c for c in calls if c[-1]]
    assert len(admitted) == out.stats.prefills
    assert any(c[3] > c[0] for c in calls), "no slot waited more than one replay: the inputs miss that path"
    assert any(c[2] and c[0] < c[1] and c[3] >= wait for c in admitted), "no admission ended a wait"


def test_idle_counts_slot_replays(llama_pair, references, monkeypatch):
    check_idle_counts_slot_replays(llama_pair, references, monkeypatch)


def test_idle_counted_in_replays_is_caught(llama_pair, references, monkeypatch):
    """A broken count (replays waited, not slot-replays) is rejected where two slots wait together."""
    real = runtime_mod.DecoderBase._generate

    def replays_only(self, *args):
        old = runtime_mod.admits_now

        def by_replay(free, pending, busy, idle, wait):
            return old(free, pending, busy, idle // max(free, 1), wait)
        runtime_mod.admits_now = by_replay
        try:
            return real(self, *args)
        finally:
            runtime_mod.admits_now = old
    monkeypatch.setattr(runtime_mod.DecoderBase, "_generate", replays_only)
    with pytest.raises(AssertionError):
        check_idle_counts_slot_replays(llama_pair, references, monkeypatch)
