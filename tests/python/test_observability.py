"""Observability: IOEngine.stats() checked against the transfers made (bytes,
counts, errors, in flight), its Prometheus exposition scraped for real, the
native log's fields, levels and routing into Python's logging, profiler
ranges switched on, and the names of the threads an engine starts."""
import ast
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import Pair, RemoteTarget, freeze, make_engine, pattern, resume, unique_key, wait_ok
from mori_torch import log as mlog
from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, StatusCode

HERE = os.path.dirname(os.path.abspath(__file__))


def _invariant(c):
    """Every transfer counted has succeeded, failed or is still in flight."""
    assert c["transfers"] == c["reads"] + c["writes"]
    assert c["transfers"] == c["succeeded"] + sum(c["errors"].values()) + c["in_flight"], c
    assert c["bytes"] == c["bytes_read"] + c["bytes_written"]


def test_stats_match_the_transfers_made():
    p = Pair(nbytes=1 << 20, num_data_conns=2, striping_threshold_bytes=4096)
    try:
        p.local.copy_(pattern(p.local.numel(), 3))
        written = read = 0
        statuses = []
        for i, size in enumerate([1, 100, 4096, 65536, 300000]):  # engine writes
            statuses.append(p.init.write(p.local_desc, i * 1000, p.remote_desc, 0, size,
                                         p.init.allocate_transfer_uid()))
            written += size
        sess = p.init.create_session(p.local_desc, p.remote_desc)
        for size in [8, 8192]:  # session reads
            statuses.append(sess.read(0, 0, size, sess.allocate_transfer_uid()))
            read += size
        # one batch transfer of 3 segments counts once, with all its bytes
        statuses.append(sess.batch_write([0, 100, 200], [4000, 5000, 6000], [10, 20, 30], sess.allocate_transfer_uid()))
        written += 60
        for st in statuses:
            wait_ok(st)

        s = p.init.stats()
        assert s["engine"] == p.init.key
        tcp = s["peers"][p.target.key]["TCP"]
        assert (tcp["writes"], tcp["reads"], tcp["succeeded"]) == (6, 2, 8)
        assert (tcp["bytes_written"], tcp["bytes_read"]) == (written, read)
        assert tcp["errors"] == {} and tcp["in_flight"] == 0
        assert tcp["latency"]["count"] == 8 and sum(tcp["latency"]["buckets"]) == 8
        assert tcp["latency"]["sum_ns"] > 0
        assert len(tcp["latency"]["buckets"]) == len(s["latency_bounds_us"]) + 1
        assert s["backends"]["TCP"] == tcp and s["total"] == tcp
        assert list(s["peers"]) == [p.target.key]
        _invariant(tcp)
        # The target initiated nothing.
        assert p.target.stats()["total"]["transfers"] == 0
        # The TorchScript class gives the same counters.
        assert json.loads(p.init._e.stats_json()) == s
    finally:
        p.close()
    # Still readable after shutdown.
    assert p.init.stats()["total"]["succeeded"] == 8


def test_stats_count_refused_transfers_by_code():
    p = Pair(nbytes=1 << 16)
    stranger = make_engine("stranger")
    try:
        bad = p.init.write(p.local_desc, 0, p.remote_desc, (1 << 16) - 4, 8, 1)  # past the remote end
        assert bad.WaitFor(5000) == StatusCode.ERR_INVALID_ARGS
        far = MemoryDesc.unpack(stranger.register_torch_tensor(torch.zeros(64, dtype=torch.uint8)).pack())
        unknown = p.init.read(p.local_desc, 0, far, 0, 8, 2)  # its engine was never registered
        assert unknown.WaitFor(5000) == StatusCode.ERR_NOT_FOUND
        wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 8, 3))
        s = p.init.stats()
        assert s["unrouted"]["errors"] == {"ERR_INVALID_ARGS": 1, "ERR_NOT_FOUND": 1}
        assert (s["unrouted"]["writes"], s["unrouted"]["reads"]) == (1, 1)
        assert s["unrouted"]["latency"]["count"] == 0  # never started
        assert s["total"]["transfers"] == 3 and s["total"]["succeeded"] == 1
        assert s["total"]["errors"] == {"ERR_INVALID_ARGS": 1, "ERR_NOT_FOUND": 1}
        _invariant(s["total"])
    finally:
        p.close()
        stranger.shutdown()


