"""decode_head_argmax: the vocabulary head's kernel with the greedy choice folded in, against torch.argmax and
torch.isfinite over the logits the same kernel writes, and through the model's forward.

Same interpreter arrangement as test_decode_linear.py.
"""
from helpers import interpreter_before_triton

_ENV_BEFORE = interpreter_before_triton()  # before anything below imports triton

import contextlib  # noqa: E402
import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from helpers import (interpreter_while_testing, kernel_setting, require_kernel, run_compiled_script,  # noqa
                     run_module_in_fresh_process)

_dl = importlib.import_module("spec_graph.kernels.decode_linear")
_ll = importlib.import_module("spec_graph.kernels.linear_launch")
from spec_graph.kernels.counters import new_sync  # noqa: E402
from spec_graph.kernels.decode_linear import decode_head_argmax, decode_linear  # noqa: E402
from spec_graph.kernels.greedy_head import MERGE_BLOCK, head_argmax_ref  # noqa: E402

COMPILED, INTERPRETER_BUILDS, DEV, NEEDS_FRESH_PROCESS = kernel_setting(_dl._decode_linear_kernel, _ENV_BEFORE)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on_while_testing():
    with interpreter_while_testing(DEV.type == "cpu" and INTERPRETER_BUILDS, _ENV_BEFORE):
        yield


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernels run in this process")
def test_greedy_head_suite_in_a_fresh_process():
    run_module_in_fresh_process(__file__)


def _require_kernel():
    require_kernel(_dl, _dl._decode_linear_kernel, DEV, NEEDS_FRESH_PROCESS,
                   "test_greedy_head_suite_in_a_fresh_process")


@contextlib.contextmanager
def launch(dot, block_n, block_k):
    saved = dict(_ll.LAUNCH)
    _ll.LAUNCH.update(DOT=dot, BLOCK_N=block_n, BLOCK_K=block_k)
    try:
        yield
    finally:
        _ll.LAUNCH.clear()
        _ll.LAUNCH.update(saved)


def _head(M, K, N, dtype, distinct, nans, infs, g):
    """x [M, K], a head w [N, K] of `distinct` different rows (so each row's maximum recurs across column blocks),
    with NaN weights in `nans` columns and inf weights in `infs`, and a norm weight."""
    x = torch.randn(M, K, generator=g)
    base = torch.randn(distinct, K, generator=g) / K**0.5
    w = base[torch.randint(0, distinct, (N,), generator=g)]
    for col in torch.randint(0, N, (nans,), generator=g).tolist():
        w[col, col % K] = float("nan")
    for col in torch.randint(0, N, (infs,), generator=g).tolist():
        w[col, (col + 1) % K] = float("inf")
    nw = 1 + 0.3 * torch.randn(K, generator=g)
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV), nw.to(dtype).to(DEV)


def _want(x, w, nw, eps):
    """torch's argmax and isfinite over the logits of the same kernel (decode_linear): the same sums, so the
    choice must agree exactly, ties and NaNs included."""
    logits = decode_linear(x, w, None, nw, eps).float()
    return logits.argmax(-1), torch.isfinite(logits).all(-1)


@settings(max_examples=8, **SETTINGS)
@given(st.integers(1, 6), st.sampled_from([16, 48, 64]), st.integers(1, 300), st.sampled_from([1, 2, 3, 50]),
       st.integers(0, 2), st.integers(0, 2), st.booleans(), st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from([(True, 16, 16), (True, 32, 64), (False, 1, 64), (False, 2, 16), (False, 4, 64)]),
       st.integers(0, 2**31 - 1))
def test_choice_equals_torch_argmax_of_the_heads_logits(M, K, N, distinct, nans, infs, norm, dtype, conf, seed):
    """Rows of few distinct values (ties across blocks), NaN and inf columns, and up to 300 one-column blocks
    (two steps of the merge, MERGE_BLOCK parts each; the next test takes four)."""
    _require_kernel()
    x, w, nw = _head(M, K, N, dtype, distinct, nans, infs, torch.Generator().manual_seed(seed))
    nw = nw if norm else None
    sync = new_sync(DEV)
    with launch(*conf):
        ids, fin = decode_head_argmax(x, w, nw, 1e-5, sync)
        want_ids, want_fin = _want(x, w, nw, 1e-5)
    assert ids.dtype == torch.int64 and fin.dtype == torch.bool and ids.shape == fin.shape == (M,)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    assert torch.equal(fin, want_fin), (fin, want_fin)
    assert not sync.any()  # the merge's counter is back at zero for the next launch


