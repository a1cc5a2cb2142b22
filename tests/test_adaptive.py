"""Adaptive K (num_speculative_tokens="auto"): the chooser's math, the engine's per-replay choice, its device
counters, the stats, determinism, N steps per replay, capture per K, and the CLI."""
import copy
import itertools
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import fake_platform, hf_greedy

import spec_graph.adaptive as adaptive_mod
import spec_graph.runtime as runtime_mod
import spec_graph.step_times as step_times_mod
from spec_graph import SpecDecoder, SpecGraphConfig
from spec_graph.adaptive import ChoiceAhead, KChooser, expected_tokens
from spec_graph.export import ExportError, export_pair

PROMPTS = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12, 13], [3]]
# Seconds per step for K = 1..4: with a fresh (0.6) estimate K=1 pays best, with the near draft's acceptance
# K=4 does, so a generation walks through more than one K.
TIMES = {1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9}


def _engine(pair, plat=None, **cfg):
    cfg = {"num_speculative_tokens": "auto", "max_speculative_tokens": 4, "max_len": 64, "max_batch_size": 4, **cfg}
    dec = SpecDecoder.from_pretrained(*pair, SpecGraphConfig(**cfg))
    if plat is not None:
        dec = SpecDecoder(dec.target, dec.draft, dec.config, dec.tokenizer, dec.eos_token_ids, plat=plat)
        dec.compiled = False  # the recorded step is the eager one: this is about capture, not compilation
    for greedy, b, k in itertools.product((True, False), (1, 2, 4), TIMES):
        dec.step_times[(greedy, b, k)] = TIMES[k] * (1 + b / 8)
    return dec


# ------------------------------------------------------------------ the chooser
def _enumerated_expectation(rates, k):
    """E(committed tokens) over every pattern of k independent judgements (position j passes with rates[j]): the
    accepted drafts are the leading passes, plus one correction or bonus token."""
    total = 0.0
    for pattern in itertools.product((0, 1), repeat=k):
        p = 1.0
        for j, ok in enumerate(pattern):
            p *= rates[j] if ok else 1 - rates[j]
        lead = next((j for j, ok in enumerate(pattern) if not ok), k)
        total += p * (lead + 1)
    return total


@pytest.mark.parametrize("formula, right", [(expected_tokens, True),
                                            (lambda r, k: 1 + sum(r[:k]), False)])  # rates taken as unconditional
def test_expected_tokens(formula, right):
    rates = [0.9, 0.5, 0.7, 0.2]
    ok = all(abs(formula(rates, k) - _enumerated_expectation(rates, k)) < 1e-12 for k in range(1, 5))
    assert ok == right


def _feed(chooser, rates, k, steps=8):
    """One replay's counters: row r takes `steps` row-steps of k drafts, position j accepted with rates[r] (one
    rate, or one per position), exactly in mean."""
    n = chooser.kmax
    last = list(chooser._last) + [0] * (2 * n * len(rates) - len(chooser._last))
    for r, rate in enumerate(rates):
        per_position = rate if isinstance(rate, list) else [rate] * k
        reach = float(steps)
        for j in range(k):
            last[2 * n * r + j] += round(reach)
            last[2 * n * r + n + j] += round(reach * per_position[j])
            reach *= per_position[j]
    chooser.observe(last)


class _IgnoresTime(KChooser):
    def choose(self, times):
        return super().choose({k: 1.0 for k in times})


class _IgnoresAcceptance(KChooser):
    def rates(self):
        return [0.6] * self.kmax


@pytest.mark.parametrize("cls, right", [(KChooser, True), (_IgnoresTime, False), (_IgnoresAcceptance, False)])
def test_chooser_follows_acceptance_and_time(cls, right):
    times = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 6: 2.0, 8: 2.4}
    picks = []
    for rate in (0.99, 0.05):  # (at 0.97 the unseen positions 7 and 8 keep K at 6: see the test below)
        c = cls((1, 2, 3, 4, 6, 8))
        k = 1
        for _ in range(12):
            _feed(c, [rate], k, 64)
            k = c.choose(times)
        picks.append(k)
    assert (picks == [8, 1]) == right, picks


@pytest.mark.parametrize("margin, deepest", [(adaptive_mod.EXPLORE_MARGIN, 8), (0.0, 6)])
def test_chooser_tries_a_deep_position_it_has_not_seen(monkeypatch, margin, deepest):
    """A position K stayed below leans on the one before it times PRIOR_SHRINK (< 1: deep drafts fare worse than
    shallow ones on real text), so on flat 0.97 acceptance K=8 looks no better than K=6 until a step reaches
    positions 7 and 8. A larger K priced within EXPLORE_MARGIN of the best is tried where its first deep
    position is unseen, at any number of busy rows; seen at 0.97, K=8 stays. The control: with no margin the
    chooser stays at K=6. With EXPLORE_ROWS 1, 2 busy rows do not try."""
    assert adaptive_mod.PRIOR_SHRINK < 1 and adaptive_mod.EXPLORE_MARGIN > 0 and adaptive_mod.EXPLORE_ROWS is None
    monkeypatch.setattr(adaptive_mod, "EXPLORE_MARGIN", margin)
    times = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 6: 2.0, 8: 2.4}
    c = KChooser((1, 2, 3, 4, 6, 8))
    k, ks = 1, []
    for _ in range(12):
        _feed(c, [0.97], k, 64)
        k = c.choose(times)
        ks.append(k)
    assert max(ks) == deepest and ks[-3:] == [deepest] * 3, ks
    for rows_limit, most in ((None, deepest), (1, 6)):  # two busy rows, far from done: they try unless limited
        monkeypatch.setattr(adaptive_mod, "EXPLORE_ROWS", rows_limit)
        c, k, ks = KChooser((1, 2, 3, 4, 6, 8)), 1, []
        for _ in range(12):
            _feed(c, [0.97], k, 64)
            k = c.choose(times, {0: 10_000, 1: 10_000})
            ks.append(k)
        assert max(ks) == most, (rows_limit, ks)


def test_chooser_moves_within_a_few_replays_and_deep_positions_follow_the_first():
    c = KChooser((1, 2, 3, 4, 6, 8))
    times = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 6: 2.0, 8: 2.4}
    k = 1
    for _ in range(10):
        _feed(c, [0.99], k)
        k = c.choose(times)
    assert k == 8
    ks = []
    for _ in range(6):  # the prompts turn hard
        _feed(c, [0.05], k)
        k = c.choose(times)
        ks.append(k)
    assert ks[-1] == 1 and ks.index(1) <= 4, ks
    for _ in range(40):  # K stays at 1: only position 1 is seen (8 rows a replay); deep positions drift toward
        _feed(c, [0.05], 1)  # its rate, by one row-step's weight a replay
    r = c.rates()
    assert r[0] < 0.1 and all(a < 0.5 for a in r), r  # from 0.95 (the prior keeps a little weight)
    for _ in range(8):  # and easy again: K climbs back, though positions 2.. were not seen for a while
        _feed(c, [0.99], k)
        k = c.choose(times)
    assert k >= 6


