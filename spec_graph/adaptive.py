"""Adaptive K: before each replay, the number of drafts that finishes the work left soonest.

Per draft position j (1-based) the engine keeps a smoothed conditional
acceptance ``a_j = P(draft j accepted | drafts 1..j-1 accepted)``, over all
rows and per row. With K drafts a row commits, in expectation,

    E(K) = 1 + sum_{j=1..K} prod_{i<=j} a_i      (the accepted prefix + the correction or bonus token)

tokens per step, and a step of K drafts over the batch bucket takes ``t(K)``
(measured once, when the graphs are captured: the replay, plus the host's
read after it, which the next replay waits for; step_times.py).
A ``generate`` call ends when its last row does, so the chooser minimises
the time the work left takes:

    steps(K) = max( (queued + sum_r rem_r) / (rows * E(K)),  max_r rem_r / E_r(K) )

with ``rem_r`` the tokens row r has left, ``queued`` those of the requests
not yet admitted and ``E_r`` from row r's own rates. While requests wait the
first term rules (every committed token is throughput: argmax E(K) / t(K));
once the queue is empty the slowest row does, and drafts that only finish
the fast rows sooner are not paid for. It picks ``argmin_K steps(K) t(K)``
(the smaller K on a tie), or once in a while a larger K priced within
EXPLORE_MARGIN of it whose first deeper position it has not seen; with more than
one busy row it keeps the K running while that is priced within KEEP_MARGIN. Counts
come from the device in the one read the engine makes per replay anyway, so
choosing costs no host sync; and the engine chooses while the replay before
runs (``ChoiceAhead``), so the choice costs the replays no time either.
Nothing here is random: under a seed (and a fixed time table) the choices,
and so the tokens, repeat.
"""
from __future__ import annotations

import functools
import operator

import torch

# Weight of the past per row-step that reached a position: about the last 1 / (1 - DECAY) such row-steps count
# (about one replay of a full batch of 8, a few of one request alone), so a new kind of prompt moves K soon while
# one unlucky step does not. A position above K fades by one row-step's weight per replay. (0.85 led 0.9 and 0.95
# on the H200 at B=1 and B=8, with the host's time per replay in the step times.)
DECAY = 0.85
# Before anything is seen, position 1 is assumed accepted this often; a position seen little (K stayed below it)
# leans on the rate of the one before it times PRIOR_SHRINK (deep drafts fare worse than shallow ones on real
# text), with its miss rate times PRIOR_MISS_SCALE. 0.9 held the simulated B=8 chooser within 3% of the best
# fixed K where 1.0 over-reached (0.955 / 0.950 on held-out code / random bytes, greedy), with EXPLORE_MARGIN
# for where deep drafts do as well (sim_adaptive.py, RESULTS.md 2026-12-02).
PRIOR_RATE = 0.6
PRIOR_WEIGHT = 1.0  # in row-steps: what one observation weighs against the prior
PRIOR_SHRINK = 0.9
PRIOR_MISS_SCALE = 1.0  # 1.5 puts 0.97 after 0.98, 0.7 after 0.8 (tried: no better than 1)

# A row's own estimate: its past per row-step of its own weighs ROW_DECAY (a request's text changes slowly), and
# the rates over all rows stand in for ROW_PRIOR_WEIGHT row-steps of it (a new row starts as the batch's average).
ROW_DECAY = 0.95
ROW_PRIOR_WEIGHT = 8.0

# A larger K whose priced cost is within EXPLORE_MARGIN of the best, and whose first position above the best K
# has faded below EXPLORE_SEEN (decayed) row-steps, is taken for one replay: the prior of an unseen deep position
# is a guess, and only a step that reaches it can correct it. While the larger K stays within the margin this
# recurs as the position fades again (about every 9 replays of one row; at most 2% dearer each). 0: never.
# EXPLORE_ROWS limits the tries to that many busy rows (None: any). Kept at any: at B=8 greedy, interleaved on
# one H100 engine, trying at any row count ran 0.967 / 1.010x the best fixed K on held-out code / random bytes
# against 0.904 / 1.003x at one row only (RESULTS.md 2026-12-05); without tries the chooser settled on K=1 where
# deeper K did as well.
EXPLORE_MARGIN = 0.02
EXPLORE_ROWS: int | None = None
EXPLORE_SEEN = 0.25
# With more than one busy row the K running now (in the bucket priced; the engine clears ``last_k`` for another) is
# kept while its priced cost is within KEEP_MARGIN of the best: there the choice comes a replay late from a batch's
# slowly moving estimate, so near ties flipped K back and forth, and each change costs (a change of graph; the new
# graph's next replays ran slower than the same K's fixed). On one H100, two runs at B=8 greedy: 4.2 / -0.5 / 1.6%
# and -1.2 / 0.4 / 6.6% faster on held-out code / random bytes / the two alternating; at one row, where the choice
# follows each replay's outcome, -1.5 / -2.0 / 0.4% (not kept there). 0: the best always.
KEEP_MARGIN = 0.01


