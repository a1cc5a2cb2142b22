"""Host-sync check: spec_graph.compile / spec_graph.check / the FX pass / the split warning.

The "models" are tiny torch-only toys (an embedding and a linear head) so every test runs in milliseconds;
only ``test_clean_step_through_inductor`` compiles for real. Expected line numbers come from ``# SYNC: op``
marker comments, read with inspect, so editing this file cannot break them.
"""
from __future__ import annotations

import inspect
import logging
import os
import pickle
import re
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import spec_graph
from spec_graph import backend as sg_backend
from spec_graph.passes import host_reads as fx_reads
from spec_graph.passes import host_sync
from spec_graph.passes import graph_split
from spec_graph.passes.graph_split import reset_split_warnings
from spec_graph.passes.host_sync import Finding, GraphSplitWarning, HostSyncError, SpecGraphWarning, find_host_reads

K = 4
V = 16
HERE = os.path.abspath(__file__)
CPU = {"device": "cpu"}  # the tensors here are CPU ones, also on a machine with a GPU


class ToyLM(nn.Module):
    """tokens [T] -> logits [T, V]."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(V, 8, generator=g))
            self.head.weight.copy_(torch.randn(V, 8, generator=g))
            self.head.bias.zero_()
        self.requires_grad_(False)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


TARGET = ToyLM(0)
DRAFT = ToyLM(0)
with torch.no_grad():  # a draft that agrees with the target on some tokens, not all
    DRAFT.head.weight.add_(0.8 * torch.randn(V, 8, generator=torch.Generator().manual_seed(1)))


def speculative_step(cur_token, input_pos):
    """One greedy speculative step written the way gpt-fast writes it: host reads all over."""
    draft_tokens = []
    tok = cur_token.view(1)
    for _ in range(K):  # draft K tokens, one forward each
        tok = DRAFT(tok).argmax(-1)
        draft_tokens.append(tok)
    draft_tokens = torch.cat(draft_tokens)
    # verify every draft with one target forward
    target_tokens = TARGET(torch.cat([cur_token.view(1), draft_tokens])).argmax(-1)
    accepted = (draft_tokens == target_tokens[:K]).int().cumprod(0)
    n = accepted.sum().item()  # SYNC: item
    rejected_locations = (accepted == 0).nonzero()  # SYNC: nonzero
    if n == K:  # SYNC: branch
        next_tokens = torch.cat([draft_tokens, target_tokens[K:]])
    else:
        next_tokens = torch.cat([draft_tokens[:n], target_tokens[n:n + 1]])
    tokens = next_tokens.tolist()  # SYNC: tolist
    new_pos = (input_pos + next_tokens.shape[0]).cpu()  # SYNC: cpu
    return next_tokens, rejected_locations, tokens, new_pos


def clean_step(cur_token, input_pos):
    """The same step with no host read: counts stay tensors, the output has a static shape [K+1]
    (accepted drafts, the target's token at the first rejected slot, then -1)."""
    draft_tokens = []
    tok = cur_token.view(1)
    for _ in range(K):
        tok = DRAFT(tok).argmax(-1)
        draft_tokens.append(tok)
    draft_tokens = torch.cat(draft_tokens)
    target_tokens = TARGET(torch.cat([cur_token.view(1), draft_tokens])).argmax(-1)
    n = (draft_tokens == target_tokens[:K]).int().cumprod(0).sum()
    slots = torch.arange(K + 1, device=cur_token.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((1,), -1)])
    bonus = target_tokens.gather(0, n.view(1))
    out = torch.where(slots < n, padded, torch.where(slots == n, bonus, torch.full_like(padded, -1)))
    return out, n, input_pos + n + 1


def _count(x):
    return (x > 0).sum().item()  # SYNC: item


def host_reads(x):
    """Host reads that enter the graph when scalar / dynamic-shape capture is on."""
    n = _count(x)
    idx = torch.nonzero(x > 0)  # SYNC: nonzero
    return x * n, idx