def _fade_per_batch_row_step(reached, accepted, new, decay):
    """The rule before: every position fades by each row-step of the replay, reached or not."""
    n = len(reached)
    for j in range(n):
        keep = decay ** new[0]
        reached[j] = keep * reached[j] + new[j]
        accepted[j] = keep * accepted[j] + new[n + j]


@pytest.mark.parametrize("broken", [False, True])
def test_positions_above_k_fade_by_one_row_step_a_replay(monkeypatch, broken):
    """Eight rows, position 1 accepted half the time and the deeper ones 0.95 of the time they are reached. K then
    stays at 1 for three replays: what positions 2.. showed is still there (as the per-row-step rule, it would
    be forgotten, and position 2 would fall back to position 1's 0.5)."""
    if broken:
        monkeypatch.setattr(adaptive_mod, "_decayed_add", _fade_per_batch_row_step)
    c = KChooser((1, 2, 3, 4, 6, 8))
    n = c.kmax
    for _ in range(10):
        _feed(c, [[0.5] + [0.95] * (n - 1)], n)
    for _ in range(3):
        _feed(c, [0.5], 1)
    assert (c.rates()[1] > 0.8) != broken, c.rates()


def test_counts_carry_across_bucket_sizes():
    """The read covers the rows of the replay's bucket: a row left out of one replay (a smaller bucket) still has its
    device count, so what it adds when the bucket grows again is only its new steps. Undecayed sums, Kmax = 2."""
    c = KChooser((1, 2), decay=1.0)
    c.observe([3, 1, 2, 0, 5, 2, 4, 1])  # two rows: [reached_1, reached_2, accepted_1, accepted_2] each
    c.observe([4, 1, 3, 0])  # a bucket of one row
    c.observe([4, 1, 3, 0, 6, 3, 5, 2])  # two rows again: row 1 took one step meanwhile
    assert (c.reached, c.accepted) == ([3 + 5 + 1 + 1, 1 + 2 + 1], [2 + 4 + 1 + 1, 0 + 1 + 1])


class _BlindToWorkLeft(KChooser):
    def choose(self, times, remaining=None, queued=0):
        return super().choose(times)


class _SlowestRowEvenWithAQueue(KChooser):
    def choose(self, times, remaining=None, queued=0):
        return super().choose(times, remaining, 0)


@pytest.mark.parametrize("cls, right", [(KChooser, True), (_BlindToWorkLeft, False),
                                        (_SlowestRowEvenWithAQueue, False)])
def test_chooser_serves_the_queue_then_the_slowest_row(cls, right):
    """Row 0 accepts 0.97 per position, row 1 0.3. While requests wait every committed token counts: a long K
    (the most tokens per second over both rows). Once none wait and row 1 holds the work left, only its tokens
    shorten the call: K=1, its own best."""
    times = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 6: 2.0, 8: 2.4}
    c = cls((1, 2, 3, 4, 6, 8))
    for _ in range(6):
        _feed(c, [0.97, 0.3], 8, 64)
    assert c.row_rates(0)[0] > 0.9 and c.row_rates(1)[0] < 0.4
    picks = c.choose(times, {0: 100, 1: 100}, queued=100_000), c.choose(times, {0: 5, 1: 100})
    assert (picks[0] >= 6 and picks[1] == 1) == right, picks
    c.admit(1)  # a new request in row 1 starts from the rates over all rows
    assert c.row_rates(1) == c.rates()


class _KeepAtOneRow(KChooser):
    """Broken: the running K kept at one busy row too (a row of no tokens left added: every cost scales alike)."""

    def choose(self, times, remaining=None, queued=0):
        return super().choose(times, {**(remaining or {}), -1: 0}, queued)


class _KeepUnpriced(KChooser):
    """Broken: the running K kept where the table has no time for it."""

    def choose(self, times, remaining=None, queued=0):
        if len(remaining or ()) > 1 and self.last_k is not None and not times.get(self.last_k):
            return self.last_k
        return super().choose(times, remaining, queued)


KEEP_VARIANTS = {"right": KChooser, "never kept": KChooser, "kept at one row": _KeepAtOneRow,
                 "kept unpriced": _KeepUnpriced}


@pytest.mark.parametrize("variant", list(KEEP_VARIANTS))
def test_a_batch_keeps_its_k_in_a_near_tie(monkeypatch, variant):
    """With two busy rows the K running is kept while priced within KEEP_MARGIN of the best, and left where it is
    priced beyond or not priced at all; one busy row gets the best K, as does a choice with no K running. Through
    ChoiceAhead too: the K it was told is running is the one kept."""
    monkeypatch.setattr(adaptive_mod, "EXPLORE_MARGIN", 0.0)  # no try of K=2 for its unseen position
    if variant == "never kept":
        monkeypatch.setattr(adaptive_mod, "KEEP_MARGIN", 0.0)
    cls = KEEP_VARIANTS[variant]
    c = cls((1, 2))
    pooled = adaptive_mod._expected_by_k(c.rates())
    near = {1: pooled[1], 2: pooled[2] * 1.005}  # K=1 best, K=2 within the margin of 1%
    far = {1: pooled[1], 2: pooled[2] * 1.02}
    rows2, rows1, queued = {0: 50, 1: 50}, {0: 50}, 10**6  # the waiting work rules: costs follow times / E(K)
    assert c.choose(near, rows2, queued) == 1  # nothing running yet
    c.last_k = 2
    got = (c.choose(near, rows2, queued), c.choose(far, rows2, queued), c.choose(near, rows1, queued),
           c.choose({1: pooled[1], 2: None}, rows2, queued), c.choose({1: pooled[1], 2: 0.0}, rows2, queued))
    ahead = ChoiceAhead(cls((1, 2)), lambda ch, lens: ch.choose(near, {r: 50 for r in lens}, queued))
    lens = {0: 10, 1: 12}
    first = ahead.pick(lens)
    ahead.ahead(2, 1, lens)  # a K=2 replay launched (a try, say): the next K comes from the chooser now
    ahead.seen(list(ahead.chooser._last), {0: 11, 1: 13})
    assert (got == (2, 1, 1, 1, 1) and (first, ahead.pick({0: 11, 1: 13})) == (1, 2)) == (variant == "right"), got


# ------------------------------------------------------------------ the engine
def _host_counts(out, kmax):
    """The chooser's counters recomputed from the results: per position, row-steps that reached it and that
    accepted it."""
    steps = [(a, k) for r in out for a, k in zip(r.accepted_counts, r.k_per_step)]
    reached = [sum(k > j and a >= j for a, k in steps) for j in range(kmax)]
    accepted = [sum(a > j for a, _ in steps) for j in range(kmax)]
    return reached + accepted


