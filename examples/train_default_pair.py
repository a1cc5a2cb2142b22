#!/usr/bin/env python
"""Train the tiny embedded default target/draft model pair shipped with spec-graph.

The pair lives in ``spec_graph/data/default_pair/{target,draft}`` and is what
``spec-graph generate`` uses when no model is given. Both models are
``LlamaForCausalLM`` checkpoints over a shared byte-level tokenizer (256 byte
tokens + ``<|endoftext|>`` + ``<|pad|>``), trained on the Python standard
library's own ``.py`` sources.

* target: d=384, 6 layers, 6 heads / 2 kv heads, untied embeddings, saved
  sharded (``model.safetensors.index.json`` + >= 2 shards), float16.
* draft:  d=128, 4 layers, 4 heads / 2 kv heads, tied embeddings, single
  ``model.safetensors``, float16; distilled on the target's logits.

At the end the saved checkpoints are reloaded from disk and the greedy
speculative-decoding acceptance rate at K=4 (accepted / proposed draft tokens)
is measured on held-out prompts with a plain, cache-free HF loop.

GPU run (a few minutes on one H100/H200)::

    python examples/train_default_pair.py --out spec_graph/data/default_pair

The shipped pair was trained on one H200 (about 5 minutes) with
``--corpus-dir`` pointing at an extracted copy of CPython 3.11.7's stdlib
(the training machine's own stdlib lacked the test suite); see
``training_summary.json`` next to the checkpoints.

CPU smoke test (a few steps, tiny eval)::

    python examples/train_default_pair.py --steps 3 --out /tmp/pair --smoke
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import math
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EOS = "<|endoftext|>"
PAD = "<|pad|>"
EOS_ID = 256
PAD_ID = 257
VOCAB_SIZE = 264  # 258 used ids rounded up to a multiple of 8


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer():
    """Byte-level tokenizer whose token id == byte value (0..255), + 2 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, PAD])
    assert tok.token_to_id(EOS) == EOS_ID and tok.token_to_id(PAD) == PAD_ID
    # exact round trip of arbitrary UTF-8, ids == raw bytes
    for sample in ["def f(x):\n\treturn x  # ünïcødé ✓ 𝔘\r\n", "", " \x00\x7f€"]:
        ids = tok.encode(sample).ids
        assert ids == list(sample.encode("utf-8")), (sample, ids)
        assert tok.decode(ids, skip_special_tokens=False) == sample
    return tok


def save_tokenizer(tok, directory: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(str(directory))
    # save_pretrained writes tokenizer.json; make sure it is the raw one
    tok.save(str(directory / "tokenizer.json"))


# --------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------
def is_val_file(rel: str, val_every: int) -> bool:
    h = int(hashlib.md5(rel.encode("utf-8")).hexdigest(), 16)
    return h % val_every == 0


def load_corpus(root: Path, val_every: int, max_file_bytes: int):
    """Return (train_docs, val_docs) as lists of (relpath, text); file-level split."""
    train, val = [], []
    skipped = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or "dist-packages" in rel.split("/"):
            continue
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        if not text.strip() or len(raw) > max_file_bytes:
            skipped += 1
            continue
        (val if is_val_file(rel, val_every) else train).append((rel, text))
    return train, val, skipped


def docs_to_ids(docs) -> np.ndarray:
    eos = np.array([EOS_ID], dtype=np.int32)
    parts = []
    for _, text in docs:
        parts.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32))
        parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------
def make_config(kind: str):
    from transformers import LlamaConfig

    common = dict(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )
    if kind == "target":
        return LlamaConfig(
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=1024,
            tie_word_embeddings=False,
            **common,
        )
    if kind == "draft":
        return LlamaConfig(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=384,
            tie_word_embeddings=True,
            **common,
        )
    raise ValueError(kind)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights


