"""Admission: freed slots wait (config.admission_wait slot-steps) so that queued requests share a prefill."""
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


def test_the_default_wait_is_one_step_of_the_batch():
    import dataclasses

    cfg = SpecGraphConfig(max_batch_size=8)
    assert cfg.admission_wait is None and cfg.slot_steps_waited == 8
    assert dataclasses.replace(cfg, max_batch_size=32).slot_steps_waited == 32  # follows the slots it is for
    assert SpecGraphConfig(max_batch_size=8, admission_wait=0).slot_steps_waited == 0


def test_a_wait_set_after_construction_is_checked_before_any_work(llama_pair):
    dec = decoder(llama_pair, 0)
    dec.config.admission_wait = "8"
    with pytest.raises(ValueError, match="admission_wait must be a non-negative integer.*got '8'"):
        dec.generate(PROMPTS, NEW)
    dec.config.admission_wait = 2
    assert len(dec.generate(PROMPTS[:2], 4)) == 2


def _trace(monkeypatch):
    """Records each admission check as ("check", free, pending, busy, idle, wait, answer), and each replay as
    ("replay", steps, slots free in it)."""
    events, real = [], runtime_mod.admits_now

    def traced(*args):
        events.append(("check", *args, real(*args)))
        return events[-1][-1]
    monkeypatch.setattr(runtime_mod, "admits_now", traced)
    run = runtime_mod.DecoderBase._run_steps

    def replay(self, *args, **kw):
        S = self.config.max_batch_size  # a busy row is active: rows end (finish) in the host loop before a replay
        events.append(("replay", self.config.steps_per_graph, S - int(self.state["active"][:S].sum())))
        return run(self, *args, **kw)
    monkeypatch.setattr(runtime_mod.DecoderBase, "_run_steps", replay)
    return events


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


def check_idle_counts_slot_steps(pair, monkeypatch, prompts, expected, wait=3, stop=None, **cfg):
    events = _trace(monkeypatch)
    out = decoder(pair, wait, **cfg).generate(prompts, NEW, stop_token_ids=stop)
    assert [r.token_ids for r in out] == expected
    checks = [i for i, e in enumerate(events) if e[0] == "check"]
    for i, j in zip(checks, checks[1:]):
        _, free, pending, busy, idle, _, admitted = events[i]
        queued = pending - (min(free, pending) if admitted else 0)
        # idle restarts at an admission, then grows by each replay's steps times the slots free in it (rows that
        # ended in their prefill included), while requests stay queued
        grown = sum(e[1] * e[2] for e in events[i + 1: j]) if queued else 0
        assert events[j][4] == (0 if admitted else idle) + grown, (events[i:j + 1], wait)
    admissions = [events[i] for i in checks if events[i][-1]]
    assert len(admissions) == out.stats.prefills
    assert all(e[3] == 0 or e[1] >= e[2] or e[4] >= wait for e in admissions)
    # the inputs reach every path: a wait over several replays, admissions that end a wait, a replay after an
    # admission with requests still queued
    assert any(events[i][4] > events[i][1] for i in checks), "no slot waited over a replay"
    assert any(e[3] and e[1] < e[2] and e[4] >= wait for e in admissions), "no admission ended a wait"
    assert any(e[-1] and e[1] < e[2] for e in (events[i] for i in checks[:-1])), "no admission left requests queued"
    return events


def _ends_in_prefill(target):
    """Prompts for slots past a small bucket: one long request, then prompts whose first greedy token is a stop
    token its output never holds (each ends in its prefill), with the stop ids."""
    long = next(p for p in PROMPTS if len(hf_greedy(target, p, NEW)) == NEW)
    out = set(hf_greedy(target, long, NEW))
    quick = next(p for p in PROMPTS if hf_greedy(target, p, 1)[0] not in out)
    stop = [hf_greedy(target, quick, 1)[0]]
    return [long] + [quick] * 7, [hf_greedy(target, long, NEW)] + [stop] * 7, stop


@pytest.mark.parametrize("cfg", [{}, {"steps_per_graph": 2}])
def test_idle_counts_slot_steps(llama_pair, references, monkeypatch, cfg):
    check_idle_counts_slot_steps(llama_pair, monkeypatch, PROMPTS, references, **cfg)


def test_free_slots_past_the_running_bucket_count(llama_pair, monkeypatch):
    """Slots 1-3 free (their requests end in their prefills) while slot 0 runs in bucket 1: they wait all the same."""
    prompts, expected, stop = _ends_in_prefill(llama_pair[0])
    events = check_idle_counts_slot_steps(llama_pair, monkeypatch, prompts, expected, wait=4, stop=stop)
    assert any(e[0] == "replay" and e[2] == 3 for e in events), "no replay ran in bucket 1 with three slots free"


