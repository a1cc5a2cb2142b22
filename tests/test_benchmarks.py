"""The benchmark scripts' own settings (no GPU: nothing here times or compiles)."""
import sys
from pathlib import Path

import pytest
from torch._functorch import config as aot_config
from torch._inductor import config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_step  # noqa: E402

from spec_graph.kernels import launch_key, linear_launch  # noqa: E402

ROWS = linear_launch.ONE_STEP_ROWS


def caches_on():
    """Inductor's caches on inside, and restored after (configs patched: apply_settings writes them)."""
    return inductor_config.patch(fx_graph_cache=True), aot_config.patch(enable_autograd_cache=True)


def test_bench_step_settings_reach_every_compile(monkeypatch):
    """--set changes the kernels' setting and the backend's cache key, and turns inductor's caches off, so that
    the plain torch.compile of (e) cannot load a graph built under other settings."""
    monkeypatch.setattr(linear_launch, "ONE_STEP_ROWS", ROWS)
    fx, aot = caches_on()
    with fx, aot:
        before = launch_key()
        bench_step.apply_settings([f"linear_launch.ONE_STEP_ROWS={ROWS + 3}"])
        assert linear_launch.ONE_STEP_ROWS == ROWS + 3 and launch_key() != before
        assert inductor_config.fx_graph_cache is False and aot_config.enable_autograd_cache is False


def test_bench_step_settings_left_alone_without_set():
    fx, aot = caches_on()
    with fx, aot:
        bench_step.apply_settings([])
        assert inductor_config.fx_graph_cache is True and aot_config.enable_autograd_cache is True


@pytest.mark.parametrize("pair,message", [("ONE_STEP_ROWS", "MODULE.NAME=VALUE"),
                                          ("nomodule.X=1", "no module"),
                                          ("linear_launch.NOPE=1", "no setting"),
                                          ("linear_launch.ONE_STEP_ROWS=abc", "not a Python literal")])
def test_bench_step_settings_reject_bad_input(pair, message):
    """A bad pair stops the run before any setting is made (the good pair before it included)."""
    fx, aot = caches_on()
    with fx, aot:
        with pytest.raises(SystemExit, match=message):
            bench_step.apply_settings([f"linear_launch.ONE_STEP_ROWS={ROWS + 3}", pair])
        assert linear_launch.ONE_STEP_ROWS == ROWS and inductor_config.fx_graph_cache is True