def save_model(model, directory: Path, sharded: bool) -> None:
    m = copy.deepcopy(model).to("cpu", dtype=torch.float16)
    m.config.use_cache = True
    m.generation_config.eos_token_id = EOS_ID
    m.generation_config.bos_token_id = EOS_ID
    m.generation_config.pad_token_id = PAD_ID
    kwargs = {}
    if "safe_serialization" in inspect.signature(m.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers < 5; v5 always writes safetensors
    if sharded:
        # fp16 target is ~19 MB -> max 8 MB per shard gives >= 3 shards
        kwargs["max_shard_size"] = "8MB"
    else:
        kwargs["max_shard_size"] = "1GB"
    m.save_pretrained(str(directory), **kwargs)
    # transformers 5 stores rope_theta under rope_parameters; keep the classic
    # top-level key too for plain-JSON readers and older transformers.
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", float(getattr(m.config, "rope_theta", None) or 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    files = sorted(p.name for p in directory.iterdir())
    if sharded:
        assert "model.safetensors.index.json" in files, files
        assert sum(f.endswith(".safetensors") for f in files) >= 2, files
    else:
        assert "model.safetensors" in files, files


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------
class Batcher:
    def __init__(self, ids: np.ndarray, seq_len: int, device, seed: int):
        self.data = torch.from_numpy(ids.astype(np.int64)).to(device)
        self.seq_len = seq_len
        self.device = device
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=device)

    def sample(self, batch_size: int):
        hi = self.data.numel() - self.seq_len - 1
        starts = torch.randint(0, hi, (batch_size,), generator=self.gen).to(self.device)
        chunk = self.data[starts[:, None] + self.offsets]
        return chunk[:, :-1], chunk[:, 1:]


def val_windows(ids: np.ndarray, seq_len: int, max_tokens: int, device):
    n = min(len(ids) - 1, max_tokens) // seq_len
    t = torch.from_numpy(ids[: n * seq_len + 1].astype(np.int64))
    x = t[:-1].view(n, seq_len)
    y = t[1:].view(n, seq_len)
    return x.to(device), y.to(device)


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)


@torch.no_grad()
def evaluate(model, vx, vy, batch_size, device, teacher=None):
    """Mean val CE; with a teacher also top-1 agreement with it."""
    model.eval()
    tot, agree, n = 0.0, 0, 0
    for i in range(0, vx.shape[0], batch_size):
        x, y = vx[i : i + batch_size], vy[i : i + batch_size]
        with autocast(device):
            logits = model(input_ids=x, use_cache=False).logits
        logits = logits.float()
        tot += F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        if teacher is not None:
            with autocast(device):
                tl = teacher(input_ids=x, use_cache=False).logits
            agree += (tl.argmax(-1) == logits.argmax(-1)).sum().item()
        n += y.numel()
    model.train()
    return tot / n, (agree / n if teacher is not None else None)


