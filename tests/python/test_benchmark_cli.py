"""The benchmark CLI runs end to end (two processes, engine + same-run
baseline) on every backend the machine has, and refuses the others clearly."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {
    "backend", "op", "mem", "segment_bytes", "segments", "gbps", "baseline", "baseline_gbps", "ratio",
    "machine", "p50_us", "p99_us", "iters", "num_data_conns", "sess", "shuffle", "command",
}


def _run(*args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run(
        [sys.executable, "-m", "mori_torch.benchmark", *args],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_batch_write_session_json(tmp_path):
    out = tmp_path / "bench.json"
    p = _run(
        "--op-type", "write", "--buffer-size", "64K", "--transfer-batch-size", "4",
        "--enable-batch-transfer", "--enable-sess", "--iters", "3", "--warmup", "1", "--json", str(out),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "baseline GB/s" in p.stdout and "ratio" in p.stdout
    records = json.loads(out.read_text())
    assert isinstance(records, list) and len(records) == 1
    r = records[0]
    assert REQUIRED <= set(r), REQUIRED - set(r)
    assert r["backend"] == "tcp" and r["op"] == "write" and r["mem"] == "cpu"
    assert r["segment_bytes"] == 64 * 1024 and r["segments"] == 4
    assert r["sess"] is True and r["shuffle"] is False and r["iters"] == 3
    assert r["gbps"] > 0 and r["baseline_gbps"] > 0
    assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"])
    assert r["p99_us"] >= r["p50_us"] > 0
    assert r["ratio_p50"] == pytest.approx(r["baseline"]["p50_us"] / r["p50_us"])
    assert "p50 ratio" in p.stdout
    assert r["verified"] is True
    assert r["command"][1:] == p.args[3:]


def test_large_segments_without_a_batch_size_fit_the_buffer_limit(tmp_path):
    # The README's first command (64M segments, MORI-IO's default of 256 per
    # iteration) under a smaller --max-buffer: the batch shrinks to what fits,
    # and the run says so and says what the baseline is.
    out = tmp_path / "bench.json"
    p = _run("--op-type", "write", "--buffer-size", "64M", "--max-buffer", "256M", "--iters", "2", "--warmup", "1",
             "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "64M segments: 4 per iteration, not 256, to stay within --max-buffer 256M" in p.stderr
    assert "baseline: plain TCP sockets moving the same bytes" in p.stderr
    (r,) = json.loads(out.read_text())
    assert r["segment_bytes"] == 64 << 20 and r["segments"] == 4 and r["verified"] is True


def _rdma_devices():
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


@pytest.mark.skipif(bool(_rdma_devices()), reason="checks the message shown without an RDMA device")
def test_rdma_without_a_device_is_refused():
    p = _run("--backend", "rdma", "--buffer-size", "64K", "--transfer-batch-size", "2", "--iters", "1", timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "--backend rdma cannot start on this machine" in p.stderr and "RDMA device" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_xgmi_without_gpu_is_refused():
    p = _run("--backend", "xgmi", "--iters", "1", timeout=60)
    assert p.returncode == 1
    assert "--backend xgmi needs a CUDA/HIP GPU" in p.stderr
    assert "Traceback" not in p.stderr


def test_xgmi_with_host_memory_is_refused():
    p = _run("--backend", "xgmi", "--mem-type", "cpu", "--iters", "1", timeout=60)
    assert p.returncode == 1
    assert "--backend xgmi moves GPU memory between GPU peers" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_gpu_memory_without_gpu_is_refused():
    p = _run("--mem-type", "gpu", timeout=60)
    assert p.returncode != 0
    assert "--mem-type gpu needs a CUDA/HIP GPU" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("backend", ["tcp", "xgmi"])
def test_gpu_memory(tmp_path, backend, op):
    # tcp: GPU memory through staging buffers, socket baseline; xgmi: GPU
    # peers (cuda:1 as the target where there are two GPUs), copy_ baseline.
    out = tmp_path / "bench.json"
    p = _run(
        "--backend", backend, "--mem-type", "gpu", "--op-type", op, "--buffer-size", "256K",
        "--transfer-batch-size", "8", "--enable-batch-transfer", "--enable-sess", "--shuffle", "--iters", "3",
        "--warmup", "1", "--json", str(out),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    (r,) = json.loads(out.read_text())
    assert r["backend"] == backend and r["mem"] == "gpu" and r["op"] == op and r["verified"] is True
    assert r["baseline"]["kind"] == ("torch_copy" if backend == "xgmi" else "socket_loopback")
    assert r["gbps"] > 0 and r["baseline_gbps"] > 0
    assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"])
    if backend == "xgmi":
        assert "baseline: torch copy_ of the same bytes between cuda:" in p.stderr


def test_peer_copy_baseline_needs_xgmi():
    p = _run("--copy-baseline", "peer", "--iters", "1", timeout=60)
    assert p.returncode == 1
    assert "--copy-baseline peer is a torch copy_ between GPU peers: it needs --backend xgmi, not tcp" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
def test_xgmi_peer_copy_baseline(tmp_path):
    # copy_ to and from the target process's own buffer, opened through CUDA IPC.
    out = tmp_path / "bench.json"
    p = _run(
        "--backend", "xgmi", "--op-type", "both", "--buffer-size", "1M", "--transfer-batch-size", "1",
        "--iters", "4", "--warmup", "1", "--copy-baseline", "peer", "--json", str(out),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    recs = json.loads(out.read_text())
    assert [r["op"] for r in recs] == ["read", "write"]
    for r in recs:
        assert r["verified"] is True and r["baseline"]["kind"] == "torch_copy_peer"
        assert r["baseline_gbps"] > 0 and r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"])
    assert "the target process's buffer on cuda:" in p.stderr


def test_notice_delay_reaches_the_engines(tmp_path):
    # Held for 6 s, the verification read's notice reaches the target no
    # sooner (no request follows it while the target waits): the run takes
    # that long (without the flag: about 3 s here) only if the flag reached the initiator's engine.
    out = tmp_path / "bench.json"
    t0 = time.monotonic()
    p = _run("--op-type", "read", "--buffer-size", "4K", "--transfer-batch-size", "1", "--iters", "3",
             "--warmup", "1", "--notice-delay-us", "6000000", "--json", str(out))
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    (r,) = json.loads(out.read_text())
    assert r["notice_delay_us"] == 6000000 and r["verified"] is True
    assert took >= 6.0, f"the run took {took:.1f} s: the notice was not held"


def test_notice_delay_is_checked_and_tcp_only():
    p = _run("--notice-delay-us", "-2", "--iters", "1", timeout=60)
    assert p.returncode == 2
    assert "TcpBackendConfig.notice_delay_us must be in [-1, 10000000], got -2" in p.stderr
    p = _run("--backend", "xgmi", "--notice-delay-us", "0", "--iters", "1", timeout=60)
    assert p.returncode == 1
    assert "--notice-delay-us is a TcpBackendConfig setting: it needs --backend tcp, not xgmi" in p.stderr
    assert "Traceback" not in p.stderr
