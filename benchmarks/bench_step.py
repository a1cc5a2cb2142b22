"""Speculative-step latency on one GPU, side by side in one run.

    python benchmarks/bench_step.py [--batch-sizes 1,8,32] [--iters 50] [--plot] [--out benchmarks/RESULTS.md]

Random-weight Llama pair, bf16, K=4, context 512 (target 2048 x 16 layers,
32/8 heads, inter 5632, vocab 32000, ~0.85B; draft 768 x 4 layers, 12/4
heads, inter 2048, ~74M). Variants, in ms per speculative iteration:

  (a) HF transformers assisted generation (num_assistant_tokens=4, constant), B=1 only
  (b) gpt-fast style: each draft step and the verify compiled with mode="reduce-overhead",
      acceptance decided on the host every iteration
  (c) spec-graph: the whole step captured as one graph (fusion passes on; and off)
  (d) spec-graph multi-step: 8 steps per graph, per step
  (e) a captured target-only single-token decode step, compiled as the engine compiles its step (the
      spec_graph backend with its inductor settings and the ops opaque); ``--e-plain`` also times it compiled
      by a plain torch.compile, as (e) was before 2026-12-04
  and the bytes floor: weights + KV read per step over the measured copy bandwidth.

Timings are CUDA-event medians after warm-up. Each run also counts the kernels of one (c) and one (e)
replay (torch.profiler) and the share of the measured copy bandwidth that (c) and (e) reach (bytes floor
over time). ``--max-len`` / ``--context`` move the static cache length and the live context.

    python benchmarks/bench_step.py --table [--batch-sizes 1,8] [--table-max-lens 640,8192,32768]

``--inductor-variants pdl,autotune,coordesc`` also times (c) at the first batch size compiled with each of those
inductor settings (see INDUCTOR_VARIANTS), against the default compile of the same run. ``--layer-variants
none,target,draft`` times (c) at every batch size with the fused decode linear layers (kernels/decode_linear.py)
in those models only (see LAYER_VARIANTS; the default fuses both), against the default of the same run.

times (c) alone at contexts 512 / 4k / 16k / 32k for each max_len where they fit, each with its floor
(weights plus the live KV only): the step's cost should follow the context, not max_len.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec_graph import SpecGraphConfig  # noqa: E402
from spec_graph.config import cache_length  # noqa: E402
from spec_graph import platform as sg_platform  # noqa: E402
from spec_graph.backend import backend_compile  # noqa: E402
from spec_graph.capture import GraphSet  # noqa: E402
from spec_graph.engine import SpecDecoder  # noqa: E402
from spec_graph.kernels import PLACEHOLDER  # noqa: E402
from spec_graph.models import load_model  # noqa: E402

from bench_util import (Bar, append_section, apply_settings, attempt, copy_bandwidth, kernel_count,  # noqa: E402
                        median_ms, progress, report_head, timing_lock)

TARGET = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
              intermediate_size=5632, vocab_size=32000)
DRAFT = dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=32000)
K = 4
CONTEXT = 512
MAX_LEN = 640  # the static cache spans cache_length(MAX_LEN, K) positions; attention reads all of them
CACHE_LEN = cache_length(MAX_LEN, K)
HOST_REPEATS = 5  # generations timed for the host CPU figure; the median is reported
# inductor settings a run can compare (--inductor-variants): programmatic dependent launch, Triton GEMM
# templates chosen by autotuning (with epilogue fusion), tuned pointwise/reduction launches
INDUCTOR_VARIANTS = {"pdl": {"triton.enable_pdl": True}, "autotune": {"max_autotune_gemm": True},
                     "coordesc": {"coordinate_descent_tuning": True}}
# (target, draft) fused decode linear layers of a --layer-variants run; the default step fuses both
LAYER_VARIANTS = {"none": (False, False), "target": (True, False), "draft": (False, True)}


def make_pair(root: Path):
    import transformers

    dirs = []
    for name, dims, seed in (("target", TARGET, 0), ("draft", DRAFT, 1)):
        # a window that covers the --table's longest cache (32768): larger max_len values warn otherwise
        cfg = transformers.LlamaConfig(max_position_embeddings=40960, tie_word_embeddings=False,
                                       eos_token_id=None, bos_token_id=None, **dims)
        cfg.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(seed)
        with torch.device("cuda"):
            m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        m.save_pretrained(root / name)
        dirs.append((root / name, m))
    return dirs


# ----------------------------------------------------------------- (a) HF assisted generation
def bench_hf(hf_target, hf_draft, iters: int) -> float:
    hf_draft.generation_config.num_assistant_tokens = K
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    if hasattr(hf_draft.generation_config, "assistant_confidence_threshold"):
        hf_draft.generation_config.assistant_confidence_threshold = 0.0
    calls = []
    h = hf_target.register_forward_pre_hook(lambda *a: calls.append(time.perf_counter()))
    ids = torch.randint(0, 32000, (1, CONTEXT), device="cuda")
    per_iter = []
    with torch.no_grad(), timing_lock():
        for rep in range(3):
            calls.clear()
            torch.cuda.synchronize()
            hf_target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=hf_draft,
                               max_new_tokens=iters, min_new_tokens=iters, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            end = time.perf_counter()
            # iterations = target forwards after the prefill; time from the first verify to the end
            if len(calls) > 2 and rep > 0:
                per_iter.append((end - calls[1]) / (len(calls) - 1) * 1e3)
    h.remove()
    return statistics.median(per_iter)


# ----------------------------------------------------------------- (b) gpt-fast style
class _Cached(torch.nn.Module):
    """A model with its KV cache as module buffers, as gpt-fast keeps it."""

    def __init__(self, model, B):
        super().__init__()
        self.model = model
        k, v = model.new_kv_cache(B, CACHE_LEN)
        self.register_buffer("k_cache", k)
        self.register_buffer("v_cache", v)

    def forward(self, tokens, positions):
        return self.model(tokens, positions, self.k_cache, self.v_cache)


def bench_gptfast(target, draft, B: int, iters: int, bar: Bar) -> float:
    """gpt-fast's loop: K compiled draft decodes, a compiled verify, acceptance read on the host."""
    t, d = _Cached(target, B), _Cached(draft, B)
    decode = torch.compile(d, mode="reduce-overhead", fullgraph=True)
    verify = torch.compile(t, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, 32000, (B, CONTEXT), device="cuda")
    with torch.no_grad():
        pos = torch.arange(CONTEXT, device="cuda").expand(B, CONTEXT)
        t(prompt, pos)
        d(prompt, pos)
    # Positions stay at the 512-token context so every iteration costs the same.
    base = torch.full((B, 1), CONTEXT, device="cuda")
    vpos = base - 1 + torch.arange(K + 1, device="cuda")[None]
    state = {"last": prompt[:, -1:].clone()}

    def iteration():
        cur, drafts = state["last"], []
        for j in range(K):
            cur = decode(cur, base - 1 + j)[:, -1].argmax(-1, keepdim=True)
            drafts.append(cur)
        dr = torch.cat(drafts, 1)
        tgt = verify(torch.cat((state["last"], dr), 1), vpos).argmax(-1)
        mism = dr != tgt[:, :K]
        if B == 1:  # gpt-fast's own formulation: nonzero, .item(), branch on the result
            rej = mism[0].nonzero()
            n_acc = [K if rej.shape[0] == 0 else rej[0].item()]
        else:  # one host read per step for a batch
            n_acc = [r.index(True) if True in r else K for r in mism.tolist()]
        if any(n == K for n in n_acc):  # all accepted: feed the last draft to the draft cache
            decode(dr[:, -1:], base + K - 1)
        state["last"] = tgt.gather(1, torch.tensor(n_acc, device="cuda")[:, None])

    with torch.no_grad():
        for _ in range(3):  # compile, cudagraph warm-up and record
            iteration()
        bar.step()
        return median_ms(iteration, iters)


