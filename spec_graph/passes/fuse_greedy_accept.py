"""Fusion pass: greedy acceptance + counting + next-input prep + output append
-> one ``spec_graph::greedy_accept_prepare`` op.

What is matched: the post-grad (functionalized, decomposed) aten graph of
``kernels.greedy_accept.greedy_accept_prepare_ref``, and of the same
computation with the acceptance count written any of the common ways
(``COUNT_FORMULATIONS``). On CPU, ``torch.compile`` of code that calls the op
itself also lands here: a ``triton_op`` is traced through its body, and on
fake tensors the body is the reference.

The matching, the mutation handling and the checks are ``fusion.FusionPass``'s.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ..kernels import contracts
from ..kernels.contracts import greedy_accept_problem
from .fusion import COUNT_FORMULATIONS, FusionPass, _state_inputs

_ga = importlib.import_module("spec_graph.kernels.greedy_accept")

PLACEHOLDER = _ga.PLACEHOLDER


# ---------------------------------------------------------------- the pass
GREEDY_INPUTS = ("draft_token_ids", "target_argmax", "active", "tail", "seq_lens", "n_out", "max_new", "stop_ids",
                 "out_buf")


def _greedy_search(count: Callable):
    """greedy_accept_prepare_ref with the acceptance count `count` (see COUNT_FORMULATIONS)."""

    def search(draft_token_ids, target_argmax, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf):
        K = draft_token_ids.shape[1]
        t = target_argmax[:, :K]
        j = torch.arange(K + 1, device=draft_token_ids.device)[None, :]
        n = count(lambda: draft_token_ids == t, lambda: draft_token_ids != t, K)
        valid = torch.where(active, n + 1, torch.zeros_like(n))
        sampled = torch.where(j < valid[:, None], target_argmax, PLACEHOLDER)
        outs = _ga.prep_append_ref(sampled, valid, active, tail, seq_lens, n_out, max_new, stop_ids, out_buf)
        return (sampled, *outs)

    search.__name__ = f"greedy_accept_prepare_{count.__name__}"
    return search


class FuseGreedyAccept(FusionPass):
    """Reference greedy acceptance + prep + append -> ``spec_graph::greedy_accept_prepare``."""

    name = "fuse_greedy_accept"
    input_names = GREEDY_INPUTS
    source_files = (_ga.__file__, contracts.__file__)

    @property
    def op(self):
        return torch.ops.spec_graph.greedy_accept_prepare.default

    @classmethod
    def formulations(cls) -> dict:
        # the kernel file's own reference first (its count is the cumprod formulation)
        return {"reference": _ga.greedy_accept_prepare_ref,
                **{name: _greedy_search(fn) for name, fn in COUNT_FORMULATIONS.items()}}

    @classmethod
    def example_inputs(cls, B: int = 2, K: int = 3, L: int = 8, S: int = 2, device="cpu") -> tuple:
        i64 = dict(dtype=torch.int64, device=device)
        return (torch.zeros((B, K), **i64), torch.zeros((B, K + 1), **i64), *_state_inputs(B, L, S, device))

    def check_inputs(self, vals: dict) -> bool:
        return greedy_accept_problem(**vals) is None


__all__ = ["FuseGreedyAccept"]
