"""The README's main demo runs end to end (smaller size, same code path)."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The examples import mori_torch from this tree even where it is not installed.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def test_tcp_demo_verifies_every_phase():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "tcp_demo.py"), "--size-mib", "64", "--num-data-conns", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all bytes verified in every phase" in out.stdout
    assert out.stdout.count("GB/s") == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
@pytest.mark.parametrize("backend", ["xgmi", "tcp"])
def test_paged_kv_cache_example_verifies_every_step(backend):
    # CUDA's default (lazy) module loading, and no warm-up in the example: the
    # step's first kernels launch behind a pending pull.
    env = {k: v for k, v in ENV.items() if k != "CUDA_MODULE_LOADING"}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "paged_kv_cache.py"), "--iters", "12", "--pages", "128",
         "--backend", backend],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all pages and outputs verified" in out.stdout
