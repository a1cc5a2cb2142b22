"""The static-KV decoder against HF transformers' own forward, and the loader's errors."""
import json

import pytest
import torch
from helpers import ARCHS, make_checkpoint

from spec_graph.models import CheckpointError, load_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
VARIANTS = {
    "LlamaForCausalLM": dict(rope_scaling=LLAMA3_ROPE, attention_bias=True, rope_theta=500000.0),
    "Qwen2ForCausalLM": dict(rope_theta=1e6),
    "Qwen3ForCausalLM": dict(head_dim=24, tie_word_embeddings=True),
    "MistralForCausalLM": dict(sliding_window=6),
}


def _hf_logits(path, ids):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_heads", [1, 2])  # MQA and GQA
def test_logits_match_hf(tmp_path, arch, kv_heads):
    path = make_checkpoint(tmp_path / arch, arch, kv_heads=kv_heads, init_std=0.05, **VARIANTS[arch])
    model = load_model(path, "float32")
    torch.manual_seed(1)
    lens = [5, 17, 11]  # different prompt lengths in one padded batch
    T = max(lens)
    toks = torch.randint(0, 128, (len(lens), T))
    kv = model.new_kv_cache(4, 64)
    slots = torch.tensor([3, 0, 2])
    logits = model(toks, torch.arange(T).expand(len(lens), T), *kv, slots=slots)
    for b, n in enumerate(lens):
        ref = _hf_logits(path, toks[b, :n].tolist())
        rel = ((logits[b, :n] - ref).norm() / ref.norm()).item()
        assert rel <= 1e-4, f"{arch} row {b}: relative error {rel:.2e}"


def test_incremental_decode_matches_full_forward(tmp_path):
    path = make_checkpoint(tmp_path / "m", kv_heads=2)
    model = load_model(path)
    toks = torch.randint(0, 128, (2, 12))
    full = model(toks, torch.arange(12).expand(2, 12), *model.new_kv_cache(2, 32))
    kv = model.new_kv_cache(2, 32)
    model(toks[:, :8], torch.arange(8).expand(2, 8), *kv)
    steps = [model(toks[:, t:t + 1], torch.full((2, 1), t), *kv)[:, 0] for t in range(8, 12)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 8:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(tmp_path, dtype):
    path = make_checkpoint(tmp_path / "m", init_std=0.05)
    model = load_model(path, dtype)
    assert model.model.embed_tokens.weight.dtype == dtype
    kv = model.new_kv_cache(1, 16)
    assert kv[0].dtype == dtype
    out = model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], *kv)
    ref = load_model(path, "float32")(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], *ref_kv(path))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 5e-2


def ref_kv(path):
    return load_model(path).new_kv_cache(1, 16)


def test_sharded_checkpoint_with_index(tmp_path):
    import transformers

    path = make_checkpoint(tmp_path / "one")
    m = transformers.AutoModelForCausalLM.from_pretrained(path)
    m.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_model(path), load_model(tmp_path / "sharded")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_error_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_error_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path / "m")


def test_error_corrupt_config(tmp_path):
    path = make_checkpoint(tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(path)


def test_error_unsupported_architecture(tmp_path):
    path = make_checkpoint(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(path)


HF_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
              "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config"}
_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=128)


def _hf_windows(arch, fields):
    """Per layer, the sliding window transformers' own config class gives (0: full attention)."""
    import transformers

    c = getattr(transformers, HF_CLASSES[arch])(**fields)
    sw = getattr(c, "sliding_window", None) or 0
    types = getattr(c, "layer_types", None)
    if arch == "MistralForCausalLM" or not types:
        return c, tuple(sw if arch == "MistralForCausalLM" else 0 for _ in range(c.num_hidden_layers))
    return c, tuple(sw if t == "sliding_attention" else 0 for t in types)