def more_copies(x):
    y = x.to("cpu")  # SYNC: to(cpu)
    return y.numpy()  # SYNC: numpy


def one_break(x):
    y = x * 2
    if y.sum() > 0:  # SYNC: branch
        y = y + 1
    return y - 1


def no_break(x):
    return torch.where(x.sum() > 0, x * 2 + 1, x * 2) - 1


def expected(fn) -> set[tuple[str, int]]:
    lines, start = inspect.getsourcelines(fn)
    out = set()
    for i, text in enumerate(lines):
        m = re.search(r"# SYNC: (\S+)", text)
        if m:
            out.add((m.group(1), start + i))
    return out


def located(findings) -> set[tuple[str, int]]:
    for f in findings:
        assert os.path.abspath(f.file) == HERE, f  # the user's file, never torch internals
    return {(f.op, f.line) for f in findings}


def step_args(token: int = 3):
    return torch.tensor(token), torch.tensor([10])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    reset_split_warnings()
    yield
    torch._dynamo.reset()


@pytest.fixture
def backend_calls(monkeypatch):
    """Count the graphs that reach the spec_graph backend (and what its FX pass found in them)."""
    calls = []
    real = sg_backend.find_host_reads

    def counting(gm):
        found = real(gm)
        calls.append(found)
        return found

    monkeypatch.setattr(sg_backend, "find_host_reads", counting)
    return calls


@pytest.fixture
def eager_compile_stage(monkeypatch):
    """Replace inductor by running the Dynamo graph as is (keeps these tests at milliseconds)."""
    import torch._inductor.compile_fx as cfx

    calls = []

    def compile_fx(gm, example_inputs, **kwargs):
        calls.append(gm)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    return calls


# ------------------------------------------------------------------------------------------------------------
# spec_graph.compile / spec_graph.check on the gpt-fast-style step
# ------------------------------------------------------------------------------------------------------------
def test_compile_raises_listing_every_sync_point(backend_calls, eager_compile_stage):
    want = expected(speculative_step)
    assert {op for op, _ in want} == {"item", "nonzero", "branch", "tolist", "cpu"}
    step = spec_graph.compile(speculative_step, options=CPU)
    with pytest.raises(HostSyncError) as info:
        step(*step_args())
    err = info.value
    assert isinstance(err, ValueError)
    assert located(err.findings) == want
    msg = str(err)
    for f in err.findings:
        assert f"{f.file}:{f.line}: {f.op} (" in msg
    assert "torch.where" in msg and "mask" in msg and "static" in msg
    assert not backend_calls and not eager_compile_stage  # nothing of the broken step was compiled


def test_check_reports_the_same_list_without_raising():
    report = spec_graph.check(speculative_step, *step_args())
    assert not report.ok
    assert located(report.findings) == expected(speculative_step)
    assert [f.line for f in report.findings] == sorted(f.line for f in report.findings)
    text = str(report)
    for f in report.findings:
        assert str(f) in text
    # the same findings as the error raised by spec_graph.compile, and the same through a compiled wrapper
    with pytest.raises(HostSyncError) as info:
        spec_graph.compile(speculative_step, options=CPU)(*step_args())
    assert info.value.findings == report.findings
    assert spec_graph.check(spec_graph.compile(speculative_step), *step_args()).findings == report.findings


