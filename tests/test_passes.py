"""The spec_graph fusion passes and their pass manager.

- every formulation of the acceptance / leading-valid count (spec-graph's own
  references and ones written independently here) is fused into the
  ``spec_graph::`` op by inductor with the PassManager as its post-grad pass,
  for several K and B, with outputs and the appended buffer equal to the
  unfused function's, exactly;
- formulations sharing no code with the package (own count, stops, tail and
  append) compute exactly what the op computes, on inputs reaching every branch,
  and the pass leaves them unfused (which forms it matches, and why: see
  test_own_formulations_are_left_alone);
- turning a pass off leaves the graph unfused; the manager's uuid is stable
  and follows the enabled set;
- under TRITON_INTERPRET=1 (in a subprocess: Triton decides compiled vs
  interpreted when a kernel is defined) the fused graph runs the Triton
  kernels themselves, not their references;
- torch.compile of the speculative step with the ``spec_graph`` backend fires
  the passes (greedy and sampling);
- the Ascend path wires the same passes into torchair's custom-pass hook
  (a fake torchair module stands in).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from spec_graph.kernels import greedy_accept_prepare, prepare_next
from spec_graph.kernels.greedy_accept import PLACEHOLDER, greedy_accept_prepare_ref, prep_append_ref
from spec_graph.kernels.prepare_next import prepare_next_ref
from spec_graph.passes.manager import PassManager

ROOT = Path(__file__).parents[1]
GREEDY_OP = torch.ops.spec_graph.greedy_accept_prepare.default
PREPARE_OP = torch.ops.spec_graph.prepare_next.default
AF = torch.ops.higher_order.auto_functionalized
# ops of the reference formulations that the fused graph must no longer contain
REFERENCE_OPS = {
    torch.ops.aten.cumprod.default, torch.ops.aten.cumsum.default, torch.ops.aten.amin.default,
    torch.ops.aten.min.dim, torch.ops.aten.argmax.default, torch.ops.aten.gather.default, torch.ops.aten.any.dim,
}
NO_CACHE = {"fx_graph_cache": False}  # a cache hit would skip the post-grad passes


# ------------------------------------------------------------ formulations
# The counts written here, independently of the passes, the way someone might write them; the
# prep/append after them is the package's prep_append_ref (see OWN_GREEDY for forms without it).
def _greedy_rest(n, d, t, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf):
    K = d.shape[1]
    j = torch.arange(K + 1, device=d.device)[None, :]
    valid = torch.where(active, n + 1, torch.zeros_like(n))
    sampled = torch.where(j < valid[:, None], t, PLACEHOLDER)
    return (sampled, *prep_append_ref(sampled, valid, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf))


def greedy_cumprod(d, t, *state):
    n = (d == t[:, :d.shape[1]]).long().cumprod(1).sum(1)
    return _greedy_rest(n, d, t, *state)


def greedy_where_amin(d, t, *state):
    K = d.shape[1]
    mismatch = d != t[:, :K]
    n = torch.where(mismatch, torch.arange(K, device=d.device), K).amin(1)
    return _greedy_rest(n, d, t, *state)


def greedy_where_min(d, t, *state):
    K = d.shape[1]
    mismatch = d != t[:, :K]
    n = torch.where(mismatch, torch.arange(K, device=d.device), K).min(1).values
    return _greedy_rest(n, d, t, *state)


def greedy_cumsum(d, t, *state):
    mismatch = d != t[:, :d.shape[1]]
    n = (mismatch.long().cumsum(1) == 0).sum(1)
    return _greedy_rest(n, d, t, *state)


def greedy_argmax(d, t, *state):
    K = d.shape[1]
    mismatch = d != t[:, :K]
    n = torch.where(mismatch.any(1), mismatch.long().argmax(1), K)
    return _greedy_rest(n, d, t, *state)


def _prep_rest(lead, sampled, active, *state):
    valid = torch.where(active, lead, torch.zeros_like(lead))
    return prep_append_ref(sampled, valid, active, *state)


def prep_cumprod(sampled, active, *state):
    return _prep_rest((sampled != PLACEHOLDER).long().cumprod(1).sum(1), sampled, active, *state)


def prep_where_amin(sampled, active, *state):
    K1 = sampled.shape[1]
    lead = torch.where(sampled == PLACEHOLDER, torch.arange(K1, device=sampled.device), K1).amin(1)
    return _prep_rest(lead, sampled, active, *state)


def prep_where_min(sampled, active, *state):
    K1 = sampled.shape[1]
    lead = torch.where(sampled == PLACEHOLDER, torch.arange(K1, device=sampled.device), K1).min(1).values
    return _prep_rest(lead, sampled, active, *state)


def prep_cumsum(sampled, active, *state):
    lead = ((sampled == PLACEHOLDER).long().cumsum(1) == 0).sum(1)
    return _prep_rest(lead, sampled, active, *state)


def prep_argmax(sampled, active, *state):
    K1 = sampled.shape[1]
    stop = sampled == PLACEHOLDER
    lead = torch.where(stop.any(1), stop.long().argmax(1), K1)
    return _prep_rest(lead, sampled, active, *state)


# "op": the fused op called directly. Traced on CPU (fake tensors), a triton_op is its body,
# i.e. the reference; the pass turns it back into the op.
GREEDY = {"op": greedy_accept_prepare, "reference": greedy_accept_prepare_ref, "cumprod": greedy_cumprod,
          "where_amin": greedy_where_amin, "where_min": greedy_where_min, "cumsum": greedy_cumsum,
          "argmax": greedy_argmax}
PREPARE = {"op": prepare_next, "reference": prepare_next_ref, "cumprod": prep_cumprod, "where_amin": prep_where_amin,
           "where_min": prep_where_min, "cumsum": prep_cumsum, "argmax": prep_argmax}


# ------------------------------------------ formulations sharing no code with the package
# Written from the op's contract alone (no prep_append_ref, no kernels import but PLACEHOLDER):
# per-column loops, torch.isin for the stops, the tail read off the committed stream, the
# append as one index_put per column.
def own_matching_prefix(d, t):
    K = d.shape[1]
    n = torch.zeros(d.shape[0], dtype=torch.long)
    alive = torch.ones(d.shape[0], dtype=torch.bool)
    for i in range(K):
        alive = alive & (d[:, i] == t[:, i])
        n = n + alive.long()
    return n


def own_prep_append(sampled, valid, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf):
    """Same contract as prep_append_ref, written independently of it."""
    B, K1 = sampled.shape
    L = out_buf.shape[1]
    rows = torch.arange(B)
    valid = torch.where(active, valid, 0)
    # the committed stream is tail[0], tail[1], sampled[:valid]: the new tail is its last two tokens
    stream = torch.cat((tail, sampled), dim=1)
    new_tail = stream[rows[:, None], valid[:, None] + torch.arange(2)]
    # the first produced token that is a stop id (stop_ids is PLACEHOLDER-padded) ends the row
    hit = torch.isin(sampled, stop_ids) & (sampled != PLACEHOLDER)
    first = torch.full((B,), K1)
    for i in reversed(range(K1)):
        first = torch.where(hit[:, i] & (i < valid), i, first)
    keep = torch.minimum(torch.minimum(valid, (max_new - n_out).clamp(min=0)), first + 1)
    for i in range(K1):  # column n_out + i gets sampled[:, i] while i < keep, inside the buffer
        pos = n_out + i
        at = pos.clamp(max=L - 1)
        out_buf[rows, at] = torch.where((i < keep) & (pos < L), sampled[:, i], out_buf[rows, at])
    new_n_out = n_out + keep
    done = active & ((first < keep) | (new_n_out >= max_new))
    return ((valid - 1).clamp(min=0), torch.where(active, K1 - valid, 0), new_tail, seq_lens + valid, new_n_out,
            done)


def _own_greedy(count, append):
    def greedy(d, t, active, *state):
        valid = torch.where(active, count(d, t) + 1, 0)
        sampled = torch.where(torch.arange(d.shape[1] + 1) < valid[:, None], t, PLACEHOLDER)
        return (sampled, *append(sampled, valid, active, *state))

    return greedy


def _known_count(d, t):  # a count the pass knows (COUNT_FORMULATIONS' where_amin)
    K = d.shape[1]
    return torch.where(d != t[:, :K], torch.arange(K), K).amin(1)


def prep_own(sampled, active, *state):
    lead = torch.zeros(sampled.shape[0], dtype=torch.long)
    alive = active.clone()
    for i in range(sampled.shape[1]):
        alive = alive & (sampled[:, i] != PLACEHOLDER)
        lead = lead + alive.long()
    return own_prep_append(sampled, lead, active, *state)


OWN_GREEDY = {
    "own": _own_greedy(own_matching_prefix, own_prep_append),  # nothing from the package
    "known_count_own_append": _own_greedy(_known_count, own_prep_append),
    "own_count_reference_append": _own_greedy(own_matching_prefix, prep_append_ref),
}


# ------------------------------------------------------------------ inputs
def _state(g, B, L, S):
    """active, tail, seq_lens, n_out, max_new, stop_ids, out_buf: inactive rows, a full buffer, a small budget."""
    active = torch.rand(B, generator=g) < 0.8
    active[0] = True
    n_out = torch.randint(0, L, (B,), generator=g)
    n_out[0] = 0
    if B > 1:
        n_out[1] = L - 1  # append clipped at the end of the buffer
    max_new = n_out + torch.randint(0, 6, (B,), generator=g)
    stop = torch.full((S,), PLACEHOLDER, dtype=torch.long)
    stop[0] = 3
    out_buf = torch.randint(10, 20, (B, L), generator=g)
    return (active, torch.randint(4, 9, (B, 2), generator=g), torch.randint(5, 9, (B,), generator=g), n_out,
            max_new, stop, out_buf)


def greedy_inputs(B, K, L=10, S=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(4, 7, (B, K), generator=g)
    t = torch.randint(3, 7, (B, K + 1), generator=g)  # 3 is a stop token
    agree = torch.rand(B, K, generator=g) < 0.75
    agree[0] = True  # one row accepts every draft
    t[:, :K] = torch.where(agree, d, t[:, :K])
    return (d, t, *_state(g, B, L, S))


def prepare_inputs(B, K, L=10, S=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    j = torch.arange(K + 1)[None, :]
    valid = torch.randint(1, K + 2, (B,), generator=g)
    sampled = torch.where(j < valid[:, None], torch.randint(3, 9, (B, K + 1), generator=g), PLACEHOLDER)
    state = _state(g, B, L, S)
    sampled[~state[0]] = PLACEHOLDER
    return (sampled, *state)


def _clone(args):
    return tuple(a.clone() for a in args)


# --------------------------------------------------------------- harness
class RecordingPassManager(PassManager):
    """A PassManager that also keeps the targets of the graph it leaves."""

    def __call__(self, graph):
        super().__call__(graph)
        self.targets = [n.target for n in graph.nodes if n.op == "call_function"]
        self.fused_ops = [n.args[0] for n in graph.nodes if n.target is AF]


def compile_and_run(fn, args, keep=None, enabled=None):
    """torch.compile(fn) through inductor with the PassManager as post-grad pass.

    Returns (outputs, args after the call, pass manager). `keep`: indices of fn's
    outputs to return (the others are dropped, as callers do, and DCE'd)."""
    from torch._inductor.compile_fx import compile_fx

    pm = RecordingPassManager(enabled=enabled)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": pm, **NO_CACHE})

    def wrapped(*a):
        out = fn(*a)
        return out if keep is None else tuple(out[i] for i in keep)

    torch._dynamo.reset()
    run_args = _clone(args)
    out = torch.compile(wrapped, backend=backend, fullgraph=True, dynamic=False)(*run_args)
    return out, run_args, pm


def expected(fn, args, keep=None):
    run_args = _clone(args)
    out = fn(*run_args)
    return (out if keep is None else tuple(out[i] for i in keep)), run_args


def assert_same(got, want):
    assert len(got) == len(want)
    for g_, w in zip(got, want):
        assert g_.dtype == w.dtype and g_.shape == w.shape
        assert torch.equal(g_, w), (g_, w)


# (formulation, B, K, kept outputs): K covers 1..8 and B 1..5; some cases drop outputs the way
# the step does (DCE then removes their nodes from the graph)
STEP_KEEP_GREEDY = (1, 3, 4, 5, 6)  # num_accepted, new_tail, new_seq_lens, new_n_out, done
STEP_KEEP_PREPARE = (0, 2, 3, 4, 5)
GREEDY_CASES = [
    ("reference", 3, 4, None), ("reference", 4, 1, STEP_KEEP_GREEDY), ("cumprod", 2, 8, None),
    ("where_amin", 5, 2, None), ("where_amin", 1, 7, STEP_KEEP_GREEDY), ("where_min", 3, 3, STEP_KEEP_GREEDY),
    ("cumsum", 4, 5, None), ("cumsum", 2, 1, STEP_KEEP_GREEDY), ("argmax", 3, 6, None),
    ("argmax", 5, 4, STEP_KEEP_GREEDY), ("op", 2, 3, STEP_KEEP_GREEDY),
]
PREPARE_CASES = [
    ("reference", 3, 4, None), ("reference", 2, 8, STEP_KEEP_PREPARE), ("cumprod", 4, 1, None),
    ("where_amin", 5, 3, STEP_KEEP_PREPARE), ("where_min", 1, 6, None), ("cumsum", 3, 2, STEP_KEEP_PREPARE),
    ("argmax", 4, 7, None), ("argmax", 2, 5, STEP_KEEP_PREPARE), ("op", 3, 3, STEP_KEEP_PREPARE),
]


# test formulation -> the pass's formulation that must match it (the kernel files' references
# count with cumprod, so the independently written cumprod is caught by "reference")
FIRES_AS = {"op": "reference", "reference": "reference", "cumprod": "reference", "where_amin": "where_amin",
            "where_min": "where_min", "cumsum": "cumsum", "argmax": "argmax"}


def _check_fused(pm, op, pass_name, form=None):
    assert pm.last_counts[pass_name] == 1, pm.last_counts
    if form is not None:
        assert pm.last_fired[pass_name] == [FIRES_AS[form]], pm.last_fired
    assert pm.fused_ops == [op], pm.fused_ops
    left = REFERENCE_OPS.intersection(pm.targets)
    assert not left, f"reference ops left in the fused graph: {left}"


@pytest.mark.parametrize("form,B,K,keep", GREEDY_CASES)
def test_greedy_formulations_fuse(form, B, K, keep):
    args = greedy_inputs(B, K)
    out, run_args, pm = compile_and_run(GREEDY[form], args, keep)
    _check_fused(pm, GREEDY_OP, "fuse_greedy_accept", form)
    want, want_args = expected(GREEDY[form], args, keep)
    assert_same(out, want)
    assert_same(run_args, want_args)  # out_buf appended exactly as the reference does, inputs untouched


@pytest.mark.parametrize("form,B,K,keep", PREPARE_CASES)
def test_prepare_next_formulations_fuse(form, B, K, keep):
    args = prepare_inputs(B, K)
    out, run_args, pm = compile_and_run(PREPARE[form], args, keep)
    _check_fused(pm, PREPARE_OP, "fuse_prepare_next", form)
    want, want_args = expected(PREPARE[form], args, keep)
    assert_same(out, want)
    assert_same(run_args, want_args)


def _step_then_snapshot(*args):
    out = greedy_accept_prepare_ref(*args)
    snap = args[-1].clone()  # the buffer as this step left it
    args[-1][:, -1] = 7  # then written again
    return (snap, *out)


def _two_steps_with_a_snapshot(d, t, active, *state):
    first = greedy_accept_prepare_ref(d, t, active, *state)
    snap = state[-1].clone()
    second = greedy_accept_prepare_ref(d, t, active & ~first[6], *first[3:6], *state[3:])
    return (snap, *first, *second)


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("fn", [_step_then_snapshot, _two_steps_with_a_snapshot])
def test_a_copy_of_the_appended_buffer_keeps_its_contents(fn, broken, monkeypatch):
    """A copy of ``out_buf`` taken after a step and before a later write keeps the step's contents. A clone is a
    no-op to the functional graph, so the copy is the step's buffer itself: a fused op writing it in place would
    let the later write (or the copy back into the caller's buffer) reach the copy. Such a step is left unfused;
    one whose buffer is not returned still fuses. Control: fused anyway, the copy shows the later write."""
    import spec_graph.passes.fusion as fusion

    if broken:
        monkeypatch.setattr(fusion, "_returned_and_used", lambda node: False)
    B, L = 2, 8  # both rows keep room and budget for a second step
    args = (torch.tensor([[5, 6], [5, 7]]), torch.tensor([[5, 6, 9], [5, 1, 2]]), torch.ones(B, dtype=torch.bool),
            torch.zeros(B, 2, dtype=torch.long), torch.full((B,), 4), torch.zeros(B, dtype=torch.long),
            torch.full((B,), L), torch.tensor([-1]), torch.zeros(B, L, dtype=torch.long))
    out, run_args, pm = compile_and_run(fn, args)
    want, want_args = expected(fn, args)
    right = all(torch.equal(g_, w) for g_, w in zip(out, want)) and torch.equal(run_args[-1], want_args[-1])
    assert right != broken, (out[0], want[0])
    if fn is _two_steps_with_a_snapshot and not broken:
        assert pm.last_counts["fuse_greedy_accept"] == 1, pm.last_counts  # the second step: nothing copies its buffer


def test_inputs_exercise_every_branch():
    """The test data hits accept-all, early rejection, inactive rows, stop tokens, budget and buffer end."""
    args = greedy_inputs(5, 4)
    sampled, n_acc, _, _, _, n_out, done = greedy_accept_prepare_ref(*_clone(args))
    assert n_acc.max() == 4 and n_acc.min() < 4
    assert done.any() and (sampled == 3).any()


def test_pass_off_leaves_graph_unfused():
    args = greedy_inputs(3, 4)
    out, run_args, pm = compile_and_run(greedy_accept_prepare_ref, args, enabled={"fuse_greedy_accept": False})
    assert pm.last_counts == {"fuse_prepare_next": 0}
    assert pm.fused_ops == []
    assert torch.ops.aten.cumprod.default in pm.targets and torch.ops.aten.gather.default in pm.targets
    want, want_args = expected(greedy_accept_prepare_ref, args)
    assert_same(out, want)
    assert_same(run_args, want_args)


def test_near_miss_is_not_fused():
    """Same structure, different literal (PLACEHOLDER -2 instead of -1): ints are wildcards in the
    search pattern, the per-shape strict check must refuse it."""

    def wrong(d, t, active, *state):
        K = d.shape[1]
        n = (d == t[:, :K]).long().cumprod(1).sum(1)
        j = torch.arange(K + 1, device=d.device)[None, :]
        valid = torch.where(active, n + 1, torch.zeros_like(n))
        sampled = torch.where(j < valid[:, None], t, -2)
        return (sampled, *prep_append_ref(sampled, valid, active, *state))

    args = greedy_inputs(2, 3)
    out, run_args, pm = compile_and_run(wrong, args)
    assert pm.last_counts["fuse_greedy_accept"] == 0 and pm.fused_ops == []
    want, _ = expected(wrong, args)
    assert_same(out, want)


def _branches(args, want) -> set:
    """Which branches of the contract the greedy inputs `args` reach, read off the op's results `want`."""
    d, t, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf = args
    sampled, n_acc, _, _, _, new_n_out, done = want
    K, L = d.shape[1], out_buf.shape[1]
    e = new_n_out - n_out  # tokens appended
    valid = torch.where(active, n_acc + 1, 0)
    last = sampled.gather(1, (e - 1).clamp(min=0)[:, None])[:, 0]
    stopped = active & (e > 0) & torch.isin(last, stop_ids[stop_ids != PLACEHOLDER])
    rows = {"inactive": ~active, "all_accepted": active & (n_acc == K), "some_rejected": active & (n_acc < K),
            "stop": stopped & done, "budget": active & (e < valid) & ~stopped & done,
            "buffer_end": active & (n_out + e > L), "continues": active & ~done}
    return {name for name, r in rows.items() if r.any()}


@pytest.mark.parametrize("form", OWN_GREEDY)
def test_own_formulations_compute_the_op(form):
    """(a) The independently written formulations compute exactly what the op computes (outputs
    and the appended buffer) on inputs that reach every branch of the contract."""
    fn, reached = OWN_GREEDY[form], set()
    for seed in range(12):
        B, K = 2 + seed % 5, 1 + seed % 6
        args = greedy_inputs(B, K, seed=seed)
        want, want_args = expected(greedy_accept_prepare, args)
        got, got_args = expected(fn, args)
        assert_same(got, want)
        assert_same(got_args, want_args)
        reached |= _branches(args, want)
    for seed in range(6):
        args = prepare_inputs(2 + seed % 4, 1 + seed, seed=seed)
        want, want_args = expected(prepare_next, args)
        got, got_args = expected(prep_own, args)
        assert_same(got, want)
        assert_same(got_args, want_args)
    assert reached == {"inactive", "all_accepted", "some_rejected", "stop", "budget", "buffer_end", "continues"}


@pytest.mark.parametrize("form", OWN_GREEDY)
def test_own_formulations_are_left_alone(form):
    """(b) What the pass does with them: nothing. Matched are exactly the forms that trace to the
    aten graph of one of the pass's patterns: a count from COUNT_FORMULATIONS (or the kernel
    file's cumprod) followed by the package's own prep/append (``prep_append_ref``), as step.py
    writes it with fused=False and as a traced call of the op is on CPU. A pattern is that traced
    graph, matched node for node (ints, dtypes wildcards first, then every literal re-checked):
    an equivalent computation written another way -- here the count as a loop, the stops via
    isin, the tail gathered from the committed stream, the append as index_put per column --
    traces to other aten ops, so it matches no pattern. Half-known forms (a known count with an
    own append, an own count with the reference append) match none either: one pattern spans the
    whole computation, from the draft/target tokens to the appended buffer (its anchor). Matching
    every equivalent way of writing each piece would take a pattern per combination; the pass
    recognises what the package itself emits plus the common counts, and leaves the rest alone.
    Not matched means not fused, never fused wrongly: no spec_graph op in the graph, which
    computes what eager does."""
    args = greedy_inputs(4, 3)
    out, run_args, pm = compile_and_run(OWN_GREEDY[form], args)
    assert pm.last_counts == {"fuse_greedy_accept": 0, "fuse_prepare_next": 0}, pm.last_fired
    assert pm.fused_ops == []
    assert GREEDY_OP not in pm.targets and PREPARE_OP not in pm.targets
    want, want_args = expected(greedy_accept_prepare, args)
    assert_same(out, want)
    assert_same(run_args, want_args)


def test_names_and_options():
    assert PassManager.names() == ["fuse_greedy_accept", "fuse_prepare_next"]
    with pytest.raises(ValueError, match="unknown pass"):
        PassManager(enabled={"no_such_pass": True})
    with pytest.raises(ValueError, match="True or False"):  # "false" must not read as on
        PassManager(enabled={"fuse_greedy_accept": "false"})
    assert list(PassManager(enabled={"fuse_greedy_accept": False}).passes) == ["fuse_prepare_next"]
    from spec_graph.backend import BackendOptions

    for bad, match in (({"passes": {"fuse_greedy_acept": False}}, "unknown pass"), ({"passes": None}, "dict"),
                       ({"passes": {"fuse_prepare_next": 0}}, "True or False"),
                       ({"capture": "no"}, "options\\['capture'\\] must be True or False"),
                       ({"opaque_kernels": 1}, "options\\['opaque_kernels'\\] must be True or False"),
                       ({"inductor": [("max_autotune", True)]}, "options\\['inductor'\\] must be a dict"),
                       ({"device": "tpu"}, "unsupported device 'tpu': use cuda, npu or cpu"),
                       ({"device": 3}, "device must be a string")):
        with pytest.raises(ValueError, match=match):
            BackendOptions.parse(bad)
    ok = BackendOptions.parse({"capture": False, "device": "cpu", "opaque_kernels": True, "inductor": {}})
    assert (ok.capture, ok.device, ok.opaque_kernels) == (False, "cpu", True)


def test_uuid_stable_and_follows_enabled_set():
    a, b = PassManager(), PassManager(enabled={"fuse_greedy_accept": True})
    assert isinstance(a.uuid(), str) and a.uuid() and a.uuid() == b.uuid()
    off = PassManager(enabled={"fuse_greedy_accept": False})
    off2 = PassManager(enabled={"fuse_prepare_next": False})
    none = PassManager(enabled={n: False for n in PassManager.names()})
    assert len({a.uuid(), off.uuid(), off2.uuid(), none.uuid()}) == 4
    assert off.uuid() == PassManager(enabled={"fuse_greedy_accept": False}).uuid()
    # a pass's uuid is a hash of its sources: the same in another process
    code = "from spec_graph.passes.manager import PassManager; print(PassManager().uuid())"
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert other.stdout.strip() == a.uuid()


def test_uuid_follows_the_kernels_launch_settings(monkeypatch):
    """Inductor's caches key a custom op's Triton kernels by their source alone, while the op picks tiles and
    splits in Python at trace time: the uuid changes with each launch setting (in the module or set at run
    time), and returns when the setting does. The control: without the kernels' key the uuid misses the
    change, and a compile would be served the launches of the one before."""
    from spec_graph.kernels import attention, linear_launch
    from spec_graph.passes import manager

    base = PassManager().uuid()
    changes = ((linear_launch, "ONE_STEP_ROWS", 1), (linear_launch, "SPLIT_TILES", {}),
               (linear_launch, "LAUNCH", {"BLOCK_N": 4}), (attention, "MIN_SPLIT_KEYS", 7))
    for module, name, value in changes:
        with monkeypatch.context() as m:
            m.setattr(module, name, value)
            assert PassManager().uuid() != base, name
        assert PassManager().uuid() == base, name
        with monkeypatch.context() as m:
            m.setattr(manager, "launch_key", lambda: "")
            blind = PassManager().uuid()
            m.setattr(module, name, value)
            assert PassManager().uuid() == blind, name  # the control: blind to the change


@pytest.mark.parametrize("opaque", [True, False])
def test_opaque_kernels_keep_the_ops_whole(opaque):
    """opaque_kernels: the project's Triton ops stay one call each in the compiled code (AOT autograd does not
    trace into their bodies); else they are decomposed. Either way the result and the caches the op writes in place
    are the eager ones."""
    from torch._inductor.utils import run_and_get_code

    from spec_graph.backend import backend_compile
    from spec_graph.kernels.counters import new_sync
    from spec_graph.kernels.decode_linear import decode_linear, decode_qkv_rope_cache

    g = torch.Generator().manual_seed(0)
    B, T, H, nh, nkv, D, L = 2, 3, 32, 2, 1, 16, 8
    x = torch.randn(B, T, H, generator=g)
    w, wo = torch.randn((nh + 2 * nkv) * D, H, generator=g) / 6, torch.randn(H, nh * D, generator=g) / 6
    nw = torch.rand(H, generator=g) + 0.5
    ang = torch.rand(B, T, D, generator=g) * 6
    sync = new_sync()  # split-K's counters, as the models pass them; the last op takes none

    def f(x, pos, kc, vc):
        q = decode_qkv_rope_cache(x, w, None, nw, 1e-6, ang.cos(), ang.sin(), nh, D, kc, vc, 1, None, pos + 1, sync)
        return decode_linear(q, wo, residual=x)

    pos = torch.tensor([[2, 3, 4], [0, 1, 2]])
    kc0, vc0 = torch.zeros(2, B, nkv, L, D), torch.zeros(2, B, nkv, L, D)
    want = f(x, pos, kc0, vc0)
    kc, vc = torch.zeros_like(kc0), torch.zeros_like(vc0)
    out, codes = run_and_get_code(backend_compile(f, "cpu", opaque_kernels=opaque), x, pos, kc, vc)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close((kc, vc), (kc0, vc0))  # inductor's cos and sin may round apart from eager's
    assert kc.abs().sum() > 0
    code = "\n".join(codes)
    for op in ("decode_qkv_rope_cache", "decode_linear"):
        assert (f"torch.ops.spec_graph.{op}.default(" in code) == opaque, op


def test_pass_manager_pickles():
    import pickle

    pm = PassManager(enabled={"fuse_prepare_next": False})
    pm.passes  # built
    again = pickle.loads(pickle.dumps(pm))
    assert again.uuid() == pm.uuid() and again.enabled == pm.enabled


@pytest.mark.gpu
@pytest.mark.parametrize("fn,inputs,op,name", [
    (greedy_argmax, lambda: greedy_inputs(4, 5), GREEDY_OP, "fuse_greedy_accept"),
    (prep_where_min, lambda: prepare_inputs(3, 4), PREPARE_OP, "fuse_prepare_next"),
], ids=["greedy", "prepare_next"])
def test_fused_graph_on_gpu(fn, inputs, op, name):
    """On a CUDA device: the pass fires the same way and the compiled Triton kernel runs."""
    from spec_graph import platform

    plat = platform.current()
    if plat.name != "cuda":
        pytest.skip("inductor's GPU path is the CUDA one; Ascend goes through torchair")
    args = tuple(a.to(plat.device) for a in inputs())
    out, run_args, pm = compile_and_run(fn, args)
    _check_fused(pm, op, name)
    want, want_args = expected(fn, args)
    assert_same(out, want)
    assert_same(run_args, want_args)


# ------------------------------------------------- Triton path (interpreter)
TRITON_SCRIPT = textwrap.dedent(r"""
    import importlib, json, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from torch._subclasses.fake_tensor import is_fake
    from spec_graph import platform
    ga = importlib.import_module("spec_graph.kernels.greedy_accept")
    pn = importlib.import_module("spec_graph.kernels.prepare_next")
    rng = importlib.import_module("spec_graph.kernels.rng")
    sys.path.insert(0, os.environ["TESTS_DIR"])
    import test_passes as T

    assert platform.use_triton(torch.device("cpu"))
    launches = {}

    class Counting:
        # stands in for a Triton kernel object: counts launches, then runs the interpreter kernel
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel
        def __getitem__(self, grid):
            def launch(*a, **k):
                launches[self.name] = launches.get(self.name, 0) + 1
                return self.kernel[grid](*a, **k)
            return launch

    def no_reference(name, ref):
        # tracing (fake tensors) may use the reference; running on real tensors must not
        def guarded(*a, **k):
            if not any(is_fake(x) for x in a if isinstance(x, torch.Tensor)):
                raise AssertionError(name + " reference ran instead of the Triton kernel")
            return ref(*a, **k)
        return guarded

    probe = torch.zeros(1)
    results = {"uuid": T.PassManager().uuid()}
    for name, fn, inputs, op, mod, kname, refname in (
            ("greedy", T.greedy_where_amin, T.greedy_inputs(4, 3), T.GREEDY_OP, ga,
             "_greedy_accept_prepare_kernel", "greedy_accept_prepare_ref"),
            ("prepare", T.prep_cumsum, T.prepare_inputs(3, 4), T.PREPARE_OP, pn,
             "_prepare_next_kernel", "prepare_next_ref")):
        kernel = getattr(mod, kname)
        assert rng.use_kernel(kernel, probe), "kernel built before TRITON_INTERPRET=1"
        want, want_args = T.expected(fn, inputs)          # unfused, eager
        setattr(mod, kname, Counting(name, kernel))
        setattr(mod, refname, no_reference(refname, getattr(mod, refname)))
        out, run_args, pm = T.compile_and_run(fn, inputs)  # fused op runs inside the compiled graph
        T._check_fused(pm, op, pm.names()[0 if name == "greedy" else 1])
        T.assert_same(out, want)
        T.assert_same(run_args, want_args)
        results[name] = launches.get(name, 0)
    print("RESULT " + json.dumps(results))
""")


def _triton_version() -> tuple:
    try:
        import triton
    except ImportError:
        return (0, 0)
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


@pytest.mark.skipif((0, 0) < _triton_version() < (3, 8),
                    reason="Triton's interpreter before 3.8 cannot run the kernels' grid-stride row loop; "
                           "test_fused_graph_on_gpu runs the compiled kernels there")
def test_fused_graph_runs_triton_kernels_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "TESTS_DIR": str(Path(__file__).parent)}
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    assert res["greedy"] >= 1 and res["prepare"] >= 1, res
    assert res["uuid"] == PassManager().uuid()


