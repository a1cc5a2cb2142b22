"""Adaptive K's choices priced with a device's step times, on any machine: which chooser settings would win.

    python benchmarks/sim_adaptive.py [--times 0.294,0.399,0.501,0.606,0.815,1.031] [--k-set 1,2,3,4,6,8]
        [--overhead 0.09] [--prefill-ms 0] [--batch-size 1] [--prompts 8] [--decays 0.9,0.95,0.98] [--temperature 0]
        [--device cpu] [--admission-wait W] [--prior-shrinks 0.9:4] [--choose-every 2,3] [--seeds 0,1,2]
        [--variants all|engine]
        [--skip-fixed] [--oracle]

Acceptance does not depend on the device: the engine runs the embedded pair on bench_adaptive.py's workloads
((i) held-out stdlib, (ii) random bytes, (iii) alternating) wherever it is, greedy (or sampled at --temperature
under the same --seeds for every run, a whole pass each), at each fixed K and at K="auto", and each run is priced
as if each replay had taken ``times[K] + overhead`` ms (defaults: the H200 table the auto engine measured at B=1
for the embedded pair, and the host time per replay read from that run's fixed-K rows; RESULTS.md, 2026-12-01).
The chooser sees ``times[K]`` as its table, plus the overhead for the variants marked "+h"; each variant runs
again blind to the work each row has left (the most tokens per second over the busy rows at every replay, as the
engine chose before). Simulated tok/ms = generated tokens / priced
time (prefills left out, or each at --prefill-ms).

--oracle (greedy, batch size 1) adds the most any choice of K per step could reach. Greedy output is the same for
every K, so a step that starts at committed length c commits min(a(c), K) + 1 tokens, a(c) being how many of
the output's next tokens the draft predicts in a row (read from one teacher-forced draft forward over prompt and
output); a shortest-path over c with the same prices picks each step's K knowing a(c). The same model also prices
each fixed K, which checks it against the engine's runs, and the best rule that picks K from the step before's
outcome alone, fitted to the same runs (a bound on choosers that remember one step).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_adaptive as ba  # noqa: E402
import torch  # noqa: E402
from bench_util import settings_as  # noqa: E402
from spec_graph import SpecDecoder, SpecGraphConfig, adaptive  # noqa: E402


def engine(k, B: int, kmax: int, device: str, admission_wait: int | None = None) -> SpecDecoder:
    kw = dict(max_speculative_tokens=kmax) if k == ba.AUTO else {}
    cfg = SpecGraphConfig(num_speculative_tokens=k, max_batch_size=B, max_len=ba.MAX_LEN, device=device,
                          batch_buckets=(B,), admission_wait=admission_wait, **kw)
    return SpecDecoder.from_pretrained(ba.DEFAULT_PAIR / "target", ba.DEFAULT_PAIR / "draft", cfg)


PRIOR_SETTINGS = ("PRIOR_SHRINK", "PRIOR_WEIGHT", "PRIOR_MISS_SCALE", "EXPLORE_MARGIN", "EXPLORE_ROWS")


def prior_as(*values: float):
    """The chooser's prior for each position: the rate of the one before it times PRIOR_SHRINK, its miss rate
    times PRIOR_MISS_SCALE, weighing PRIOR_WEIGHT row-steps against the observations; and the margin within which
    it tries a larger K whose deep position it has not seen (EXPLORE_MARGIN), at up to EXPLORE_ROWS busy rows:
    `values` in PRIOR_SETTINGS' order, the others as the engine has them."""
    return settings_as(adaptive, **dict(zip(PRIOR_SETTINGS, values)))


def priced(stats, times: dict, overhead: float, fixed_k=None, prefill_ms: float = 0.0) -> float:
    """Generated tokens per priced ms (stats: one call's, or a list of calls' summed); each prefill forward at
    ``prefill_ms``."""
    runs = stats if isinstance(stats, list) else [stats]
    ms = sum(times[k] + overhead for s in runs for k in (s.k_per_step or [fixed_k] * s.steps))
    return sum(s.generated_tokens for s in runs) / (ms + prefill_ms * sum(s.prefills for s in runs))


def prefills(stats: list) -> str:
    return "prefills per call " + " / ".join(f"{sum(s.prefills for s in runs) / len(runs):g}" for runs in stats)


def draft_runs(dec: SpecDecoder, result) -> list[int]:
    """a(c) for each committed length c from the prompt's end + 1 to the output's end: how many output tokens
    from position c on the draft predicts in a row, given the true tokens before each (one forward)."""
    seq = list(result.prompt_token_ids) + list(result.token_ids)
    kv = dec.draft.new_kv_cache(1, len(seq))
    with torch.no_grad():
        logits = dec.draft(torch.tensor([seq]), torch.arange(len(seq))[None], *kv)[0]
    hit = (logits[:-1].argmax(-1) == torch.tensor(seq[1:])).tolist()  # hit[j]: position j + 1 predicted
    runs, run = [0] * len(seq), 0
    for j in range(len(seq) - 2, -1, -1):
        run = run + 1 if hit[j] else 0
        runs[j + 1] = run
    return runs[len(result.prompt_token_ids) + 1:]


