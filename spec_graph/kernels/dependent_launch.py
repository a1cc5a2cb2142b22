"""Programmatic dependent launch (PDL) for the step's chains of kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still running: its programs
get resident, read what no kernel of the step writes (weights), and then wait (`wait_inputs`, griddepcontrol.wait)
until the kernel before has finished and its writes are visible, before they read anything else. A kernel
that calls `release_dependents` lets the next PDL kernel start once each of its programs has made that call
(else as its programs exit). The launch gap and the next kernel's first loads then overlap this kernel's tail.

Every kernel of a chain waits before its first read of another kernel's output, and it only finishes after
that wait, so the kernel before the one it waits on has finished too: reading any older buffer after the wait
is safe. Only launches from the ops' own bodies take PDL (real tensors, as in the engine's captured steps,
which compile their ops opaque); a kernel traced into inductor's code keeps a plain launch, and its waits
compile to nothing.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton

from .. import platform

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton, or none: platform.dependent_launch is False there
    gdc_launch_dependents = gdc_wait = None

# modes (kernels take them as their PDL constexpr)
OFF, WAIT, RELEASE = 0, 1, 2
# OFF: plain launches; WAIT: PDL launches, dependents start as programs exit; RELEASE: PDL launches, dependents
# start once every program has done its main reads
MODE = WAIT


@triton.jit
def wait_inputs(PDL: tl.constexpr):
    """Wait for the kernel before (PDL launches); nothing otherwise."""
    if PDL != 0:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel launch now (RELEASE); nothing otherwise."""
    if PDL == 2:
        gdc_launch_dependents()


def _traced() -> bool:
    """Whether a launch now is traced into a graph (torch.library.wrap_triton dispatches it to inductor) rather
    than run on real tensors."""
    try:
        from torch._library.triton import is_wrap_triton_enabled
    except ImportError:
        return True
    return is_wrap_triton_enabled()


def launch_options(t: torch.Tensor) -> dict:
    """The PDL constexpr and Triton launch option for a kernel launched now on t's device: MODE with
    `launch_pdl` where the device supports it and the launch is not traced, else OFF."""
    if MODE == OFF or t.device.type != "cuda" or _traced() or not platform.dependent_launch(t.device):
        return {"PDL": OFF}
    return {"PDL": MODE, "launch_pdl": True}
