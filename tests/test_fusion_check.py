"""The compiled engine knows whether its fusion passes fired.

The fused Triton ops reach the compiled step only through the passes' pattern match, and
a step the passes no longer match computes the same tokens with the unfused reference ops.
So after each compile of its step the engine reads the pass counts the ``spec_graph``
backend reports (``BackendOptions.on_passes``) and warns once per pass on the "spec_graph"
logger when the expected fusion (greedy: fuse_greedy_accept, sampling: fuse_prepare_next)
did not fire.

- the real backend on CPU (inductor; caches off or empty, so that the passes run): the greedy
  and the sampling step fuse, with no warning; a second engine whose step inductor's FX graph
  cache serves (passes not run, no count) does not warn either; a pass broken to find nothing
  gives exactly one warning naming it, and the same tokens (which is why only the count can tell);
- the engine's wiring with a stand-in for torch.compile (no inductor): a cache hit
  (passes did not run) and a pass turned off in SpecGraphConfig.passes warn nothing, and a
  second compile without the fusion does not warn again.

Inductor compiles take tens of seconds here: three real compiles and one cache hit
(max_batch_size=1: one graph per step mode; K=1).
"""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from spec_graph import SpecDecoder, SpecGraphConfig
from spec_graph.backend import BackendOptions
from spec_graph.passes.fuse_greedy_accept import FuseGreedyAccept

PROMPTS = [[3, 4, 5, 6]]
MAX_NEW = 8
FUSED_GREEDY = {"fuse_greedy_accept": 1, "fuse_prepare_next": 0}
FUSED_SAMPLING = {"fuse_greedy_accept": 0, "fuse_prepare_next": 1}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from helpers import make_checkpoint, perturbed_copy

    root = tmp_path_factory.mktemp("fusion_check")
    target = make_checkpoint(root / "target", vocab_size=64, hidden_size=32, layers=1, heads=2, kv_heads=1,
                             intermediate_size=64)
    return target, perturbed_copy(target, root / "draft", noise=0.5)


def engine(pair, **cfg) -> SpecDecoder:
    cfg = {"num_speculative_tokens": 1, "max_batch_size": 1, "max_len": 32, "device": "cpu", "dtype": "float32",
           "enable_graph": True, **cfg}
    dec = SpecDecoder.from_pretrained(*pair, SpecGraphConfig(**cfg))
    assert dec.compiled == cfg["enable_graph"] and dec.graphs is None  # CPU: compiled, never captured
    return dec


@pytest.fixture(scope="module")
def eager_greedy(tiny_pair):
    return [r.token_ids for r in engine(tiny_pair, enable_graph=False).generate(PROMPTS, MAX_NEW)]


@contextlib.contextmanager
def compiling_for_real():
    """A fresh compile that runs the post-grad passes: a cache hit would skip them."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "spec_graph" and r.levelno >= logging.WARNING]


# ------------------------------------------------- the real backend (inductor on CPU)
def test_greedy_step_fuses_without_warning(tiny_pair, eager_greedy, caplog):
    """The greedy step fuses; a second engine served by inductor's cache (its passes do not run:
    no count) is not taken for a missed fusion. Here the caches are on but empty, so that the
    first compile runs the passes and the second can hit."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            caplog.at_level(logging.DEBUG, logger="spec_graph"):
        dec = engine(tiny_pair)
        out = dec.generate(PROMPTS, MAX_NEW)
        assert out.stats.steps > 1  # the compiled step ran again after its compile
        assert dec.pass_counts == {"greedy": [FUSED_GREEDY]}  # one compile, the fusion fired
        assert [r.token_ids for r in out] == eager_greedy
        torch._dynamo.reset()
        again = engine(tiny_pair)
        assert [r.token_ids for r in again.generate(PROMPTS, MAX_NEW)] == eager_greedy
        assert again.pass_counts == {"greedy": [None]}  # a cache hit: the passes did not run
    assert warnings_of(caplog) == []
    assert any("inductor's cache" in r.getMessage() for r in caplog.records)