def _blocks_apart():
    """Three rows against a head of 3 * MERGE_BLOCK + 5 one-column blocks (a merge of four steps): row 0's
    maximum recurs in every block, row 1 has a NaN in a late block (inf - inf), row 2 an overflow to inf beside
    a larger finite value. Each row reads its own columns of w, and x is 0 on the others (0 * a finite weight)."""
    M, K = 3, 16
    N = 3 * MERGE_BLOCK + 5
    x = torch.zeros(M, K)
    x[0, 0] = 1.0
    x[1, 1] = x[1, 3] = 10.0
    x[2, 2] = 10.0
    w = torch.zeros(N, K)
    w[:, 0] = torch.arange(N) % 7 / 7.0  # row 0: 6/7 at n = 6, 13, ... (first: 6)
    w[:, 1] = -1.0
    w[N - 9, 1], w[N - 9, 3] = 3e38, -3e38  # row 1: inf + -inf
    w[5, 1] = 2.0
    w[:, 2] = 0.05
    w[MERGE_BLOCK + 1, 2] = 3e38  # row 2: 3e39 rounds to inf in block MERGE_BLOCK + 1, its maximum
    return x.to(DEV), w.to(DEV), N


def test_choice_over_many_blocks_and_the_broken_rules_it_rejects():
    """The rules the comparisons above rely on, worked by hand, and broken variants that give other answers: the
    last maximum instead of the first, NaN ignored, inf counted as finite."""
    _require_kernel()
    x, w, N = _blocks_apart()
    with launch(False, 1, 16):
        ids, fin = decode_head_argmax(x, w, None, 0.0, new_sync(DEV))
        logits = decode_linear(x, w, None, None, 0.0).float()
    assert ids.tolist() == [6, N - 9, MERGE_BLOCK + 1]
    assert fin.tolist() == [True, False, False]
    last_max = logits.shape[-1] - 1 - logits.flip(-1).argmax(-1)
    assert last_max[0].item() != ids[0].item()  # ties broken toward the last column: rejected
    assert logits.nan_to_num(nan=float("-inf")).argmax(-1)[1].item() != ids[1].item()  # NaN ignored: rejected
    assert (~logits.isnan().any(-1)).tolist() != fin.tolist()  # only NaN counted as not finite: rejected
    assert head_argmax_ref(x, w, None, 0.0)[:, 0].tolist() == ids.tolist()  # the reference's rules are the same