def _check_auto(out, pair, n_new, prompts=PROMPTS):
    assert [r.token_ids for r in out] == [hf_greedy(pair[0], p, n_new) for p in prompts]
    for r in out:
        assert len(r.k_per_step) == len(r.accepted_counts)
        assert all(0 <= a <= k for a, k in zip(r.accepted_counts, r.k_per_step))
    s = out.stats
    assert len(s.k_per_step) == s.steps and len(set(s.k_per_step)) >= 2, s.k_per_step
    assert abs(s.tokens_per_step * s.request_steps - s.generated_tokens) < 1e-6
    counts = [a for r in out for a in r.accepted_counts]
    assert s.acceptance_rate == pytest.approx(sum(counts) / sum(k for r in out for k in r.k_per_step))


@pytest.mark.parametrize("broken", [False, True])
def test_auto_greedy_equals_hf(llama_pair, monkeypatch, broken):
    """K moves between replays; the tokens stay HF's, each step's accepted count stays within the K it ran with,
    and the device counters equal the results'. Broken: the engine runs the largest K whatever it chose."""
    if broken:
        orig = runtime_mod.DecoderBase._steps_fn
        monkeypatch.setattr(runtime_mod.DecoderBase, "_steps_fn",
                            lambda self, g, B, K, *rest: orig(self, g, B, self.K, *rest))
    keep = adaptive_mod.KEEP_MARGIN
    monkeypatch.setattr(adaptive_mod, "KEEP_MARGIN", 0.0)  # K then moves in near ties too: rejections at 1, 2, 3
    dec = _engine(llama_pair)
    out = dec.generate(PROMPTS, 32)
    if broken:
        with pytest.raises(AssertionError):
            _check_auto(out, llama_pair, 32)
        return
    _check_auto(out, llama_pair, 32)
    steps = [(a, k) for r in out for a, k in zip(r.accepted_counts, r.k_per_step)]
    assert dec.k_counts.sum(0).tolist() == _host_counts(out, dec.K)
    # per row: request s ran in row s (four requests, four rows)
    assert [dec.k_counts[s].tolist() for s in range(4)] == [_host_counts([r], dec.K) for r in out]
    more = dec.generate(PROMPTS + [[11, 12, 13]], 32)  # a fifth request, in the first row freed
    _check_auto(more, llama_pair, 32, PROMPTS + [[11, 12, 13]])
    assert dec.k_counts.sum(0).tolist() == _host_counts(more, dec.K)
    reached = steps + [(a, k) for r in more for a, k in zip(r.accepted_counts, r.k_per_step)]
    # a rejection at draft positions 1, 2 and 3, and every draft of a K=2 step accepted (the bonus token)
    assert {a for a, k in reached if a < k} >= {0, 1, 2} and (2, 2) in reached, reached
    # the same counters under a wrong reading (positions not conditioned on the earlier drafts) differ
    assert [sum(k > j for _, k in steps) for j in range(dec.K)] != dec.k_counts.sum(0).tolist()[: dec.K]
    monkeypatch.setattr(adaptive_mod, "KEEP_MARGIN", keep)  # the engine's own setting: the same tokens and counts
    kept = dec.generate(PROMPTS, 32)
    assert [r.token_ids for r in kept] == [r.token_ids for r in out]
    assert dec.k_counts.sum(0).tolist() == _host_counts(kept, dec.K)


class _AfterTheRead(ChoiceAhead):
    """Observes each replay's counts and chooses after its read (the reference the B=1 choice must equal)."""

    def ahead(self, k, n, lens):
        pass

    def seen(self, counts, lens):
        self.chooser.observe(counts)
        self._next = None  # chosen at the next pick, with the lengths read


def test_engine_tells_the_chooser_the_work_left(llama_pair, monkeypatch):
    """Before each replay the chooser hears each busy row's tokens left and those of the requests still waiting;
    a row taken by a new request is admitted afresh. Four requests in two rows: each row serves two. (Chosen
    after each read here, where every choice is the one used; test_choice_ahead_of_a_batch for the engine's.)"""
    seen = []

    class Recording(KChooser):
        def admit(self, row):
            seen.append(("admit", row))
            super().admit(row)

        def choose(self, times, remaining=None, queued=0):
            seen.append((dict(remaining), queued))
            return super().choose(times, remaining, queued)

    monkeypatch.setattr(runtime_mod, "KChooser", Recording)
    monkeypatch.setattr(runtime_mod, "ChoiceAhead", _AfterTheRead)
    _engine(llama_pair, max_batch_size=2).generate(PROMPTS, 12)
    assert seen[:3] == [("admit", 0), ("admit", 1), ({0: 11, 1: 11}, 2 * 12)]  # one token each from its prefill
    assert sorted(x for x in seen if x[0] == "admit") == [("admit", 0), ("admit", 0), ("admit", 1), ("admit", 1)]
    last: dict = {}
    for x in seen:
        if x[0] == "admit":
            last.pop(x[1], None)
            continue
        for row, left in x[0].items():  # every replay commits at least one token in each busy row
            assert 0 < left < last.get(row, 13), (row, left, seen)
            last[row] = left
    assert seen[-1][1] == 0


def _chooses_while_replays_run(events: list[str]) -> bool:
    """Each replay's chooser work (but where the rows changed: the first replay's choice) falls between its launch
    and its read, while it runs; nothing of it between the read and the next launch."""
    text = " ".join(events)
    between = text.split("read")[1:-1]  # from each read to the next one
    return all(x.strip() == "replay" or x.strip().startswith("replay ") and "choose" in x for x in between) \
        and all(x.strip().split()[0] == "replay" for x in between)


class _OneReplayLate(ChoiceAhead):
    """Chooses every next K from the counts up to the replay before, one row as a batch (broken for B=1)."""
    MAX_FORK_ROWS = 0


@pytest.mark.parametrize("order", ["engine", "after the read"])
def test_engine_chooses_while_the_replay_runs(llama_pair, monkeypatch, order):
    """The host waits for each replay's end anyway: the chooser's work goes there, off the replays' path. One
    request (no row changes after the first replay). Control: a loop that chooses after the read."""
    events = []

    class Recording(KChooser):
        def observe(self, counts):
            events.append("observe")
            super().observe(counts)

        def choose(self, times, remaining=None, queued=0):
            events.append("choose")
            return super().choose(times, remaining, queued)

    monkeypatch.setattr(runtime_mod, "KChooser", Recording)
    if order != "engine":
        monkeypatch.setattr(runtime_mod, "ChoiceAhead", _AfterTheRead)
    dec = _engine(llama_pair, max_batch_size=1)
    run, read = dec._run_steps, dec._read_after_replay
    monkeypatch.setattr(dec, "_run_steps", lambda *a: (events.append("replay"), run(*a))[1])
    monkeypatch.setattr(dec, "_read_after_replay", lambda B, *a: (events.append("read"), read(B, *a))[1])
    out = dec.generate(PROMPTS[:1], 24)
    assert out[0].token_ids == hf_greedy(llama_pair[0], PROMPTS[0], 24)
    assert events.count("replay") == len(out.stats.k_per_step) > 3
    assert _chooses_while_replays_run(events) == (order == "engine"), events