# --------------------------------------------------- the step, end to end
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from helpers import make_checkpoint, perturbed_copy

    from spec_graph.models import load_model

    root = tmp_path_factory.mktemp("tiny")
    target = make_checkpoint(root / "target", vocab_size=48, hidden_size=32, layers=1, heads=2, kv_heads=1,
                             intermediate_size=64)
    draft = perturbed_copy(target, root / "draft", noise=0.5)
    return load_model(target), load_model(draft)


def _step_inputs(target, draft, B=2, L=8, max_len=24, K=2):
    torch.manual_seed(0)
    i64 = dict(dtype=torch.long)
    state = {
        "tail": torch.randint(2, 40, (B, 2)), "seq_lens": torch.tensor([5, 3][:B]), "n_out": torch.ones(B, **i64),
        "max_new": torch.full((B,), L, **i64), "active": torch.ones(B, dtype=torch.bool),
        "error": torch.zeros(B, dtype=torch.bool), "seeds": torch.arange(B) + 7, "steps": torch.ones(B, **i64),
        "temperature": torch.full((B,), 0.9), "top_k": torch.zeros(B, **i64), "top_p": torch.ones(B),
    }
    out_buf = torch.full((B, L), PLACEHOLDER, **i64)
    acc_log = torch.zeros(B, L, **i64)
    stop_ids = torch.tensor([1, PLACEHOLDER])
    return (state, out_buf, acc_log, stop_ids, draft.new_kv_cache(B, max_len + K + 2),
            target.new_kv_cache(B, max_len + K + 2))


