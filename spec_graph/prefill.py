"""Admission's prefill: one forward of both models over the admitted prompts, then each row's first token and
state, all on the device; replayed from a graph per (rows, padded length, greedy) where that pays.

``Prefills`` is a part of ``runtime.DecoderBase``: it reads the engine's state buffers, caches and stop ids."""
from __future__ import annotations

import torch

from .capture import GraphSet
from .kernels import PLACEHOLDER, REQUEST_ROW, race_sample
from .sampling import SamplingParams, logits_to_probs

# Prefills of at most this many positions (rows x padded length), each row at most PREFILL_GRAPH_LEN long, replay
# a graph: short ones are bound by kernel launches on the host, long ones by the device. (On an H200, a B=8 call
# of bench_adaptive.py admits 8 prompts of 128 positions at once: 84 ms per call run eagerly, 61 ms replayed.)
# The length bound keeps a graph's attention scores (rows x heads x length^2) within what 512 allowed before.
PREFILL_GRAPH_TOKENS = 1024
PREFILL_GRAPH_LEN = 512
# A prefill's per-row integers after its tokens: length, slot, max_new, seed, top_k (_prefill_rows)
PREFILL_COLUMNS = 5


class Prefills:
    """The prefill half of ``DecoderBase``; a subclass supplies ``_prefill_forward``."""

    def _new_prefill_graphs(self) -> None:
        # A pool of their own: a prefill graph's logits stay live in it while step graphs replay.
        self.prefill_graphs = GraphSet(self.platform) if self.graphs is not None and self.capture_prefill else None
        self._prefill_inputs: dict = {}

    def _reads_live_only(self) -> bool:
        """Whether every forward attends to positions its request wrote and no others (a subclass says; the
        prefill's kv_len and the live-length kernel do); if not, a slot's old contents are read, masked."""
        return False

    def _zero_slots(self, slots: torch.Tensor, upto: int | None = None) -> None:
        """Zero positions [0, upto) of these slots' caches (None: all of them)."""
        # A slot may hold another request's non-finite garbage; masked keys would still poison p @ v. Only where
        # old positions are read, and only below where earlier requests wrote: its cost follows their lengths,
        # not max_len.
        if self._reads_live_only():
            return
        for kc, vc in (self.target_kv, self.draft_kv):
            kc[:, slots, :, :upto] = 0
            vc[:, slots, :, :upto] = 0

    def _caches_touched(self) -> None:
        """Runs outside any request (capture, timing) wrote the caches at positions of their own: every slot is
        zeroed whole at its next admission."""
        self._written_below = [self.cache_len] * self.rows

    def _admitted(self, slots: list[int], lens: list[int], max_new: list[int], T: int) -> int:
        """Records where the requests now in ``slots`` can write, and returns the positions to clear first: below
        where the slots' earlier requests could. A request writes its prefill's T positions (padding included),
        then at most K + 1 past its committed length per step, that length staying within its prompt and
        max_new; a finished or free row's step writes scratch at its last length, the same bound."""
        upto = max(self._written_below[s] for s in slots)
        cleared = not self._reads_live_only()  # else the old contents stay, below the old bound
        for s, n, m in zip(slots, lens, max_new):
            bound = min(self.cache_len, max(T, n + m + 2 * self.K + 2))
            self._written_below[s] = bound if cleared else max(bound, self._written_below[s])
        return upto

    def _prefill(self, slots: list[int], prompts: list[list[int]], max_new: list[int], seeds: list[int],
                 params: SamplingParams, meanwhile=None) -> list[bool]:
        """Admit `prompts` into `slots`: one forward of both models, then each row's first token and state, all on
        the device (in one graph where the prefill replays one). Returns whether each row goes on (one host read);
        `meanwhile()`, if given, runs on the host between the prefill's launch and that read."""
        n = len(slots)
        T = max(len(p) for p in prompts)
        # Padded to a power of two where a prefill can replay a graph on this platform (one graph per shape: few
        # shapes), whether or not this engine captures: an uncaptured engine on the device then runs the same
        # shapes, so the same kernels and tokens, as a captured one. Elsewhere a prefill runs at its own length
        # (a 6000-token prompt is not worth 8191 positions). Below cache_len (prompts are shorter than max_len),
        # as an export's span is.
        padded = self._padded_length(T)
        T = padded if self.capture_prefill and self.platform.supports_graphs and self._graph_shape(n, padded) else T
        # Every per-row input in two host tensors, two copies to the device: a graph bakes in no request's values.
        rows = torch.zeros(n, T + PREFILL_COLUMNS, dtype=torch.long)
        for i, p in enumerate(prompts):
            rows[i, : len(p)] = torch.tensor(p)
        top_k = min(params.top_k, self.vocab_size)  # the same filter; an int64 whatever top_k is
        rows[:, T:] = torch.tensor([[len(p), s, m, seed, top_k]
                                    for p, s, m, seed in zip(prompts, slots, max_new, seeds)])
        floats = torch.tensor([[max(params.temperature, 1e-5), params.top_p]] * n, dtype=torch.float32)
        rows, floats = rows.to(self.device), floats.to(self.device)
        upto = self._admitted(slots, [len(p) for p in prompts], max_new, T)
        self._zero_slots(rows[:, T + 1], None if upto >= self.cache_len else upto)
        active = self._prefill_run(rows, floats, params.greedy)
        if meanwhile is not None:
            meanwhile()
        return active.tolist()

    @torch.inference_mode()  # captured or not: the same (inference) tensors reach a compiled forward's guards
    def _prefill_rows(self, rows: torch.Tensor, floats: torch.Tensor, greedy: bool) -> torch.Tensor:
        """The prefill over device inputs alone (what its graph records): ``rows [n, T + PREFILL_COLUMNS]`` holds
        each row's tokens, then its length, slot, max_new, seed and top_k; ``floats [n, 2]`` its temperature and
        top_p. Commits each row's first token and writes its state; returns whether each row goes on."""
        n, T = rows.shape[0], rows.shape[1] - PREFILL_COLUMNS
        toks = rows[:, :T].contiguous()
        lens, slot_t, max_new_t, seeds_t, top_k = (c.contiguous() for c in rows[:, T:].t())
        temperature, top_p = (c.contiguous() for c in floats.t())
        dev = rows.device
        pos = torch.arange(T, device=dev).expand(n, T)
        logits = self._prefill_forward(toks, pos, slot_t, lens)
        st = self.state
        st["temperature"][slot_t] = temperature
        st["top_k"][slot_t] = top_k
        st["top_p"][slot_t] = top_p
        if greedy:
            first = logits.argmax(-1)
        else:
            probs = logits_to_probs(logits, temperature, top_k, top_p)
            zero = torch.zeros_like(seeds_t)  # tensors, not ints: an int becomes a host-to-device copy
            first = race_sample(probs, seeds_t, zero, torch.full_like(seeds_t, REQUEST_ROW), zero)
        finite = torch.isfinite(logits).all(-1)
        # a compare, not torch.isin: isin sorts and reads sizes back on the host (0.8 ms per prefill on CUDA)
        done = (first[:, None] == self.stop_buf[None, :]).any(-1) | (max_new_t <= 1)
        active = finite & ~done
        st["tail"][slot_t] = torch.stack((toks[torch.arange(n, device=dev), lens - 1], first), 1)
        st["seq_lens"][slot_t] = lens + 1
        st["n_out"][slot_t] = finite.long()  # non-finite logits commit nothing: no made-up first token
        st["max_new"][slot_t] = max_new_t
        st["seeds"][slot_t] = seeds_t
        st["error"][slot_t] = ~finite
        st["active"][slot_t] = active
        # constants by index_fill_: `t[idx] = 1` copies the 1 from the host, which no graph may record
        st["steps"].index_fill_(0, slot_t, 1)
        self.out_buf.index_fill_(0, slot_t, PLACEHOLDER)
        self.out_buf[:, 0].index_copy_(0, slot_t, first)
        self.acc_log.index_fill_(0, slot_t, 0)
        return active

    def _padded_length(self, T: int) -> int:
        return min(1 << (T - 1).bit_length(), self.cache_len - 1)

    def _graph_shape(self, n: int, T: int) -> bool:
        """Whether a prefill of n rows of T positions has a shape that replays a graph. Only padded lengths do: an
        eager prefill at its own length (too many positions padded) keeps its shape off the graphs."""
        return T == self._padded_length(T) and n * T <= PREFILL_GRAPH_TOKENS and T <= PREFILL_GRAPH_LEN

    def _prefill_replays(self, n: int, T: int) -> bool:
        """Whether a prefill of n rows of T positions replays a graph (else it runs eagerly)."""
        return self.prefill_graphs is not None and self._graph_shape(n, T)

    def _prefill_run(self, rows: torch.Tensor, floats: torch.Tensor, greedy: bool) -> torch.Tensor:
        """``_prefill_rows``, replayed from a graph per (rows, length, greedy) where that pays.

        Capturing runs the prefill for real (warm-up) with the request's own inputs: it rewrites the same
        slots' caches and state with the same values, so it is harmless. The result is the graph's static
        output, valid until the next prefill."""
        n, T = rows.shape[0], rows.shape[1] - PREFILL_COLUMNS
        graphs, key = self.prefill_graphs, (n, T, greedy)
        if not self._prefill_replays(n, T) or key in graphs.failed:
            return self._prefill_rows(rows, floats, greedy)
        static = self._prefill_inputs.get(key)
        if static is None:
            static = (rows.clone(), floats.clone())
            with torch.inference_mode():
                if not graphs.capture(key, lambda: self._prefill_rows(*static, greedy)):
                    return self._prefill_rows(rows, floats, greedy)
            self._prefill_inputs[key] = static
        else:
            for dst, src in zip(static, (rows, floats)):
                dst.copy_(src)
        return graphs.replay(key)
