"""benchmarks/compare_peers.py on host memory: every library that is here runs
its workloads in its own processes with its bytes verified, next to the socket
and torch baselines of the same run; a library that is not installed is
reported as such, not as a failure. scripts/setup.sh puts NIXL (whose UCX runs
over TCP without a GPU) in <venv>/peers, outside the venv's site-packages so
that nothing else imports it; these tests add it to the path when it is
there. Mooncake's engine needs libcuda: without a GPU driver it is reported
as unavailable."""
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_peers  # noqa: E402

WORKLOADS = [w[0] for w in compare_peers.QUICK_WORKLOADS]
PEERS_SITE = Path(sys.prefix) / "peers"
EXTRA_PATH = [str(PEERS_SITE)] if PEERS_SITE.is_dir() else []


def _installed(lib):
    name = compare_peers.MODULE[lib].split(".")[0]
    return importlib.machinery.PathFinder.find_spec(name, EXTRA_PATH + sys.path) is not None


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + EXTRA_PATH
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("peers")
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare_peers.py"), "--mem", "cpu", "--quick", "--iters", "2",
         "--warmup", "1", "--lat-samples", "20", "--json", str(d / "peers.json"), "--markdown", str(d / "peers.md")],
        cwd=str(ROOT), env=_env(), capture_output=True, text=True, timeout=400,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((d / "peers.json").read_text()), (d / "peers.md").read_text(), p


def test_report_shape_and_versions(report):
    rep, _, _ = report
    assert rep["op"] == "read" and rep["mem_types"] == ["cpu"] and rep["baseline"]["cpu"] == "socket"
    assert rep["machine"] and rep["torch"] and "compare_peers.py" in rep["command"]
    libs = [r["library"] for r in rep["results"]]
    assert libs == ["mori_torch", "nixl", "mooncake", "socket", "torch_copy", "torch_gather"]
    for r in rep["results"]:
        assert r["mem"] == "cpu" and r["path"]
        if r["status"] == "ok":
            assert r["version"]
            assert [w["workload"] for w in r["workloads"]] == WORKLOADS


def test_mori_torch_and_baselines_move_verified_bytes(report):
    rep, _, _ = report
    by = {r["library"]: r for r in rep["results"]}
    for lib in ("mori_torch", "socket", "torch_copy", "torch_gather"):
        r = by[lib]
        assert r["status"] == "ok", r
        for w in r["workloads"]:
            assert w["verified"] is True, (lib, w)
            assert w["gbps"] > 0 and w["p99_us"] >= w["p50_us"] >= w["min_us"] > 0
            assert w["ratio"] is not None and w["baseline"] == "socket"
            assert w["iters"] == (20 if w["latency"] else 2)
    assert by["mori_torch"]["env"] == {} and by["mori_torch"]["version"].startswith("0.")
    lat = next(w for w in by["mori_torch"]["workloads"] if w["latency"])
    assert lat["segments"] == 1 and lat["segment_bytes"] == 4096
    assert lat["ratio"] == pytest.approx(
        next(w for w in by["socket"]["workloads"] if w["latency"])["p50_us"] / lat["p50_us"])


@pytest.mark.parametrize("lib", ["nixl", "mooncake"])
def test_peer_reported_as_installed_or_not(report, lib):
    rep, md, p = report
    r = next(r for r in rep["results"] if r["library"] == lib)
    assert r["env"] == compare_peers.ENV[(lib, "cpu")]
    if _installed(lib) and lib == "nixl":
        assert r["status"] == "ok", r
        assert r["version"] == "1.5.1" and [w["workload"] for w in r["workloads"]] == WORKLOADS
        assert all(w["verified"] and w["ratio"] > 0 for w in r["workloads"])
    elif _installed(lib):
        assert r["status"] in ("ok", "unavailable"), r  # Mooncake: no libcuda without a GPU driver
        if r["status"] == "ok":
            assert all(w["verified"] for w in r["workloads"])
    else:
        assert r["status"] == "not installed"
        assert compare_peers.DIST[lib] in r["detail"]
        assert f"| {lib} | not installed" in md
        assert f"{lib} (cpu) failed" not in p.stderr


def test_markdown_table_lists_every_workload(report):
    _, md, p = report
    header = next(ln for ln in md.splitlines() if ln.startswith("| library"))
    assert all(w in header for w in WORKLOADS)
    assert "| mori_torch |" in md and md in p.stdout


def test_page_check_catches_a_wrong_page():
    import torch

    seg, n = 64, 8
    ref = torch.randint(0, 256, (seg * 32,), dtype=torch.uint8)
    idx = compare_peers.permutation(32, 3)[:n]
    local = ref.view(-1, seg)[torch.tensor(idx)].reshape(-1).clone()
    assert compare_peers.pages_match(local, ref, seg, n, idx)
    local[seg * 5 + 7] ^= 1
    assert not compare_peers.pages_match(local, ref, seg, n, idx)
    assert not compare_peers.pages_match(ref.clone(), ref, seg, n, idx)  # unpermuted bytes are not the pages


def test_permutation_leaves_no_adjacent_pages():
    for n in (2, 3, 100, 4096):
        p = compare_peers.permutation(n, 11)
        assert sorted(p) == list(range(n))
        assert all(p[i + 1] != p[i] + 1 for i in range(n - 1))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_paths(tmp_path):
    # mori_torch's XGMI path and any peer installed here, against torch copy_.
    out = tmp_path / "peers.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare_peers.py"), "--mem", "gpu", "--quick", "--iters", "3",
         "--lat-samples", "50", "--json", str(out)],
        cwd=str(ROOT), env=_env(), capture_output=True, text=True, timeout=400,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    by = {r["library"]: r for r in rep["results"]}
    assert "socket" not in by and rep["baseline"]["gpu"] == "torch_copy"
    for lib in ("mori_torch", "torch_copy", "torch_gather"):
        assert by[lib]["status"] == "ok", by[lib]
        assert all(w["verified"] and w["baseline"] == "torch_copy" for w in by[lib]["workloads"])
    for lib in ("nixl", "mooncake"):
        assert by[lib]["status"] in ("ok", "not installed", "unavailable"), by[lib]


def test_workloads_option_runs_the_named_ones_in_order(tmp_path):
    out = tmp_path / "some.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare_peers.py"), "--mem", "cpu", "--quick", "--libs",
         "mori_torch", "--workloads", "latency_4KiB", "512x4KiB", "--iters", "2", "--warmup", "1", "--lat-samples",
         "10", "--json", str(out)],
        cwd=str(ROOT), env=_env(), capture_output=True, text=True, timeout=200,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    mori = next(r for r in rep["results"] if r["library"] == "mori_torch")
    assert [w["workload"] for w in mori["workloads"]] == ["latency_4KiB", "512x4KiB"]
    assert all(w["verified"] for w in mori["workloads"])
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_peers.py"), "--quick", "--workloads",
                          "64MiB"], cwd=str(ROOT), env=_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--workloads: unknown 64MiB; these are: 4MiB, 1024x16KiB" in bad.stderr
