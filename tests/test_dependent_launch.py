"""Programmatic dependent launch (kernels/dependent_launch.py): when the ops' kernels take it, that a PDL launch
really overlaps the kernel before it and that wait_inputs orders the reads, and that a captured chain of the
step's ops gives the same bits with and without it."""
import importlib

import pytest
import torch

from spec_graph import platform
from spec_graph.kernels._triton import HAS_TRITON, tl, triton
from spec_graph.kernels.dependent_launch import release_dependents, wait_inputs

_pdl = importlib.import_module("spec_graph.kernels.dependent_launch")


class _On:
    """Stands in for a tensor on a CUDA device."""
    device = torch.device("cuda")


@pytest.fixture
def device_supports_pdl(monkeypatch):
    monkeypatch.setattr(platform, "dependent_launch", lambda device: device.type == "cuda")


def test_launch_options_only_for_eager_launches_on_supporting_devices(device_supports_pdl, monkeypatch):
    if not HAS_TRITON:
        pytest.skip("needs triton")
    from torch._library.triton import set_wrap_triton_enabled

    monkeypatch.setattr(_pdl, "MODE", _pdl.RELEASE)
    with set_wrap_triton_enabled(False):  # an op's body on real tensors
        assert _pdl.launch_options(_On()) == {"PDL": _pdl.RELEASE, "launch_pdl": True}
        assert _pdl.launch_options(torch.zeros(1)) == {"PDL": _pdl.OFF}  # CPU: no PDL
        monkeypatch.setattr(_pdl, "MODE", _pdl.WAIT)
        assert _pdl.launch_options(_On()) == {"PDL": _pdl.WAIT, "launch_pdl": True}
        monkeypatch.setattr(_pdl, "MODE", _pdl.OFF)
        assert _pdl.launch_options(_On()) == {"PDL": _pdl.OFF}
    monkeypatch.setattr(_pdl, "MODE", _pdl.RELEASE)
    with set_wrap_triton_enabled(True):  # traced into inductor's code: inductor launches it plainly
        assert _pdl.launch_options(_On()) == {"PDL": _pdl.OFF}


def test_no_pdl_where_the_device_lacks_it():
    assert not platform.dependent_launch(torch.device("cpu"))
    assert not platform.dependent_launch(torch.device("meta"))


# ------------------------------------------------------------------ on the GPU
SPIN_NS = 2_000_000  # the first kernel's delay before its write: far longer than the host's next launch


if HAS_TRITON:
    from triton.language.extra.cuda import globaltimer

    @triton.jit
    def _late_write(flag_ptr, SPIN: tl.constexpr, PDL: tl.constexpr):
        """Releases its dependents at once, then spins SPIN ns and writes 1."""
        release_dependents(PDL)
        t0 = globaltimer()
        while globaltimer() - t0 < SPIN:
            pass
        tl.store(flag_ptr, 1)

    @triton.jit
    def _read_flag(flag_ptr, out_ptr, WAIT: tl.constexpr, PDL: tl.constexpr):
        """out = flag, read after wait_inputs when WAIT, else at once."""
        if WAIT:
            wait_inputs(PDL)
        tl.store(out_ptr, tl.load(flag_ptr, volatile=True))


def _needs_pdl():
    if not torch.cuda.is_available() or not platform.dependent_launch(torch.device("cuda")):
        pytest.skip("needs a GPU with programmatic dependent launch")


def _flag_seen(wait: bool) -> int:
    """What the reader saw, on the second try: the first compiles the kernels, and a launch that compiles comes
    after the writer is done."""
    for _ in range(2):
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        out = torch.full((1,), -1, dtype=torch.int32, device="cuda")
        opts = _pdl.launch_options(flag)  # the ops' own path: real tensors, outside any trace
        _late_write[(1,)](flag, SPIN=SPIN_NS, **opts)
        _read_flag[(1,)](flag, out, WAIT=wait, **opts)
        torch.cuda.synchronize()
    return int(out.item())


@pytest.mark.gpu
def test_pdl_launch_overlaps_and_wait_inputs_orders_the_reads(monkeypatch):
    _needs_pdl()
    from torch._library.triton import set_wrap_triton_enabled

    monkeypatch.setattr(_pdl, "MODE", _pdl.RELEASE)
    with set_wrap_triton_enabled(False):
        # the control: a reader that does not wait starts while the writer spins, so the overlap is real (with
        # plain launches it would see 1, and with a wait left out of a kernel this is what its reads would get)
        assert _flag_seen(wait=False) == 0
        assert _flag_seen(wait=True) == 1
        monkeypatch.setattr(_pdl, "MODE", _pdl.OFF)
        assert _flag_seen(wait=False) == 1


def _layer_chain(rows: int, layers: int = 3):
    """A decoder layer's ops (qkv+RoPE+cache write, attention, o_proj+residual, gate_up, down+residual) chained
    through `layers` layers at B=1, T=rows, bf16; returns (run, inputs)."""
    from spec_graph.kernels.attention import decode_attention
    from spec_graph.kernels.counters import new_sync
    from spec_graph.kernels.decode_linear import decode_gate_up, decode_linear, decode_qkv_rope_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    H, Hq, Hkv, D, inter, L = 768, 12, 4, 64, 2048, 640
    r = lambda *s: (torch.randn(*s, generator=g, device="cuda") * 0.05).to(torch.bfloat16)  # noqa: E731
    w = [dict(qkv=r((Hq + 2 * Hkv) * D, H), o=r(H, Hq * D), gu=r(2 * inter, H), down=r(H, inter),
              n1=r(H) + 1, n2=r(H) + 1) for _ in range(layers)]
    kc, vc = r(layers, 1, Hkv, L, D), r(layers, 1, Hkv, L, D)
    pos = torch.arange(500, 500 + rows, device="cuda")[None]
    ang = pos[..., None].float() * torch.linspace(0.01, 1.0, D, device="cuda")
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    x0 = r(1, rows, H)
    sync = new_sync(torch.device("cuda"))

    def run():
        x = x0
        for i, p in enumerate(w):
            q = decode_qkv_rope_cache(x, p["qkv"], None, p["n1"], 1e-6, cos, sin, Hq, D, kc, vc, i, None, pos,
                                      sync=sync)
            a = decode_attention(q.view(1, rows, Hq, D), kc, vc, i, None, pos)
            x = decode_linear(a.reshape(1, rows, Hq * D), p["o"], residual=x, sync=sync)
            h = decode_gate_up(x, p["gu"], None, p["n2"], 1e-6, sync=sync)
            x = decode_linear(h, p["down"], residual=x, sync=sync)
        return torch.cat([x.flatten(), kc.flatten()[:4096]])
    return run, (kc, vc)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5])  # one-step CUDA-core sums (weights read before the wait); tensor cores
def test_captured_chain_of_ops_same_bits_with_pdl(rows, monkeypatch):
    _needs_pdl()
    got = {}
    for mode in (_pdl.OFF, _pdl.RELEASE, _pdl.WAIT):
        monkeypatch.setattr(_pdl, "MODE", mode)
        run, (kc, vc) = _layer_chain(rows)
        saved = kc.clone(), vc.clone()
        run()  # compile the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for _ in range(3):  # the caches' writes are idempotent: each replay writes the same k and v
            kc.copy_(saved[0])
            vc.copy_(saved[1])
            graph.replay()
        torch.cuda.synchronize()
        got[mode] = out.clone()
    assert torch.isfinite(got[_pdl.OFF].float()).all()
    assert torch.equal(got[_pdl.RELEASE], got[_pdl.OFF])
    assert torch.equal(got[_pdl.WAIT], got[_pdl.OFF])
