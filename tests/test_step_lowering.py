"""What inductor makes of the engine's compiled step around the Triton kernels, checked on any machine.

The step is compiled as on a GPU (the kernels' path forced, triton aimed at a stand-in sm90 target) and stopped
when inductor has lowered it, before code generation; the test reads inductor's list of buffers and kernels.
"""
from pathlib import Path

import pytest

from helpers import run_compiled_script

pytest.importorskip("triton")

_LOWER_SCRIPT = r"""
import collections, json, sys, tempfile
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, "tests")


class StandInDriver:  # enough of a CUDA driver for inductor to lower triton kernels
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, *a):
        return 0


triton.runtime.driver.set_active(StandInDriver())
import torch._inductor.config  # noqa: E402
torch._inductor.config.fx_graph_cache = False  # a graph served from the cache would skip the lowering read here
import spec_graph.kernels as kernels
from spec_graph import SpecDecoder, SpecGraphConfig, platform
from spec_graph.kernels import attention, counters, decode_linear, linear_launch
from helpers import build_tokenizer, make_checkpoint, perturbed_copy

for mod in (decode_linear, attention):
    mod.use_kernel = lambda kernel, x: True
platform.use_triton = lambda device: True
platform.use_fused_linear = lambda device: True
variant, rows = sys.argv[1], int(sys.argv[2])
if variant == "default layout":  # the control: inductor's own layout rule for kernel inputs
    kernels.INDUCTOR_CONFIGS = {}
if variant == "permuted q":  # the control of the stride check: q reaches the attention kernel as a sum of a
    from spec_graph.models import llama  # head-major view and a copy, which inductor lays out head-major where
    attend = llama.decode_attention  # its traced strides are row-major (on torch 2.11-2.14; q * 1 alone only to 2.13)
    half_sum = lambda qt: ((qt + qt.contiguous()) * 0.5).transpose(1, 2)  # noqa: E731
    llama.decode_attention = lambda q, *a: attend(half_sum(q.transpose(1, 2)), *a)
if variant.startswith("split"):  # every product split-K over two programs per column block, attention's keys split
    linear_launch.LAUNCH.update(BLOCK_N=16, BLOCK_K=16, SPLIT_K=2)
    attention.MIN_SPLIT_KEYS = 8
if variant == "split, computed counters":  # the control of the counters check: a computed (not buffer) sync
    from spec_graph.models import llama
    fused = llama.DecoderLayer.forward_fused
    llama.DecoderLayer.forward_fused = lambda self, *a: fused(self, *a[:-1], a[-1] * 1)
if variant.endswith("fused choice"):  # the greedy heads' argmax folded into their kernel, or torch's after them
    from spec_graph.models import llama
    llama.FUSED_CHOICE = not variant.endswith("unfused choice")
if variant.startswith("opaque"):  # as the engine compiles its step on a graph platform: the ops kept whole
    import spec_graph.backend as backend_mod
    import spec_graph.engine as engine_mod
    compile_step = engine_mod.backend_compile
    engine_mod.backend_compile = lambda *a, **k: compile_step(*a, **{**k, "opaque_kernels": True})
    if variant.startswith("opaque, exact strides"):  # the control: inductor's default layout rule for custom ops
        import torch._functorch.config as fc
        backend_mod.opaque_ops = lambda: fc.patch(decompose_custom_triton_ops=False)
mismatches = []
root = Path(tempfile.mkdtemp())
tok = build_tokenizer(96)
target = make_checkpoint(root / "t", vocab_size=96, tokenizer=tok, layers=3)
draft = perturbed_copy(target, root / "d", noise=0.03)


class Lowered(Exception):
    pass


def read(scheduler, operations):
    from torch._inductor.virtualized import V
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    out = collections.Counter()
    for op in V.graph.operations:
        origins = {str(o.target) for o in op.origins}
        if type(op).__name__ == "UserDefinedTritonKernel":
            name = kernel_side_table.get_kernel(op.kernel_idx).fn.__name__
            out["kernel " + name] += 1
            mismatches.extend(f"{name}.{arg}" for arg in strides_unlike_traced(op))
        elif type(op).__name__ == "FallbackKernel" and str(getattr(op, "op_overload", "")).startswith("spec_graph."):
            out["op " + str(op.op_overload).split(".")[1]] += 1
        elif any("aten.argmax" in o for o in origins):
            out["argmax buffers"] += 1
        elif any("aten.cos" in o for o in origins):
            out["cos buffers"] += 1
        elif any("index_put" in o for o in origins) and len(op.get_size()) == 5:  # [layers, slots, Hkv, L, D]
            out["cache index_put buffers"] += 1
        elif type(op).__name__ == "ComputedBuffer" and len(op.get_size()) == 5:  # a copy of a whole cache
            out["other cache-sized buffers"] += 1
        elif type(op).__name__ == "ComputedBuffer" and list(op.get_size()) == [counters.SYNC_SLOTS]:
            out["split-K counter buffers"] += 1  # a copy of the counters: they must be the model's own
    out["stride mismatches"] = sorted(set(mismatches))
    raise Lowered(json.dumps(out))


def strides_unlike_traced(op):
    # the kernel's tensor arguments whose strides, as inductor lays them out, differ from the traced tensors'
    # (which the launchers read) in a dimension of more than one element
    from torch._inductor.virtualized import V
    node = next(o for o in op.origins if "triton_kernel_wrapper_mutation" in str(o.target))
    traced = node.kwargs["kwargs"]
    for arg, ir_arg in op.kwargs.items():
        fx_arg = traced.get(arg)
        if not hasattr(ir_arg, "get_stride") or not isinstance(fx_arg, torch.fx.Node):
            continue
        val = fx_arg.meta["val"]
        for size, got, want in zip(val.shape, ir_arg.get_stride(), val.stride()):
            if not V.graph.sizevars.statically_known_equals(size, 1) and \
                    not V.graph.sizevars.statically_known_equals(got, want):
                yield arg
                break


import torch._inductor.scheduler as scheduler
scheduler.Scheduler.__init__ = read
dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=4, max_len=64,
                                                                 max_batch_size=rows, enable_graph=True,
                                                                 device="cpu"))  # the stand-in driver's device
try:
    with torch.inference_mode():
        dec._step_fn(True)(*dec._step_args(min(rows, 2)))
except Exception as e:
    msg = str(e)
    print(msg[msg.index("{"):msg.rindex("}") + 1])
"""