def lr_at(progress: float, step: int, base_lr: float, warmup: int, min_frac: float = 0.1) -> float:
    if step < warmup:
        return base_lr * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return base_lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def train(
    name,
    model,
    batcher,
    vx,
    vy,
    args,
    device,
    *,
    lr,
    max_steps,
    time_budget,
    teacher=None,
    alpha=0.0,
):
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    model.train()
    best = (float("inf"), None, -1, None)  # (score, state, step, (ce, agree))
    t0 = time.time()
    step = 0
    history = []

    def do_eval(step):
        nonlocal best
        ce, agree = evaluate(model, vx, vy, args.eval_batch, device, teacher=teacher)
        # draft selection: blend of val CE and disagreement (acceptance proxy)
        score = ce if teacher is None else ce - 2.0 * agree
        history.append({"step": step, "time": round(time.time() - t0, 1), "val_ce": ce, "val_agree": agree})
        tag = ""
        if score < best[0]:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best = (score, state, step, (ce, agree))
            tag = " *"
        extra = f" agree={agree:.4f}" if agree is not None else ""
        print(
            f"[{name}] step {step:6d} t={time.time() - t0:7.1f}s val_ce={ce:.4f} "
            f"({ce / math.log(2):.3f} bits/byte){extra}{tag}",
            flush=True,
        )

    while True:
        elapsed = time.time() - t0
        progress = 0.0
        if max_steps:
            progress = max(progress, step / max_steps)
        if time_budget:
            progress = max(progress, elapsed / time_budget)
        if progress >= 1.0:
            break
        cur_lr = lr_at(progress, step, lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        x, y = batcher.sample(args.batch_size)
        with autocast(device):
            logits = model(input_ids=x, use_cache=False).logits
        logits = logits.float().view(-1, logits.shape[-1])
        ce = F.cross_entropy(logits, y.reshape(-1))
        loss = ce
        if teacher is not None:
            with torch.no_grad(), autocast(device):
                tlogits = teacher(input_ids=x, use_cache=False).logits
            tlogp = F.log_softmax(tlogits.float().view(-1, tlogits.shape[-1]), dim=-1)
            kl = F.kl_div(F.log_softmax(logits, dim=-1), tlogp, log_target=True, reduction="batchmean")
            loss = alpha * kl + (1 - alpha) * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0:
            print(
                f"[{name}] step {step:6d} t={time.time() - t0:7.1f}s lr={cur_lr:.2e} loss={loss.item():.4f} "
                f"ce={ce.item():.4f}",
                flush=True,
            )
        if step % args.eval_every == 0:
            do_eval(step)
    do_eval(step)
    wall = time.time() - t0
    score, state, best_step, (best_ce, best_agree) = best
    model.load_state_dict(state)
    print(
        f"[{name}] done: {step} steps in {wall:.1f}s; best step {best_step}: val_ce={best_ce:.4f}"
        + (f" agree={best_agree:.4f}" if best_agree is not None else ""),
        flush=True,
    )
    return {
        "steps": step,
        "wall_s": round(wall, 1),
        "best_step": best_step,
        "best_val_ce": best_ce,
        "best_val_agree_with_target": best_agree,
        "history": history,
    }


# --------------------------------------------------------------------------
# independent acceptance measurement (plain HF forward calls, no KV cache)
# --------------------------------------------------------------------------
@torch.no_grad()
def argmax_next(model, ids, device) -> torch.Tensor:
    x = torch.tensor([ids], dtype=torch.long, device=device)
    return model(input_ids=x, use_cache=False).logits[0].argmax(-1)


@torch.no_grad()
def speculative_greedy(target, draft, prompt, max_new, k, device):
    """Greedy speculative decoding. Returns (generated ids, proposed, accepted)."""
    ids = list(prompt)
    proposed = accepted = 0
    out = []
    while len(out) < max_new:
        props = []
        ctx = list(ids)
        for _ in range(k):
            t = int(argmax_next(draft, ctx, device)[-1])
            props.append(t)
            ctx.append(t)
        tgt = argmax_next(target, ids + props, device)[len(ids) - 1 :].tolist()  # k+1 predictions
        n = 0
        while n < k and props[n] == tgt[n]:
            n += 1
        proposed += k
        accepted += n
        new = props[:n] + [tgt[n]]
        ids += new
        out += new
        if EOS_ID in new:
            out = out[: out.index(EOS_ID) + 1]
            break
    return out[:max_new], proposed, accepted


@torch.no_grad()
def target_greedy(target, prompt, max_new, device):
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        t = int(argmax_next(target, ids, device)[-1])
        ids.append(t)
        out.append(t)
        if t == EOS_ID:
            break
    return out


def make_prompts(val_docs, n, seed, min_len=96, max_len=320):
    """Deterministic held-out prompts: a span of a val file ending at a line end."""
    rng = random.Random(seed)
    docs = [t for _, t in val_docs if len(t.encode("utf-8")) > max_len + 200]
    prompts = []
    tries = 0
    while len(prompts) < n and tries < 100 * n:
        tries += 1
        text = rng.choice(docs).encode("utf-8")
        start = rng.randrange(0, len(text) - max_len - 100)
        nl = text.find(b"\n", start)
        if nl < 0:
            continue
        start = nl + 1
        end = text.find(b"\n", start + min_len)
        if end < 0 or end + 1 - start > max_len:
            continue
        p = text[start : end + 1]
        if not p.strip():
            continue
        prompts.append(list(p))
    return prompts


def measure_acceptance(target_dir, draft_dir, val_docs, args, device):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    draft = LlamaForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).to(device).eval()
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == PAD_ID
    assert tok("def f():\n    é")["input_ids"] == list("def f():\n    é".encode())

    prompts = make_prompts(val_docs, args.accept_prompts, args.seed + 1)
    tot_p = tot_a = 0
    per_prompt = []
    t0 = time.time()
    for i, p in enumerate(prompts):
        out, pr, ac = speculative_greedy(target, draft, p, args.accept_new_tokens, args.k, device)
        tot_p += pr
        tot_a += ac
        per_prompt.append(ac / max(pr, 1))
        if i == 0:
            ref = target_greedy(target, p, len(out), device)
            print(f"[accept] spec output == target greedy on prompt 0: {ref == out}", flush=True)
    rate = tot_a / max(tot_p, 1)
    print(
        f"[accept] K={args.k}: accepted {tot_a} / proposed {tot_p} = {rate:.4f} over {len(prompts)} held-out prompts "
        f"({args.accept_new_tokens} new tokens each; mean per-prompt {np.mean(per_prompt):.4f}; "
        f"{time.time() - t0:.1f}s)",
        flush=True,
    )
    sample = target_greedy(target, list(b"def "), args.sample_tokens, device)
    text = tok.decode(list(b"def ") + sample, skip_special_tokens=False)
    print("[sample] target greedy from 'def ':\n" + text + "\n[/sample]", flush=True)
    return {
        "k": args.k,
        "prompts": len(prompts),
        "new_tokens_per_prompt": args.accept_new_tokens,
        "proposed": tot_p,
        "accepted": tot_a,
        "acceptance_rate": rate,
        "mean_per_prompt_rate": float(np.mean(per_prompt)),
    }


