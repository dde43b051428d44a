"""Every example runs: end to end where its hardware is there, and where it is
not, it exits at once with a message saying what is missing (never a
traceback, never a hang)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import mori_torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
# The examples import mori_torch from this tree even where it is not installed.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
HAS_GPU = mori_torch._C.WITH_GPU and torch.cuda.is_available()

# Each example and the test that runs it; examples/vllm_disagg/proxy.py runs
# in tests/vllm/test_proxy_example.py (it needs vLLM's aiohttp).
COVERED = {
    "tcp_demo.py": "test_tcp_demo_verifies_every_phase",
    "paged_kv_cache.py": "test_paged_kv_cache_example_*",
    "vllm_disagg/launch.sh": "test_vllm_launch_says_what_it_needs",
    "vllm_disagg/proxy.py": "tests/vllm/test_proxy_example.py",
}


def run(args, timeout, env=ENV):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_every_example_has_a_test():
    found = set()
    for dirpath, _, files in os.walk(EXAMPLES):
        for f in files:
            if f.endswith((".py", ".sh")):
                found.add(os.path.relpath(os.path.join(dirpath, f), EXAMPLES))
    assert found == set(COVERED), f"examples without a test: {found - set(COVERED)}; gone: {set(COVERED) - found}"


def test_tcp_demo_verifies_every_phase():
    out = run([sys.executable, os.path.join(EXAMPLES, "tcp_demo.py"), "--size-mib", "64", "--num-data-conns", "2"],
              timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all bytes verified in every phase" in out.stdout
    assert out.stdout.count("GB/s") == 4
    # Progress per phase: the start, the wait for the peer and the end are announced.
    for line in ("starting process A", "waiting for process A", "connected to A", "stopping both engines"):
        assert line in out.stdout, out.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the message a machine without a GPU gets")
def test_paged_kv_cache_example_without_a_gpu_says_so():
    out = run([sys.executable, os.path.join(EXAMPLES, "paged_kv_cache.py"), "--iters", "2"], timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "paged_kv_cache.py needs a GPU:" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/HIP GPU")
@pytest.mark.parametrize("backend", ["xgmi", "tcp"])
def test_paged_kv_cache_example_verifies_every_step(backend):
    # CUDA's default (lazy) module loading, and no warm-up in the example: the
    # step's first kernels launch behind a pending pull.
    env = {k: v for k, v in ENV.items() if k != "CUDA_MODULE_LOADING"}
    out = run([sys.executable, os.path.join(EXAMPLES, "paged_kv_cache.py"), "--iters", "12", "--pages", "128",
               "--backend", backend], timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all pages and outputs verified" in out.stdout


def test_vllm_launch_says_what_it_needs():
    # With vLLM and two GPUs it would start servers for MODEL: left unset, it
    # must stop at that. Elsewhere it names the missing vLLM or GPUs.
    env = {k: v for k, v in ENV.items() if k != "MODEL"}
    env["PYTHON"] = sys.executable
    out = run(["bash", os.path.join(EXAMPLES, "vllm_disagg", "launch.sh")], timeout=120, env=env)
    assert out.returncode != 0
    if shutil.which("vllm", path=env.get("PATH")) is None:
        expected = "launch.sh needs vLLM"
    elif torch.cuda.device_count() < 2:
        expected = "launch.sh needs two GPUs"
    else:
        expected = "set MODEL"
    assert expected in out.stderr, out.stderr