class _ChoosesWhenRowsFinish(ChoiceAhead):
    """Broken: where rows finished, the K chosen during the replay is dropped and chosen again at the pick."""

    def pick(self, lens):
        if set(lens) != getattr(self, "_rows", set(lens)):
            self._next = None
        self._rows = set(lens)
        return super().pick(lens)


@pytest.mark.parametrize("broken", [None, "finish", "admission"])
def test_no_choice_between_a_read_and_the_next_launch(llama_pair, monkeypatch, broken):
    """Rows that finish at different replays, and requests admitted into the freed rows: every choice falls while
    a replay or a prefill runs (between its launch and its read), none between a read and the next launch, where
    the device would wait for it. Broken: a choice again where rows finished; the admission's choice after the
    prefill's read."""
    events = []

    class Recording(KChooser):
        def choose(self, times, remaining=None, queued=0):
            events.append("choose")
            return super().choose(times, remaining, queued)

    monkeypatch.setattr(runtime_mod, "KChooser", Recording)
    if broken == "finish":
        monkeypatch.setattr(runtime_mod, "ChoiceAhead", _ChoosesWhenRowsFinish)
    dec = _engine(llama_pair, max_batch_size=2, admission_wait=0)
    run, read, prefill_run, prefill = dec._run_steps, dec._read_after_replay, dec._prefill_run, dec._prefill

    def prefill_then_read(*a):
        *args, meanwhile = a
        if broken == "admission":
            act = prefill(*args, None)
            events.append("read")
            meanwhile()
            return act
        act = prefill(*a)
        events.append("read")
        return act

    monkeypatch.setattr(dec, "_run_steps", lambda *a: (events.append("launch"), run(*a))[1])
    monkeypatch.setattr(dec, "_prefill_run", lambda *a: (events.append("launch"), prefill_run(*a))[1])
    monkeypatch.setattr(dec, "_read_after_replay", lambda B, *a: (events.append("read"), read(B, *a))[1])
    monkeypatch.setattr(dec, "_prefill", prefill_then_read)
    prompts = PROMPTS + [[11, 12, 13]]
    out = dec.generate(prompts, 12)
    assert [r.token_ids for r in out] == [hf_greedy(llama_pair[0], p, 12) for p in prompts]
    ks = [len(r.k_per_step) for r in out]
    assert len(set(ks)) > 1 and out.stats.prefills >= 3, (ks, out.stats)  # rows finished apart; admissions
    text = " ".join(events)
    assert text.count("choose") >= out.stats.prefills
    between = [x.split("launch")[0] for x in text.split("read")[1:]]  # from each read to the next launch
    assert all("choose" not in x for x in between) == (broken is None), events


class _RowExpectedWithoutPrior(KChooser):
    """Broken: a row's expectation from its own counts alone, not drawn toward the pooled rates."""

    def _row_expected(self, row, pooled, pooled_e):
        own = self.rows.get(row)
        return pooled_e if own is None else adaptive_mod._expected_by_k([a / max(r, 1e-9) for r, a in zip(*own)])


@pytest.mark.parametrize("cls", [KChooser, _RowExpectedWithoutPrior])
def test_row_expectation_in_one_pass_is_row_rates(cls):
    """The chooser's one-pass expectation per row is ``_expected_by_k(row_rates(row))``, float for float, for rows
    seen a little or much and rows not seen (the pooled expectation)."""
    gen = torch.Generator().manual_seed(0)
    c = cls((1, 2, 3, 4))
    counts = torch.zeros(3, 8, dtype=torch.long)
    for step in range(12):
        accepted = torch.randint(-1, 5, (3,), generator=gen)
        accepted[2] = -1  # row 2 never steps
        adaptive_mod.count_acceptance(counts, accepted, 1 + step % 4)
        c.observe(counts.flatten().tolist())
        rates = c.rates()
        pooled = adaptive_mod._expected_by_k(rates)
        same = all(c._row_expected(r, rates, pooled) == adaptive_mod._expected_by_k(c.row_rates(r, rates))
                   for r in range(3))
        if not same:
            break
    assert same == (cls is KChooser)


def test_after_step_is_the_devices_count():
    """A chooser's fork for row r taking K drafts and accepting a has seen what count_acceptance adds on the
    device, row r's rates and all: for every K, every outcome, a row inside a larger bucket; the neighbouring
    outcomes (the control) it has not."""
    kmax, B = 4, 3
    start = torch.tensor([[3, 2, 1, 0, 2, 1, 0, 0], [0] * 8, [5, 4, 4, 1, 4, 4, 1, 0]])
    base = KChooser((1, 2, 4))
    base.observe(start.flatten().tolist())
    for k, row in itertools.product((1, 2, 4), (0, 2)):
        for a in range(k + 1):
            counts = start.clone()
            accepted = torch.full((B,), -1)
            accepted[row] = a
            adaptive_mod.count_acceptance(counts, accepted, k)
            real = counts.flatten().tolist()
            ref = KChooser((1, 2, 4))
            ref.observe(start.flatten().tolist())
            ref.observe(real)
            fork = base.after_step(row, k, a)
            assert fork.has_seen(real) and fork.rates() == ref.rates() and fork.row_rates(row) == ref.row_rates(row)
            assert base.has_seen(start.flatten().tolist()) and not base.has_seen(real)  # the base is untouched
            for other in (a - 1, a + 1):
                if 0 <= other <= k:
                    assert not base.after_step(row, k, other).has_seen(real)
    assert kmax == base.kmax
    # a fork for a row past the counts observed so far (rows never observed count zero, as on the device)
    first = KChooser((1, 2, 4))
    first.observe(start[0].tolist())
    counts = start.clone()
    counts[1:] = 0
    adaptive_mod.count_acceptance(counts, torch.tensor([-1, -1, 2]), 4)
    assert first.after_step(2, 4, 2).has_seen(counts.flatten().tolist())
    assert not first.after_step(2, 4, 1).has_seen(counts.flatten().tolist())


class _RowsChangedInPlace(KChooser):
    """Broken: a row's rates updated in its lists, which a fork shares with the chooser it came from."""

    def _row_add(self, row, new):
        own = self.rows.setdefault(row, ([0.0] * self.kmax, [0.0] * self.kmax))
        adaptive_mod._decayed_add(*own, new, adaptive_mod.ROW_DECAY)