def _clone_tree(x):
    return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _step_fn(target, draft, K, greedy):
    from spec_graph.step import speculative_step

    def step(state, out_buf, acc_log, stop_ids, draft_kv, target_kv):
        return speculative_step(draft, target, draft_kv, target_kv, state, out_buf, acc_log, stop_ids, K, greedy,
                                fused=False)

    return step


def _run_step(compiled, step, inputs):
    with torch.inference_mode():
        got_args = _clone_tree(inputs)
        got = compiled(*got_args)
        want_args = _clone_tree(inputs)
        want = step(*want_args)
    # the step's own state update agrees with eager (same tokens, same appended buffer)
    for key in ("tail", "seq_lens", "n_out", "active", "steps"):
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(got_args[1], want_args[1])  # out_buf
    assert torch.equal(got_args[2], want_args[2])  # acc_log
    assert (got_args[1] != PLACEHOLDER).any()  # tokens were appended


def test_greedy_step_through_spec_graph_backend_fires_pass(tiny_models, monkeypatch):
    """torch.compile(step, backend=spec_graph_backend): dynamo -> AOT -> inductor with the
    PassManager the backend builds; the greedy acceptance is fused and the compiled step
    matches the eager one."""
    import spec_graph.backend as backend_mod

    target, draft = tiny_models
    managers = []

    class Recording(RecordingPassManager):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            managers.append(self)

    monkeypatch.setattr(backend_mod, "PassManager", Recording)
    step = _step_fn(target, draft, K=2, greedy=True)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend_mod.spec_graph_backend, fullgraph=True, dynamic=False,
                             options={"capture": False, "device": "cpu", "inductor": NO_CACHE})
    _run_step(compiled, step, _step_inputs(target, draft, K=2))
    assert len(managers) == 1
    assert managers[0].last_counts == {"fuse_greedy_accept": 1, "fuse_prepare_next": 0}
    assert managers[0].fused_ops == [GREEDY_OP]