def test_sampling_step_fuses_without_warning(tiny_pair, caplog):
    dec = engine(tiny_pair)
    with compiling_for_real(), caplog.at_level(logging.DEBUG, logger="spec_graph"):
        out = dec.generate(PROMPTS, MAX_NEW, temperature=0.8, seed=3)
    assert out.stats.steps > 1 and all(r.finish_reason != "error" for r in out)
    assert dec.pass_counts == {"sampling": [FUSED_SAMPLING]}
    assert warnings_of(caplog) == []


def test_a_pass_that_finds_nothing_is_reported_once(tiny_pair, eager_greedy, caplog, monkeypatch):
    """The failure mode itself: the pass stops matching (here: replaces nothing). The tokens
    stay the same -- only the count shows that the fused kernel is gone."""
    monkeypatch.setattr(FuseGreedyAccept, "__call__", lambda self, graph: 0)
    dec = engine(tiny_pair)
    with compiling_for_real(), caplog.at_level(logging.WARNING, logger="spec_graph"):
        first = dec.generate(PROMPTS, MAX_NEW)
        dec.generate(PROMPTS, MAX_NEW)  # the compiled step again: no new compile, no new warning
    assert dec.pass_counts == {"greedy": [{"fuse_greedy_accept": 0, "fuse_prepare_next": 0}]}
    warned = warnings_of(caplog)
    assert len(warned) == 1, warned
    assert "fuse_greedy_accept" in warned[0] and "greedy step" in warned[0]
    assert [r.token_ids for r in first] == eager_greedy


# --------------------------------- the engine's wiring, with a stand-in for torch.compile
def fake_compile(reports: list):
    """torch.compile stand-in: the step runs eagerly; its first len(reports) calls each 'compile',
    handing the next report to the backend option on_passes as the spec_graph backend would."""
    def compile_(fn, *, backend, options, **kwargs):
        BackendOptions.parse(options)  # the engine's options are valid backend options
        queue = list(reports)

        def run(*args):
            if queue:
                options["on_passes"](queue.pop(0))
            return fn(*args)

        return run

    return compile_


@pytest.mark.parametrize("cfg,greedy,reports,n_warnings", [
    ({}, True, [None], 0),  # served from inductor's cache: the passes did not run, nothing to check
    ({}, False, [None, FUSED_SAMPLING], 0),
    ({"passes": {"fuse_greedy_accept": False}}, True, [{"fuse_prepare_next": 0}], 0),  # turned off: not expected
    ({"passes": {"fuse_greedy_accept": False}}, False, [{"fuse_prepare_next": 0}], 1),  # still expected there
    ({}, True, [{"fuse_greedy_accept": 0}, {"fuse_greedy_accept": 0}], 1),  # two compiles, one warning
    ({}, False, [FUSED_GREEDY], 1),  # the other step's fusion does not count
], ids=["cache-hit", "cache-hit-then-fused", "pass-off", "other-pass-off", "once", "wrong-pass"])
def test_engine_checks_each_compile(tiny_pair, monkeypatch, caplog, cfg, greedy, reports, n_warnings):
    monkeypatch.setattr(torch, "compile", fake_compile(reports))
    dec = engine(tiny_pair, **cfg)
    step = dec._step_fn(greedy)
    with caplog.at_level(logging.DEBUG, logger="spec_graph"), torch.inference_mode():
        for _ in range(len(reports) + 1):  # one call per 'compile', and one more that compiles nothing
            step(*dec._step_args(1))
    mode = "greedy" if greedy else "sampling"
    assert dec.pass_counts == {mode: reports}
    warned = warnings_of(caplog)
    assert len(warned) == n_warnings, warned
    expected = "fuse_greedy_accept" if greedy else "fuse_prepare_next"
    assert all(expected in w for w in warned)
    hits = [r for r in caplog.records if "inductor's cache" in r.getMessage()]
    assert len(hits) == reports.count(None) and all(r.levelno == logging.DEBUG for r in hits)


def test_on_passes_must_be_callable():
    with pytest.raises(ValueError, match="on_passes"):
        BackendOptions.parse({"on_passes": []})
    assert BackendOptions.parse({"on_passes": print}).on_passes is print
