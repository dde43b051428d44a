"""Stream-ordered pulls over TCP inside real model steps (issue: transfers
across nodes): each scenario runs in a fresh process (nothing warmed up, as a
user's first step), with GPU pages on both sides in two processes on one GPU,
under a timeout so a hang fails instead of stalling the suite. Bytes and
outputs are checked in the scenario (gpu_scenarios/stream_step.py)."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "gpu_scenarios", "stream_step.py")


def run(scenario, timeout=300, **env):
    e = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}  # CUDA's default: lazy
    e.update(env)
    try:
        out = subprocess.run([sys.executable, SCRIPT, scenario], capture_output=True, text=True, timeout=timeout,
                             env=e)
    except subprocess.TimeoutExpired as t:
        pytest.fail(f"{scenario} hung for {timeout} s:\n{t.stdout}\n{t.stderr}")
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("OK "), out.stdout + out.stderr
    assert "lazy" not in out.stderr.lower(), out.stderr  # no warning to read
    return last


@pytest.mark.parametrize("scenario", ["eager-default", "eager-side"])
def test_eager_read_then_kernel_on_the_pages(scenario):
    run(scenario)


def test_eager_with_eager_module_loading():
    run("eager-default", CUDA_MODULE_LOADING="EAGER")


@pytest.mark.parametrize("scenario", ["compiled", "reduce-overhead"])
def test_compiled_step(scenario):
    run(scenario, timeout=600)


@pytest.mark.parametrize("scenario", ["graph", "graph-two-peers"])
def test_captured_step_replayed_100_times(scenario):
    run(scenario)


def test_errors_release_the_stream_and_name_page_and_peer():
    run("errors")