def dir_size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


# --------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("spec_graph/data/default_pair"))
    ap.add_argument("--corpus-dir", type=Path, default=None, help="default: this Python's stdlib")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=0, help="max steps per model (0: time budget only)")
    ap.add_argument("--target-seconds", type=float, default=150.0)
    ap.add_argument("--draft-seconds", type=float, default=100.0)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--distill-alpha", type=float, default=0.8, help="weight of KL(target||draft); 0 disables")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-batch", type=int, default=256)
    ap.add_argument("--val-tokens", type=int, default=1_000_000)
    ap.add_argument("--val-every", type=int, default=20, help="1 in N files held out (by path hash)")
    ap.add_argument("--max-file-bytes", type=int, default=400_000)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--accept-prompts", type=int, default=20)
    ap.add_argument("--accept-new-tokens", type=int, default=128)
    ap.add_argument("--sample-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny settings for a CPU smoke test")
    args = ap.parse_args(argv)

    if args.smoke:
        args.batch_size = min(args.batch_size, 4)
        args.eval_batch = 16
        args.val_tokens = 16 * args.seq_len
        args.eval_every = max(1, args.steps // 2) if args.steps else 2
        args.log_every = 1
        args.warmup = 2
        args.accept_prompts = 2
        args.accept_new_tokens = 12
        args.sample_tokens = 16
        if not args.steps:
            args.steps = 3

    t_start = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import tokenizers
    import transformers

    print(
        f"python {sys.version.split()[0]} torch {torch.__version__} transformers {transformers.__version__} "
        f"tokenizers {tokenizers.__version__} device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        flush=True,
    )

    # ---- corpus
    root = args.corpus_dir or Path(sysconfig.get_paths()["stdlib"])
    train_docs, val_docs, skipped = load_corpus(root, args.val_every, args.max_file_bytes)
    train_ids, val_ids = docs_to_ids(train_docs), docs_to_ids(val_docs)
    print(
        f"corpus {root}: {len(train_docs)} train files ({len(train_ids) / 1e6:.2f}M tokens), "
        f"{len(val_docs)} val files ({len(val_ids) / 1e6:.2f}M tokens), {skipped} skipped",
        flush=True,
    )
    assert len(train_docs) > 50 and len(val_docs) > 5, "corpus too small; pass --corpus-dir"

    tok = build_tokenizer()
    batcher = Batcher(train_ids, args.seq_len, device, args.seed)
    vx, vy = val_windows(val_ids, args.seq_len, args.val_tokens, device)
    print(f"val windows: {vx.shape[0]} x {args.seq_len}", flush=True)

    from transformers import LlamaForCausalLM

    # ---- target
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(make_config("target")).to(device)
    print(f"target params: {n_params(target):,}", flush=True)
    t_info = train(
        "target", target, batcher, vx, vy, args, device,
        lr=args.target_lr, max_steps=args.steps, time_budget=None if args.smoke else args.target_seconds,
    )

    # ---- draft (distilled on the best target)
    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(make_config("draft")).to(device)
    print(f"draft params: {n_params(draft):,}", flush=True)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    teacher = target if args.distill_alpha > 0 else None
    d_info = train(
        "draft", draft, batcher, vx, vy, args, device,
        lr=args.draft_lr, max_steps=args.steps, time_budget=None if args.smoke else args.draft_seconds,
        teacher=teacher, alpha=args.distill_alpha,
    )

    # ---- save
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tdir, ddir = out / "target", out / "draft"
    for d in (tdir, ddir):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    save_model(target, tdir, sharded=True)
    save_model(draft, ddir, sharded=False)
    save_tokenizer(tok, tdir)
    save_tokenizer(tok, ddir)
    for p in out.rglob("*"):
        if p.is_file():
            p.chmod(0o644)

    # ---- reload from disk, check fp16 val loss, measure acceptance
    tr = LlamaForCausalLM.from_pretrained(str(tdir), dtype=torch.float32).to(device)
    dr = LlamaForCausalLM.from_pretrained(str(ddir), dtype=torch.float32).to(device)
    t_ce, _ = evaluate(tr, vx, vy, args.eval_batch, device)
    d_ce, d_agree = evaluate(dr, vx, vy, args.eval_batch, device, teacher=tr)
    print(f"[reloaded fp16] target val_ce={t_ce:.4f}  draft val_ce={d_ce:.4f} agree={d_agree:.4f}", flush=True)
    del tr, dr
    acc = measure_acceptance(tdir, ddir, val_docs, args, device)

    sizes = {"target": dir_size(tdir), "draft": dir_size(ddir)}
    summary = {
        "corpus": {
            "root": str(root),
            "python": sys.version.split()[0],
            "train_files": len(train_docs),
            "val_files": len(val_docs),
            "train_tokens": int(len(train_ids)),
            "val_tokens": int(len(val_ids)),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": {"target": n_params(target), "draft": n_params(draft)},
        "target": {k: v for k, v in t_info.items() if k != "history"},
        "draft": {k: v for k, v in d_info.items() if k != "history"},
        "reloaded_fp16_val_ce": {"target": t_ce, "draft": d_ce, "draft_agree": d_agree},
        "acceptance": acc,
        "sizes_bytes": sizes,
        "total_wall_s": round(time.time() - t_start, 1),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shown = ("params", "reloaded_fp16_val_ce", "acceptance", "sizes_bytes", "total_wall_s")
    print(json.dumps({k: summary[k] for k in shown}, indent=2))
    print(f"files: {sorted(str(p.relative_to(out)) for p in out.rglob('*') if p.is_file())}")
    print(f"total size {sum(sizes.values()) / 1e6:.2f} MB; total wall {time.time() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
