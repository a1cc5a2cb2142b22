"""The pattern machinery that both fusion passes share (``FusionPass``), the ways of
writing the acceptance count (``COUNT_FORMULATIONS``) and the state contract the fused ops check.

How a match becomes the op:

* Patterns come from tracing the reference with inductor's ``fwd_only`` (and
  inductor's joint-graph normalization, so they look like the graphs the passes
  get), or with torchair's decomposition table on Ascend, and ``fx_to_pattern``.
  Ints, lists, dtypes and devices are wildcards in this first, loose pattern (as ``register_replacement``
  does), so one pattern per formulation serves every K, B, L. Each candidate is then re-checked against
  a strict pattern traced at the matched shapes (every literal compared:
  K, PLACEHOLDER, clamps, dtypes), cached per shape.
* The output append mutates ``out_buf``. Functionalized, the graph computes
  ``new = where(write, vals, out_buf)`` and copies ``new`` back into the input
  at the end. The pattern therefore treats ``new`` as one more output (the
  anchor), and the replacement is functional too:
  ``auto_functionalized(greedy_accept_prepare, ..., out_buf=out_buf)``, whose
  last result stands for ``new``. Inductor's reinplace pass (which runs after
  custom post passes) turns that into the op writing ``out_buf`` in place when
  nothing else reads the old value -- no clone, no copy back; else it clones.
* Callers drop outputs (``_, num_acc, _, ...``) and DCE removes their nodes,
  so an all-outputs pattern would not match real code. Here only the append
  is required; every other output is matched where present, as long as every
  input is still read by what remains (dropping the outputs that alone read an
  input, such as the new lengths, leaves that input unbound: no fusion). K
  must be static (a symbolic K is not matched). A match is
  refused when one of its inner nodes is used outside it (nothing would be
  saved), when an input depends on the match (the op would feed itself), or
  when the appended buffer is returned beside another use (a clone is a no-op
  to the functional graph, so a copy of the buffer taken before a later write
  is the buffer itself; written in place, the copy would change).

Uses only ``torch._inductor.pattern_matcher`` pieces present in torch 2.11
and 2.13 (PatternMatcherPass, fwd_only, fx_to_pattern, MultiOutputPattern,
register_graph_pattern, MULTIPLE).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import operator
from pathlib import Path
from typing import Callable

import torch
import torch.fx

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ uuid
def files_hash(paths, extra: str = "") -> str:
    """Stable hex digest of file contents (+ `extra`): a pass's uuid()."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()


# ------------------------------------------------- first-index formulations
# n = first j < N with stop[:, j] (else N), written the ways people write it.
# `keep` / `stop` are zero-argument builders of the [B, N] bool masks (keep = ~stop,
# built with the opposite comparison, as code does), so each formulation traces
# to the graph its author's code gives.
def count_cumprod(keep, stop, N):
    return keep().long().cumprod(1).sum(1)


def count_where_amin(keep, stop, N):
    s = stop()
    return torch.where(s, torch.arange(N, device=s.device), N).amin(1)


def count_where_amin_2d(keep, stop, N):
    s = stop()
    return torch.where(s, torch.arange(N, device=s.device)[None, :], N).amin(1)


def count_where_min(keep, stop, N):
    s = stop()
    return torch.where(s, torch.arange(N, device=s.device), N).min(1).values


def count_where_min_2d(keep, stop, N):
    s = stop()
    return torch.where(s, torch.arange(N, device=s.device)[None, :], N).min(1).values


def count_cumsum(keep, stop, N):
    return (stop().long().cumsum(1) == 0).sum(1)


def count_argmax(keep, stop, N):
    s = stop()
    return torch.where(s.any(1), s.long().argmax(1), N)


# name -> count function; "reference" is the kernel file's own reference function.
COUNT_FORMULATIONS: dict[str, Callable] = {
    "where_amin": count_where_amin,
    "where_amin_2d": count_where_amin_2d,
    "where_min": count_where_min,
    "where_min_2d": count_where_min_2d,
    "cumsum": count_cumsum,
    "argmax": count_argmax,
}


# ------------------------------------------------------- pattern machinery
def _pm():
    from torch._inductor import pattern_matcher

    return pattern_matcher


