"""The one place that knows the device: cuda | npu | cpu.

Everything else asks this module; no other file names ``torch.cuda`` or
``torch.npu``.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

# Upper bound on Triton programs per launch. Kernels loop over rows inside a
# program (grid-stride), so a small grid is always correct; triton-ascend maps
# programs to physical vector cores, so there it must not exceed the core count.
DEFAULT_MAX_PROGRAMS = 1024
CPU_SMS = 132  # multiprocessors assumed off CUDA (an H100's / H200's count)


def _meminfo(key: str) -> int | None:
    """A /proc/meminfo field in bytes; None where /proc is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _host_total_memory() -> int:
    """Bytes of host memory (MemTotal; physical pages where /proc is absent)."""
    total = _meminfo("MemTotal")
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if total is None else total


def _host_available_memory() -> int:
    """Bytes of host memory available to a new allocation (MemAvailable; free pages where /proc is absent)."""
    avail = _meminfo("MemAvailable")
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if avail is None else avail


def _no_wait() -> None:
    pass


@dataclass(frozen=True)
class Platform:
    name: str  # "cuda" | "npu" | "cpu"

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    @property
    def supports_graphs(self) -> bool:
        return self.name in ("cuda", "npu")

    @property
    def _mod(self):
        """torch.cuda or torch.npu (torch_npu's mirror of it); None on CPU."""
        return {"cuda": torch.cuda, "npu": getattr(torch, "npu", None)}.get(self.name)

    def _need_graphs(self):
        if self._mod is None:
            raise RuntimeError("static graphs need a CUDA or NPU device; on CPU the compiled step runs as is")
        return self._mod

    def synchronize(self) -> None:
        if self._mod is not None:
            self._mod.synchronize()

    def to_host(self, t: torch.Tensor):
        """``(host, wait)``: ``t`` on the host and what waits for its copy to end, which the engine calls only
        after its next launch. The copy is a blocking one: the engine asks right after a read, with the device
        idle, and at B=8 a fresh pinned buffer, an async copy and an event cost the host more than the blocking
        copy of those few rows (0.3-0.5 ms a 16-request call on an H100)."""
        return t.cpu(), _no_wait

    def to_host_later(self, t: torch.Tensor):
        """``(host, wait)`` as ``to_host``, with a copy that does not wait for the work queued before it: the engine
        asks with a replay still running, which a blocking copy would wait for (and leave the device idle after)."""
        if self._mod is None:
            return t.clone(), _no_wait  # (cpu() would return t itself, which later work changes)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = self._mod.Event()
        done.record()
        return host, done.synchronize

    def free_memory(self) -> int:
        """Free bytes on this device (available host memory on CPU)."""
        if self._mod is None:
            return _host_available_memory()
        free, _ = self._mod.mem_get_info(self.device)
        return int(free)

    def total_memory(self) -> int:
        """Bytes of memory on this device (host memory on CPU)."""
        if self._mod is None:
            return _host_total_memory()
        _, total = self._mod.mem_get_info(self.device)
        return int(total)

    def memory_reserved(self) -> int | None:
        """Bytes the caching allocator holds on this device (graph pools included); None on CPU."""
        return None if self._mod is None else int(self._mod.memory_reserved(self.device))

    def max_programs(self) -> int:
        if self.name == "npu":
            try:
                props = torch.npu.get_device_properties(0)  # type: ignore[attr-defined]
                return int(getattr(props, "vector_core_num", 0) or 40)
            except Exception:
                return 40
        if self.name == "cuda":
            return min(DEFAULT_MAX_PROGRAMS, 4 * multiprocessors(self.device))
        return DEFAULT_MAX_PROGRAMS

    # ---- static graphs (CUDA graph / ACL graph); the only place that names them
    def new_graph(self):
        mod = self._need_graphs()
        return mod.CUDAGraph() if self.name == "cuda" else mod.NPUGraph()

    def graph_pool(self):
        return self._mod.graph_pool_handle() if self._mod is not None else None

    def new_stream(self):
        return self._mod.Stream() if self._mod is not None else None

    def record(self, graph, fn, pool=None, stream=None):
        """Record the work `fn()` issues into `graph` (nothing runs); return fn's static outputs. A record that
        fails leaves the device as it found it (_abandon_capture)."""
        mod = self._need_graphs()
        before = mod.current_stream()
        try:
            with mod.graph(graph, pool=pool, stream=stream):
                return fn()
        except BaseException:
            self._abandon_capture(pool, before)
            raise

    def _abandon_capture(self, pool, before) -> None:
        """After a failed capture torch leaves the capture's stream current, the device's random generator in
        graph mode and, where the capture was invalidated, its memory pool marked as recording, so that any later
        capture into that pool fails ("already recording to mempool_id"). All undone here. The pool is the one
        the caller shared (a failed graph cannot name its own: torch's ``graph.pool()`` needs a capture that
        ended); a pool torch made for the graph alone is never captured into again."""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None) if self.name == "cuda" else None
        if end is not None and pool is not None:
            with contextlib.suppress(RuntimeError):  # torch ended the recording itself
                end(self._mod.current_device(), pool)
        self._mod.set_stream(before)
        if self.name == "cuda":
            self._end_generator_capture()

    def _end_generator_capture(self) -> None:
        """torch (2.11 at least) puts the device's random generator in graph mode when a capture begins and
        takes it out only when a capture ends; after a failed one every eager random op raises ("Offset increment
        outside graph capture encountered unexpectedly"), vLLM's sampler too. A capture that ends, of work that
        draws nothing, takes it out and leaves the generator's offset as it was."""
        graph = self._mod.CUDAGraph()
        with contextlib.suppress(RuntimeError):
            with self._mod.graph(graph):
                torch.empty(1, device=torch.device("cuda", self._mod.current_device())).zero_()
        graph.reset()

    def replay(self, graph) -> None:
        graph.replay()

    def on_side_stream(self, stream):
        """Context manager running work on `stream`, ordered after the current stream's work."""
        if self._mod is None:
            return contextlib.nullcontext()
        stream.wait_stream(self._mod.current_stream())
        return self._mod.stream(stream)

    def join_stream(self, stream) -> None:
        if self._mod is not None:
            self._mod.current_stream().wait_stream(stream)

    def compile_backend(self):
        """The compiler under spec-graph's passes: inductor, or torch_npu's graph backend on Ascend."""
        return "npu" if self.name == "npu" else "inductor"

    def device_name(self) -> str:
        return str(self._mod.get_device_name(0)) if self._mod is not None else "cpu"


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