def expected_tokens(rates: list[float], k: int) -> float:
    """E(K): committed tokens per row-step with ``k`` drafts under conditional acceptance ``rates``."""
    return _expected_by_k(rates[:k])[-1]


def count_acceptance(counts: torch.Tensor, accepted: torch.Tensor, K: int) -> None:
    """Add one step's counts to ``counts [B, 2 * Kmax]`` in place, on the device: per row and position j
    (0-based), 1 where the row's step proposed it with every earlier draft accepted (``accepted >= j`` and
    ``j < K``), then 1 where it accepted it (``accepted > j``). ``accepted [B]``: drafts accepted per row,
    negative where a row took no step."""
    depth = torch.arange(counts.shape[1] // 2, device=counts.device)
    a = accepted[:, None]
    counts.add_(torch.cat(((a >= depth) & (depth < K), a > depth), dim=1).to(counts.dtype))


def _expected_by_k(rates: list[float]) -> list[float]:
    """[E(0), E(1), ..., E(len(rates))] (expected_tokens at every K) in one pass."""
    out, reach = [1.0], 1.0
    for a in rates:
        reach *= a
        out.append(out[-1] + reach)
    return out


def _decayed_add(reached: list[float], accepted: list[float], new: list[int], decay: float) -> None:
    """One replay's counts ``new = [reached..., accepted...]`` added to the decayed sums in place. A position's
    past fades by ``decay`` per new row-step that reached it, and by one such step where none did: in a batch,
    the positions below K have seen every row's step while those above it fade as one row's would (how deep
    drafts fare, given the ones before them, changes less between rows than the first does)."""
    n = len(reached)
    for j in range(n):
        m = new[j]
        keep = decay if m <= 1 else decay ** m  # (decay ** 1 is decay: the same floats, without the power)
        reached[j] = keep * reached[j] + m
        accepted[j] = keep * accepted[j] + new[n + j]


@functools.lru_cache(maxsize=None)
def _step_counts(n: int, k: int, accepted: int) -> tuple[int, ...]:
    """The counts ``count_acceptance`` adds for one row-step of ``k`` drafts with ``accepted`` of them accepted,
    over ``n`` positions: ``[reached..., accepted...]``."""
    return (tuple(int(j < k and accepted >= j) for j in range(n))
            + tuple(int(j < k and accepted > j) for j in range(n)))


def _smoothed(reached: list[float], accepted: list[float], prior: list[float], weight: float) -> list[float]:
    return [(a + weight * p) / (r + weight) for r, a, p in zip(reached, accepted, prior)]


class KChooser:
    """Smoothed per-position acceptance and the K it implies, for one ``generate`` call.

    ``observe(counts)`` takes the engine's cumulative device counters of rows
    0.. as one flat list, ``2 * Kmax`` per row: ``[reached_1..reached_Kmax,
    accepted_1..accepted_Kmax]`` (the row's steps where position j was proposed
    with every earlier draft accepted, and where it was accepted too);
    ``admit(row)`` says a new request took the row; ``choose(times, remaining,
    queued)`` takes ``{K: seconds per step}``, ``{row: tokens left}`` of the busy
    rows and the tokens of the requests still waiting (without ``remaining``:
    the K of the most tokens per second over all rows).
    """

    def __init__(self, choices: tuple[int, ...], decay: float | None = None):
        self.choices = tuple(choices)
        self.kmax = self.choices[-1]
        self.decay = DECAY if decay is None else decay  # the module's setting as it is now, as the others are read
        self.reached = [0.0] * self.kmax
        self.accepted = [0.0] * self.kmax
        self.rows: dict[int, tuple[list[float], list[float]]] = {}  # row: (reached, accepted), its own
        self._last = [0] * (2 * self.kmax)
        self.last_k: int | None = None  # the K of the replay running, where the engine says

    def admit(self, row: int) -> None:
        self.rows.pop(row, None)

    def observe(self, counts: list[int]) -> None:
        n = self.kmax
        self._last += [0] * (len(counts) - len(self._last))
        new = [c - p for c, p in zip(counts, self._last)]
        self._last[:len(counts)] = counts  # rows past a smaller bucket keep theirs for when it grows again
        per_row = [new[i:i + 2 * n] for i in range(0, len(new), 2 * n)]
        _decayed_add(self.reached, self.accepted, [sum(col) for col in zip(*per_row)], self.decay)
        for row, d in enumerate(per_row):
            if d[0]:
                self._row_add(row, d)

    def _row_add(self, row: int, new: list[int]) -> None:
        # new lists, not changed in place: forks (after_step) share the rows they do not step
        reached, accepted = self.rows.get(row) or ([0.0] * self.kmax, [0.0] * self.kmax)
        own = (list(reached), list(accepted))
        _decayed_add(*own, new, ROW_DECAY)
        self.rows[row] = own

    def has_seen(self, counts: list[int]) -> bool:
        """Whether ``counts`` are the counters this chooser last observed (rows past them aside; rows it never
        observed count zero, as they start)."""
        return self._last[:len(counts)] + [0] * (len(counts) - len(self._last)) == list(counts)

    def after_step(self, row: int, k: int, accepted: int) -> "KChooser":
        """A copy that has also observed row ``row`` take one step of ``k`` drafts and accept ``accepted`` of them:
        the counts ``count_acceptance`` adds on the device, on top of the last observed."""
        n = self.kmax
        new = _step_counts(n, k, accepted)
        base = 2 * n * row
        fork = object.__new__(type(self))  # copy.copy's result, at a third of its cost (forks are made per replay)
        fork.__dict__.update(self.__dict__)
        fork.reached, fork.accepted, fork.rows = list(self.reached), list(self.accepted), dict(self.rows)
        last = self._last + [0] * (base + 2 * n - len(self._last))
        last[base:base + 2 * n] = map(operator.add, last[base:base + 2 * n], new)
        fork._last = last
        # what observe(the counts) would do: every other row's counts are unchanged, so this row's are the sums'
        _decayed_add(fork.reached, fork.accepted, new, self.decay)
        if new[0]:
            fork._row_add(row, new)
        return fork

    def rates(self) -> list[float]:
        out, prev = [], PRIOR_RATE
        shrink, miss, weight = PRIOR_SHRINK, PRIOR_MISS_SCALE, PRIOR_WEIGHT  # read once: this runs per fork
        for r, a in zip(self.reached, self.accepted):
            prev = (a + weight * max(1.0 - (1.0 - shrink * prev) * miss, 0.0)) / (r + weight)
            out.append(prev)
        return out

    def row_rates(self, row: int, pooled: list[float] | None = None) -> list[float]:
        """Row ``row``'s own rates, drawn toward those over all rows (``pooled``: ``rates()``) where it has seen
        little."""
        pooled = self.rates() if pooled is None else pooled
        if row not in self.rows:
            return pooled
        return _smoothed(*self.rows[row], pooled, ROW_PRIOR_WEIGHT)

    def _row_expected(self, row: int, pooled: list[float], pooled_e: list[float]) -> list[float]:
        """``_expected_by_k(self.row_rates(row, pooled))`` in one pass (the same floats): the chooser runs it per
        busy row before every replay, on the host."""
        own = self.rows.get(row)
        if own is None:
            return pooled_e
        out, reach = [1.0], 1.0
        for r, a, p in zip(*own, pooled):
            reach *= (a + ROW_PRIOR_WEIGHT * p) / (r + ROW_PRIOR_WEIGHT)
            out.append(out[-1] + reach)
        return out

    def choose(self, times: dict[int, float], remaining: dict[int, int] | None = None, queued: int = 0) -> int:
        rates = self.rates()
        pooled = _expected_by_k(rates)
        ks = [k for k in self.choices if (t := times.get(k)) is not None and t > 0]
        costs = []
        if remaining:  # steps until the work left is done (module docstring), at least the slowest row's
            total = queued + sum(remaining.values())
            per_row = [(left, self._row_expected(r, rates, pooled), max(left - 1, 0)) for r, left in remaining.items()]
            for k in ks:
                slowest = 0.0
                for left, e, most in per_row:
                    # a row commits at most the tokens it has left: drafts past them finish it no sooner
                    v = left / e[k if k < most else most]
                    if v > slowest:
                        slowest = v
                costs.append(max(total / (len(remaining) * pooled[k]), slowest) * times[k])
        else:
            costs = [1.0 / pooled[k] * times[k] for k in ks]
        best, best_cost = self.choices[0], float("inf")
        for k, cost in zip(ks, costs):
            if cost < best_cost * (1 - 1e-9):
                best, best_cost = k, cost
        few_rows = EXPLORE_ROWS is None or len(remaining or ()) <= EXPLORE_ROWS
        if best < self.kmax and self.reached[best] < EXPLORE_SEEN and few_rows:
            wider = [k for k, cost in zip(ks, costs) if k > best and cost <= best_cost * (1 + EXPLORE_MARGIN)]
            if wider:
                return min(wider)
        if KEEP_MARGIN and len(remaining or ()) > 1 and self.last_k in ks \
                and costs[ks.index(self.last_k)] <= best_cost * (1 + KEEP_MARGIN):
            return self.last_k
        return best


class ChoiceAhead:
    """A ``KChooser`` driven so that its work falls while a replay runs (the host waits for the replay's end anyway)
    and costs the replays no time.

    With one busy row and one step per replay, the K after each of the replay's possible outcomes (0..K drafts
    accepted) is chosen while it runs, and the outcome read after it picks one: the K a choice after the read would
    make. Otherwise the next K is chosen from the counts up to the replay before (one replay late: a batch's counts
    move less from one replay to the next than one row's). Where a request is admitted, the next K is chosen from
    every count so far, with the new rows, while their prefill runs (the engine calls ``pick`` there); where rows
    finish, the K chosen during the replay serves the rows left for one replay. So no choice falls between a read
    and the next launch, where the device would wait for it (at B=8 some 19 a call had, about 60 us each).

    ``choose(chooser, lens) -> K`` prices a chooser's choice for the busy rows at committed lengths ``lens``
    ({row: length}). Per replay the engine calls ``pick(lens)`` for its K, ``ahead(K, N, lens)`` once it is launched,
    and ``seen(counts, lens)`` with the read after it; ``admit(row)`` where a request takes a row.
    """

    MAX_FORK_ROWS = 1  # busy rows up to which every outcome is chosen for ahead (their count grows as (K + 1)^rows)

    def __init__(self, chooser: KChooser, choose):
        self.chooser, self._choose = chooser, choose
        self._unseen: list[int] | None = None  # counts read, not yet observed
        self._next: int | None = None
        self._forks: list | None = None  # [(lens, chooser, K)] per outcome a = 0..K of the running replay
        self._fork_from: tuple[int, int] = (0, 0)  # (row, length) the forks start from
        self._spent = None  # the forks read, and the chooser they replace: freed while the next replay runs

    def _observe_unseen(self) -> None:
        if self._unseen is not None:
            self.chooser.observe(self._unseen)
            self._unseen = None

    def admit(self, row: int) -> None:
        self._observe_unseen()  # the row's last request's steps count as its, not the new one's
        self.chooser.admit(row)
        self._next = None

    def pick(self, lens: dict[int, int]) -> int:
        if self._next is None:
            self._observe_unseen()
            self._next = self._choose(self.chooser, lens)
        return self._next

    def ahead(self, k: int, n: int, lens: dict[int, int]) -> None:
        self._spent = None
        self._observe_unseen()
        self.chooser.last_k = k
        if n == 1 and len(lens) <= self.MAX_FORK_ROWS:
            (row, length), = lens.items()
            self._fork_from = (row, length)
            forks = [({row: length + a + 1}, self.chooser.after_step(row, k, a)) for a in range(k + 1)]
            self._forks = [(ln, fork, self._choose(fork, ln)) for ln, fork in forks]
        else:  # every row commits at least n tokens
            self._next = self._choose(self.chooser, {r: length + n for r, length in lens.items()})

    def seen(self, counts: list[int], lens: dict[int, int]) -> None:
        forks, self._forks = self._forks, None
        if forks is not None:  # the outcome from the row's new length (the read is on the replays' path)
            self._spent = (forks, self.chooser)
            row, length = self._fork_from
            a = lens.get(row, length) - length - 1
            if 0 <= a < len(forks) and forks[a][0] == lens and forks[a][1].has_seen(counts):
                _, self.chooser, self._next = forks[a]
                return
            self._next = None  # not an outcome foreseen: chosen after the read
        self._unseen = counts