@pytest.mark.parametrize("cls", [KChooser, _RowsChangedInPlace])
def test_forks_and_their_chooser_keep_apart(cls):
    """Forks share the rows they do not step with the chooser they came from: whichever of them observes more later,
    the other's rates stay what they were (the chosen fork replaces the chooser; the rest are dropped)."""
    start = [2, 1, 2, 0, 3, 2, 3, 1]  # rows 0 and 1 of K up to 2, each seen
    more = [c + 1 for c in start]  # both rows step once more
    base = cls((1, 2))
    base.observe(start)
    fork = base.after_step(0, 2, 1)
    fork_row1 = fork.row_rates(1)
    base.observe(more)
    kept = fork.row_rates(1) == fork_row1
    base_row0 = base.row_rates(0)
    base.after_step(1, 1, 0).observe([c + 2 for c in start])
    kept = kept and base.row_rates(0) == base_row0
    assert kept == (cls is KChooser)


class _LateWithoutProgress(ChoiceAhead):
    """Broken: a batch's next K priced at the lengths before the running replay."""

    def ahead(self, k, n, lens):
        super().ahead(k, 0, lens)


@pytest.mark.parametrize("cls", [ChoiceAhead, _LateWithoutProgress])
def test_choice_ahead_of_a_batch(cls):
    """Two busy rows: while replay n runs, the counts of replay n - 1 are observed and the next K is chosen for
    rows that will have committed at least the replay's N steps' tokens; used at the next pick, unless a request
    is admitted; the counts read after replay n are observed during replay n + 1, or before the admission."""
    calls = []

    def choose(chooser, lens):
        calls.append((dict(lens), chooser.reached[0]))
        return len(calls)

    ahead = cls(KChooser((1, 2)), choose)
    assert ahead.pick({0: 10, 1: 12}) == 1 and ahead.pick({0: 10, 1: 12}) == 1  # chosen once
    ahead.ahead(2, 3, {0: 10, 1: 12})
    one_step = [1, 1, 1, 1, 0, 0, 0, 0]  # row 0 accepted both drafts, row 1 took no step
    ahead.seen(one_step, {0: 15, 1: 13})
    assert ahead.pick({0: 15, 1: 13}) == 2
    ahead.ahead(2, 3, {0: 15, 1: 13})
    ok = calls == [({0: 10, 1: 12}, 0.0), ({0: 13, 1: 15}, 0.0), ({0: 18, 1: 16}, 1.0)]
    ahead.seen([2, 2, 2, 2, 0, 0, 0, 0], {0: 20, 1: 16})  # row 0 accepted both drafts again
    ahead.admit(1)  # a new request in row 1
    assert ahead.pick({0: 20, 1: 2}) == 4  # chosen again, with the counts just read (1 decayed, plus 1)
    assert calls[-1][0] == {0: 20, 1: 2} and calls[-1][1] == pytest.approx(1 + adaptive_mod.DECAY)
    assert ok == (cls is ChoiceAhead), calls


@pytest.mark.parametrize("ahead", [ChoiceAhead, _OneReplayLate])
def test_one_row_gets_the_choice_after_the_read(llama_pair, monkeypatch, ahead):
    """With one busy row, the K chosen ahead for the replay's real outcome is the K a choice after the read makes:
    the same K sequence, step for step. Broken: the next K from the counts up to the replay before."""
    def ks(cls):
        monkeypatch.setattr(runtime_mod, "ChoiceAhead", cls)
        dec = _engine(llama_pair, max_batch_size=1)
        return [r.k_per_step for r in dec.generate(PROMPTS, 32)]

    reference, got = ks(_AfterTheRead), ks(ahead)
    assert len({k for r in reference for k in r}) >= 3, reference  # K moves: the choices have something to differ in
    assert (got == reference) == (ahead is ChoiceAhead), (got, reference)


def test_auto_captured_n_steps_per_replay(llama_pair):
    """Every (bucket, K) graph is recorded in the one pool; 3 steps per replay; HF's tokens; capture reported."""
    plat = fake_platform()
    dec = _engine(llama_pair, plat=plat, steps_per_graph=3, batch_buckets=(1, 2, 4))
    out = dec.generate(PROMPTS, 24)
    _check_auto(out, llama_pair, 24)
    assert set(dec.graphs.graphs) == {(True, b, k) for b in (1, 2, 4) for k in (1, 2, 3, 4)}
    assert set(dec.capture_report) == {1, 2, 3, 4}
    assert all(r["capture_s"] > 0 and r["memory_bytes"] is None for r in dec.capture_report.values())
    assert len(out.stats.k_per_step) % 3 == 0
    assert dec.k_counts.sum(0).tolist() == _host_counts(out, dec.K)
    # re-captured after reset_graphs: the report is the new graphs' alone, not added to the dropped ones'
    dec.reset_graphs()
    assert dec.capture_report == {}
    dec.generate(PROMPTS[:1], 4)
    assert set(dec.capture_report) == {1, 2, 3, 4}


def test_auto_measures_step_times_once(llama_pair):
    """Each (bucket, K) is timed once, at two live lengths, into (base, per position) seconds. Without graphs
    a bucket is timed when a call can first use it (a one-prompt call times bucket 1 alone)."""
    dec = SpecDecoder.from_pretrained(*llama_pair, SpecGraphConfig(num_speculative_tokens="auto",
                                                                   max_speculative_tokens=3, max_len=64,
                                                                   max_batch_size=2, batch_buckets=(1, 2)))
    one = dec.generate(PROMPTS[:1], 8)
    assert one[0].token_ids == hf_greedy(llama_pair[0], PROMPTS[0], 8)
    assert {b for _, b, _ in dec.step_times} == ({1} if dec.graphs is None else {1, 2})
    before = dict(dec.step_times)
    out = dec.generate(PROMPTS[:2], 8)
    assert all(dec.step_times[k] == v for k, v in before.items())  # bucket 1's times stay as measured
    # timing ran the steps with every row active, then put the state back: the requests are untouched
    assert [r.token_ids for r in out] == [hf_greedy(llama_pair[0], p, 8) for p in PROMPTS[:2]]
    table, host = dict(dec.step_times), dict(dec.host_times)
    assert set(table) == {(True, b, k) for b in (1, 2) for k in (1, 2, 3)}
    assert all(base + 16 * per > 0 and per >= 0 for base, per in table.values())
    assert set(host) == {(True, 1), (True, 2)}
    # each K's step time holds the host's work per replay too (it waits for the replay's end)
    dec.host_times[(True, 2)] = 0.5
    dec.config.steps_per_graph = 2
    assert dec._times_for(True, 2, 100.0) == {k: table[(True, 2, k)][0] + 100 * table[(True, 2, k)][1] + 0.25
                                              for k in (1, 2, 3)}
    dec.host_times[(True, 2)], dec.config.steps_per_graph = host[(True, 2)], 1
    dec.generate(PROMPTS[:2], 8)
    assert dec.step_times == table and dec.host_times == host  # fixed once measured: same seed, same Ks
    dec.reset_graphs()
    assert dec.step_times == {} and dec.host_times == {}  # measured again with the next graphs


