"""Which tensors inductor would clone around the Triton kernels of a compiled decode forward, on a machine
without a GPU: the fused path is forced on and traced with a stand-in CUDA target (sm90), and compilation stops
after the post-grad passes (reinplacing) with a list of each kernel's clones and the copies and index_put nodes.
A KV cache in a clone list means a full-cache copy per layer on the GPU.

    PYTHONPATH=. TRITON_INTERPRET=0 python benchmarks/probe_cache_clones.py T
"""
import sys, torch
sys.path.insert(0, "tests")
import test_decode_linear as t
from spec_graph.kernels import attention, decode_linear as dl
from spec_graph.models import llama
import torch._inductor.fx_passes.post_grad as pg
import triton
from triton.backends.compiler import GPUTarget
class FakeDriver:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def get_current_device(self): return 0
    def get_current_stream(self, *a): return 0
triton.runtime.driver.set_active(FakeDriver())
for mod in (dl, attention):
    mod.use_kernel = lambda kernel, x: True
llama.platform.use_triton = lambda device: True
model = t._layer_model(torch.float32)
kc, vc = (torch.zeros(2, 4, 2, 32, 16) for _ in range(2))
T = int(sys.argv[1])
tok = torch.zeros(2, T, dtype=torch.long); pos = torch.arange(T).expand(2, T).contiguous() + 8
class Stop(Exception): pass
def inspect(graph):
    for n in graph.nodes:
        if n.op == "call_function" and "triton_kernel_wrapper_functional" in str(n.target):
            print("kernel", n.kwargs["kernel_idx"], "clones", n.kwargs.get("tensors_to_clone"))
        if n.op == "call_function" and ("index_put" in str(n.target) or "copy" in str(n.target) or "clone" in str(n.target)):
            print(n.name, n.target, [a.name if hasattr(a, "name") else a for a in n.args[:2]])
        if False:
            print("node", n.target, [getattr(a, "meta", {}).get("val", a).shape if hasattr(a, "meta") else a for a in n.args[:1]])
    raise Stop()
pg.decompose_triton_kernel_wrapper_functional = inspect
f = torch.compile(lambda: model(tok, pos, kc, vc), fullgraph=True)
try:
    with torch.no_grad():
        f()
except Exception as e:
    print("stopped:", type(e).__name__, str(e)[:200])