def oracle_ms(runs: list[int], price: dict) -> float:
    """The least priced ms to commit every token after the first, a step at offset c committing
    min(runs[c], K) + 1 tokens at price[K]."""
    n = len(runs)

    @functools.lru_cache(maxsize=None)
    def best(c: int) -> float:
        return 0.0 if c >= n else min(price[k] + best(c + min(runs[c], k) + 1) for k in price)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * n + 100))
    return best(0)


def policy_ms(runs: list[int], price: dict, choose) -> float:
    """Priced ms of the steps that K = choose(the step before's (K, accepted), None at first) takes."""
    c, ms, last = 0, 0.0, None
    while c < len(runs):
        k = choose(last)
        last = (k, min(runs[c], k))
        c, ms = c + last[1] + 1, ms + price[k]
    return ms


def fitted_memory_policy(seqs: list, price: dict, first: int) -> float:
    """tok/ms of the best rule "K from the step before's accepted count and whether it took all K" fitted to
    these very runs (coordinate ascent over the rule's table): what any chooser that remembers one step could
    reach at most, about."""
    states = [(a, full) for a in range(max(price) + 1) for full in (False, True)]
    table = dict.fromkeys(states, first)
    choose = lambda last: first if last is None else table[(last[1], last[1] == last[0])]  # noqa: E731
    rate = lambda: sum(n for n, _ in seqs) / sum(policy_ms(r, price, choose) for _, r in seqs)  # noqa: E731
    best = rate()
    for _ in range(3):
        for state, k in itertools.product(states, price):
            old, table[state] = table[state], k
            got = rate()
            if got > best:
                best = got
            else:
                table[state] = old
    return best


