"""Adaptive K: before each replay, the number of drafts with the most expected committed tokens per second.

Per draft position j (1-based) the engine keeps a smoothed conditional
acceptance ``a_j = P(draft j accepted | drafts 1..j-1 accepted)``. With K
drafts a row commits, in expectation,

    E(K) = 1 + sum_{j=1..K} prod_{i<=j} a_i      (the accepted prefix + the correction or bonus token)

tokens per step, and a step of K drafts over the batch bucket takes ``t(K)``
(measured once, when the graphs are captured: the replay, plus the host's
read and choice after it, which the next replay waits for; step_times.py).
The chooser picks
``argmax_K E(K) / t(K)`` (the smaller K on a tie). Counts come from the device
in the one read the engine makes per replay anyway, so choosing costs no host
sync. Nothing here is random: under a seed (and a fixed time table) the
choices, and so the tokens, repeat.
"""
from __future__ import annotations

import torch

# Weight of the past per row-step observed: about the last 1 / (1 - DECAY) row-steps count (about one replay of
# a full batch of 8, a few of one request alone), so a new kind of prompt moves K soon while one unlucky step does
# not; per row-step, not per replay, so that one row's steps are not read as noisily as eight rows'. (0.85 led
# 0.9 and 0.95 on the H200 at B=1 and B=8, with the host's time per replay in the step times.)
DECAY = 0.85
# Before anything is seen, position 1 is assumed accepted this often; a position not seen lately (K stayed
# below it) falls back to the rate of the one before it, so the estimate of deep positions follows the first.
PRIOR_RATE = 0.6
PRIOR_WEIGHT = 1.0  # in row-steps: what one observation weighs against the prior


def expected_tokens(rates: list[float], k: int) -> float:
    """E(K): committed tokens per row-step with ``k`` drafts under conditional acceptance ``rates``."""
    total, reach = 1.0, 1.0
    for a in rates[:k]:
        reach *= a
        total += reach
    return total


def count_acceptance(counts: torch.Tensor, accepted: torch.Tensor, K: int) -> None:
    """Add one step's counts to ``counts [2 * Kmax]`` in place, on the device: per position j (0-based), the rows
    whose step proposed it with every earlier draft accepted (``accepted >= j`` and ``j < K``), then the rows that
    accepted it (``accepted > j``). ``accepted [B]``: drafts accepted per row, negative where a row took no step."""
    depth = torch.arange(counts.shape[0] // 2, device=counts.device)
    a = accepted[:, None]
    reached = ((a >= depth) & (depth < K)).sum(0)
    counts.add_(torch.cat((reached, (a > depth).sum(0))))


class KChooser:
    """Smoothed per-position acceptance and the K it implies, for one ``generate`` call.

    ``observe(counts)`` takes the engine's cumulative device counters as a list
    ``[reached_1..reached_Kmax, accepted_1..accepted_Kmax]`` (row-steps where
    position j was proposed with every earlier draft accepted, and where it was
    accepted too); ``choose(times)`` takes ``{K: seconds per step}``.
    """

    def __init__(self, choices: tuple[int, ...], decay: float = DECAY):
        self.choices = tuple(choices)
        self.kmax = self.choices[-1]
        self.decay = decay
        self.reached = [0.0] * self.kmax
        self.accepted = [0.0] * self.kmax
        self._last = [0] * (2 * self.kmax)

    def observe(self, counts: list[int]) -> None:
        new = [c - p for c, p in zip(counts, self._last)]
        self._last = list(counts)
        n = self.kmax
        keep = self.decay ** new[0]  # new[0]: the row-steps taken (every step reaches position 1)
        for j in range(n):
            self.reached[j] = keep * self.reached[j] + new[j]
            self.accepted[j] = keep * self.accepted[j] + new[n + j]

    def rates(self) -> list[float]:
        out, prev = [], PRIOR_RATE
        for r, a in zip(self.reached, self.accepted):
            prev = (a + PRIOR_WEIGHT * prev) / (r + PRIOR_WEIGHT)
            out.append(prev)
        return out

    def choose(self, times: dict[int, float]) -> int:
        rates = self.rates()
        best, best_rate = self.choices[0], -1.0
        for k in self.choices:
            t = times.get(k)
            if t is None or t <= 0:
                continue
            rate = expected_tokens(rates, k) / t
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best