def _lowered(variant: str, rows: int = 1) -> dict:
    return run_compiled_script(_LOWER_SCRIPT, variant, rows)


def test_step_computes_rope_once_per_forward_and_writes_caches_in_qkv():
    """Each of the step's five forwards (four drafts, the verify; 3 layers each) computes its RoPE tables once,
    in one buffer that every layer's qkv kernel reads, and the qkv kernel writes k and v into the caches (no
    index_put). The control lowers the same step under inductor's default layout rule for kernel inputs, which
    copies the tables again for each layer's kernel."""
    forwards, layers = 5, 3
    got = _lowered("as is")
    assert got["kernel _decode_linear_kernel"] == forwards * (4 * layers + 1), got  # + lm_head
    assert got["kernel _decode_attention_kernel"] == forwards * layers, got
    assert got.get("cache index_put buffers", 0) == 0 and got.get("other cache-sized buffers", 0) == 0, got
    assert got["cos buffers"] == forwards, got
    assert got["stride mismatches"] == [], got
    control = _lowered("default layout")
    assert control["cos buffers"] >= forwards * layers, control


def test_opaque_step_computes_rope_once_per_forward():
    """The step as the engine compiles it on a graph platform (opaque_kernels: each op one call, launched by its own
    body) calls the same ops as the decomposed one, reads its RoPE tables (cos, sin) from one pair of buffers per
    forward and copies no cache. The control keeps inductor's default layout rule for custom ops (exact strides),
    under which it computes the tables again for each layer's qkv op (on an H200, 62 kernels more in a K=4 step)."""
    forwards, layers = 5, 3
    got = _lowered("opaque, unfused choice")
    assert got.get("kernel _decode_linear_kernel", 0) == 0, got  # nothing decomposed
    assert got["op decode_qkv_rope_cache"] == got["op decode_attention"] == forwards * layers, got
    assert got["op decode_gate_up"] == forwards * layers, got
    assert got["op decode_linear"] == forwards * (2 * layers + 1), got  # o_proj, down_proj; lm_head
    assert got.get("argmax buffers", 0) >= forwards and "op decode_head_argmax" not in got, got  # FUSED_CHOICE off
    assert got.get("cache index_put buffers", 0) == 0 and got.get("other cache-sized buffers", 0) == 0, got
    assert got["cos buffers"] <= 2 * forwards, got
    control = _lowered("opaque, exact strides, unfused choice")
    assert control["cos buffers"] >= forwards * layers, control


def test_fused_choice_takes_the_heads_argmax_into_their_kernel():
    """With FUSED_CHOICE on, each greedy forward's head, as the engine compiles its step, is one
    decode_head_argmax and the step has no argmax of its own. The control is
    test_opaque_step_computes_rope_once_per_forward's step (FUSED_CHOICE off), which takes torch's argmax after
    each head."""
    forwards, layers = 5, 3
    got = _lowered("opaque, fused choice")
    assert got["op decode_head_argmax"] == forwards and got["op decode_linear"] == forwards * 2 * layers, got
    assert got.get("argmax buffers", 0) == 0, got


def test_split_k_kernels_count_in_the_models_own_counters():
    """Split-K launches mutate the model's counter buffer in place: the same kernels, and no buffer of counters
    (a copy or a functional update of them) in the step, with attention split over key ranges beside them (its
    merge kernel after each split one). The control hands the kernels computed counters, which inductor makes
    a buffer of."""
    got = _lowered("split")
    assert got["kernel _decode_linear_kernel"] == 5 * (4 * 3 + 1), got
    assert got["kernel _decode_attention_kernel"] == 5 * 3 and got["kernel _combine_kernel"] == 5 * 3, got
    assert got.get("split-K counter buffers", 0) == 0 and got.get("other cache-sized buffers", 0) == 0, got
    assert got["stride mismatches"] == [], got
    assert _lowered("split, computed counters")["split-K counter buffers"] > 0