def run_oracle(wl: dict, ks: list, times: dict, overhead: float, max_new: int, device: str) -> dict:
    """{name: [tok/ms per workload]}: the oracle, the fitted one-step rule, and each fixed K under the same model
    (which should equal the engine's fixed-K rows)."""
    dec = engine(1, 1, max(ks), device)
    price = {k: times[k] + overhead for k in ks}
    rows: dict = {}
    for w in ba.WORKLOADS:
        seqs = []
        for p in wl[w]:
            (res,) = dec.generate([p], max_new)
            seqs.append((len(res.token_ids), draft_runs(dec, res)))
        tokens = sum(n for n, _ in seqs)
        rows.setdefault("oracle K per step", []).append(tokens / sum(oracle_ms(r, price) for _, r in seqs))
        rows.setdefault("best one-step rule, fitted to these runs", []).append(
            fitted_memory_policy(seqs, price, 4 if 4 in price else ks[0]))
        for k in ks:
            ms = sum(policy_ms(r, price, lambda last, k=k: k) for _, r in seqs)
            rows.setdefault(f"modelled K={k}", []).append(tokens / ms)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--times", default="0.294,0.399,0.501,0.606,0.815,1.031", help="ms per step for each K of --k-set")
    ap.add_argument("--k-set", default="1,2,3,4,6,8")
    ap.add_argument("--overhead", type=float, default=0.09, help="host ms per replay added to every step")
    ap.add_argument("--prefill-ms", type=float, default=0.0,
                    help="ms per prefill forward (0: prefills left out; at batch 8 their count differs by K: rows "
                         "finishing in one replay are admitted in one prefill)")
    ap.add_argument("--admission-wait", type=int, default=None,
                    help="the engines' SpecGraphConfig.admission_wait (slot-steps freed slots may wait to share a "
                         "prefill; default: the config's)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--decays", default="0.9,0.95,0.98", help="chooser decays per row-step to try (empty: none)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled (token verification)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", default=str(ba.SEED),
                    help="sampling seeds: each cell sums every seed's tokens and priced time (sampled runs vary by "
                         "several percent from one seed to the next)")
    ap.add_argument("--prior-shrinks", default="",
                    help="also the engine's chooser (+h) with other priors per position, as "
                         "shrink:weight[:miss[:explore[:rows]]] (0.9:4: the rate of the position before x 0.9, "
                         "weighing 4 row-steps; 1:1:1.5: its miss rate x 1.5; 0.9:1:1:0.03: a larger K within 3%% "
                         "tried where unseen; 0.9:1:1:0.02:1: tried at one busy row only; "
                         "sim_adaptive.PRIOR_SETTINGS)")
    ap.add_argument("--choose-every", default="", metavar="N,N",
                    help="also the engine's chooser (+h) choosing only every N-th replay where it chooses from the "
                         "batch's counts (more than one busy row), keeping the K running between "
                         "(bench_adaptive.choosing_every)")
    ap.add_argument("--variants", choices=("all", "engine"), default="all",
                    help="chooser variants per decay: all (with and without the host time, blind to rows' work "
                         "left or not) or the engine's alone (+h, by row)")
    ap.add_argument("--skip-fixed", action="store_true",
                    help="run the chooser variants alone (the fixed-K runs of these settings repeat, under one seed)")
    ap.add_argument("--oracle", action="store_true",
                    help="also the best K per step chosen knowing each step's acceptance (greedy, batch size 1)")
    a = ap.parse_args()
    everies = ba.replay_counts(a.choose_every)
    ks = [int(k) for k in a.k_set.split(",")]
    times = dict(zip(ks, (float(t) for t in a.times.split(","))))
    if len(times) != len(ks):
        ap.error("--times needs one value per K of --k-set")
    B, seeds = a.batch_size, [int(x) for x in a.seeds.split(",")]
    wl = {w: p[:a.prompts] for w, p in ba.workloads(a.prompts).items()}
    rows = {}
    gen = lambda dec, w: [dec.generate(wl[w], a.max_new_tokens, temperature=a.temperature, seed=seed).stats  # noqa
                          for seed in seeds]
    for k in ks if not a.skip_fixed else ():
        dec = engine(k, B, max(ks), a.device, a.admission_wait)
        out = [gen(dec, w) for w in ba.WORKLOADS]
        rows[f"K={k}"] = [priced(s, times, a.overhead, k, a.prefill_ms) for s in out]
        print(f"K={k}: " + " / ".join(f"{x:.3f}" for x in rows[f"K={k}"]) + f"  ({prefills(out)})", flush=True)
    decays = [float(x) for x in a.decays.split(",") if x]
    variants = [(f"auto decay {d}" + (" +h" if h else "") + ("" if by_row else ", blind to rows' work left"), d,
                 h, (), by_row, 1)
                for d in decays for h in (False, True) for by_row in (True, False)
                if a.variants == "all" or h and by_row]
    for item in (x for x in a.prior_shrinks.split(",") if x):
        prior = tuple(float(v) for v in item.split(":"))
        if len(prior) > len(PRIOR_SETTINGS):
            ap.error(f"--prior-shrinks {item!r}: at most {len(PRIOR_SETTINGS)} values, {':'.join(PRIOR_SETTINGS)}")
        label = ", ".join(f"{name} {v:g}" for name, v in zip(PRIOR_SETTINGS, prior))
        variants += [(f"auto decay {d} +h, {label}", d, True, prior, True, 1) for d in decays]
    for every in everies:
        variants += [(f"auto decay {d} +h, choosing every {every} replays", d, True, (), True, every) for d in decays]
    if variants:
        dec = engine(ba.AUTO, B, max(ks), a.device, a.admission_wait)
        dec.step_times = {(g, B, k): 1e-3 * t for k, t in times.items() for g in (True, False)}
    for name, decay, with_h, prior, by_row, every in variants:
        with ba.chooser_as(decay=decay, host_ms=a.overhead if with_h else 0.0, rows=by_row), prior_as(*prior), \
                ba.choosing_every(every):
            out = [gen(dec, w) for w in ba.WORKLOADS]
        rows[name] = [priced(s, times, a.overhead, prefill_ms=a.prefill_ms) for s in out]
        mean_k = [sum(k for s in runs for k in s.k_per_step) / sum(len(s.k_per_step) for s in runs) for runs in out]
        print(f"{name}: " + " / ".join(f"{x:.3f}" for x in rows[name])
              + "  (mean K " + " / ".join(f"{m:.2f}" for m in mean_k) + f"; {prefills(out)})", flush=True)
    if a.oracle:
        if a.temperature or B != 1:
            ap.error("--oracle prices greedy runs at batch size 1")
        rows.update(run_oracle(wl, ks, times, a.overhead, a.max_new_tokens, a.device))
    if a.skip_fixed:  # no fixed K to compare with: the chooser's figures alone
        for n, r in rows.items():
            print(f"| {n} | {' / '.join(f'{x:.3f}' for x in r)} |")
        return
    best = {w: max((r[i], n) for n, r in rows.items() if n.startswith("K=")) for i, w in enumerate(ba.WORKLOADS)}
    print(f"\ntemperature {a.temperature}")
    print("| variant | simulated tok/ms (i) / (ii) / (iii) | vs best fixed K (i) / (ii) | vs K=4 (iii) |")
    print("|---|---|---|---|")
    for n, r in rows.items():
        vs = " / ".join(f"{r[i] / best[w][0]:.3f}" for i, w in enumerate(ba.WORKLOADS[:2]))
        k4 = rows.get("K=4")
        print(f"| {n} | {' / '.join(f'{x:.3f}' for x in r)} | {vs} | " + (f"{r[2] / k4[2]:.3f} |" if k4 else "n/a |"))
    print("best fixed K: " + ", ".join(f"{w} {best[w][1]}" for w in ba.WORKLOADS))


if __name__ == "__main__":
    main()