def test_stats_in_flight_and_a_failed_transfer():
    target = RemoteTarget(nbytes=4 << 20)
    init = make_engine("init")
    try:
        init.register_remote_engine(target.engine_desc)
        buf = torch.ones(4 << 20, dtype=torch.uint8)
        local = init.register_torch_tensor(buf)
        wait_ok(init.write(local, 0, target.mem_desc, 0, 64, 1))  # connected

        freeze(target.pid)
        st = init.write(local, 0, target.mem_desc, 0, 4 << 20, 2)
        time.sleep(0.2)
        assert st.Code() == StatusCode.IN_PROGRESS
        tcp = init.stats()["peers"][target.key]["TCP"]
        assert tcp["in_flight"] == 1 and tcp["writes"] == 2
        _invariant(tcp)
        os.kill(target.pid, signal.SIGCONT)
        wait_ok(st)
        assert init.stats()["peers"][target.key]["TCP"]["in_flight"] == 0

        # The target dies: the next transfer fails and is counted under its code.
        target.proc.kill()
        target.proc.join(10)
        failed = init.write(local, 0, target.mem_desc, 0, 1 << 20, 3)
        code = failed.WaitFor(30000)
        assert code not in (StatusCode.SUCCESS, StatusCode.IN_PROGRESS), failed.Message()
        tcp = init.stats()["peers"][target.key]["TCP"]
        assert tcp["errors"] == {StatusCode(code).name: 1}
        assert (tcp["writes"], tcp["succeeded"], tcp["in_flight"]) == (3, 2, 0)
        assert tcp["bytes_written"] == 64 + (4 << 20)  # the failed one's bytes do not count
        _invariant(tcp)
    finally:
        resume(target.pid)
        init.shutdown()
        target.close()


# ---- GPU memory (XGMI) -------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
def test_stats_count_gpu_transfers_under_their_backend():
    from mori_torch.io import XgmiBackendConfig

    engines = []
    for name in ("gpu-a", "gpu-b"):
        e = IOEngine(unique_key(name), IOEngineConfig("127.0.0.1", 0))
        e.create_backend(BackendType.XGMI, XgmiBackendConfig())
        engines.append(e)
    a, b = engines
    try:
        a.register_remote_engine(b.get_engine_desc())
        src = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0").view(torch.uint8)
        dst = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda:0")
        ld, rd = a.register_torch_tensor(src), b.register_torch_tensor(dst)
        wait_ok(a.write(ld, 0, rd, 0, 4 << 20, 1))
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
        want = torch.cat([dst[4096:8192], dst[65536:69632]])
        sess = a.create_session(ld, rd)
        # Reads remote [4096, 8192) and [65536, 69632) into local [0, 4096) and [8192, 12288).
        wait_ok(sess.batch_read([0, 8192], [4096, 65536], [4096, 4096], sess.allocate_transfer_uid()))
        torch.cuda.synchronize()
        assert torch.equal(torch.cat([src[0:4096], src[8192:12288]]), want)
        x = a.stats()["peers"][b.key]["XGMI"]
        assert (x["writes"], x["reads"], x["succeeded"], x["in_flight"]) == (1, 1, 2, 0)
        assert (x["bytes_written"], x["bytes_read"]) == (4 << 20, 8192)
        assert x["latency"]["count"] == 2 and x["errors"] == {}
        _invariant(x)
    finally:
        a.shutdown()
        b.shutdown()


# ---- profiler ranges ---------------------------------------------------------

def test_nvtx_flag_turns_ranges_on_and_transfers_still_work():
    native = torch.classes.mori.Engine
    was = native.trace_ranges_enabled()
    try:
        native.set_trace_ranges(False)
        e = IOEngine(unique_key("nvtx"), IOEngineConfig("127.0.0.1", 0, nvtx=True))
        assert native.trace_ranges_enabled()
        e.create_backend(BackendType.TCP)
        t = e.register_torch_tensor(torch.arange(256, dtype=torch.uint8))
        dst = torch.zeros(256, dtype=torch.uint8)
        d = e.register_torch_tensor(dst)
        wait_ok(e.read(d, 0, t, 0, 256, 1))  # within one engine
        assert torch.equal(dst, torch.arange(256, dtype=torch.uint8))
        assert e.stats()["peers"][e.key]["TCP"]["succeeded"] == 1
        e.shutdown()
        with pytest.raises(TypeError, match="nvtx must be a bool"):
            IOEngine(unique_key("nvtx"), IOEngineConfig(nvtx=1))
    finally:
        native.set_trace_ranges(was)


def test_nvtx_env_turns_ranges_on():
    code = "import torch, mori_torch; print(torch.classes.mori.Engine.trace_ranges_enabled())"
    env = dict(os.environ, MORI_TORCH_NVTX="1")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "True"
    env["MORI_TORCH_NVTX"] = "0"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


_NVTX_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from conftest import wait_ok
    from mori_torch.io import BackendType, IOEngine, IOEngineConfig, XgmiBackendConfig
    e = IOEngine("nvtx", IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.XGMI, XgmiBackendConfig())
    a = torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")
    b = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    da, db = e.register_torch_tensor(a), e.register_torch_tensor(b)
    for i in range(10):
        wait_ok(e.write(da, 0, db, 0, 1 << 20, i))
        wait_ok(e.read(da, 0, db, 0, 4096, 100 + i))
    assert torch.equal(a, b)
    e.shutdown()