def test_sampling_step_post_grad_graph_fires_pass(tiny_models):
    """The sampling step, through dynamo + AOT with inductor's decompositions and
    joint-graph passes (the graph inductor's post-grad passes get), then the PassManager,
    then the fused graph run eagerly: prepare_next is fused, results match eager.
    (Full inductor codegen of the sampling step costs over a minute of C++ builds here.)"""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    target, draft = tiny_models
    pm = RecordingPassManager()

    def backend(gm, example_inputs):
        def fw(g, ins):
            g = joint_graph_passes(g) or g
            pm(g.graph)
            g.recompile()
            return g.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, decompositions=select_decomp_table(),
                                     keep_inference_input_mutations=True)

    step = _step_fn(target, draft, K=2, greedy=False)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    _run_step(compiled, step, _step_inputs(target, draft, K=2))
    assert pm.last_counts == {"fuse_greedy_accept": 0, "fuse_prepare_next": 1}
    assert pm.fused_ops == [PREPARE_OP]


# ------------------------------------------------------- Ascend wiring
def _fake_torchair(monkeypatch):
    """A torchair stand-in shaped like torchair's own: CompilerConfig with mode and the
    post_grad_custom_pre_pass hook, get_npu_backend(*, compiler_config, custom_decompositions)
    whose backend AOT-traces with torchair's (empty for these ops) decomposition table,
    calls hook(gm, example_inputs, config), and then runs the graph eagerly."""
    calls = {}

    class CompilerConfig:
        def __init__(self):
            self.mode = "max-autotune"
            self.post_grad_custom_pre_pass = None
            self.post_grad_custom_post_pass = None

    def get_npu_default_decompositions():
        return {}

    def get_npu_backend(*, compiler_config=None, custom_decompositions={}):
        calls["config"] = compiler_config
        decompositions = {**get_npu_default_decompositions(), **custom_decompositions}

        def backend(gm, example_inputs):
            from torch._functorch.aot_autograd import aot_module_simplified

            def fw(g, ins):
                for name in ("post_grad_custom_pre_pass", "post_grad_custom_post_pass"):
                    hook = getattr(compiler_config, name)
                    if hook is not None:
                        calls.setdefault("hooks", []).append(name)
                        hook(g, ins, compiler_config)
                calls["targets"] = [n.target for n in g.graph.nodes if n.op == "call_function"]
                g.recompile()
                return g.forward

            return aot_module_simplified(gm, example_inputs, fw_compiler=fw, decompositions=decompositions,
                                         keep_inference_input_mutations=True)

        return backend

    torchair = types.ModuleType("torchair")
    torchair.__path__ = []  # a package, so that torchair._utils imports
    torchair.CompilerConfig = CompilerConfig
    torchair.get_npu_backend = get_npu_backend
    utils = types.ModuleType("torchair._utils")
    utils.get_npu_default_decompositions = get_npu_default_decompositions
    monkeypatch.setitem(sys.modules, "torchair", torchair)
    monkeypatch.setitem(sys.modules, "torchair._utils", utils)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails: no torch_npu here
    monkeypatch.setitem(sys.modules, "npugraph_ex", None)
    return calls