def test_a_call_times_the_bucket_its_batch_is_priced_with(llama_pair):
    """Without graphs: three requests over buckets (1, 2) and 4 slots run at B=3, priced with bucket 4's times
    (the measured bucket nearest above), so that call times buckets 1, 2 and 4; one request, bucket 1 alone."""
    cfg = SpecGraphConfig(num_speculative_tokens="auto", max_speculative_tokens=2, max_len=64, max_batch_size=4,
                          batch_buckets=(1, 2), enable_graph=False)
    dec = SpecDecoder.from_pretrained(*llama_pair, cfg)
    dec.generate(PROMPTS[:1], 4)
    assert {b for _, b, _ in dec.step_times} == {1}
    out = dec.generate(PROMPTS[:3], 6)
    assert {b for _, b, _ in dec.step_times} == {1, 2, 4}
    assert [r.token_ids for r in out] == [hf_greedy(llama_pair[0], p, 6) for p in PROMPTS[:3]]


@pytest.mark.parametrize("budget,runs_per_key", [(float("inf"), 4), (0.0, 3)])
def test_long_steps_are_timed_fewer_times(llama_pair, monkeypatch, budget, runs_per_key):
    """Timing stops repeating a (bucket, K) step once its timed runs pass TIMING_BUDGET_S (eager steps over a
    long cache last long, and their noise is small against that), after MIN_TIMED_RUNS (2) of them, so that one
    run a hiccup stretched is not the price: a warm-up and two timed runs per key and length, and the host's work
    timed without replays; with no bound (the control) each key gets a warm-up and 3 timed runs, and the host's
    work 3 x HOST_REPLAYS replays each way."""
    import spec_graph.step_times as step_times_mod

    monkeypatch.setattr(step_times_mod, "TIMING_BUDGET_S", budget)
    dec = SpecDecoder.from_pretrained(*llama_pair, SpecGraphConfig(num_speculative_tokens="auto",
                                                                   max_speculative_tokens=2, max_len=64,
                                                                   max_batch_size=1))
    runs = {}
    real = dec._timed_run

    def counted(key, length):
        run = real(key, length)
        return lambda: (runs.__setitem__(key, runs.get(key, 0) + 1), run())[1]
    monkeypatch.setattr(dec, "_timed_run", counted)
    out = dec.generate(PROMPTS[:1], 6)
    assert out[0].token_ids == hf_greedy(llama_pair[0], PROMPTS[0], 6)
    lengths = 2 if step_times_mod._platform.use_triton(dec.device) or dec.span_steps else 1  # it follows the length
    host_runs = 2 * step_times_mod.HOST_REPLAYS * 3 if budget == float("inf") else 0  # read + sync, x 3
    assert runs == {(True, 1, 1): lengths * runs_per_key + host_runs, (True, 1, 2): lengths * runs_per_key}, runs
    assert dec.host_times[(True, 1)] >= 0


def test_host_time_moves_the_choice(llama_pair):
    """A host cost per replay favours more drafts per replay: with these step times and the estimate the engine
    starts from (0.6 per position, 0.9x the one before past it), K=1 is best without it and K=4 with 10 s of host
    work per replay (K=3 priced best, K=4 within EXPLORE_MARGIN and unseen)."""
    dec = _engine(llama_pair)
    times = dec._times_for(True, 1, 10.0)
    assert KChooser((1, 2, 3, 4)).choose(times) == 1
    dec.host_times[(True, 1)] = 10.0
    times = dec._times_for(True, 1, 10.0)
    assert times == {k: TIMES[k] * (1 + 1 / 8) + 10.0 for k in TIMES}
    assert KChooser((1, 2, 3, 4)).choose(times) == 4


def test_auto_sampling_repeats_under_a_seed(llama_pair):
    dec = _engine(llama_pair)
    runs = [dec.generate(PROMPTS, 24, temperature=1.0, seed=s) for s in (7, 7, 8)]
    same = [[r.token_ids for r in o] + [o.stats.k_per_step] for o in runs]
    assert same[0] == same[1] and same[0] != same[2]
    assert len(set(runs[0].stats.k_per_step)) >= 2


@pytest.mark.parametrize("broken", [False, True])
def test_auto_sampling_repeats_under_a_seed_across_engines(llama_pair, tmp_path, monkeypatch, broken):
    """Two engines built alike give the same Ks and sampled tokens for one seed: the second reads the step-time
    table the first measured, kept under SPEC_GRAPH_CACHE_DIR. Here the second engine's own timings would be
    other ones, as a busy machine's are: every K but the one the first engine chose least made slower (whichever
    K a machine favours, the second's own table then leads elsewhere). Control: with no table kept, the second
    engine times its own steps, and its Ks and tokens part from the first's."""
    monkeypatch.setenv(step_times_mod.CACHE_ENV, "" if broken else str(tmp_path))
    cfg = SpecGraphConfig(num_speculative_tokens="auto", max_speculative_tokens=4, max_len=64, max_batch_size=4)
    first = SpecDecoder.from_pretrained(*llama_pair, cfg)
    want = first.generate(PROMPTS, 24, temperature=1.0, seed=7)
    assert first.step_times and (broken or list(tmp_path.rglob("*.json")))
    second = SpecDecoder.from_pretrained(*llama_pair, cfg)
    real, ks = second._timed_run, want.stats.k_per_step
    least = min(second.k_choices, key=ks.count)
    assert ks.count(least) < len(ks)

    def slower_but_the_least_chosen(key, length):
        run = real(key, length)
        return run if key[2] == least else (lambda: (time.sleep(0.02), run())[1])
    monkeypatch.setattr(second, "_timed_run", slower_but_the_least_chosen)
    got = second.generate(PROMPTS, 24, temperature=1.0, seed=7)
    same = ([r.token_ids for r in got], got.stats.k_per_step) == ([r.token_ids for r in want], want.stats.k_per_step)
    assert same != broken


def test_auto_costs_no_extra_host_read(llama_pair, monkeypatch):
    """Per replay the host reads the device once, with "auto" as with a fixed K."""
    reads = []
    orig = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (reads.append(1), orig(t))[1])

    def overhead(**cfg):
        dec = _engine(llama_pair, **cfg)
        reads.clear()
        out = dec.generate(PROMPTS[:1], 24)
        return len(reads) - len(out.stats.k_per_step)  # replays (N=1): one step each

    assert overhead() == overhead(num_speculative_tokens=2)