# ----------------------------------------------------------------- (c)(d) spec-graph
PRIME_PREFILL = 1024  # longer contexts are primed without a prefill: the step's cost does not depend on the KV values


def prime(dec: SpecDecoder, B: int, context: int | None = None) -> dict:
    """Fill rows [0, B) with `context`-token contexts; return a snapshot to restore before each timing.

    Up to PRIME_PREFILL tokens the context is prefilled; a longer one is a short prefill whose committed
    length is then set to `context` (the cache below it holds whatever is there, which costs the same)."""
    context = context or CONTEXT
    max_len = dec.config.max_len
    dec.stop_buf.fill_(PLACEHOLDER)
    n = context - 1 if context <= PRIME_PREFILL else 15
    prompts = [torch.randint(0, 32000, (n,)).tolist() for _ in range(B)]
    from spec_graph.sampling import SamplingParams

    dec._prefill(list(range(B)), prompts, [max_len - context] * B, list(range(B)), SamplingParams())
    if context > PRIME_PREFILL:
        dec.state["seq_lens"][:B] = context
        dec._caches_touched()  # its steps now write past the admitted requests' bounds
    return {k: v.clone() for k, v in dec.state.items()}


def restore(dec: SpecDecoder, snap: dict) -> None:
    for k, v in snap.items():
        dec.state[k].copy_(v)


