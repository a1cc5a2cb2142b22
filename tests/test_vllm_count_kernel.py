"""The vLLM plugin's rejection-count kernel (``spec_graph.vllm_plugin.kernels``) against its torch reference.

Needs no vLLM: the check runs in a fresh process where importing vllm fails, so it also proves the kernel
module imports without it (and runs where vLLM is not installed, unlike test_vllm_plugin.py).
"""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None and sys.platform != "linux",
                                reason="Triton is not installed (the test extra installs it on Linux only)")

# Runs first in the fresh process: any import of vllm (direct or indirect) raises ImportError.
BLOCK_VLLM = textwrap.dedent("""
    import sys

    class _NoVllm:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError(f"vllm is blocked in this process ({name})")
            return None

    sys.meta_path.insert(0, _NoVllm())
""")


def test_count_kernel_matches_reference_in_interpreter():
    """The Triton kernel (TRITON_INTERPRET=1, fresh process without vLLM) equals the torch reference on ragged
    rows, outputs and backup-token table alike."""
    code = BLOCK_VLLM + textwrap.dedent("""
        import os, torch
        assert os.environ["TRITON_INTERPRET"] == "1"
        try:
            import vllm  # noqa: F401
            raise AssertionError("vllm should not be importable here")
        except ImportError:
            pass
        from spec_graph.vllm_plugin import kernels as k
        from spec_graph.kernels.rng import use_kernel
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
        assert use_kernel(k._count_valid_kernel, torch.zeros(1))
        g = torch.Generator().manual_seed(0)
        for R, S, vocab in [(1, 1, 10), (7, 4, 50), (33, 6, 1000), (5, 17, 3)]:
            sampled = torch.randint(0, vocab + 2, (R, S), generator=g, dtype=torch.int32)
            ndraft = torch.randint(0, S, (R,), generator=g)            # per-row drafts, may be 0 or < K
            valid = torch.minimum(torch.randint(0, S + 1, (R,), generator=g), ndraft + 1)
            j = torch.arange(S)[None]
            sampled = torch.where(j < valid[:, None], sampled, -1).to(torch.int32)
            discard = torch.rand(R, generator=g) < 0.3
            table = torch.randint(0, vocab, (R + 9,), generator=g, dtype=torch.int32)
            slots = torch.randperm(R + 9, generator=g)[:R]               # rows own distinct slots, any order
            tables = [table.clone(), table.clone()]
            got = k.count_valid(sampled, discard, tables[0], slots, vocab, max_programs=3)
            ref = k.count_valid_ref(sampled, discard, tables[1], slots, vocab)
            for a, b in zip(got, ref):
                assert a.dtype == torch.int32 and torch.equal(a, b), (R, S, a, b)
            assert torch.equal(tables[0], tables[1])
            # independent check of the formulas
            ok = (sampled != -1) & (sampled < vocab)
            assert torch.equal(ref[1], torch.where(discard, 0, ok.sum(1)).to(torch.int32))
            expect = table.clone()
            expect[slots] = ref[0]
            assert torch.equal(tables[1], expect)
        s = torch.tensor([[3, 4, -1, -1], [7, -1, -1, -1], [-1, -1, -1, -1], [1, 2, 3, 99]], dtype=torch.int32)
        table = torch.tensor([0, 14, 13, 12, 11, 0], dtype=torch.int32)
        nxt, val = k.count_valid(s, torch.tensor([False, True, False, False]), table, torch.tensor([4, 3, 2, 1]), 50)
        assert nxt.tolist() == [4, 12, 13, 3] and val.tolist() == [2, 0, 0, 3], (nxt, val)
        assert table.tolist() == [0, 3, 13, 12, 4, 0], table
        print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