def test_config_and_choices():
    assert SpecGraphConfig(num_speculative_tokens="auto").k_choices == (1, 2, 3, 4, 6, 8)
    assert SpecGraphConfig(num_speculative_tokens="AUTO", max_speculative_tokens=5).k_choices == (1, 2, 3, 4, 5)
    assert SpecGraphConfig(num_speculative_tokens="auto", max_speculative_tokens=16).k_choices[-3:] == (8, 12, 16)
    assert SpecGraphConfig(num_speculative_tokens=3, max_speculative_tokens=8).k_choices == (3,)
    c = SpecGraphConfig(num_speculative_tokens="auto", max_len=100)
    assert c.max_k == 8 and c.cache_len == SpecGraphConfig(num_speculative_tokens=8, max_len=100).cache_len
    for bad in ({"num_speculative_tokens": "fast"}, {"num_speculative_tokens": "auto", "max_speculative_tokens": 0},
                {"max_speculative_tokens": 17}, {"max_speculative_tokens": "8"}):
        with pytest.raises(ValueError, match="num_speculative_tokens|max_speculative_tokens"):
            SpecGraphConfig(**bad)


def test_export_refuses_auto(tmp_path, llama_pair):
    with pytest.raises(ExportError, match="fixes K.*-k 4"):
        export_pair(*llama_pair, tmp_path / "x.pt2", num_speculative_tokens="auto")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "spec_graph.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_k_auto(llama_pair):
    t, d = map(str, llama_pair)
    base = ["generate", "--target", t, "--draft", d, "--prompt-ids", "5,9,17", "--max-new-tokens", "12",
            "--device", "cpu"]
    r = _cli(*base, "-k", "auto", "--max-speculative-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["k_per_step"] and set(stats["k_per_step"]) <= {1, 2, 3} and len(stats["k_per_step"]) == stats["steps"]
    assert len(stats["acceptance_rate_per_position"]) == 3
    r = _cli(*base, "-k", "auto", "--quiet")
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    # sampled under a seed with no step-time table kept (as the tests run), the Ks follow this process's step
    # times: the user is told; a fixed K is not warned
    for k, warned in (("auto", True), ("3", False)):
        r = _cli(*base, "-k", k, "--quiet", "--temperature", "0.8", "--seed", "1")
        assert r.returncode == 0 and ("repeats from run to run" in r.stderr) == warned, r.stderr
    for bad, msg in ((["-k", "fast"], "integer 1..16 or 'auto'"),
                     (["-k", "3", "--max-speculative-tokens", "4"], "add -k auto")):
        r = _cli(*base, *bad)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_k_auto_sampled_repeats_from_run_to_run_with_the_table_kept(llama_pair, tmp_path):
    """With SPEC_GRAPH_CACHE_DIR set, the second run reads the first run's step times: the same tokens and Ks,
    and no warning."""
    t, d = map(str, llama_pair)
    args = ["generate", "--target", t, "--draft", d, "--prompt-ids", "5,9,17", "--max-new-tokens", "16",
            "--device", "cpu", "-k", "auto", "--temperature", "1", "--seed", "3", "--json", "--quiet"]
    env = {**os.environ, "SPEC_GRAPH_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-m", "spec_graph.cli", *args], capture_output=True, text=True,
                           timeout=300, env=env) for _ in range(2)]
    assert all(r.returncode == 0 and not r.stderr.strip() for r in runs), [r.stderr for r in runs]
    out = [json.loads(r.stdout) for r in runs]
    assert out[0]["outputs"][0]["token_ids"] == out[1]["outputs"][0]["token_ids"]
    assert out[0]["stats"]["k_per_step"] == out[1]["stats"]["k_per_step"]
    assert len(list(tmp_path.rglob("*.json"))) == 1


def test_auto_compiled_step_counts_inside_the_graph(llama_pair):
    """The spec_graph backend's step (CPU: compiled, not captured) counts acceptance inside the compiled graph;
    the counts and the tokens equal the eager engine's."""
    eager = _engine(llama_pair, max_speculative_tokens=2, batch_buckets=(4,))
    dec = _engine(llama_pair, max_speculative_tokens=2, batch_buckets=(4,), enable_graph=True)
    assert dec.compiled
    outs = [d.generate(PROMPTS, 16) for d in (eager, dec)]
    assert [r.token_ids for r in outs[1]] == [r.token_ids for r in outs[0]]
    assert outs[1].stats.k_per_step == outs[0].stats.k_per_step and len(set(outs[1].stats.k_per_step)) == 2
    assert dec.k_counts.sum(0).tolist() == eager.k_counts.sum(0).tolist() == _host_counts(outs[1], 2)
    assert {k for _, k in dec._fns} == {1, 2}


# ------------------------------------------------------------------ the kept step-time table
class _Table(step_times_mod.StepTimes):
    """A step-time table alone: what two engines built alike share through the file."""

    def __init__(self, identity="one-pair"):
        self.step_times, self.host_times, self._timed, self.identity = {}, {}, set(), identity

    def _timing_identity(self):
        return self.identity

    def measured(self, key, value):
        self.step_times[key] = value
        self._timed.add(key)
        return self


@pytest.mark.parametrize("broken", [False, True])
def test_tables_saved_by_two_engines_keep_both(tmp_path, monkeypatch, broken):
    """Two engines with one identity that time steps side by side save one after the other: the file keeps the
    steps of both, and where both timed a step the one saved first wins, in the file and in the second engine's
    table (the first may already price its Ks by it). Control: a save that writes its own entries alone drops
    the first engine's."""
    monkeypatch.setenv(step_times_mod.CACHE_ENV, str(tmp_path))
    if broken:
        monkeypatch.setattr(step_times_mod.StepTimes, "_load_times", lambda self, overwrite=False, kept=None: None)
    first = _Table().measured((True, 1, 1), (1.0, 0.0)).measured((True, 1, 2), (2.0, 0.0))
    second = _Table().measured((True, 1, 2), (9.0, 0.0)).measured((True, 1, 3), (3.0, 0.0))
    second.step_times[(True, 1, 1)] = (5.0, 0.0)  # set by its caller: not measured here, and not written
    first._save_times()
    second._save_times()
    kept = json.loads(first._times_file().read_text())["steps"]
    both = sorted(kept) == [[True, 1, 1, [1.0, 0.0]], [True, 1, 2, [2.0, 0.0]], [True, 1, 3, [3.0, 0.0]]]
    assert (both and second.step_times[(True, 1, 2)] == (2.0, 0.0)) != broken, kept
    assert second.step_times[(True, 1, 1)] == (5.0, 0.0)  # the caller's entry stays in its table


