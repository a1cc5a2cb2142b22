"""Run by tests/test_vllm_plugin.py in a fresh process: target TP 2 (two CPU workers), draft TP 1, flag on.

Prints one line ``RESULT {json}``: each rank's drafter summary, the drafts each rank proposed, the greedy
tokens and the spec-decode counters (draft "none": the greedy tokens without speculation). vLLM spawns its
workers, hence the ``__main__`` guard."""
import json, sys


def drafter_summary(worker):
    """On each rank: spec-graph's drafter, its draft's parameter count and a checksum of its weights."""
    d = worker.model_runner.drafter
    m = d.core.model
    n = sum(p.numel() for p in m.parameters())
    s = float(sum(p.double().sum() for p in m.parameters()))
    return {"type": type(d).__name__, "params": n, "checksum": s}


def record_drafts(worker):
    d = worker.model_runner.drafter
    log = d._spec_graph_test_log = []
    orig = d.propose

    def propose(*a, **k):
        out = orig(*a, **k)
        log.append(out.tolist())
        return out

    d.propose = propose


def drafts(worker):
    return worker.model_runner.drafter._spec_graph_test_log


if __name__ == "__main__":
    target, draft, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from vllm import LLM, SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=16)
    if draft == "none":  # the same engine without speculation
        llm = LLM(model=target, enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=4,
                  tensor_parallel_size=2, distributed_executor_backend="mp")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs]}))
        sys.exit(0)
    llm = LLM(model=target, enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=4,
              tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                  "draft_tensor_parallel_size": 1},
              additional_config={"enable_spec_graph": True}, disable_log_stats=False)
    summary = llm.collective_rpc(drafter_summary)
    llm.collective_rpc(record_drafts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    m = {x.name: x for x in llm.get_metrics()}
    print("RESULT " + json.dumps({
        "summary": summary, "drafts": llm.collective_rpc(drafts),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "drafted": m["vllm:spec_decode_num_draft_tokens"].value,
        "accepted": m["vllm:spec_decode_num_accepted_tokens"].value}))