@pytest.mark.parametrize("arch,extra", [
    ("LlamaForCausalLM", {}),
    # Qwen's switch on a Llama config: transformers' Llama reads no window (it was applied here)
    ("LlamaForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    ("MistralForCausalLM", {}),  # no sliding_window: Hugging Face's 4096, not full attention
    ("MistralForCausalLM", dict(sliding_window=None)),
    ("MistralForCausalLM", dict(sliding_window=9)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True)),  # window 4096 on layers from max_window_layers=28 up
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=None)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=3)),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True)),
])
def test_fields_left_out_default_as_hugging_face_does(arch, extra):
    """A field config.json leaves out means what transformers' config class of that architecture assumes: the
    window (max_position_embeddings) and the sliding windows per layer. (A Mistral config without
    sliding_window read as full attention gave other tokens than HF's past 4096 positions.)"""
    from spec_graph.models.config import ModelArgs

    fields = dict(_SMALL, num_hidden_layers=30, **extra)
    hf, windows = _hf_windows(arch, fields)
    args = ModelArgs.from_hf_config(dict(fields, architectures=[arch]))
    assert args.sliding_windows == windows
    assert args.max_position_embeddings == hf.max_position_embeddings


SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")


def _hf_shape(c) -> tuple:
    """The shape fields as transformers' model uses them (its attention takes head_dim, else hidden // heads)."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, head_dim)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("left_out", [(f,) for f in SHAPE_FIELDS] + [SHAPE_FIELDS], ids=[*SHAPE_FIELDS, "all"])
def test_shape_fields_left_out_default_as_hugging_face_does(arch, left_out):
    """Each shape field config.json leaves out takes its value from transformers' class of that architecture: a
    fixed number (Mistral's 8 kv heads, Qwen's 32, Qwen3's head_dim 128) or one computed from other fields (Llama's
    kv heads = heads). Every stated value differs from every default, so a wrong default cannot pass."""
    import transformers

    from spec_graph.models.config import ModelArgs

    fields = dict(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=64,
                  num_key_value_heads=4, head_dim=8)
    fields = {k: v for k, v in fields.items() if k not in left_out}
    args = ModelArgs.from_hf_config(dict(fields, architectures=[arch]))
    hf = getattr(transformers, HF_CLASSES[arch])(**fields)
    assert (args.vocab_size, args.hidden_size, args.intermediate_size, args.num_layers, args.num_heads,
            args.num_kv_heads, args.head_dim) == _hf_shape(hf)


# Per architecture: make_checkpoint's arguments (each left-out field at transformers' default for that class) and
# the fields then removed from config.json: kv heads and head_dim, and a size field where the model stays small.
LEFT_OUT = {
    "LlamaForCausalLM": (dict(heads=4, kv_heads=4, intermediate_size=11008), ("num_key_value_heads", "head_dim",
                                                                              "intermediate_size")),
    "MistralForCausalLM": (dict(heads=16, kv_heads=8, vocab_size=32000), ("num_key_value_heads", "head_dim",
                                                                          "vocab_size")),
    "Qwen2ForCausalLM": (dict(heads=64, kv_heads=32, hidden_size=128, intermediate_size=22016),
                         ("num_key_value_heads", "head_dim", "intermediate_size")),
    "Qwen3ForCausalLM": (dict(heads=32, kv_heads=32, head_dim=128), ("num_key_value_heads", "num_attention_heads",
                                                                     "head_dim")),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_leaving_out_fields_matches_hugging_face(tmp_path, arch):
    """A checkpoint whose config.json leaves out kv heads, head_dim or a size field gives HF's logits (Mistral's
    and Qwen's kv heads read as the attention heads made the weights' shapes a mismatch)."""
    import transformers

    kw, left_out = LEFT_OUT[arch]
    path = make_checkpoint(tmp_path / arch, arch, init_std=0.05, **kw)
    cfg = json.loads((path / "config.json").read_text())
    built = _hf_shape(transformers.AutoConfig.from_pretrained(path))
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in left_out}))
    assert _hf_shape(transformers.AutoConfig.from_pretrained(path)) == built  # HF reads the same model back
    model = load_model(path, "float32")
    toks = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    logits = model(toks, torch.arange(9)[None], *model.new_kv_cache(1, 16))[0]
    torch.testing.assert_close(logits, _hf_logits(path, toks[0].tolist()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type,arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                             ("mistral", "MistralForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_architecture_from_model_type(model_type, arch):
    """Without 'architectures' the model_type names the model, as for transformers' Auto classes; with neither,
    the error names both fields."""
    from spec_graph.models.config import ModelArgs, UnsupportedModelError

    fields = dict(_SMALL, num_hidden_layers=2)
    assert ModelArgs.from_hf_config(dict(fields, model_type=model_type)).architecture == arch
    with pytest.raises(UnsupportedModelError, match="no 'architectures' field and its 'model_type' is 'gpt2'"):
        ModelArgs.from_hf_config(dict(fields, model_type="gpt2"))
    with pytest.raises(UnsupportedModelError, match="names no architecture"):
        ModelArgs.from_hf_config(fields)


@pytest.mark.parametrize("text,needle", [
    ('{"eos_token_id": "</s>"}', "'eos_token_id' must be a token id or a list of token ids, got '</s>'"),
    ('{"eos_token_id": [1, null]}', "got \\[1, None\\]"),
    ('{"eos_token_id": 2.7}', "got 2.7"),
    ('{"eos_token_id": true}', "got True"),
    ('{"eos_token_id": -1}', "got -1"),
    ('{"eos_token_id": 1180591620717411303424}', "0 <= id < 2\\*\\*63"),  # past int64: torch could not hold it
    ('{"eos_token_id": %s}' % list(range(2, 79)), "names 77 EOS ids, but a request takes at most 64 stop ids"),
    ("[1, 2]", "must hold a JSON object"),
    ("{not json", "is not valid JSON"),
])
def test_malformed_generation_config_is_named(tmp_path, text, needle):
    """generation_config.json's EOS ids end requests: a malformed one is a ValueError naming the file, not a
    TypeError from inside the loader or an id silently dropped (true read as 1, 2.7 as 2)."""
    from spec_graph import SpecDecoder, SpecGraphConfig

    path = make_checkpoint(tmp_path / "m")
    (path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match="generation_config.json") as e:
        SpecDecoder.from_pretrained(path, path, SpecGraphConfig(max_len=32))
    assert e.match(needle)
    (path / "generation_config.json").write_text('{"eos_token_id": [3, 4]}')  # the control
    assert {3, 4} <= set(SpecDecoder.from_pretrained(path, path, SpecGraphConfig(max_len=32)).eos_token_ids)


@pytest.mark.parametrize("act, ok", [("silu", True), ("swish", True), (None, True), ("gelu", False),
                                     ("gelu_pytorch_tanh", False), ("relu", False)])
def test_only_the_silu_mlp_is_accepted(tmp_path, act, ok):
    """The MLP computes SiLU(gate) * up: a checkpoint with another activation would load and give wrong tokens."""
    path = make_checkpoint(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    if act is None:
        cfg.pop("hidden_act", None)
    else:
        cfg["hidden_act"] = act
    (path / "config.json").write_text(json.dumps(cfg))
    if ok:
        assert load_model(path).args.hidden_size == cfg["hidden_size"]
    else:
        with pytest.raises(ValueError, match=f"'hidden_act' is '{act}'.*supports 'silu' and 'swish' only"):
            load_model(path)


def test_error_missing_weights(tmp_path):
    path = make_checkpoint(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(path)


def test_error_truncated_weights(tmp_path):
    path = make_checkpoint(tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(path)


def test_error_shape_mismatch(tmp_path):
    path = make_checkpoint(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp.*has shape .* implies"):
        load_model(path)


def test_error_missing_shard(tmp_path):
    import transformers

    path = make_checkpoint(tmp_path / "one")
    transformers.AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "sh", max_shard_size="40KB")
    shard = sorted((tmp_path / "sh").glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(tmp_path / "sh")


def test_compiled_decode_does_not_copy_the_kv_cache(tmp_path):
    """Inductor must update the cache in place: no buffer the size of a layer's cache in the generated code."""
    import re

    from torch._inductor.utils import run_and_get_code

    model = load_model(make_checkpoint(tmp_path / "m", layers=2))
    kv = model.new_kv_cache(8, 200)
    tok, pos = torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), 50)
    f = torch.compile(lambda: model(tok, pos, *kv), fullgraph=True)
    with torch.no_grad():
        _, code = run_and_get_code(f)
    per_layer = kv[0][0].numel()
    sizes = [m.group(1) for src in code for m in re.finditer(r"empty_strided\w*\(\(([^)]*)\)", src)]
    big = [s for s in sizes if eval(f"__import__('math').prod(({s},))") >= per_layer]
    assert sizes and not big, f"full-cache buffers in generated code: {big}"


