"""What the benchmark scripts share: progress lines, CUDA-event timing, kernel counts, the copy bandwidth,
kernel settings set from the command line, and sections appended to RESULTS.md."""
from __future__ import annotations

import ast
import contextlib
import datetime
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Bar:
    """A minimal progress bar (compile and capture take minutes)."""

    def __init__(self, total: int, label: str):
        self.total, self.n, self.label, self.t0 = total, 0, label, time.time()
        self._draw()

    def _draw(self):
        w = 30
        fill = int(w * self.n / max(self.total, 1))
        print(f"\r  {self.label} [{'#' * fill}{'.' * (w - fill)}] {self.n}/{self.total} "
              f"{time.time() - self.t0:5.0f}s", end="" if self.n < self.total else "\n", flush=True)

    def step(self):
        self.n += 1
        self._draw()


@contextlib.contextmanager
def timing_lock():
    """Hold SPEC_GRAPH_BENCH_LOCK (a file path), if set, while timing: benchmark processes sharing
    one GPU then never time at the same moment (their compiles may still overlap)."""
    path = os.environ.get("SPEC_GRAPH_BENCH_LOCK")
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def median_ms(fn, iters: int, warmup: int = 5, setup=None) -> float:
    with timing_lock():
        return _median_ms(fn, iters, warmup, setup)


def _median_ms(fn, iters: int, warmup: int, setup) -> float:
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if setup:
            setup()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def device_events(fn, replays: int) -> list:
    """torch.profiler's device (kernel and copy) events of ``replays`` calls of ``fn``, after one warm call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    return [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


def kernel_count(fn, replays: int = 10) -> float:
    """Kernels launched per call of ``fn`` (a graph replay)."""
    return len(device_events(fn, replays)) / replays


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / (ms / 1e3)


@contextlib.contextmanager
def settings_as(module, **values):
    """`module`'s settings (its upper-case globals) set to `values` inside, restored after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def int_list(text: str, flag: str, what: str, least: int) -> list[int]:
    """A comma-separated flag's integers ("16,32" -> [16, 32]; "" -> []); an item that is not an integer of at least
    `least` is refused by name, as `what`."""
    out = []
    for item in filter(None, text.split(",")):
        if not item.strip().isdigit() or int(item) < least:
            raise SystemExit(f"{flag} {text!r}: {item!r} is not {what} (an integer >= {least})")
        out.append(int(item))
    return out


def parse_setting(pair: str, flag: str = "--set") -> tuple:
    """MODULE.NAME=VALUE -> (module, name, value) of a setting of spec_graph.kernels.MODULE or spec_graph.models.MODULE
    (VALUE a Python literal); exits with a message that names the problem."""
    target, eq, value = pair.partition("=")
    module, _, name = target.rpartition(".")
    if not eq or not module or not name:
        sys.exit(f"{flag} takes MODULE.NAME=VALUE (e.g. linear_launch.ONE_STEP_ROWS=1), got {pair!r}")
    mod = None
    for package in ("spec_graph.kernels", "spec_graph.models"):
        try:
            mod = importlib.import_module(f"{package}.{module}")
            break
        except ModuleNotFoundError:
            pass
    if mod is None:
        sys.exit(f"{flag} {pair!r}: neither spec_graph.kernels nor spec_graph.models has a module {module!r}")
    if not name.isupper() or not hasattr(mod, name):
        sys.exit(f"{flag} {pair!r}: {mod.__name__} has no setting {name!r}")
    try:
        return mod, name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        sys.exit(f"{flag} {pair!r}: {value!r} is not a Python literal")


def apply_settings(pairs: list[str]) -> None:
    """--set MODULE.NAME=VALUE: a setting of a spec_graph.kernels module (VALUE a Python literal), set before
    anything compiles. The spec_graph backend's cache key holds these settings (kernels.launch_key), so runs of one
    machine that set them differently each compile their own step; --e-plain's plain torch.compile has no such key,
    so with any setting inductor's caches are off for the run (else it could load a graph built under other
    settings)."""
    settings = [parse_setting(pair) for pair in pairs]
    if settings:
        from torch._functorch import config as aot_config
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = False
        if hasattr(aot_config, "enable_autograd_cache"):
            aot_config.enable_autograd_cache = False
    for mod, name, value in settings:
        setattr(mod, name, value)


def append_section(path, lines: list[str]) -> None:
    """Add a section (lines) at the end of the report at `path` (a new report if there is none) and print it."""
    out = Path(path)
    prev = out.read_text() if out.exists() else "# Benchmark results\n"
    out.write_text(prev.rstrip() + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


def attempt(label: str, errors: dict, fn, *args):
    """Run one variant; a failure is recorded in the report instead of ending the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None


def report_head(title: str, script: str, dev_name: str) -> list[str]:
    """A RESULTS.md section's first lines: its title with today's date, the device and versions, the command."""
    return [f"## {title} — {datetime.date.today().isoformat()}", "",
            f"- device: {dev_name}; torch {torch.__version__}; triton {_triton_version()}",
            f"- command: `python benchmarks/{script} " + " ".join(sys.argv[1:]) + "`"]


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return "n/a"
