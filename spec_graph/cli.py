"""The ``spec-graph`` command: ``generate``, ``export`` and ``info``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PAIR = Path(__file__).parent / "data" / "default_pair"


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other error
        print(f"spec-graph: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spec-graph", description="Graph-captured draft-model speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text with a target/draft pair (default: the embedded pair)")
    g.add_argument("--exported", metavar="PT2", help="run a package written by `spec-graph export` (no model code)")
    g.add_argument("--target", help="target HF checkpoint directory (default: the embedded pair)")
    g.add_argument("--draft", help="draft HF checkpoint directory (default: the embedded pair)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a text prompt (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", type=_int_list, help="comma-separated token ids (repeatable)")
    g.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None,
                   help="draft tokens per step (1..16, default 4)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-len", type=int, default=None, help="longest prompt + output (default: fits the request)")
    g.add_argument("--max-batch-size", type=int, default=None,
                   help="request slots (default 8; with --exported the largest exported batch size)")
    g.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16 or float16")
    g.add_argument("--device", default=None, help="cuda, npu or cpu (default: the best found)")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    e = sub.add_parser("export", help="write a self-contained .pt2 of the prefill and the step (AOTInductor)")
    e.add_argument("--target", help="target HF checkpoint directory (default: the embedded pair)")
    e.add_argument("--draft", help="draft HF checkpoint directory (default: the embedded pair)")
    e.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=4, help="draft tokens per step (1..16)")
    e.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 8], help="comma-separated batch sizes (default 1,4,8)")
    e.add_argument("--max-len", type=int, default=512, help="longest prompt + output a request may reach")
    e.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    e.add_argument("--device", default=None, help="cuda, npu or cpu (default: the best found); the package runs there only")
    e.add_argument("-o", "--output", required=True, help="the package to write (e.g. pair.pt2)")
    e.add_argument("--quiet", action="store_true", help="no progress bars or summary")

    sub.add_parser("info", help="show versions, the platform found, and whether graphs are available")
    return p


def _pair(a) -> tuple[str, str]:
    if (a.target is None) != (a.draft is None):
        raise ValueError("give both --target and --draft, or neither for the embedded default pair")
    return a.target or str(DEFAULT_PAIR / "target"), a.draft or str(DEFAULT_PAIR / "draft")


def _load_exported(a):
    from .export import load_exported

    fixed = [f for f, v in (("--target", a.target), ("--draft", a.draft), ("-k", a.k), ("--max-len", a.max_len),
                            ("--dtype", a.dtype)) if v is not None]
    if fixed:
        raise ValueError(f"with --exported the package fixes the models, K, max_len and dtype: drop {', '.join(fixed)}")
    return load_exported(a.exported, device=a.device, max_batch_size=a.max_batch_size)


def _generate(a) -> int:
    prompts = a.prompt if a.prompt is not None else a.prompt_ids
    if a.exported is not None:
        dec = _load_exported(a)
        a.k = dec.K
    else:
        from .config import SpecGraphConfig
        from .engine import SpecDecoder

        target, draft = _pair(a)
        a.k = 4 if a.k is None else a.k
        if a.max_len is None:
            # token-id prompts are measured exactly; text is at most one token per byte in the default tokenizer
            longest = max(len(p.encode()) + 2 if isinstance(p, str) else len(p) for p in prompts)
            a.max_len = max(64, longest + a.max_new_tokens)
        cfg = SpecGraphConfig(num_speculative_tokens=a.k, max_batch_size=a.max_batch_size or 8, max_len=a.max_len,
                              dtype=a.dtype or "auto", device=a.device)
        dec = SpecDecoder.from_pretrained(target, draft, cfg)
    out = dec.generate(prompts, a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                       seed=a.seed)
    s = out.stats
    if a.json:
        print(json.dumps({
            "outputs": [{"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason} for r in out],
            "stats": {"acceptance_rate": s.acceptance_rate, "tokens_per_step": s.tokens_per_step,
                      "steps": s.steps, "acceptance_rate_per_position": s.acceptance_rate_per_position,
                      "generated_tokens": s.generated_tokens, "wall_time_s": s.wall_time_s},
        }))
    else:
        for i, r in enumerate(out):
            if len(out) > 1:
                print(f"--- [{i}] finish_reason={r.finish_reason}")
            if dec.tokenizer is None:
                print(" ".join(map(str, r.token_ids)))
            else:  # text prompts are echoed, so the completion reads in context
                print((prompts[i] if isinstance(prompts[i], str) else "") + r.text)
        print(f"[spec-graph] K={a.k} acceptance={s.acceptance_rate:.3f} tokens/step={s.tokens_per_step:.2f} "
              f"steps={s.steps} tokens={s.generated_tokens} time={s.wall_time_s:.2f}s", file=sys.stderr)
    return 0


def _export(a) -> int:
    from .export import export_pair

    target, draft = _pair(a)
    export_pair(target, draft, a.output, a.k, a.batch_sizes, a.max_len, a.dtype, a.device, progress=not a.quiet)
    return 0


def _info() -> int:
    import torch

    from . import __version__, platform

    plat = platform.current()
    try:
        import triton
        triton_v = triton.__version__
    except Exception:
        triton_v = "not installed"
    try:
        from importlib.metadata import version
        vllm_v = version("vllm")
    except Exception:
        vllm_v = "not installed"
    print(f"spec-graph {__version__}")
    print(f"torch {torch.__version__}, triton {triton_v}, vllm {vllm_v}, python {sys.version.split()[0]}")
    print(f"platform: {plat.name} ({plat.device_name()})")
    print(f"static graphs: {'available' if plat.supports_graphs else 'not available (no capture on CPU)'}")
    print(f"triton kernels: {'yes' if platform.use_triton(plat.device) else 'no (torch references)'}")
    print(f"default pair: {DEFAULT_PAIR} ({'present' if (DEFAULT_PAIR / 'target').is_dir() else 'missing'})")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        return _export(args) if args.command == "export" else _info()
    except (ValueError, OSError, RuntimeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"spec-graph: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