def test_fused_decode_attention_in_the_model_under_the_interpreter(tmp_path):
    """Decode and verify forwards through spec_graph::decode_attention's Triton kernel (TRITON_INTERPRET=1, a
    fresh process) give the logits and caches of the masked matmul path, with slots, GQA and a sliding window;
    a broken kernel launch (one position short) is caught by the same comparison."""
    import subprocess
    import sys
    from pathlib import Path

    paths = {arch: make_checkpoint(tmp_path / arch, arch, vocab_size=96, layers=2, heads=4, kv_heads=kv,
                                   hidden_size=64, **extra)
             for arch, kv, extra in (("LlamaForCausalLM", 2, {}), ("MistralForCausalLM", 1, dict(sliding_window=5)))}
    code = f"""
import os, torch
assert os.environ["TRITON_INTERPRET"] == "1"
from spec_graph.models import load_model
from spec_graph.kernels import attention
from spec_graph.kernels.rng import use_kernel
assert use_kernel(attention._decode_attention_kernel, torch.zeros(1))  # the kernel runs, not its reference
for path in {[str(p) for p in paths.values()]!r}:
    m = load_model(path, "float32")
    g = torch.Generator().manual_seed(0)
    kv = m.new_kv_cache(4, 48)
    slots = torch.tensor([2, 0, 3])
    prompt = torch.randint(0, 96, (3, 12), generator=g)
    m(prompt, torch.arange(12).expand(3, 12), *kv, slots=slots)
    calls = []
    orig = attention.decode_attention_ref
    for T, start in ((3, torch.tensor([12, 7, 10])), (1, torch.tensor([15, 9, 13]))):
        toks = torch.randint(0, 96, (3, T), generator=g)
        pos = start[:, None] + torch.arange(T)[None]
        for a in (True, False):
            for layer in m.model.layers:
                layer.self_attn.fused_decode = a
            caches = tuple(c.clone() for c in kv)
            out = m(toks, pos, *caches, slots=slots)
            if a:
                fused, fused_caches = out, caches
        assert torch.allclose(fused, out, atol=1e-5, rtol=1e-5), (path, T, (fused - out).abs().max())
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(fused_caches, caches))  # later layers' keys
        kv = caches
    # the control: the kernel fed positions one short must disagree
    for layer in m.model.layers:
        layer.self_attn.fused_decode = True
    real = attention.decode_attention
    import spec_graph.models.llama as llama
    llama.decode_attention = lambda q, kc, vc, layer, slots, positions, *a: real(q, kc, vc, layer, slots,
                                                                                 positions - 1, *a)
    bad = m(toks, pos, *tuple(c.clone() for c in kv), slots=slots)
    llama.decode_attention = real
    good = m(toks, pos, *tuple(c.clone() for c in kv), slots=slots)
    assert not torch.allclose(bad, good, atol=1e-3), "a position off by one went unnoticed"
print("OK")
"""
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]