def test_clean_step_reaches_backend_once_and_matches_eager(backend_calls, eager_compile_stage):
    step = spec_graph.compile(clean_step, options=CPU)
    for token in (3, 7, 11):
        args = step_args(token)
        got, want = step(*args), clean_step(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    assert len(backend_calls) == 1 and backend_calls[0] == []  # one graph, no host read in it
    assert len(eager_compile_stage) == 1


def test_clean_step_agrees_with_the_host_sync_version():
    for token in range(V):
        args = step_args(token)
        out, n, pos = clean_step(*args)
        next_tokens, _, tokens, new_pos = speculative_step(*args)
        assert int(n) + 1 == len(tokens)
        assert out[: len(tokens)].tolist() == tokens and (out[len(tokens):] == -1).all()
        assert int(pos) == int(new_pos)


def test_check_leaves_no_compiled_state(backend_calls, eager_compile_stage):
    assert spec_graph.check(clean_step, *step_args()).ok
    assert spec_graph.check(speculative_step, *step_args()).findings
    out = spec_graph.compile(clean_step, options=CPU)(*step_args())
    torch.testing.assert_close(out[0], clean_step(*step_args())[0])
    assert len(backend_calls) == 1


def test_clean_step_through_inductor(backend_calls):
    """The real path: the backend's passes and inductor (CPU) compile the clean step."""
    step = spec_graph.compile(clean_step, options=CPU)
    for token in (3, 5):
        args = step_args(token)
        for g, w in zip(step(*args), clean_step(*args)):
            torch.testing.assert_close(g, w)
    assert len(backend_calls) == 1 and backend_calls[0] == []


def test_check_names_copies_and_numpy():
    report = spec_graph.check(more_copies, torch.ones(3))
    assert located(report.findings) == expected(more_copies)


def tolist_first(x):
    return x.tolist()  # SYNC: tolist


def log_inline(x):
    y = x * 2
    logging.getLogger("spec_graph.tests").debug("y %s", y)  # SYNC: logging
    return y


def histc_unbounded(x):
    bounded = torch.histc(x, bins=4, min=0.0, max=1.0)
    return bounded + torch.histc(x, bins=4)  # SYNC: histc


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("fn", [tolist_first, log_inline, histc_unbounded])
def test_breaks_dynamo_leaves_out_of_explain_are_found_at_the_users_line(fn, broken, monkeypatch):
    """A sync at a function's first op (Dynamo skips the frame: explain has no graph and no reason), a logging
    call written inline (its break lies inside the logging module), and histc with no range (which reads the
    input's min and max on the host) are each found at the user's line. Control: without Dynamo's break log,
    with Python's library taken for user code, and with histc's range unread, each is missed or misplaced."""
    if broken:
        monkeypatch.setattr(host_sync, "_logged_breaks", lambda messages: [])
        monkeypatch.setattr(fx_reads, "_STDLIB_DIR", "/nonexistent/")
        monkeypatch.setattr(fx_reads, "_histc_range", lambda node: None)
    report = spec_graph.check(fn, torch.rand(8))
    got = {(f.op, f.line) for f in report.findings if os.path.abspath(f.file) == HERE}
    assert (got == expected(fn) and len(report.findings) == len(got)) != broken, report.findings


def sample_with_generator(p, g):
    y = p * 2
    return torch.multinomial(y, 1, generator=g)  # SYNC: graph


@pytest.mark.parametrize("broken", [False, True])
def test_a_generator_argument_is_named_with_its_fix(broken, monkeypatch):
    """Dynamo cannot take a torch.Generator into a graph: the break is reported once, at the user's line, saying
    so and what to do instead. Control: classified by Dynamo's reason alone, it reads as a failed proxy."""
    if broken:
        classify = host_sync._classify_break
        monkeypatch.setattr(host_sync, "_classify_break", lambda reason, segment: classify(reason, ""))
    report = spec_graph.check(sample_with_generator, torch.rand(2, 5), torch.Generator().manual_seed(0))
    assert {(op.split()[0], line) for op, line in located(report.findings)} == expected(sample_with_generator)
    assert ("torch.Generator" in report.findings[0].detail) != broken, report.findings


def where_indices(x):
    rows = torch.where(x > 0.5)  # SYNC: where
    return rows[0] * 2


@pytest.mark.parametrize("broken", [False, True])
def test_one_argument_where_is_a_data_dependent_shape(broken, monkeypatch):
    """``torch.where(cond)`` returns a tuple of index tensors whose length the data sets: named where, as a shape
    the host must read. Control: a tuple taken for a Python value, it reads as one."""
    if broken:
        monkeypatch.setattr(fx_reads, "_holds_tensors", lambda out: isinstance(out, torch.Tensor))
    report = spec_graph.check(where_indices, torch.rand(8))
    assert located(report.findings) == expected(where_indices)
    assert ("output shape depends on tensor values" in report.findings[0].detail) != broken, report.findings


@pytest.mark.parametrize("broken", [False, True])
def test_a_device_synchronize_in_the_graph_is_found(broken, monkeypatch):
    """``torch.cuda.synchronize()`` enters Dynamo's graph as an op (it would stall the stream and break a capture).
    Control: with the host-wait ops unknown, the graph passes."""
    if broken:
        monkeypatch.setattr(fx_reads, "_HOST_WAIT_OPS", set())
    try:
        synchronize = torch.ops.streams.synchronize_device
    except (AttributeError, RuntimeError):
        pytest.skip("this torch records no synchronize op in graphs")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(synchronize, ("cuda", 0))
    graph.output(graph.call_function(torch.mul, (x, 2)))
    found = find_host_reads(graph)
    assert ([f.op for f in found] == ["synchronize"]) != broken, found


def view_as_itself(x):
    return (x * 2).view_as(x) + x.view_as(x)


@pytest.mark.parametrize("broken", [False, True])
def test_a_view_as_in_user_code_is_not_a_numpy_read(broken, monkeypatch):
    """Dynamo records ``t.numpy()`` as ``t.view_as(t)``; the user's own ``x.view_as(x)`` is no host read, and
    ``numpy()`` still is. Control: every ``t.view_as(t)`` taken for numpy refuses the plain function."""
    if broken:
        monkeypatch.setattr(fx_reads, "_written_as_view_as", lambda node: False)
    report = spec_graph.check(view_as_itself, torch.ones(3))
    assert (report.findings == []) != broken, report.findings
    assert located(spec_graph.check(more_copies, torch.ones(3)).findings) == expected(more_copies)


def test_compile_options_and_decorator(eager_compile_stage):
    @spec_graph.compile(options={"capture": False, **CPU})
    def f(x):
        return x * 2

    torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(TypeError):
        spec_graph.compile(f, fullgraph=False)
    with pytest.raises(ValueError, match="unknown spec_graph backend option"):  # at the decoration, unwrapped
        spec_graph.compile(no_break, options={"nope": 1})
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        spec_graph.compile(no_break, mode="fast")
    for bad in ("abc", [("capture", True)]):  # not a dict: named, not a dict() failure or taken as pairs
        with pytest.raises(ValueError, match="options must be a dict of spec_graph backend options"):
            spec_graph.compile(no_break, options=bad)
    with pytest.raises(ValueError, match="disagree: give the mode once"):
        spec_graph.compile(no_break, mode="default", options={"mode": "max-autotune", **CPU})
    # torch.compile takes mode or options: spec_graph.compile takes both (the mode rides in the options)
    g = spec_graph.compile(no_break, mode="max-autotune-no-cudagraphs", options={"capture": False, **CPU})
    torch.testing.assert_close(g(torch.ones(2)), no_break(torch.ones(2)))


def test_unknown_inductor_option_is_refused_by_name(eager_compile_stage):
    """An inductor key this torch lacks is named (with the nearest known key), as an unknown top-level option is,
    not left to inductor's AttributeError from inside the compile; the control: known keys, dotted ones too, pass."""
    def double(x):
        return x * 2

    sg_backend.register()
    with pytest.raises(Exception, match=r"ValueError: unknown inductor option\(s\) in options\['inductor'\]: "
                                        r"'nonexistent_opt'; torch .* has no such key"):
        torch.compile(double, backend="spec_graph", options={"inductor": {"nonexistent_opt": 1}})(torch.ones(2))
    with pytest.raises(ValueError, match=r"'max_autotun' \(did you mean 'max_autotune'\?\)"):
        sg_backend.BackendOptions.parse({"inductor": {"max_autotun": True}})
    for bad, kind in (({"max_autotune": "false"}, "bool"), ({"max_autotune": 1}, "bool"),
                      ({"realize_reads_threshold": 2.5}, "int")):  # inductor's own config refuses these too
        with pytest.raises(ValueError, match=rf"must be of type {kind} \(as torch._inductor.config"):
            sg_backend.BackendOptions.parse({"inductor": bad})
    from torch._inductor import config as inductor_config
    if hasattr(inductor_config, "get_type"):  # declared unions with None, and Literals
        for bad, want in (({"compile_threads": "4"}, "of type int"),
                          ({"incremental_autotune": "false"}, "of type bool"),
                          ({"triton.multi_kernel": "1"}, "one of 0 or 1")):
            with pytest.raises(ValueError, match=rf"must be {want}"):
                sg_backend.BackendOptions.parse({"inductor": bad})
    known = {"max_autotune": False, "triton.cudagraphs": False, "compile_threads": 1, "realize_reads_threshold": 4,
             "triton.descriptive_names": False}
    assert sg_backend.BackendOptions.parse({"inductor": known}).inductor == known
    torch.testing.assert_close(spec_graph.compile(double, options={"capture": False, "inductor": known, **CPU})(
        torch.ones(2)), torch.full((2,), 2.0))


# ------------------------------------------------------------------------------------------------------------
# The FX pass
# ------------------------------------------------------------------------------------------------------------
CAPTURE = dict(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


def test_fx_pass_flags_item_and_nonzero_that_enter_the_graph():
    seen = []

    def record(gm, example_inputs):
        seen.append(find_host_reads(gm))
        return gm.forward

    with torch._dynamo.config.patch(**CAPTURE):
        torch.compile(host_reads, backend=record, fullgraph=True)(torch.tensor([1.0, -2.0, 3.0]))
    assert len(seen) == 1
    assert located(seen[0]) == expected(_count) | expected(host_reads)


def test_fx_pass_on_aten_graph():
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def fw(gm, example_inputs):
        seen.append(find_host_reads(gm))
        assert any("_local_scalar_dense" in str(n.target) for n in gm.graph.nodes)  # it is an aten graph
        return gm.forward

    with torch._dynamo.config.patch(**CAPTURE):
        torch.compile(host_reads, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(torch.tensor([1.0, -2.0]))
    assert located(seen[0]) == expected(_count) | expected(host_reads)

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten._to_copy.default, (x,), {"device": torch.device("cpu")})
    y.meta["stack_trace"] = '  File "/src/step.py", line 7, in step\n    y = x.to(device="cpu")\n'
    z = g.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.float16})  # no device: fine
    g.output((y, z))
    assert find_host_reads(g) == [Finding("_to_copy(device=cpu)", "/src/step.py", 7, "device->host copy")]