""")


@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nsys") is None,
                    reason="needs a CUDA GPU and Nsight Systems (nsys)")
def test_nvtx_ranges_reach_nsys(tmp_path):
    rep = tmp_path / "p"
    env = dict(os.environ, MORI_TORCH_NVTX="1")
    subprocess.run(["nsys", "profile", "-t", "nvtx,cuda", "-o", str(rep), sys.executable, "-c", _NVTX_SCRIPT, HERE],
                   env=env, check=True, capture_output=True, timeout=300)
    out = subprocess.run(["nsys", "stats", "-q", "-r", "nvtx_sum", "-f", "csv", str(rep) + ".nsys-rep"],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    rows = {line.split(",")[-1].strip().strip('"'): line for line in out.splitlines() if "mori." in line}
    assert any(k.endswith("mori.write") for k in rows) and any(k.endswith("mori.read") for k in rows), out


# ---- log -------------------------------------------------------------------

_ENGINE_SCRIPT = textwrap.dedent("""
    from mori_torch.io import IOEngine, IOEngineConfig
    import mori_torch
    e = IOEngine("logged", IOEngineConfig("127.0.0.1", 0))
    e.shutdown()
    mori_torch.log.flush(2000)
""")


def _run_logged(spec):
    env = dict(os.environ, MORI_TORCH_LOG=spec)
    env.pop("MORI_TORCH_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120).stderr


def test_log_lines_carry_subsystem_thread_and_file_line():
    err = _run_logged("warning,engine=info")
    m = re.search(r"\[mori_torch INFO \d+\.\d{3} pid=\d+ engine (\S+) core/engine\.cpp:(\d+)\] "
                  r"engine 'logged' listening on 127\.0\.0\.1:\d+", err)
    assert m, err
    assert int(m.group(2)) > 0
    # Off for that subsystem: the line is not written.
    assert "listening on" not in _run_logged("info,engine=warning")


def test_bad_log_env_is_reported_not_fatal():
    err = _run_logged("info,nosuch=debug")
    assert "MORI_TORCH_LOG='info,nosuch=debug' ignored: unknown subsystem 'nosuch'" in err


def test_set_level_spec_and_errors():
    saved = mlog.level_spec()
    try:
        mlog.set_level("error,tcp=debug")
        assert mlog.level_spec() == "error,tcp=debug"
        with pytest.raises(ValueError, match="unknown subsystem 'tpc'"):
            mlog.set_level("tpc=debug")
        with pytest.raises(ValueError, match="unknown level 'loud'"):
            mlog.set_level("loud")
        with pytest.raises(TypeError):
            mlog.set_level(3)
        assert mlog.level_spec() == "error,tcp=debug"
    finally:
        mlog.set_level(saved)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_route_to_python_logging():
    saved = mlog.level_spec()
    cap = _Capture()
    root = logging.getLogger("mori_torch")
    old_level = root.level
    root.addHandler(cap)
    root.setLevel(logging.DEBUG)
    mlog.set_level("warning,engine=info")
    mlog.route_to_python()
    try:
        e = IOEngine(unique_key("routed"), IOEngineConfig("127.0.0.1", 0))
        e.shutdown()
        deadline = time.time() + 10
        mine = []
        while not mine and time.time() < deadline:
            mine = [r for r in cap.records if e.key in r.getMessage() and "listening on" in r.getMessage()]
            time.sleep(0.05)
        assert len(mine) == 1, [r.getMessage() for r in cap.records]
        r = mine[0]
        assert r.name == "mori_torch.engine" and r.levelno == logging.INFO
        assert r.pathname == "core/engine.cpp" and r.filename == "engine.cpp" and r.lineno > 0
        assert r.threadName and r.mori_subsystem == "engine"
        assert abs(r.created - time.time()) < 60
    finally:
        mlog.unroute()
        mlog.set_level(saved)
        root.removeHandler(cap)
        root.setLevel(old_level)


# ---- thread names ------------------------------------------------------------

_THREADS_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, sys.argv[1])
    torch.set_num_threads(1)
    from conftest import Pair, wait_ok

    def comms():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    out[tid] = f.read().strip()
            except FileNotFoundError:
                pass
        return out

    torch.zeros(1 << 20).add_(1)  # torch's own pools, before the baseline
    before = comms()
    p = Pair(nbytes=1 << 20, num_data_conns=2)
    for i in range(4):
        wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 1 << 19, i))
        wait_ok(p.init.read(p.local_desc, 0, p.remote_desc, 0, 1 << 19, 10 + i))
    new = {t: n for t, n in comms().items() if t not in before}
    print(sorted(set(new.values())))
    p.close()
""")


def test_every_engine_thread_is_named():
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, HERE], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    names = ast.literal_eval(out.strip().splitlines()[-1])
    assert names, out
    assert all(n.startswith("mori-") and len(n) <= 15 for n in names), names
    # The threads of the TCP path and the control plane are among them.
    for expected in ("mori-loop", "mori-ctrl", "mori-tcp-send", "mori-tcp-recv", "mori-tcp-serve"):
        assert expected in names, names