def test_all_equal_and_all_minus_inf_rows_choose_the_first_column():
    _require_kernel()
    K, N = 16, 300
    x = torch.ones(2, K, device=DEV)
    w = torch.zeros(N, K, device=DEV)
    w[:, 0] = torch.tensor([0.0, float("-inf")], device=DEV).repeat_interleave(N // 2)[:N]
    x[1, 0] = 0.0  # row 1: 0 * -inf is NaN in the second half; row 0: -inf there, 0 in the first half
    x[0, 1:] = 0.0
    w2 = torch.full((N, K), float("-inf"), device=DEV)
    with launch(True, 16, 16):
        ids, fin = decode_head_argmax(x, w, None, 0.0, new_sync(DEV))
        want = _want(x, w, None, 0.0)
        ids2, fin2 = decode_head_argmax(x[:1], w2, None, 0.0, new_sync(DEV))
    assert ids.tolist() == want[0].tolist() == [0, N // 2] and fin.tolist() == want[1].tolist() == [False, False]
    assert ids2.tolist() == [0] and fin2.tolist() == [False]


def test_op_mutates_only_its_counters_and_runs_the_reference_without_them():
    schema = str(torch.ops.spec_graph.decode_head_argmax.default._schema)
    assert schema.count("!") == 1 and schema.endswith("!) sync) -> Tensor"), schema  # one output (greedy_head.py)
    m = dict(device="meta")
    ids, fin = decode_head_argmax(torch.empty(2, 5, 32, **m), torch.empty(100, 32, **m), None, 1e-6)
    assert ids.shape == fin.shape == (2, 5) and ids.dtype == torch.int64 and fin.dtype == torch.bool
    g = torch.Generator().manual_seed(1)
    x, w, nw = (t.cpu() for t in _head(3, 16, 40, torch.float32, 3, 1, 1, g))
    ids, fin = decode_head_argmax(x, w, nw, 1e-6)  # no counters: the reference
    want = head_argmax_ref(x, w, nw, 1e-6)
    assert torch.equal(ids, want[:, 0]) and torch.equal(fin, want[:, 1].bool())


@pytest.mark.parametrize("T,dtype", [(1, torch.float32), (5, torch.float32), (2, torch.bfloat16)])
def test_model_forward_chooses_as_its_logits_say(T, dtype, monkeypatch):
    """Transformer.forward(choose=True) with the head's fold equals the argmax and finite flags of its logits,
    and with FUSED_CHOICE off takes torch's argmax of them."""
    _require_kernel()
    from spec_graph.models import llama
    from spec_graph.models.config import ModelArgs

    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=96)
    torch.manual_seed(0)
    model = llama.Transformer(args).to(dtype).to(DEV)
    B = 2
    tokens = torch.randint(0, 300, (B, T), device=DEV)
    positions = torch.arange(T, device=DEV)[None].repeat(B, 1) + 3
    cache = model.new_kv_cache(B, 16)
    monkeypatch.setattr(llama, "FUSED_LAYERS", True)
    monkeypatch.setattr(llama, "FUSED_CHOICE", True)
    calls = []
    fold = llama.decode_head_argmax
    monkeypatch.setattr(llama, "decode_head_argmax", lambda *a, **k: calls.append(1) or fold(*a, **k))
    with torch.no_grad():
        logits = model(tokens, positions, *(c.clone() for c in cache))
        ids, fin = model(tokens, positions, *(c.clone() for c in cache), choose=True)
        monkeypatch.setattr(llama, "FUSED_CHOICE", False)
        ids2, fin2 = model(tokens, positions, *(c.clone() for c in cache), choose=True)
    assert calls == [1]  # the fold ran once (FUSED_CHOICE on), torch's argmax after it
    assert ids.shape == (B, T) and torch.equal(ids, logits.argmax(-1)) and torch.equal(ids2, ids)
    assert fin.all() and torch.equal(fin2, fin)


_SM90_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spec_graph.kernels import decode_linear as dl, greedy_head as gh, linear_launch as ll

fn = dl._decode_linear_kernel
out = {}
for rows, cols, K in ((1, 32000, 768), (5, 128256, 4096), (16, 151936, 2048)):
    dot, bn, bk, warps, stages, _ = ll.launch_config(rows, cols, K, False, 2, 132)
    const = dict(MODE=dl.PLAIN, HALF=1, HAS_BIAS=False, HAS_NORM=True, HAS_RES=False, WRITE_KV=False,
                 HAS_SLOTS=False, DOT=dot, IEEE=False, UPCAST=False, BLOCK_M=16 if dot else 1, BLOCK_N=bn,
                 BLOCK_K=bk, SPLIT_K=1, NORM_BLOCK=bk, NORM_UNROLL=ll.NORM_UNROLL,
                 ONE_STEP=ll.one_step(dot, 1, K, bk), CHOOSE=True, MERGE=gh.MERGE_BLOCK)
    types = {"sync_ptr": "*i32", "ws_ptr": "*fp32", "ai_ptr": "*i32", "ids_ptr": "*i64", "eps": "fp32"}
    sig = {n: "constexpr" if n in const else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    out[f"{rows}x{cols}"] = k.metadata.shared
print(json.dumps(out))
"""


def test_choice_compiles_for_sm90():
    """The kernel with the choice folded in compiles for an H100/H200 on any machine (the interpreter accepts
    what the compiler refuses, such as a module constant read inside the kernel), for the vocabulary heads of
    the embedded pair's draft, an 8B and a 1.5B model, each within the shared memory of an sm90 program."""
    shared = run_compiled_script(_SM90_SCRIPT, skip_without_ptxas=True)
    assert len(shared) == 3 and max(shared.values()) <= 232448, shared
