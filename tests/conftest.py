import functools
import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Adaptive K's step-time tables are not read from or kept in a user's cache: tests that need one set their own.
os.environ["SPEC_GRAPH_CACHE_DIR"] = ""

from helpers import build_tokenizer, make_checkpoint, perturbed_copy  # noqa: E402

# The shared draft agrees often enough that every accepted count 0..K is reached (K up to 5): the verify
# positions 1..K and the bonus token decide tokens in the greedy tests, not only position 0.
NEAR_NOISE = 0.03


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or NPU device; skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    from spec_graph import platform

    if platform.current().supports_graphs:
        return
    skip = pytest.mark.skip(reason="no GPU/NPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@functools.cache
def _drives_vllm(path: str) -> bool:
    return "vllm" in Path(path).read_text()


@pytest.fixture(autouse=True)
def _finalize_vllm_objects(request):
    """vLLM's CPU engines leave objects in reference cycles whose __del__ calls item(). Left to the collector, one
    can run inside a later test's Dynamo trace, where that item() recurses and leaves the Python dispatch key
    excluded for the rest of the process. They are collected here, after each test of a file that drives vLLM
    (a collection costs some 0.2 s once vLLM is loaded)."""
    yield
    if "vllm" in sys.modules and _drives_vllm(str(request.path)):
        gc.collect()


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(96)


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory, tokenizer):
    """(target, draft) directories: a random Llama target and a near copy of it as draft."""
    root = tmp_path_factory.mktemp("pair")
    target = make_checkpoint(root / "target", vocab_size=96, tokenizer=tokenizer, layers=2)
    draft = perturbed_copy(target, root / "draft", noise=NEAR_NOISE)
    return target, draft
