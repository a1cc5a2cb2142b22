"""The pass manager handed to inductor as ``post_grad_custom_post_pass`` (and to
torchair as its custom pass): runs spec-graph's FX passes in order.

    PassManager()                                   # every pass on
    PassManager(enabled={"fuse_prepare_next": False})
    PassManager.names()                             # pass names, in order
    pm(graph); pm.last_counts                       # {pass name: replacements} of the last run (None: none yet)
    pm.last_fired                                   # {pass name: [formulation matched, ...]}

``uuid()`` combines the enabled passes' uuids (each a hash of its source) and the
kernels' launch settings (``kernels.launch_key``), so inductor's caches stay on and
are invalidated when a pass, its reference formulation, the enabled set or a
kernel's launch rule changes.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..kernels import launch_key

log = logging.getLogger(__name__)


def _fuse_greedy_accept(decompositions=None):
    from .fuse_greedy_accept import FuseGreedyAccept

    return FuseGreedyAccept(decompositions)


def _fuse_prepare_next(decompositions=None):
    from .fuse_prepare_next import FusePrepareNext

    return FusePrepareNext(decompositions)


# (name, factory(decompositions)), in the order they run. Factories import lazily: listing names is cheap.
PASSES: tuple[tuple[str, Callable], ...] = (
    ("fuse_greedy_accept", _fuse_greedy_accept),
    ("fuse_prepare_next", _fuse_prepare_next),
)


def check_enabled(enabled: dict, what: str = "passes") -> None:
    """Refuse pass overrides (`what`, as the caller names them) that are not a dict, name no pass or are not
    True / False (a string such as "false" would read as on)."""
    if not isinstance(enabled, dict):
        raise ValueError(f"{what} must be a dict {{pass name: True or False}}, got {enabled!r}")
    names = [name for name, _ in PASSES]
    unknown = sorted(set(enabled) - set(names), key=str)
    if unknown:
        raise ValueError(f"unknown pass name(s) {unknown} in {what}; known: {names}")
    bad = {k: v for k, v in enabled.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"{what} maps each pass name to True or False, got {bad}")


class PassManager(CustomGraphPass):
    """spec-graph's post-grad passes, in order; `enabled` = {name: bool} overrides (default on).

    decompositions: None when inductor produced the graph; else the decomposition table of
    the AOT trace that did (torchair's), so that the passes trace their patterns alike.
    """

    def __init__(self, enabled: dict | None = None, decompositions: dict | None = None) -> None:
        enabled = dict(enabled or {})
        check_enabled(enabled)
        self.enabled = {name: enabled.get(name, True) for name in self.names()}
        self.decompositions = decompositions
        self._passes: dict | None = None
        # None until the manager has run: inductor skips post-grad passes on an FX graph cache hit
        self.last_counts: dict[str, int] | None = None
        self.last_fired: dict[str, list[str]] = {}

    @classmethod
    def names(cls) -> list[str]:
        return [name for name, _ in PASSES]

    @property
    def passes(self) -> dict:
        """{name: pass object} of the enabled passes, in order (built on first use)."""
        if self._passes is None:
            self._passes = {name: make(self.decompositions) for name, make in PASSES if self.enabled[name]}
        return self._passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        counts, fired = {}, {}
        for name, p in self.passes.items():
            counts[name] = int(p(graph) or 0)
            fired[name] = list(getattr(p, "last_formulations", []))
            if counts[name]:
                log.debug("spec_graph pass %s: %d replacement(s) %s", name, counts[name], fired[name])
        self.last_counts, self.last_fired = counts, fired

    def use_decompositions(self, decompositions: dict | None) -> "PassManager":
        """Retarget (in place) to graphs traced with `decompositions`; returns self."""
        if decompositions is not self.decompositions:
            self.decompositions = decompositions
            self._passes = None
        return self

    def uuid(self) -> str:
        h = hashlib.sha256(b"spec_graph.PassManager:" + torch.__version__.encode())
        for name, p in self.passes.items():
            h.update(f"|{name}:{p.uuid()}".encode())
        h.update(f"|kernels:{launch_key()}".encode())
        return h.hexdigest()

    def __getstate__(self):
        # picklable (inductor may ship its config to compile workers): the pass objects
        # (pattern tables) are rebuilt on first use
        state = dict(self.__dict__)
        state["_passes"] = None
        return state

    # torchair calls its custom passes as fn(gm, example_inputs, config)
    def as_torchair_pass(self) -> Callable:
        def spec_graph_passes(gm, example_inputs=None, config=None):
            self(gm.graph)
            gm.recompile()
            return gm

        return spec_graph_passes

    def __repr__(self) -> str:
        on = [n for n, e in self.enabled.items() if e]
        return f"PassManager(enabled={on})"


__all__ = ["PASSES", "PassManager"]