def bench_specgraph(dec: SpecDecoder, B: int, iters: int, per: int, kernels: dict | None = None,
                    context: int | None = None) -> float:
    snap = prime(dec, B, context)
    ms = median_ms(lambda: dec._run_steps(B, True), iters, setup=lambda: restore(dec, snap))
    if kernels is not None:
        restore(dec, snap)
        kernels[B] = kernel_count(lambda: dec._run_steps(B, True), replays=1) / per
    restore(dec, snap)
    dec.state["active"].zero_()  # leave every row inactive for later captures
    return ms / per


def build_decoder(tdir, ddir, batch_sizes, passes: dict, steps_per_graph: int, bar: Bar,
                  max_len: int | None = None, fused: tuple | None = None) -> SpecDecoder:
    cfg = SpecGraphConfig(num_speculative_tokens=K, max_batch_size=max(batch_sizes), max_len=max_len or MAX_LEN,
                          dtype="bfloat16", batch_buckets=tuple(batch_sizes), steps_per_graph=steps_per_graph,
                          passes=passes)
    dec = SpecDecoder.from_pretrained(tdir, ddir, cfg)
    if fused is not None:
        dec.target.fused_layers, dec.draft.fused_layers = fused
    with counted_captures(dec.graphs, bar):
        dec._capture(True)
    assert all((True, b, K) in dec.graphs for b in batch_sizes), dec.graphs.failed
    return dec


def recapture(dec: SpecDecoder, steps_per_graph: int, bar: Bar) -> None:
    """Capture every bucket again with N steps per graph (the compiled step is reused)."""
    dec.reset_graphs(steps_per_graph)
    with counted_captures(dec.graphs, bar):
        dec._capture(True)


@contextlib.contextmanager
def counted_captures(graphs: GraphSet, bar: Bar):
    """Each capture of `graphs` steps `bar`. The wrapper holds the set, so it goes when done: left in place, a
    dropped set (and its graphs) would wait in a reference cycle for the garbage collector."""
    orig = graphs.capture
    graphs.capture = lambda key, f, warmup=2: (orig(key, f, warmup), bar.step())[0]
    try:
        yield
    finally:
        del graphs.capture


# ----------------------------------------------------------------- (e) target-only decode
def target_decode(target, B: int, plain: bool = False):
    """The target's one-token decode at B rows (a context of CONTEXT in a CACHE_LEN cache), compiled as the engine
    compiles its step, or (plain) by torch.compile with inductor's defaults; compiled at its first call."""
    kv = target.new_kv_cache(B, CACHE_LEN)
    tok = torch.randint(0, 32000, (B, 1), device="cuda")
    pos = torch.full((B, 1), CONTEXT, device="cuda")
    fn = lambda: target(tok, pos, *kv)  # noqa: E731
    if plain:
        return torch.compile(fn, fullgraph=True, dynamic=False)
    return backend_compile(fn, "cuda", opaque_kernels=True)


