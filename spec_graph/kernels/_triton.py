"""``triton`` and ``triton.language``, or inert stand-ins where Triton is not installed.

A CPU install of torch does not bring Triton; there the ops run their torch
references, and the kernel definitions only need to import.
"""
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by a subprocess test
    import logging

    HAS_TRITON = False
    # torch warns at each triton_op registration; without Triton the references are the intended path.
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)

    class _Missing:
        """Lets `@triton.jit` and `tl.constexpr(...)` run at import; anything else says why it can't."""

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def constexpr(value=None):
            return value

        def __getattr__(self, name):
            raise RuntimeError(f"triton.{name} is needed but Triton is not installed (pip install triton)")

    triton = tl = _Missing()

__all__ = ["HAS_TRITON", "triton", "tl"]