def test_backend_rejects_host_reads_that_survive(eager_compile_stage):
    with torch._dynamo.config.patch(**CAPTURE):
        with pytest.raises(HostSyncError) as info:
            spec_graph.compile(host_reads, options=CPU)(torch.tensor([1.0, -2.0, 3.0]))
    assert info.value.__cause__ is None  # unwrapped from Dynamo's BackendCompilerFailed
    assert located(info.value.findings) == expected(_count) | expected(host_reads)
    assert not eager_compile_stage


def test_clean_graph_has_no_findings():
    seen = []

    def record(gm, example_inputs):
        seen.append(find_host_reads(gm))
        return gm.forward

    with torch._dynamo.config.patch(**CAPTURE):
        torch.compile(clean_step, backend=record, fullgraph=True)(*step_args())
    assert seen == [[]]


def test_error_message_and_pickling():
    f = Finding("item", "/src/a.py", 12, "Tensor.item() reads a device value on the host")
    assert str(f) == "/src/a.py:12: item (Tensor.item() reads a device value on the host)"
    err = HostSyncError([f])
    assert str(f) in str(err) and "torch.where" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, HostSyncError) and again.findings == [f]


# ------------------------------------------------------------------------------------------------------------
# The split warning of a plain torch.compile(backend="spec_graph")
# ------------------------------------------------------------------------------------------------------------
def _split_warnings(fn, *inputs):
    sg_backend.register()
    compiled = torch.compile(fn, backend="spec_graph", options=CPU)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [compiled(x) for x in inputs]
    for x, out in zip(inputs, outs):
        torch.testing.assert_close(out, fn(x))
    return [w for w in caught if issubclass(w.category, SpecGraphWarning)]