@pytest.mark.parametrize("table,key,value,needle", [
    ("step_times", (True, 1, 2), "fast", r"step_times\[\(True, 1, 2\)\] = 'fast' is no price"),
    ("step_times", (True, 1, 2), float("nan"), "is no price"),
    ("step_times", (True, 1, 2), (1.0, -0.5), "is no price"),
    ("step_times", (True, 1), 1.0, "a key is a tuple of 3"),
    ("host_times", (True, 1), "slow", r"host_times\[\(True, 1\)\] = 'slow' is no price"),
    ("host_times", (True, 1), -1.0, "is no price"),
    ("step_times", None, None, "step_times must be a dict, got NoneType"),
])
def test_time_tables_a_caller_sets_are_checked(llama_pair, table, key, value, needle):
    """dec.step_times / dec.host_times, which a caller may set: an entry that is no price is a ValueError naming
    it, before the call runs (not a TypeError from inside the chooser, nor a NaN that steers K). Control: the
    engine runs once the entry is a price again."""
    dec = _engine(llama_pair)
    if key is None:
        setattr(dec, table, value)
    else:
        getattr(dec, table)[key] = value
    with pytest.raises(ValueError, match=needle):
        dec.generate(PROMPTS[:1], 4)
    if key is None:
        setattr(dec, table, {})
    else:
        del getattr(dec, table)[key]
    assert dec.generate(PROMPTS[:1], 4)[0].token_ids == hf_greedy(llama_pair[0], PROMPTS[0], 4)


@pytest.mark.parametrize("steps,host", [
    ([[True, 1, 1, float("nan")]], []), ([[True, 1, 2, -1.0]], []), ([[True, 1, 3, [1e9, float("inf")]]], []),
    ([[True, 1, 4, 0]], []), ([[True, 1, 1, [0.001, -1e-6]]], []), ([], [[True, 1, float("nan")]]),
    ([], [[True, 1, -0.5]]),
])
def test_a_kept_table_with_prices_no_timing_gives_is_ignored(tmp_path, monkeypatch, caplog, steps, host):
    """A kept table is read as its engine wrote it: a price no timing could give (not finite, not positive at
    length 16, a negative slope or host share) steers K with nothing behind it, so the file is ignored with a
    warning and its steps are timed again. Control: a plausible table, with a fit whose base is negative (a
    steep slope), is read."""
    monkeypatch.setenv(step_times_mod.CACHE_ENV, str(tmp_path))
    table = _Table()
    path = table._times_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"steps": steps, "host": host}))
    with caplog.at_level("WARNING", logger="spec_graph"):
        assert table._read_times(path) == ({}, {})
    assert any("ignoring the step-time table" in r.getMessage() for r in caplog.records)
    path.write_text(json.dumps({"steps": [[True, 1, 1, [-0.001, 0.0001]], [True, 1, 2, 0.002]],
                                "host": [[True, 1, 0.0]]}))
    assert table._read_times(path) == ({(True, 1, 1): (-0.001, 0.0001), (True, 1, 2): 0.002}, {(True, 1): 0.0})


@pytest.mark.parametrize("broken", [False, True])
def test_a_bad_kept_table_is_named_once_and_replaced(tmp_path, monkeypatch, caplog, broken):
    """A kept table that cannot be read is named once, where it is loaded; the save that replaces it with this
    engine's timings says nothing more. Broken: the save's read warns as the load's does (the warning twice)."""
    monkeypatch.setenv(step_times_mod.CACHE_ENV, str(tmp_path))
    if broken:
        read = step_times_mod.StepTimes._read_times
        monkeypatch.setattr(step_times_mod.StepTimes, "_read_times", lambda self, path, warn=True: read(self, path))
    table = _Table()
    path = table._times_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with caplog.at_level("WARNING", logger="spec_graph"):
        table._load_times()
        table.measured((True, 1, 1), (1.0, 0.0))._save_times()
    named = [r for r in caplog.records if "ignoring the step-time table" in r.getMessage()]
    assert (len(named) == 1) != broken, named
    assert json.loads(path.read_text()) == {"steps": [[True, 1, 1, [1.0, 0.0]]], "host": []}


@pytest.mark.parametrize("broken", [False, True])
def test_a_failed_save_leaves_no_file_behind(tmp_path, monkeypatch, broken):
    """A save whose rename fails (a full disk, say) leaves the cache as it found it, and the engine goes on
    with its own table. Control: without the clean-up the written temporary file stays."""
    monkeypatch.setenv(step_times_mod.CACHE_ENV, str(tmp_path))

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(step_times_mod.os, "replace", full_disk)
    if broken:
        monkeypatch.setattr(step_times_mod.os, "unlink", lambda path: None)
    table = _Table().measured((True, 1, 1), (1.0, 0.0))
    table._save_times()
    assert table.step_times == {(True, 1, 1): (1.0, 0.0)}
    assert (list(tmp_path.rglob("*")) == [tmp_path / "step_times"]) != broken


@pytest.mark.parametrize("broken", [False, True])
def test_models_of_another_dtype_keep_another_table(llama_pair, broken):
    """The step times of bf16 weights are not those of fp32 ones, even under one config (models built by the
    caller): the table's identity holds the weights' dtype. Control: the same models give the same identity."""
    dec = SpecDecoder.from_pretrained(*llama_pair, SpecGraphConfig(num_speculative_tokens="auto",
                                                                   max_speculative_tokens=2, max_len=64))
    models = [m if broken else copy.deepcopy(m).to(torch.bfloat16) for m in (dec.target, dec.draft)]
    other = SpecDecoder(*models, dec.config, dec.tokenizer, dec.eos_token_ids)
    assert (other._timing_identity() != dec._timing_identity()) != broken


class _KeptAcrossBuckets(KChooser):
    """Broken: the K running stays the one to keep whatever bucket the next replay runs in."""

    @property
    def last_k(self):
        return self.__dict__.get("_kept")

    @last_k.setter
    def last_k(self, k):
        if k is not None:
            self.__dict__["_kept"] = k


@pytest.mark.parametrize("cls", [KChooser, _KeptAcrossBuckets])
def test_the_k_kept_is_the_running_buckets(llama_pair, monkeypatch, cls):
    """A K is kept only where the replay priced runs in the bucket of the one running: a choice for another
    bucket (made while rows admitted into a larger one prefill) sees no K to keep. The call here changes bucket
    (2, then 1, then 2), and choices within one bucket do see the K running."""
    events = []

    class Recorded(cls):
        def choose(self, times, remaining=None, queued=0):
            events.append(("choose", dec.config.bucket_for(max(remaining) + 1), self.last_k))
            return super().choose(times, remaining, queued)

    monkeypatch.setattr(runtime_mod, "KChooser", Recorded)
    dec = _engine(llama_pair, max_batch_size=2, batch_buckets=(1, 2), admission_wait=2)
    run = dec._run_steps

    def launched(B, *rest):
        events.append(("launch", B, None))
        return run(B, *rest)
    monkeypatch.setattr(dec, "_run_steps", launched)
    # four requests in two rows, freed rows waiting a little for company: bucket 2, then 1, then 2 again
    dec.generate(PROMPTS, 16)
    last, across, within = None, [], []
    for kind, bucket, kept in events:
        if kind == "launch":
            last = bucket
        elif last is not None:
            (within if bucket == last else across).append(kept)
    assert across and any(k is not None for k in within), events
    assert all(k is None for k in across) == (cls is KChooser), across