INDUCTOR = "inductor"  # trace style: inductor's decompositions + its joint-graph normalization


def trace_style_key(decompositions) -> tuple:
    """Hashable name of a trace style: INDUCTOR, or a decomposition table (e.g. torchair's)."""
    if decompositions is None:
        return (INDUCTOR,)
    return ("table", *sorted(str(k) for k in decompositions))


def search_graphs(search_fn, args, mutated: int, decompositions=None) -> list:
    """The graph(s) the post-grad graph of `search_fn` may take, functional (see
    `functionalize_mutation`).

    decompositions None: inductor's (``fwd_only``), then inductor's own normalization --
    one graph. A table (torchair's): ``make_fx`` with it, as traced and as normalized by
    inductor's joint-graph passes (which torchair runs when its npu_fx_pass is on)."""
    if decompositions is None:
        gm = _pm().fwd_only(search_fn, args)  # positional: keyword names differ across versions
        return [normalize_like_inductor(functionalize_mutation(gm, mutated, search_fn.__name__))]
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    def trace():
        with enable_python_dispatcher():
            gm = make_fx(search_fn, decomposition_table=dict(decompositions), tracing_mode="real")(*args)
        gm.graph.eliminate_dead_code()
        return functionalize_mutation(gm, mutated, search_fn.__name__)

    return [trace(), normalize_like_inductor(trace())]


def functionalize_mutation(gm: torch.fx.GraphModule, mutated: int, name: str = "search") -> torch.fx.GraphModule:
    """`gm` ends with ``copy_(args[mutated], new)``: drop that copy and append ``new`` to the
    outputs -- the functionalized form in which real graphs hold the mutation (``new``
    then feeds an epilogue copy_ into the input, or is returned as an extra output)."""
    g = gm.graph
    ph = [n for n in g.nodes if n.op == "placeholder"][mutated]
    copies = [u for u in ph.users if u.op == "call_function" and u.target is torch.ops.aten.copy_.default]
    if len(copies) != 1 or copies[0].args[0] is not ph:
        raise RuntimeError(f"expected one copy_ into argument {mutated} of {name}")
    copy = copies[0]
    later = [u for u in ph.users if u is not copy and _after(u, copy)]
    if later:
        raise RuntimeError(f"{name} reads argument {mutated} after writing it")
    out = g.output_node()
    res = out.args[0]
    res = tuple(res) if isinstance(res, (tuple, list)) else (res,)
    out.args = ((*res, copy.args[1]),)
    g.erase_node(copy)
    g.lint()
    gm.recompile()
    return gm


