"""Fusion pass: counting + next-input prep + output append from an already-sampled
``[B, K+1]`` (PLACEHOLDER-padded; the random path) -> one ``spec_graph::prepare_next`` op.

Matches ``kernels.prepare_next.prepare_next_ref`` (its leading-valid count is the
cumprod formulation) and the same computation with the count written as in
``fusion.COUNT_FORMULATIONS`` (stop mask ``sampled == PLACEHOLDER``).
The matching, the mutation handling and the checks are ``fusion.FusionPass``'s.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

# submodules by path: the kernels package re-exports a function named prepare_next
_ga = importlib.import_module("spec_graph.kernels.greedy_accept")
_pn = importlib.import_module("spec_graph.kernels.prepare_next")
from ..kernels import contracts  # noqa: E402
from ..kernels.contracts import prepare_next_problem  # noqa: E402
from .fusion import COUNT_FORMULATIONS, FusionPass, _state_inputs  # noqa: E402

PLACEHOLDER = _ga.PLACEHOLDER
PREPARE_INPUTS = ("sampled", "active", "tail", "seq_lens", "n_out", "max_new", "stop_ids", "out_buf")


def _prepare_search(count: Callable):
    """prepare_next_ref with the leading-valid count `count`."""

    def search(sampled, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf):
        K1 = sampled.shape[1]
        lead = count(lambda: sampled != PLACEHOLDER, lambda: sampled == PLACEHOLDER, K1)
        valid = torch.where(active, lead, torch.zeros_like(lead))
        return _ga.prep_append_ref(sampled, valid, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf)

    search.__name__ = f"prepare_next_{count.__name__}"
    return search


class FusePrepareNext(FusionPass):
    """Reference prep + append from sampled tokens -> ``spec_graph::prepare_next``."""

    name = "fuse_prepare_next"
    input_names = PREPARE_INPUTS
    source_files = (_ga.__file__, _pn.__file__, contracts.__file__)

    @property
    def op(self):
        return torch.ops.spec_graph.prepare_next.default

    @classmethod
    def formulations(cls) -> dict:
        return {"reference": _pn.prepare_next_ref,
                **{name: _prepare_search(fn) for name, fn in COUNT_FORMULATIONS.items()}}

    @classmethod
    def example_inputs(cls, B: int = 2, K: int = 3, L: int = 8, S: int = 2, device="cpu") -> tuple:
        return (torch.zeros((B, K + 1), dtype=torch.int64, device=device), *_state_inputs(B, L, S, device))

    def check_inputs(self, vals: dict) -> bool:
        return prepare_next_problem(**vals) is None


__all__ = ["FusePrepareNext"]