@pytest.mark.parametrize("fn,inputs,op,name", [
    (greedy_where_min, lambda: greedy_inputs(3, 4), GREEDY_OP, "fuse_greedy_accept"),
    (prepare_next_ref, lambda: prepare_inputs(2, 3), PREPARE_OP, "fuse_prepare_next"),
], ids=["greedy", "prepare_next"])
def test_npu_backend_plugs_passes_into_torchair(monkeypatch, fn, inputs, op, name):
    from spec_graph.passes import npu_backend

    calls = _fake_torchair(monkeypatch)
    assert npu_backend.backend_kind() == "torchair"
    pm = RecordingPassManager()
    args = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=lambda gm, ex: npu_backend.compile_npu(gm, ex, pm), fullgraph=True,
                             dynamic=False)
    run_args = _clone(args)
    out = compiled(*run_args)
    assert calls["config"].mode == "reduce-overhead"
    assert calls["hooks"] == ["post_grad_custom_pre_pass"]
    assert pm.decompositions == {}  # retargeted to torchair's trace (no inductor decompositions)
    assert pm.last_counts[name] == 1, pm.last_counts
    assert AF in calls["targets"] and pm.fused_ops == [op]
    assert not REFERENCE_OPS.intersection(calls["targets"])
    want, want_args = expected(fn, args)  # the post-pass graph ran eagerly: same results
    assert_same(out, want)
    assert_same(run_args, want_args)


def test_npu_backend_needs_torchair(monkeypatch):
    from spec_graph.passes import npu_backend

    for mod in ("torchair", "torch_npu", "npugraph_ex"):
        monkeypatch.setitem(sys.modules, mod, None)
    assert npu_backend.backend_kind() is None
    with pytest.raises(RuntimeError, match="torchair"):
        npu_backend.compile_npu(None, [], PassManager())