def normalize_like_inductor(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Run on a search graph what inductor runs on a real graph before post-grad custom
    passes see it (joint-graph passes: constant folding turns scalar_tensor into
    full, ...; then the built-in post-grad patterns), so both look alike."""
    try:
        from torch._inductor.fx_passes import joint_graph, post_grad

        gm = joint_graph.joint_graph_passes(gm) or gm
        post_grad.remove_noop_ops(gm.graph)
        if hasattr(post_grad, "lazy_init"):
            post_grad.lazy_init()
        for patterns in getattr(post_grad, "pass_patterns", ()):
            patterns.apply(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    except Exception as e:  # pragma: no cover - depends on inductor internals
        log.debug("normalizing a search graph failed (%s); using it as traced", e)
    return gm


def _after(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False


def _relax_users(pattern) -> None:
    """Let every node of `pattern` have any number of users (outputs may be dead-code
    eliminated in real graphs, and CSE may merge equal nodes); containment is checked
    after the match instead."""
    pm = _pm()
    seen = set()
    stack = [pattern]
    while stack:
        p = stack.pop()
        if id(p) in seen:
            continue
        seen.add(id(p))
        if isinstance(p, pm.MultiOutputPattern):
            stack.extend(x for x in p.outputs if x is not None)
        if isinstance(p, pm._TargetExpr):
            p.users = pm.MULTIPLE
        if isinstance(p, pm._TargetArgsExpr):
            stack.extend(x for x in p.flat_args_kwargs[0] if isinstance(x, pm.PatternExpr))
        if isinstance(p, pm.ListOf):
            stack.append(p.pattern)


@functools.lru_cache(maxsize=None)
def _partial_outputs_cls():
    pm = _pm()

    class PartialOutputsPattern(pm.MultiOutputPattern):
        """A MultiOutputPattern whose first output is required and the others optional:
        an output absent from the graph maps to None in ``Match.output_nodes()``."""

        def _match(self, node, ctx):
            m = ctx.match(self.outputs[0], node)
            if not pm.is_match(m):
                return m
            for pattern in self.outputs[1:]:
                if pattern is None or pattern in ctx.pattern_to_node:
                    continue
                prior = dict(ctx.pattern_to_node)
                child = self._match_from_anchors(pattern, ctx)
                if pm.is_match(child):
                    m.extend(child)
                else:
                    ctx.pattern_to_node = prior
                    ctx.pattern_to_node[pattern] = None
            return m

    return PartialOutputsPattern


def to_pattern(gm: torch.fx.GraphModule, argnames, loose: bool):
    """Pattern of `gm` (last output = anchor, required; the others optional), users relaxed.

    loose: ints, floats, lists, dtypes and devices are wildcards (the shape-generic search
    pattern); otherwise every literal must be equal (the per-shape check)."""
    pm = _pm()
    ignore = (int, float, list, torch.device, torch.dtype) if loose else ()
    argnames = list(argnames) + _sizes_as_inputs(gm)
    p = pm.fx_to_pattern(gm, ignore_types=ignore, argnames=argnames)
    outs = list(p.outputs) if isinstance(p, pm.MultiOutputPattern) else [p]
    pattern = _partial_outputs_cls()([outs[-1], *outs[:-1]])
    _relax_users(pattern)
    return pattern


def _sizes_as_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Turn ``sym_size`` nodes (a trace at symbolic shapes) into extra inputs; return their names.

    In the graph being rewritten a symbolic size is a graph input of its own, not a
    ``sym_size`` of the tensor, so the pattern must accept any node there."""
    sizes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int]
    if not sizes:
        return []
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    names = []
    for i, n in enumerate(sizes):
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"_size{i}")
        last.meta.update(n.meta)
        n.replace_all_uses_with(last)
        gm.graph.erase_node(n)
        names.append(last.name)
    gm.recompile()
    return names


def _ancestors(nodes, stop: set) -> set:
    """All nodes that `nodes` depend on (not crossing `stop`)."""
    seen: set = set()
    stack = [n for n in nodes if isinstance(n, torch.fx.Node)]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen and a not in stop:
                seen.add(a)
                stack.append(a)
    return seen


def _topo_sort(graph: torch.fx.Graph) -> None:
    pm = _pm()
    if hasattr(pm, "stable_topological_sort"):
        pm.stable_topological_sort(graph)
        return
    # fallback: depth-first, inputs before users, keeping the current order where possible
    order = {n: i for i, n in enumerate(graph.nodes)}
    done: set = set()
    result = []

    def visit(n):
        stack = [(n, False)]
        while stack:
            x, expanded = stack.pop()
            if x in done:
                continue
            if expanded:
                done.add(x)
                result.append(x)
                continue
            stack.append((x, True))
            for a in sorted(x.all_input_nodes, key=order.get, reverse=True):
                if a not in done:
                    stack.append((a, False))

    for n in list(graph.nodes):
        visit(n)
    cursor = None
    for n in result:
        if cursor is not None and cursor.next is not n:
            cursor.append(n)
        cursor = n