def test_split_function_warns_once(backend_calls, eager_compile_stage):
    x = torch.ones(3)
    got = _split_warnings(one_break, x, -x, x * 3)
    assert len(backend_calls) >= 2  # the function was split: the backend saw its pieces
    assert len(got) == 1
    w = got[0]
    assert w.category is GraphSplitWarning
    (_, line), = expected(one_break)
    assert "one_break" in str(w.message) and f"{HERE}:{line}" in str(w.message)
    assert os.path.abspath(w.filename) == HERE and w.lineno == line
    assert "spec_graph.check" in str(w.message)


def split_at_a_print(x):
    print("x", x)
    return x + 1


def split_at_a_log(x):
    _LOG.warning("x=%s", x)
    return x + 1


def split_at_tolist(x):
    n = len(x.tolist())
    return x + n


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("fn, op", [(split_at_a_print, "print"), (split_at_a_log, "logging"),
                                    (split_at_tolist, "tolist")])
def test_a_split_before_any_traced_op_names_its_cause(fn, op, broken, eager_compile_stage, monkeypatch):
    """A break before the function's first traced op leaves Dynamo's reason empty (only the resume function's
    piece reaches the backend): the warning names the cause from the source line. Control: without that read it
    gives the place alone."""
    if broken:
        monkeypatch.setattr(graph_split, "_source_reason", lambda file, line: None)
    torch._dynamo.reset()
    reset_split_warnings()
    got = _split_warnings(fn, torch.ones(3))
    assert len(got) == 1
    assert (f"({op}: " in str(got[0].message)) != broken, str(got[0].message)