class _Broken:
    """_generate's idle count made wrong in one way, by feeding admits_now a changed count."""

    def __init__(self, how):
        self.how = how

    def __call__(self, monkeypatch):
        real_generate = runtime_mod.DecoderBase._generate
        how = self.how

        def generate(dec, *args):
            inner = runtime_mod.admits_now
            state = {"last": None}

            def wrong(free, pending, busy, idle, wait):
                seen = idle
                if how == "no reset" and state["last"] is not None:
                    seen = idle + state["last"]  # what piled up before the last admission stays
                elif how == "replays" and free > 1:
                    seen = idle // free
                answer = inner(free, pending, busy, seen, wait)
                if answer:
                    state["last"] = seen
                return answer
            runtime_mod.admits_now = wrong
            try:
                return real_generate(dec, *args)
            finally:
                runtime_mod.admits_now = inner
        monkeypatch.setattr(runtime_mod.DecoderBase, "_generate", generate)


@pytest.mark.parametrize("how", ["no reset", "replays"])
def test_a_wrong_idle_count_is_caught(llama_pair, references, monkeypatch, how):
    _Broken(how)(monkeypatch)
    with pytest.raises(AssertionError):
        check_idle_counts_slot_steps(llama_pair, monkeypatch, PROMPTS, references)


def check_groups(groups_of):
    """Each prompt in exactly one forward, in admission order; a long prompt beside short ones alone; prompts of
    like length, and short prompts whatever their lengths, in one forward; a forward within its positions."""
    from spec_graph import admission

    cases = [[16000] + [50] * 7, [128] * 8, [400] + [100] * 7, [20, 40, 80, 160], [32000] * 8,
             [9000, 8000, 5000, 100, 3000], [7], []]
    for lens in cases:
        groups = groups_of(lens)
        assert sorted(i for g in groups for i in g) == list(range(len(lens))), (lens, groups)
        assert all(g == sorted(g) and g for g in groups), groups
        for g in groups:
            padded = len(g) * max(lens[i] for i in g)
            assert len(g) == 1 or padded <= admission.PREFILL_MAX_POSITIONS, (lens, groups)
    assert groups_of(cases[0]) == [[0], list(range(1, 8))]
    for lens in cases[1:4]:
        assert groups_of(lens) == [list(range(len(lens)))], lens
    assert groups_of([32000] * 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups_of([9000, 8000, 5000, 100, 3000]) == [[0, 1, 2], [3, 4]]


def test_prefill_groups_split_where_padding_costs():
    from spec_graph.admission import prefill_groups

    check_groups(prefill_groups)


@pytest.mark.parametrize("broken", ["one forward", "one per prompt", "unordered"])
def test_prefill_groups_checks_catch_a_broken_grouping(broken):
    from spec_graph.admission import prefill_groups

    bad = {"one forward": lambda lens: [list(range(len(lens)))] if lens else [],
           "one per prompt": lambda lens: [[i] for i in range(len(lens))],
           "unordered": lambda lens: [g[::-1] for g in prefill_groups(lens)]}[broken]
    with pytest.raises(AssertionError):
        check_groups(bad)


# One long prompt and three short ones, with the padding a forward may add set low: the long one is prefilled alone
MIXED = [list(range(3, 63)), [40, 41], [7, 8, 9], [90]]


def check_mixed_lengths_split(pair, monkeypatch, groups_of=None):
    import spec_graph.admission as admission

    monkeypatch.setattr(admission, "PAD_SLACK", 8)
    if groups_of is not None:
        monkeypatch.setattr(runtime_mod, "prefill_groups", groups_of)
    shapes, real = [], runtime_mod.DecoderBase._prefill
    monkeypatch.setattr(runtime_mod.DecoderBase, "_prefill",
                        lambda self, slots, prompts, *a: shapes.append((len(slots), max(map(len, prompts))))
                        or real(self, slots, prompts, *a))
    dec = decoder(pair, 0, max_len=128)
    out = dec.generate(MIXED, NEW)
    assert [r.token_ids for r in out] == [hf_greedy(pair[0], p, NEW) for p in MIXED]
    assert out.stats.prefills == len(shapes)
    assert sorted(shapes) == [(1, 60), (3, 3)], shapes  # 60 + 3 x 3 positions, not 4 x 60


def test_an_admission_of_mixed_lengths_prefills_them_apart(llama_pair, monkeypatch):
    check_mixed_lengths_split(llama_pair, monkeypatch)


def test_an_admission_padded_to_its_longest_is_caught(llama_pair, monkeypatch):
    with pytest.raises(AssertionError):
        check_mixed_lengths_split(llama_pair, monkeypatch, lambda lens: [list(range(len(lens)))])