@functools.lru_cache(maxsize=None)
def current() -> Platform:
    """The best platform found on this machine."""
    if torch.cuda.is_available():
        return Platform("cuda")
    if _npu_available():
        return Platform("npu")
    return Platform("cpu")


def get(device: str | torch.device | None = None) -> Platform:
    if device is None:
        return current()
    from .config import check_device  # the one check of a device name (types, torch_npu, malformed names)

    check_device(device)
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use device 'cpu' "
                         "(device='cpu' in Python, --device cpu on the command line)")
    return Platform(kind)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_TRITON: dict = {}


@torch.compiler.assume_constant_result  # traced code calls it: Dynamo takes its value and guards no cache
def triton_available() -> bool:
    if "ok" not in _TRITON:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _TRITON["ok"] = True
        except Exception:
            _TRITON["ok"] = False
    return _TRITON["ok"]


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels (rather than their torch references) run on `device`."""
    if not triton_available():
        return False
    if device.type in ("cuda", "npu"):
        return True
    return device.type == "cpu" and triton_interpreting()


def use_fused_linear(device: torch.device) -> bool:
    """Whether decode forwards run the fused linear kernels (kernels/decode_linear.py). Their grid is one
    program per block of output columns (thousands for a vocabulary head), more than triton-ascend's one
    program per vector core takes, so not on NPU."""
    return device.type != "npu" and use_triton(device)


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (split-K sizes its grids by them); elsewhere CPU_SMS, so that
    the interpreter runs the same split launches."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def max_programs(device: torch.device) -> int:
    return get(device).max_programs() if device.type != "cpu" else DEFAULT_MAX_PROGRAMS