class _AddsThenPrints(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        print("adds")
        return y * 2


class _SubtractsThenPrints(torch.nn.Module):
    def forward(self, x):
        y = x - 1
        print("subtracts")
        return y * 3


@pytest.mark.parametrize("broken", [False, True])
def test_two_functions_of_one_name_in_a_file_each_warn(broken, eager_compile_stage, monkeypatch):
    """Two modules of one file whose `forward`s are both split each get their warning, naming their own break;
    the pieces of one of them still warn once. Broken: functions told apart by file and name alone (the second
    module's split went unsaid)."""
    if broken:
        monkeypatch.setattr(graph_split, "_def_line", lambda file, name, line: None)
    torch._dynamo.reset()
    reset_split_warnings()
    got = _split_warnings(_AddsThenPrints(), torch.ones(3), torch.zeros(3)) + \
        _split_warnings(_SubtractsThenPrints(), torch.ones(3))
    lines = {inspect.getsourcelines(m.forward)[1] + 2 for m in (_AddsThenPrints, _SubtractsThenPrints)}
    assert ({w.lineno for w in got} == lines and len(got) == 2) != broken, [str(w.message) for w in got]


def test_compile_raises_after_an_earlier_split_compile(backend_calls, eager_compile_stage):
    """torch.compile of the function (which splits it, with the warning) first, then spec_graph.compile: Dynamo's
    cache of the split graph, keyed by code and not by fullgraph, must not serve the fullgraph call."""
    x = torch.ones(3)
    assert len(_split_warnings(one_break, x)) == 1
    with pytest.raises(HostSyncError) as info:
        spec_graph.compile(one_break, options=CPU)(x)
    assert located(info.value.findings) == expected(one_break)


def test_compile_keeps_other_backends_compiles(backend_calls, eager_compile_stage):
    """A compile of the function by another backend cannot serve spec_graph.compile's call, so it is kept (a
    reset would recompile it); the control: an earlier spec_graph-backend compile of it is dropped."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def names():
        return sorted(getattr(e.backend, "compiler_name", "?") for e in _debug_get_cache_entry_list(no_break.__code__))
    x = torch.ones(3)
    torch.compile(no_break, backend="eager")(x)
    spec_graph.compile(no_break, options=CPU)(x)
    assert names() == ["eager", "spec_graph"]
    torch._dynamo.reset()
    torch.compile(no_break, backend="spec_graph", options=CPU)(x)
    compiled = len(backend_calls)
    spec_graph.compile(no_break, options=CPU)(x)
    assert names() == ["spec_graph"] and len(backend_calls) == compiled + 1  # compiled again, not served


def test_clean_function_does_not_warn(backend_calls, eager_compile_stage):
    x = torch.ones(3)
    assert _split_warnings(no_break, x, -x) == []
    assert len(backend_calls) == 1
    assert graph_split.warn_if_split(eager_compile_stage[0]) is False


def test_a_to_its_own_device_is_no_copy(backend_calls, eager_compile_stage):
    """``x.to(y.device)`` with both on one device (Hugging Face's RoPE writes it) copies nothing: not a finding, and
    the backend compiles it. Control: a device written out, ``.to("cpu")``, is still a copy to the host."""
    own = lambda a: a.to(a.device) * 2 + 1  # noqa: E731
    x = torch.randn(3)
    assert spec_graph.check(own, x).findings == []
    torch.testing.assert_close(torch.compile(own, backend="spec_graph")(x), own(x))
    assert backend_calls == [[]]
    assert [f.op for f in spec_graph.check(lambda a: a.to("cpu") * 2, x).findings] == ["to(cpu)"]


def test_a_hugging_face_llama_compiles_through_the_backend(tmp_path, backend_calls, eager_compile_stage):
    """A stock transformers Llama (its RoPE moves inv_freq with ``.to(x.device)``) compiles with
    backend="spec_graph" and gives eager's logits."""
    import transformers
    from helpers import make_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(make_checkpoint(tmp_path / "m", vocab_size=96)).eval()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = torch.compile(model, backend="spec_graph")(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want)
    assert backend_calls and all(found == [] for found in backend_calls)


_LOG = logging.getLogger("spec_graph.test")


def step_that_prints(x):
    y = x * 2
    print("step", y.sum())
    return y + 1


def step_that_logs(x):
    y = x * 2
    _LOG.info("step")
    return y + 1


def step_that_logs_outside_compiles(x):
    y = x * 2
    if not torch.compiler.is_compiling():
        _LOG.info("step")
    return y + 1


@pytest.mark.parametrize("fn, op, hint", [(step_that_prints, "print", "reorderable_logging_functions"),
                                          (step_that_logs, "logging", "torch.compiler.is_compiling()")])
def test_a_print_or_log_in_the_step_is_named(eager_compile_stage, fn, op, hint):
    """A print or logging call splits the graph: the error names it and says what keeps the step whole (Dynamo's
    own reason was "Failed to trace builtin operator", or one about Logger methods). The control: with the fix
    the hint gives, the step compiles whole and returns eager's result."""
    src, first = inspect.getsourcelines(fn)
    want = (op, HERE, first + next(i for i, x in enumerate(src) if "print(" in x or "_LOG." in x))
    with pytest.raises(HostSyncError) as e:
        spec_graph.compile(fn, options={"capture": False, **CPU})(torch.ones(3))
    assert [(f.op, f.file, f.line) for f in e.value.findings] == [want], e.value.findings
    assert "after the call" in e.value.findings[0].detail and hint in e.value.findings[0].detail
    fixed = fn if op == "print" else step_that_logs_outside_compiles
    with torch._dynamo.config.patch(reorderable_logging_functions={print}):
        torch._dynamo.reset()
        out = spec_graph.compile(fixed, options={"capture": False, **CPU})(torch.ones(3))
    torch.testing.assert_close(out, fn(torch.ones(3)))


def step_that_logs_a_tensor(x):
    y = x * 2
    _LOG.info("step %s", y)
    return y + 1


@pytest.mark.parametrize("broken", [False, True])
def test_a_log_of_a_tensor_is_one_finding_at_its_line(broken, monkeypatch):
    """Dynamo traces into Logger.info when a tensor is logged and resumes inside it: that resume function's line
    is logging's, not this file's. One finding, at the call. Control: a resume function of another file's function
    read as the step's file reports a second finding at a line this file does not have there."""
    if broken:
        monkeypatch.setattr(host_sync, "_defines", lambda file, name, line: True)
    src, first = inspect.getsourcelines(step_that_logs_a_tensor)
    want = [("logging", HERE, first + next(i for i, x in enumerate(src) if "_LOG." in x))]
    torch._dynamo.reset()
    got = [(f.op, f.file, f.line) for f in _check_findings(step_that_logs_a_tensor)]
    assert (got == want) != broken, got


def _check_findings(fn):
    return spec_graph.check(fn, torch.ones(3)).findings


def scaled(x, t):
    return x * t


@pytest.mark.parametrize("broken", [False, True])
def test_a_python_float_argument_is_not_a_host_read(broken, monkeypatch):
    """Dynamo passes a float it left unspecialized (after a second value) as a CPU scalar tensor and reads it back
    with item() in the graph: no device sync, so no finding. Control: counted as a read, the second value fails."""
    if broken:
        monkeypatch.setattr(fx_reads, "_reads_a_wrapped_number", lambda node: False)
    sg_backend.register()
    torch._dynamo.reset()
    f = torch.compile(scaled, backend="spec_graph", options={"capture": False, **CPU})
    x = torch.ones(3)
    try:
        ok = all(torch.equal(f(x, t), x * t) for t in (0.5, 1.5, 2.5))
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's HostSyncError
        ok = not isinstance(getattr(e, "inner_exception", e), HostSyncError)
    assert ok != broken


def test_the_split_warnings_stay_importable_from_host_sync():
    """warn_if_split and reset_split_warnings moved to graph_split; host_sync still hands them out."""
    from spec_graph.passes.host_sync import reset_split_warnings as moved

    assert moved is reset_split_warnings and host_sync.warn_if_split is graph_split.warn_if_split
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        host_sync.nothing  # noqa: B018


def masked(x):
    return x[x > 0.5] * 2


def sliced_by_a_tensor(x, n):
    return x[: n.max() + 1] * 2


@pytest.mark.parametrize("broken", [False, True])
def test_mask_indexing_and_a_slice_bound_from_a_tensor_are_named_apart(broken, monkeypatch):
    """Both give a result whose size only the data decides; the finding says which (a slice bound read from a
    tensor is no mask). Control: every such index named mask indexing, as it was."""
    if broken:
        monkeypatch.setattr(fx_reads, "_index_kind", lambda node: "mask indexing")
    ops = [f.op for f in spec_graph.check(masked, torch.rand(8)).findings]
    assert ops == ["mask indexing"], ops
    ops = [f.op for f in spec_graph.check(sliced_by_a_tensor, torch.rand(8), torch.tensor([2, 5])).findings]
    assert ("data-dependent slicing" in ops) != broken and ("mask indexing" in ops) == broken, ops