class FusionPass:
    """Pattern-match the reference formulation(s) of a computation that one mutating
    ``spec_graph::`` op performs, and replace each match by that op.

    Subclasses set: name, op (OpOverload), input_names (the op's tensor args, in order,
    the mutated one included), mutated (its name), formulations() -> {name: search_fn},
    example_inputs(), check_inputs(vals), source_files. Outputs of every search function:
    the op's outputs in order (then the mutated buffer's new value, added by tracing).
    """

    name: str = ""
    input_names: tuple = ()
    mutated: str = "out_buf"
    source_files: tuple = ()

    # -- subclass hooks
    @property
    def op(self):
        raise NotImplementedError

    @classmethod
    def formulations(cls) -> dict:
        raise NotImplementedError

    @classmethod
    def example_inputs(cls, B: int = 2, K: int = 3, L: int = 8, S: int = 2, device="cpu") -> tuple:
        raise NotImplementedError

    def check_inputs(self, vals: dict) -> bool:
        raise NotImplementedError

    # -- pass API
    def __init__(self, decompositions: dict | None = None) -> None:
        """decompositions: None for graphs from inductor; else the decomposition table the
        backend's AOT trace used (torchair's), so that patterns are traced alike."""
        self.decompositions = decompositions
        self.style = trace_style_key(decompositions)
        self.last_count = 0
        self.last_formulations: list[str] = []
        self._pass = None

    def uuid(self) -> str:
        files = (inspect.getfile(type(self)), __file__, *self.source_files)
        style = hashlib.sha256(repr(self.style).encode()).hexdigest()[:16]
        return files_hash(sorted(set(files)), extra=f"{self.name}:{torch.__version__}:{style}")

    def __call__(self, graph: torch.fx.Graph) -> int:
        self.last_formulations = []
        pm_pass = self._pattern_pass()
        count = pm_pass.apply(graph)
        if count:
            _topo_sort(graph)
            graph.lint()
            gm = graph.owning_module
            if gm is not None:
                gm.recompile()
        self.last_count = count
        return count

    # -- patterns: traced once per process, class and trace style; registered into a fresh
    #    PatternMatcherPass per instance. Entries: (formulation, search fn, variant, pattern).
    def loose_patterns(self) -> list:
        cache = _class_cache(type(self), "_loose_patterns")
        if self.style not in cache:
            from torch._subclasses.fake_tensor import FakeTensorMode

            pats, seen = [], []
            mutated = self.input_names.index(self.mutated)
            for fname, fn in self.formulations().items():
                with FakeTensorMode():  # shapes only: tracing computes nothing
                    graphs = search_graphs(fn, self.example_inputs(), mutated, self.decompositions)
                for variant, gm in enumerate(graphs):
                    pat = to_pattern(gm, self.input_names, loose=True)
                    if any(pat.pattern_eq(s) for s in seen):
                        continue  # traces alike (e.g. normalization changed nothing)
                    seen.append(pat)
                    pats.append((fname, fn, variant, pat))
            cache[self.style] = pats
        return cache[self.style]

    def _pattern_pass(self):
        if self._pass is None:
            pm = _pm()
            self._pass = pm.PatternMatcherPass(pass_name=self.name)
            for fname, fn, variant, pat in self.loose_patterns():
                pm.register_graph_pattern(
                    pat, extra_check=functools.partial(self._check, fname, fn, variant), pass_dict=self._pass,
                )(functools.partial(self._replace, fname))
        return self._pass

    # -- checks: shape-specific strict pattern, dtypes, containment, no cycles
    def _check(self, fname: str, fn, variant: int, match) -> bool:
        try:
            return self._check_impl(fname, fn, variant, match)
        except Exception as e:  # a failed check must never break compilation
            log.debug("%s: %s rejected (%s)", self.name, fname, e)
            return False

    def _check_impl(self, fname: str, fn, variant: int, match) -> bool:
        pm = _pm()
        inputs = {k: match.kwargs.get(k) for k in self.input_names}
        if not all(isinstance(n, torch.fx.Node) and "val" in n.meta for n in inputs.values()):
            return False
        vals = {k: n.meta["val"] for k, n in inputs.items()}
        if not all(isinstance(v, torch.Tensor) for v in vals.values()):
            return False
        if len({v.device for v in vals.values()}) != 1 or not self.check_inputs(vals):
            return False

        anchor = match.output_nodes()[0]
        strict = self._strict_pattern(fname, fn, variant, vals)
        sm = strict.match(anchor)
        if not pm.is_match(sm):
            log.debug("%s: %s loose match failed the strict check: %s", self.name, fname, sm)
            return False
        if any(sm.kwargs.get(k) is not n for k, n in inputs.items()):
            return False

        if _returned_and_used(anchor):
            # the appended buffer returned and also read on (a copy of it taken before a later write: a clone
            # is a no-op to a functional graph): once the op writes the buffer in place, that later write, or
            # the copy back into the caller's buffer, would change the returned copy
            log.debug("%s: %s refused: the appended buffer is returned and used again", self.name, fname)
            return False
        matched = set(sm.nodes)
        outs = sm.output_nodes()
        out_set = {n for n in outs if n is not None}
        # inner nodes used outside the match: fusing would save nothing
        for n in matched - out_set:
            if any(u not in matched for u in n.users):
                log.debug("%s: %s inner node %s has outside users", self.name, fname, n)
                return False
        # an input computed from the match would make the op feed itself
        if _ancestors(inputs.values(), stop=set()) & matched:
            return False
        match._spec_graph = (sm, inputs, vals, outs)
        return True

    def _strict_pattern(self, fname: str, fn, variant: int, vals: dict):
        """The pattern at the matched shapes with every literal kept (K, PLACEHOLDER, clamps,
        dtypes): what register_replacement's own re-check does, cached per shape."""
        key = (self.style, fname, variant,
               *((tuple(map(_dim_key, v.shape)), v.dtype, str(v.device)) for v in vals.values()))
        cache = _class_cache(type(self), "_strict_patterns")
        if key not in cache:
            fake_mode = torch._dynamo.utils.detect_fake_mode(list(vals.values()))
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                args = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                        for v in vals.values()]
                gm = search_graphs(fn, args, self.input_names.index(self.mutated), self.decompositions)[variant]
            cache[key] = to_pattern(gm, self.input_names, loose=False)
        return cache[key]

    # -- the rewrite
    def _replace(self, fname: str, match, *args, **kwargs) -> None:
        from torch._higher_order_ops.auto_functionalize import auto_functionalized

        sm, inputs, vals, outs = match._spec_graph
        graph = match.graph
        op = self.op
        # after the last input (the outputs' users get ordered by the sort in __call__)
        order = {n: i for i, n in enumerate(graph.nodes)}
        last_in = max(inputs.values(), key=order.__getitem__)
        fake_mode = torch._dynamo.utils.detect_fake_mode(list(vals.values()))
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            fvals = auto_functionalized(op, **vals)
        # anchor (new buffer) is the op's last result; the rest follow the op's outputs
        order_in_af = [len(fvals) - 1, *range(len(outs) - 1)]
        with graph.inserting_after(last_in):
            af = graph.call_function(auto_functionalized, (op,), dict(inputs))
            af.meta["val"] = fvals
        cursor = af
        for old, idx in zip(outs, order_in_af):
            if old is None:
                continue
            with graph.inserting_after(cursor):
                new = graph.call_function(operator.getitem, (af, idx))
            new.meta["val"] = fvals[idx]
            for k in ("tensor_meta", "stack_trace"):
                if k in old.meta:
                    new.meta[k] = old.meta[k]
            old.replace_all_uses_with(new)
            cursor = new
        _erase_dead(graph, sm.nodes)
        self.last_formulations.append(fname)


