"""The one place that knows the device: cuda | npu | cpu.

Everything else asks this module; no other file names ``torch.cuda`` or
``torch.npu``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Upper bound on Triton programs per launch. Kernels loop over rows inside a
# program (grid-stride), so a small grid is always correct; triton-ascend maps
# programs to physical vector cores, so there it must not exceed the core count.
DEFAULT_MAX_PROGRAMS = 1024


@dataclass(frozen=True)
class Platform:
    name: str  # "cuda" | "npu" | "cpu"

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    @property
    def supports_graphs(self) -> bool:
        return self.name in ("cuda", "npu")

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()
        elif self.name == "npu":
            torch.npu.synchronize()  # type: ignore[attr-defined]

    def max_programs(self) -> int:
        if self.name == "npu":
            try:
                props = torch.npu.get_device_properties(0)  # type: ignore[attr-defined]
                return int(getattr(props, "vector_core_num", 0) or 40)
            except Exception:
                return 40
        if self.name == "cuda":
            return min(DEFAULT_MAX_PROGRAMS, 4 * torch.cuda.get_device_properties(0).multi_processor_count)
        return DEFAULT_MAX_PROGRAMS

    def device_name(self) -> str:
        if self.name == "cuda":
            return torch.cuda.get_device_name(0)
        if self.name == "npu":
            return str(torch.npu.get_device_name(0))  # type: ignore[attr-defined]
        return "cpu"


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
    kind = torch.device(device).type
    if kind not in ("cuda", "npu", "cpu"):
        raise ValueError(f"unsupported device {device!r}: use cuda, npu or cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use --device cpu")
    if kind == "npu" and not _npu_available():
        raise ValueError("device 'npu' was asked for but torch_npu finds no NPU; use --device cpu")
    return Platform(kind)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels (rather than their torch references) run on `device`."""
    if not triton_available():
        return False
    if device.type in ("cuda", "npu"):
        return True
    return device.type == "cpu" and triton_interpreting()


def max_programs(device: torch.device) -> int:
    return get(device).max_programs() if device.type != "cpu" else DEFAULT_MAX_PROGRAMS