def test_kernel_inputs_keep_their_traced_strides():
    """Under the flexible layout the launchers' strides (read from the traced tensors) must still be the strides
    of what inductor hands each kernel. They are, in the size-1 graph (fused layers) and in the graph that a
    32-row engine's buckets above 1 share (nn.Linear layers beside the attention op). The control feeds the
    attention op a computed q that inductor lays out head-major where its traced strides are row-major, and the
    check names the argument."""
    assert _lowered("as is", 32)["stride mismatches"] == []
    assert _lowered("permuted q")["stride mismatches"] == ["_decode_attention_kernel.q_ptr"]


def test_engine_hands_inductor_the_kernel_options(monkeypatch, tmp_path):
    """The engine's step compile passes INDUCTOR_CONFIGS (the keys this torch knows) to inductor; the backend
    alone keeps inductor's defaults, and a caller's options={"inductor": ...} reach inductor as given."""
    import torch
    import torch._inductor.compile_fx as cfx

    from spec_graph.backend import known_inductor_configs, spec_graph_backend
    from spec_graph.kernels import INDUCTOR_CONFIGS

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.append(dict(config_patches))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    spec_graph_backend(gm, [torch.ones(3)], options={"capture": False})
    spec_graph_backend(gm, [torch.ones(3)], options={"capture": False, "inductor": {"comprehensive_padding": True}})
    plain, given = seen
    assert not set(INDUCTOR_CONFIGS) & set(plain), plain
    assert given["comprehensive_padding"] is True

    dec = _one_layer_decoder(tmp_path)
    torch._dynamo.reset()
    with torch.inference_mode():
        dec._step_fn(True)(*dec._step_args(1))
    torch._dynamo.reset()
    step = seen[-1]
    assert known_inductor_configs(INDUCTOR_CONFIGS) and all(step[k] == v for k, v in
                                                            known_inductor_configs(INDUCTOR_CONFIGS).items()), step


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_keeps_its_step_ops_opaque_where_it_replays_graphs(graphs, monkeypatch, tmp_path):
    """The engine compiles its step with opaque_kernels on a platform whose steps replay from graphs (where the ops'
    own launches are captured once), and decomposed elsewhere."""
    import spec_graph.engine as engine_mod

    asked = []
    monkeypatch.setattr(engine_mod, "backend_compile", lambda fn, *a, **k: asked.append(k) or fn)
    dec = _one_layer_decoder(tmp_path)
    monkeypatch.setattr(type(dec.platform), "supports_graphs", property(lambda self: graphs))
    dec._step_fn(True)
    assert asked and asked[-1]["opaque_kernels"] is graphs


def _one_layer_decoder(root: Path):
    """An engine over a one-layer target and a near draft (K=2, max_len 32), built on the CPU."""
    from helpers import build_tokenizer, make_checkpoint, perturbed_copy
    from spec_graph import SpecDecoder, SpecGraphConfig

    target = make_checkpoint(root / "t", vocab_size=96, tokenizer=build_tokenizer(96), layers=1)
    return SpecDecoder.from_pretrained(target, perturbed_copy(target, root / "d", noise=0.03),
                                       SpecGraphConfig(num_speculative_tokens=2, max_len=32, enable_graph=True))


def test_op_text_is_formatted_only_when_read():
    """Inside the backend's compile the text of an op's arguments (which inductor before torch 2.13 formats for every
    op it first falls back to, into a log line that is off) is built only when read: a node's text nests the
    nodes before it, and the fused head's first call comes after a forward's layers (the compile of a K=4 step on
    torch 2.11 never ended). Without the deferral, formatting reads the argument at once."""
    from torch._inductor import exc

    from spec_graph.backend import lazy_operator_text

    class Costly:
        reads = 0

        def __str__(self):
            Costly.reads += 1
            return "costly"

    with lazy_operator_text():
        text = exc.OperatorIssue.operator_str("spec_graph.op", [Costly()], {})
        assert Costly.reads == 0
        assert "args[0]: costly" in str(text) and Costly.reads == 1
    exc.OperatorIssue.operator_str("spec_graph.op", [Costly()], {})  # outside: torch's own, which formats at once
    assert Costly.reads == 2


def test_backend_compiles_with_the_op_text_deferred(monkeypatch):
    """The backend's inductor compile, with its ops kept whole or not, runs inside lazy_operator_text: inductor's
    formatting of an op's arguments gives back an object that is not yet text. Dropping the context from the
    backend leaves it a str."""
    import torch
    import torch._inductor.compile_fx as cfx
    from torch._inductor import exc

    from spec_graph.backend import spec_graph_backend

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.append(type(exc.OperatorIssue.operator_str("spec_graph.op", [], {})))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    for opaque in (False, True):
        spec_graph_backend(gm, [torch.ones(3)], options={"capture": False, "opaque_kernels": opaque})
    assert len(seen) == 2 and str not in seen, seen
    assert type(exc.OperatorIssue.operator_str("spec_graph.op", [], {})) is str  # restored after each compile