def _dim_key(d):
    """A size as a cache key; a symbolic size stays symbolic (int() would specialise it)."""
    return d if isinstance(d, int) else str(d)


def _class_cache(cls, name: str) -> dict:
    """A dict owned by `cls` itself (not inherited)."""
    if name not in cls.__dict__:
        setattr(cls, name, {})
    return cls.__dict__[name]


def _returned_and_used(node: torch.fx.Node) -> bool:
    return any(u.op == "output" for u in node.users) and any(u.op != "output" for u in node.users)


def _erase_dead(graph: torch.fx.Graph, nodes) -> None:
    pending = [n for n in dict.fromkeys(nodes)]
    changed = True
    while changed:
        changed = False
        for n in pending:
            if not n._erased and not n.users:
                graph.erase_node(n)
                changed = True
        pending = [n for n in pending if not n._erased]


def _state_inputs(B, L, S, device):
    i64 = dict(dtype=torch.int64, device=device)
    return (torch.ones(B, dtype=torch.bool, device=device), torch.zeros((B, 2), **i64), torch.full((B,), 4, **i64),
            torch.zeros(B, **i64), torch.full((B,), L, **i64), torch.full((S,), 1, **i64),
            torch.zeros((B, L), **i64))


__all__ = ["COUNT_FORMULATIONS", "FusionPass", "files_hash"]