def _largest_tensor(fn):
    """fn() and the most elements of any tensor an op made while it ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    Largest.n = max(Largest.n, t.numel())
            return out

    with Largest():
        out = fn()
    return out, Largest.n


def test_long_prefill_makes_neither_scores_nor_logits_per_position(tmp_path, monkeypatch):
    """A prefill of T >= PREFILL_SDPA_POSITIONS positions (each row's logits at its last prompt token) equals HF
    and makes no tensor near [B, heads, T, T] (the matmul path's scores) or [B, T, V] (every position's logits):
    at 32k positions those are 137 GB and, with a 128k vocabulary, 16 GiB. Control: the matmul path makes it."""
    import spec_graph.models.llama as llama

    path = make_checkpoint(tmp_path / "m", kv_heads=2, init_std=0.05, vocab_size=512)
    model = load_model(path, "float32")
    torch.manual_seed(0)
    B, T, heads = 2, 256, model.args.num_heads
    assert T >= llama.PREFILL_SDPA_POSITIONS
    toks = torch.randint(0, 512, (B, T))
    lens = torch.tensor([T, 200])
    pos = torch.arange(T).expand(B, T)

    def prefill():
        return model(toks, pos, *model.new_kv_cache(3, 512), slots=torch.tensor([2, 0]), kv_len=T,
                     logits_at=lens - 1)

    logits, largest = _largest_tensor(prefill)
    limit = B * heads * T * T // 2
    assert largest < limit, largest
    for b in range(B):
        ref = _hf_logits(path, toks[b, : lens[b]].tolist())[-1]
        torch.testing.assert_close(logits[b], ref, atol=2e-4, rtol=2e-4)
    monkeypatch.setattr(llama, "PREFILL_SDPA_POSITIONS", 10 ** 9)
    matmul_logits, largest = _largest_tensor(prefill)
    assert largest >= limit
    torch.testing.assert_close(matmul_logits, logits, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM"])
def test_prefill_from_the_start_builds_no_mask(tmp_path, arch):
    """A prefill whose rows' positions are 0..T-1 (``causal=True``: the engine's and the export's) attends through
    SDPA's causal kernel and builds no [B, T, L] mask (at 16k positions the mask and the masked kernel took 10x as
    long on a CPU), with HF's logits. Control: the same prefill not declared causal builds one, with the same
    logits. A sliding window (Mistral) keeps its mask either way."""
    path = make_checkpoint(tmp_path / "m", arch, kv_heads=2, init_std=0.05, vocab_size=512,
                           **({"sliding_window": 100} if arch == "MistralForCausalLM" else {}))
    model = load_model(path, "float32")
    torch.manual_seed(0)
    B, T = 2, 512
    toks = torch.randint(0, 512, (B, T))
    lens = torch.tensor([T, 300])

    def prefill(causal):
        return model(toks, torch.arange(T).expand(B, T), *model.new_kv_cache(3, 1024), slots=torch.tensor([2, 0]),
                     kv_len=T, logits_at=lens - 1, causal=causal)

    (logits, largest), (masked, largest_masked) = (_largest_tensor(lambda c=c: prefill(c)) for c in (True, False))
    assert largest_masked >= B * T * T
    assert (largest >= B * T * T) == (arch == "MistralForCausalLM"), largest
    torch.testing.assert_close(masked, logits, atol=2e-5, rtol=2e-5)
    for b in range(B):
        ref = _hf_logits(path, toks[b, : lens[b]].tolist())[-1]
        torch.testing.assert_close(logits[b], ref, atol=2e-4, rtol=2e-4)


def test_exported_prefill_of_any_length_attends_through_sdpa(tmp_path):
    """An export's prefill has a symbolic length, so it cannot choose by length: it takes SDPA at every length
    (the exported package serves prompts up to max_len)."""
    model = load_model(make_checkpoint(tmp_path / "m", kv_heads=2), "float32")

    class Prefill(torch.nn.Module):
        def forward(self, toks, pos, span, lens, kc, vc):
            return model(toks, pos, kc, vc, kv_len=span.shape[0], logits_at=lens - 1)

    T = torch.export.Dim("T", min=2, max=63)
    args = (torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], torch.arange(8), torch.tensor([8]),
            *model.new_kv_cache(1, 64))
    ep = torch.export.export(Prefill(), args, dynamic_shapes=({1: T}, {1: T}, {0: T}, None, None, None),
                             strict=False)
    assert any("scaled_dot_product" in str(n.target) for n in ep.graph.nodes)


@pytest.mark.parametrize("case", ["no generation_config.json", "it names other ids", "it names none"])
def test_eos_ids_are_those_transformers_generate_reads(tmp_path, case):
    """generation_config.json, where it exists, alone names the EOS ids (config.json's are then unused, as in
    transformers' generate); without it config.json's do. Greedy output equals HF's generate run with the
    checkpoint's own settings. The union of both files would stop at config.json's id in the last two cases."""
    import transformers
    from helpers import hf_greedy, perturbed_copy

    from spec_graph import SpecDecoder, SpecGraphConfig

    path = make_checkpoint(tmp_path / "t", vocab_size=96, eos_token_id=None)
    draft = perturbed_copy(path, tmp_path / "d", noise=0.05)
    prompt, n = [5, 9, 17, 33, 2], 24
    full = hf_greedy(path, prompt, n, eos=None)
    firsts = [t for i, t in enumerate(full) if t not in full[:i]]
    a, b = firsts[2], firsts[4]  # config.json's id comes first in the output
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=a)))
    gen = path / "generation_config.json"
    if case == "no generation_config.json":
        gen.unlink(missing_ok=True)
        want = full[: full.index(a) + 1]
    else:
        gen.write_text(json.dumps({"eos_token_id": [b]} if case == "it names other ids" else {"do_sample": False}))
        want = full[: full.index(b) + 1] if case == "it names other ids" else full
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert hf == want
    dec = SpecDecoder.from_pretrained(path, draft, SpecGraphConfig(num_speculative_tokens=3, max_len=64))
    out = dec.generate([prompt], n)[0]
    assert out.token_ids == want
    assert out.finish_reason == ("length" if want is full else "stop")