def bench_target_decode(target, B: int, iters: int, graphs: GraphSet, plain: bool = False) -> tuple:
    """(ms per replay, kernels per replay) of target_decode, captured."""
    f = target_decode(target, B, plain)
    with torch.no_grad():
        key = ("decode", B) + (("plain",) if plain else ())
        assert graphs.capture(key, f), graphs.failed
        replay = lambda: graphs.replay(key)  # noqa: E731
        return median_ms(replay, iters), kernel_count(replay)


def host_cpu_per_token(dec: SpecDecoder, B: int, steps_per_graph: int, bar: Bar) -> tuple[float, float]:
    """Process CPU ms per generated token outside graph replay (and the wait for the device).

    Every replay is left out: the steps' and the short prefills'. Returns (all of it, the decode loop
    alone: what prefills cost outside their replay left out too). Prompts are short and generations
    long, so the per-request prefill is spread over many tokens."""
    recapture(dec, steps_per_graph, bar)
    excluded = {"replay": 0.0, "prefill": 0.0}

    def timed_replay(fn):
        def wrapped(*args):
            t0 = time.process_time()
            out = fn(*args)
            torch.cuda.synchronize()
            excluded["replay"] += time.process_time() - t0
            return out
        return wrapped

    def timed_prefill(fn):
        def wrapped(*args):
            r0, t0 = excluded["replay"], time.process_time()
            fn(*args)
            torch.cuda.synchronize()
            excluded["prefill"] += time.process_time() - t0 - (excluded["replay"] - r0)
        return wrapped

    prefill = dec._prefill
    for g in (dec.graphs, dec.prefill_graphs):
        if g is not None:
            g.replay = timed_replay(g.replay)
    dec._prefill = timed_prefill(prefill)
    prompt_len = 64
    prompts = [torch.randint(0, 32000, (prompt_len,)).tolist() for _ in range(B)]
    runs = []
    try:
        dec.generate(prompts, 64)  # warm (and captures the prefill's graph)
        with timing_lock():
            for _ in range(HOST_REPEATS):
                excluded.update(replay=0.0, prefill=0.0)
                t0 = time.process_time()
                out = dec.generate(prompts, MAX_LEN - prompt_len - 1)
                total = time.process_time() - t0
                n = out.stats.generated_tokens
                runs.append(((total - excluded["replay"]) / n * 1e3,
                             (total - excluded["replay"] - excluded["prefill"]) / n * 1e3))
    finally:
        dec._prefill = prefill
        for g in (dec.graphs, dec.prefill_graphs):
            if g is not None:
                del g.replay
    # the median run: a few milliseconds of unrelated host work land in one generation now and then
    return sorted(runs)[len(runs) // 2]


def host_lines(B: int, host1, host8) -> list[str]:
    if host1 is None or host8 is None:
        return []
    return [f"- host CPU time per generated token outside replay (median of {HOST_REPEATS} generations), B={B}: "
            f"N=1 {host1[0]:.4f} ms, N=8 {host8[0]:.4f} ms (ratio {host8[0] / host1[0]:.2f}); the decode loop "
            f"alone (prefill host work excluded too): N=1 {host1[1]:.4f} ms, N=8 {host8[1]:.4f} ms "
            f"(ratio {host8[1] / host1[1]:.2f})"]


def default_pair_real(iters_prompts: int = 8):
    sys.path.insert(0, str(ROOT / "examples"))
    from default_pair_acceptance import DEFAULT_PAIR, load_corpus, make_prompts
    import sysconfig

    _, val, _ = load_corpus(Path(sysconfig.get_paths()["stdlib"]), val_every=20, max_file_bytes=400_000)
    prompts = make_prompts(val, iters_prompts, 0) if val else [list(b"def ")] * iters_prompts
    cfg = SpecGraphConfig(num_speculative_tokens=K, max_batch_size=1, max_len=512, batch_buckets=(1,),
                          steps_per_graph=8)
    dec = SpecDecoder.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", cfg)
    dec.generate(prompts[:1], 32)
    with timing_lock():
        out = dec.generate(prompts, 128)
    s = out.stats
    return s.acceptance_rate, s.wall_time_s / s.generated_tokens * 1e3, s.tokens_per_step


TABLE_CONTEXTS = (512, 4096, 16384, 32000)


def context_table(tdir, ddir, Bs, max_lens, iters: int, bw: float) -> list[str]:
    """(c) per (max_len, context) at each batch size, with its floor (weights + live KV)."""
    rows = []
    for max_len in max_lens:
        progress(f"table: max_len {max_len}: compile + capture")
        dec = build_decoder(tdir, ddir, Bs, {}, 1, Bar(len(Bs), "compile+capture"), max_len=max_len)
        for ctx in (c for c in TABLE_CONTEXTS if c + 2 * K + 2 <= max_len):
            for b in Bs:
                ms = bench_specgraph(dec, b, iters, 1, context=ctx)
                floor = step_bytes(dec.target, dec.draft, b, ctx) / bw * 1e3
                rows.append((b, max_len, ctx, ms, floor))
                progress(f"  B={b} max_len={max_len} context={ctx}: {ms:.3f} ms (floor {floor:.3f})")
        del dec
        torch.cuda.empty_cache()
    L = ["| B | max_len | context | (c) ms | floor ms | (c)/floor |", "|---|---|---|---|---|---|"]
    L += [f"| {b} | {m} | {c} | {ms:.3f} | {fl:.3f} | {ms / fl:.2f}x |" for b, m, c, ms, fl in sorted(rows)]
    return L


def main():
    global MAX_LEN, CACHE_LEN, CONTEXT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--plot", action="store_true", help="also write a PNG of ms/step per batch size")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--skip", default="", help="comma-separated variants to skip: a,b,d,e,off,host,real")
    ap.add_argument("--max-len", type=int, default=MAX_LEN, help="static cache length of (b), (c), (d), (e)")
    ap.add_argument("--context", type=int, default=CONTEXT, help="live context of every variant")
    ap.add_argument("--table", action="store_true", help="only the (c) table over contexts and max_len")
    ap.add_argument("--table-max-lens", default="640,8192,32768")
    ap.add_argument("--inductor-variants", default="",
                    help=f"also time (c) at the first batch size compiled with these inductor settings: "
                         f"{','.join(INDUCTOR_VARIANTS)}")
    ap.add_argument("--layer-variants", default="",
                    help=f"also time (c) at every batch size with the fused decode linear layers in these models "
                         f"only: {','.join(LAYER_VARIANTS)}")
    ap.add_argument("--e-plain", action="store_true",
                    help="also time (e) compiled by a plain torch.compile (inductor's defaults, the ops decomposed)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a spec_graph.kernels setting for this run, e.g. linear_launch.ONE_STEP_ROWS=1 (repeatable)")
    a = ap.parse_args()
    apply_settings(a.set)
    for opt, known in (("inductor_variants", INDUCTOR_VARIANTS), ("layer_variants", LAYER_VARIANTS)):
        unknown = {v for v in getattr(a, opt).split(",") if v} - set(known)
        if unknown:
            ap.error(f"unknown --{opt.replace('_', '-')} {sorted(unknown)}; choose from {','.join(known)}")
    if not torch.cuda.is_available():
        sys.exit("bench_step.py needs a CUDA GPU")
    MAX_LEN, CONTEXT = a.max_len, a.context
    CACHE_LEN = cache_length(MAX_LEN, K)
    if a.table:
        return main_table(a)
    skip = set(a.skip.split(",")) - {""}
    Bs = [int(b) for b in a.batch_sizes.split(",")]
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = True
    dev_name = sg_platform.current().device_name()
    res: dict = {b: {} for b in Bs}

    out = Path(a.out)
    prev = out.read_text() if out.exists() else "# Benchmark results\n"
    host = {"1": None, "8": None}
    real_box: list = [None]
    errors: dict = {}

    def flush(bw_):
        """Rewrite the report with what is measured so far (a run cut short still leaves its numbers)."""
        floors(res, Bs, bw_, target_draft[0])
        lines = report(res, Bs, bw_, dev_name, time.time() - t_start, a, host["1"], host["8"], real_box[0])
        lines += [f"- variant {k} failed: {v}" for k, v in errors.items()]
        out.write_text(prev.rstrip() + "\n\n" + "\n".join(lines) + "\n")
        return lines

    target_draft: list = [None]
    bw = copy_bandwidth()
    progress(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    root = Path(tempfile.mkdtemp())
    (tdir, hf_t), (ddir, hf_d) = make_pair(root)
    if "a" not in skip and 1 in res:
        progress("(a) HF assisted generation, B=1")
        res[1]["a"] = attempt("a", errors, bench_hf, hf_t, hf_d, a.iters)
        flush(bw)
    del hf_t, hf_d
    torch.cuda.empty_cache()

    progress("(c) spec-graph: compile + capture per bucket (passes on)")
    dec = attempt("c", errors, build_decoder, tdir, ddir, Bs, {}, 1, Bar(len(Bs), "compile+capture"))
    if dec is not None:
        kernels: dict = {}
        for b in Bs:
            res[b]["c"] = attempt("c", errors, bench_specgraph, dec, b, a.iters, 1, kernels)
            res[b]["c_kernels"] = kernels.get(b)
        progress("(d) spec-graph multi-step N=8")
        if "d" not in skip and attempt("d", errors, recapture, dec, 8, Bar(len(Bs), "capture N=8")) is None \
                and "d" not in errors:
            for b in Bs:
                res[b]["d"] = attempt("d", errors, bench_specgraph, dec, b, a.iters, 8)
        target, draft = dec.target, dec.draft
    else:
        target, draft = (load_model(d, torch.bfloat16, "cuda") for d in (tdir, ddir))
    target_draft[0] = (target, draft)
    flush(bw)
    if "b" not in skip:
        progress("(b) gpt-fast style")
        bar = Bar(len(Bs), "compile")
        for b in Bs:
            res[b]["b"] = attempt("b", errors, bench_gptfast, target, draft, b, a.iters, bar)
            flush(bw)
    if "e" not in skip:
        progress("(e) captured target-only decode")
        g = GraphSet(sg_platform.current())
        bar = Bar(len(Bs), "compile+capture")
        for b in Bs:
            e = attempt("e", errors, bench_target_decode, target, b, a.iters, g)
            res[b]["e"], res[b]["e_kernels"] = e if e is not None else (None, None)
            if a.e_plain:
                e = attempt("e_plain", errors, bench_target_decode, target, b, a.iters, g, True)
                res[b]["e_plain"], res[b]["e_plain_kernels"] = e if e is not None else (None, None)
            bar.step()
        flush(bw)
    if "off" not in skip:
        progress("(c-off) spec-graph with fusion passes off, B=1")
        def off():
            dec_off = build_decoder(tdir, ddir, [1], {name: False for name in _pass_names()}, 1, Bar(1, "compile"))
            return bench_specgraph(dec_off, 1, a.iters, 1)

        res[Bs[0]]["c_off"] = attempt("c_off", errors, off)
        flush(bw)
    for name in (v for v in a.inductor_variants.split(",") if v):
        progress(f"(c-{name}) spec-graph compiled with inductor {INDUCTOR_VARIANTS[name]}, B={Bs[0]}")

        def variant(opts=INDUCTOR_VARIANTS[name]):
            import torch._inductor.config as ind

            for key in opts:
                obj = ind
                for part in key.split(".")[:-1]:
                    obj = getattr(obj, part)
                if not hasattr(obj, key.split(".")[-1]):
                    raise RuntimeError(f"this torch's inductor has no setting {key}")
            with ind.patch(opts):
                dec_v = build_decoder(tdir, ddir, [Bs[0]], {}, 1, Bar(1, "compile"))
            return bench_specgraph(dec_v, Bs[0], a.iters, 1)

        res[Bs[0]][f"c_{name}"] = attempt(f"c_{name}", errors, variant)
        flush(bw)
    for name in (v for v in a.layer_variants.split(",") if v):
        progress(f"(c-layers-{name}) spec-graph with fused decode linear layers in {name}")

        def layers(fused=LAYER_VARIANTS[name]):
            # the buckets of (c)'s engine: the same rows, so the same forwards may fuse (at most 16 rows for
            # every batch up to them)
            dec_v = build_decoder(tdir, ddir, Bs, {}, 1, Bar(len(Bs), "compile"), fused=fused)
            return {b: bench_specgraph(dec_v, b, a.iters, 1) for b in Bs}

        for b, t in (attempt(f"c_layers_{name}", errors, layers) or {}).items():
            res[b][f"c_layers_{name}"] = t
        flush(bw)
    if "host" not in skip and dec is not None:
        progress("host CPU time per token, N=1 vs N=8")
        hb = Bs[min(1, len(Bs) - 1)]
        host["1"] = attempt("host", errors, host_cpu_per_token, dec, hb, 1, Bar(len(Bs), "capture N=1"))
        host["8"] = attempt("host", errors, host_cpu_per_token, dec, hb, 8, Bar(len(Bs), "capture N=8"))
    real_box[0] = None if "real" in skip else attempt("real", errors, default_pair_real)

    print("\n".join(flush(bw)))
    if a.plot:
        plot(res, Bs, out.with_name("bench_step.png"))


def main_table(a) -> None:
    Bs = [int(b) for b in a.batch_sizes.split(",")]
    max_lens = [int(m) for m in a.table_max_lens.split(",")]
    t0 = time.time()
    bw = copy_bandwidth()
    progress(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    (tdir, hf_t), (ddir, hf_d) = make_pair(Path(tempfile.mkdtemp()))
    del hf_t, hf_d
    torch.cuda.empty_cache()
    table = context_table(tdir, ddir, Bs, max_lens, a.iters, bw)
    L = report_head("bench_step --table", "bench_step.py", sg_platform.current().device_name()) + [
         f"- the step (c) of the pair (bf16, K={K}) at each static max_len and live context; CUDA-event medians of "
         f"{a.iters}; floor = weights + live KV over the measured copy bandwidth {bw / 1e12:.2f} TB/s; "
         f"whole run {(time.time() - t0) / 60:.1f} min", ""] + table
    append_section(a.out, L)


def floors(res, Bs, bw, models) -> None:
    """Bytes floor per step: target weights once, draft weights K times, and the KV of the context."""
    if models is None:
        return
    target, draft = models
    for b in Bs:
        res[b]["floor"] = step_bytes(target, draft, b, CONTEXT) / bw * 1e3
        if isinstance(res[b].get("e"), float):  # the target decode's own floor: its weights and live KV once
            res[b]["e_floor"] = step_bytes(target, None, b, CONTEXT) / bw * 1e3


def step_bytes(target, draft, B: int, context: int) -> int:
    """Bytes a step must read: target weights once, draft weights K times, and the live KV (no draft: a
    target decode)."""
    weights = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    kv_tok = lambda m: 2 * m.args.num_layers * m.args.num_kv_heads * m.args.head_dim * 2  # noqa: E731  K and V, bf16
    if draft is None:
        return weights(target) + kv_tok(target) * context * B
    return weights(target) + K * weights(draft) + (kv_tok(target) + K * kv_tok(draft)) * context * B


def _pass_names():
    from spec_graph.passes.manager import PassManager

    return PassManager.names()


def report(res, Bs, bw, dev_name, elapsed, a, host1, host8, real):
    L = report_head("bench_step", "bench_step.py", dev_name) + [
         f"- pair: random-weight Llama target 2048x16 (0.85B) + draft 768x4 (74M), bf16, K={K}, context {CONTEXT}, "
         f"static cache {CACHE_LEN} positions; CUDA-event medians of {a.iters} after warm-up",
         f"- measured copy bandwidth {bw / 1e12:.2f} TB/s; whole run {elapsed / 60:.1f} min",
         "",
         "| B | (a) HF assisted | (b) gpt-fast style | (c) spec-graph | (c) passes off | (d) N=8, per step "
         "| (e) target decode | bytes floor | (c)/floor | (a)/(c) | (b)/(c) | (c)/(e) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v: f"{v:.3f}" if isinstance(v, float) else "n/a"  # noqa: E731
    r = lambda x, y: f"{x / y:.2f}x" if isinstance(x, float) and isinstance(y, float) else "n/a"  # noqa: E731
    for b in Bs:
        d = res[b]
        L.append(f"| {b} | {f(d.get('a'))} | {f(d.get('b'))} | {f(d.get('c'))} | {f(d.get('c_off'))} | "
                 f"{f(d.get('d'))} | {f(d.get('e'))} | {f(d.get('floor'))} | {r(d.get('c'), d.get('floor'))} | "
                 f"{r(d.get('a'), d.get('c'))} | {r(d.get('b'), d.get('c'))} | {r(d.get('c'), d.get('e'))} |")
    L.append("")
    L.append("All times in ms per speculative iteration (one target verify of K+1 tokens).")
    c1 = res[Bs[0]].get("c")
    d1 = res[Bs[0]].get("d")
    if isinstance(c1, float) and isinstance(d1, float):
        L.append(f"- derived end-to-end at alpha=0.8, K=4 (3.36 tokens/step), B={Bs[0]}: "
                 f"{c1 / 3.36:.3f} ms/token (N=1), {d1 / 3.36:.3f} ms/token (N=8)")
    for b in Bs:
        d = res[b]
        share = lambda t, fl: f"{fl / t:.0%}" if isinstance(t, float) and isinstance(fl, float) else "n/a"  # noqa: E731
        cnt = lambda n: f"{n:.0f}" if isinstance(n, float) else "n/a"  # noqa: E731
        L.append(f"- B={b}: kernels per step (c) {cnt(d.get('c_kernels'))}, (e) {cnt(d.get('e_kernels'))}; share of "
                 f"the copy bandwidth reached: (c) {share(d.get('c'), d.get('floor'))}, "
                 f"(e) {share(d.get('e'), d.get('e_floor'))}")
        if "e_plain" in d:
            L.append(f"- B={b}: (e) compiled by a plain torch.compile: {f(d.get('e_plain'))} ms, "
                     f"{cnt(d.get('e_plain_kernels'))} kernels, {share(d.get('e_plain'), d.get('e_floor'))} of the "
                     f"copy bandwidth (the engine's compile: {f(d.get('e'))} ms)")
    for name in (v for v in a.inductor_variants.split(",") if v):
        t, base = res[Bs[0]].get(f"c_{name}"), res[Bs[0]].get("c")
        L.append(f"- (c) compiled with inductor {INDUCTOR_VARIANTS[name]}, B={Bs[0]}: {f(t)} ms"
                 + (f" ({t / base:.3f}x the default)" if isinstance(t, float) and isinstance(base, float) else ""))
    for name in (v for v in a.layer_variants.split(",") if v):
        for b in Bs:
            t, base = res[b].get(f"c_layers_{name}"), res[b].get("c")
            L.append(f"- (c) with fused decode linear layers in {name} (default: both), B={b}: {f(t)} ms"
                     + (f" ({t / base:.3f}x the default)" if isinstance(t, float) and isinstance(base, float) else ""))
    L += host_lines(Bs[min(1, len(Bs) - 1)], host1, host8)
    if real is not None:
        L.append(f"- embedded trained pair (graphs, N=8, B=1, K=4): acceptance {real[0]:.3f}, "
                 f"{real[2]:.2f} tokens/step, {real[1]:.3f} ms/token end to end (incl. prefill)")
    return L


def plot(res, Bs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"a": "(a) HF assisted", "b": "(b) gpt-fast style", "c": "(c) spec-graph", "d": "(d) N=8 per step",
             "e": "(e) target decode", "floor": "bytes floor"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in names.items():
        xs = [b for b in Bs if isinstance(res[b].get(key), float)]
        if xs:
            ax.plot(xs, [res[b][key] for b in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per speculative step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
