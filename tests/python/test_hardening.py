"""Contract fixes of issue #18 at the Python API: every call after shutdown()
raises, misuse raises ValueError/TypeError, and an engine whose stderr is a
pipe nobody reads still serves and shuts down (real processes)."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import Pair, make_engine, unique_key, wait_ok
from mori_torch.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    TcpBackendConfig,
)


def test_every_call_after_shutdown_raises():
    p = Pair(1 << 16)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    e = p.init
    e.shutdown()
    calls = {
        "register_torch_tensor": lambda: e.register_torch_tensor(torch.zeros(8, dtype=torch.uint8)),
        "register_memory": lambda: e.register_memory(p.local.data_ptr(), 8, -1, MemoryLocationType.CPU),
        "deregister_memory": lambda: e.deregister_memory(p.local_desc),
        "create_backend": lambda: e.create_backend(BackendType.TCP),
        "remove_backend": lambda: e.remove_backend(BackendType.TCP),
        "register_remote_engine": lambda: e.register_remote_engine(p.target.get_engine_desc()),
        "deregister_remote_engine": lambda: e.deregister_remote_engine(p.target.get_engine_desc()),
        "get_engine_desc": lambda: e.get_engine_desc(),
        "allocate_transfer_uid": lambda: e.allocate_transfer_uid(),
        "read": lambda: e.read(p.local_desc, 0, p.remote_desc, 0, 8, 1),
        "write": lambda: e.write(p.local_desc, 0, p.remote_desc, 0, 8, 1),
        "batch_write": lambda: e.batch_write([p.local_desc], [[0]], [p.remote_desc], [[0]], [[8]], [1]),
        "batch_read": lambda: e.batch_read([p.local_desc], [[0]], [p.remote_desc], [[0]], [[8]], [1]),
        "create_session": lambda: e.create_session(p.local_desc, p.remote_desc),
        "pop_inbound_transfer_status": lambda: e.pop_inbound_transfer_status("x", 1),
        "wait_all": lambda: e.wait_all([]),
        "mapped_remote_memories": lambda: e.mapped_remote_memories(),
        "session.write": lambda: sess.write(0, 0, 8, 1),
        "session.read": lambda: sess.read(0, 0, 8, 1),
        "session.batch_write": lambda: sess.batch_write([0], [0], [8], 1),
        "session.allocate_transfer_uid": lambda: sess.allocate_transfer_uid(),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="shut down"):
            call()
            pytest.fail(f"{name} did not raise after shutdown()")
    e.shutdown()  # a second shutdown() is a no-op
    p.target.shutdown()


def test_misuse_raises_value_or_type_error():
    p = Pair(1 << 16)
    with pytest.raises(TypeError):
        p.init.pop_inbound_transfer_status(123, 1)
    with pytest.raises(TypeError):
        p.init.pop_inbound_transfer_status("x", "1")
    with pytest.raises(ValueError, match="contiguous"):
        p.init.register_torch_tensor(torch.zeros(8, 8).t())
    with pytest.raises(TypeError):
        p.init.register_memory("0x1000", 8, -1, MemoryLocationType.CPU)
    with pytest.raises(ValueError):
        p.init.register_memory(p.local.data_ptr(), -8, -1, MemoryLocationType.CPU)
    with pytest.raises(ValueError):
        p.init.deregister_remote_engine(make_engine("never-registered").get_engine_desc())
    with pytest.raises(TypeError):
        p.init.create_session(p.local_desc, "remote")
    fresh = IOEngine(unique_key("fresh"), IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match="inactivity_timeout_ms"):
        fresh.create_backend(BackendType.TCP, TcpBackendConfig(inactivity_timeout_ms=0))
    with pytest.raises(TypeError):
        fresh.create_backend(BackendType.TCP, TcpBackendConfig(serve_threads="many"))
    fresh.shutdown()
    with pytest.raises(ValueError):
        MemoryDesc.unpack(b"\x00" * 5)
    p.close()


def test_inactivity_timeout_is_a_tcp_option_with_a_documented_default():
    assert TcpBackendConfig().inactivity_timeout_ms == 10000
    assert TcpBackendConfig().op_timeout_ms == 30000
    p = Pair(1 << 20, inactivity_timeout_ms=2000, serve_threads=2)
    p.local.fill_(9)
    wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 1 << 20, p.init.allocate_transfer_uid()))
    assert bool((p.remote == 9).all())
    p.close()


_STALLED_STDERR_TARGET = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {root!r})
    from mori_torch.io import BackendType, IOEngine, IOEngineConfig, set_log_level
    set_log_level("info")  # log as much as possible
    e = IOEngine("stalled-stderr", IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP)
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    d = e.register_torch_tensor(buf)
    print(e.get_engine_desc().port, e.get_engine_desc().pack().hex(), d.pack().hex(),
          flush=True)
    sys.stdin.readline()  # the parent has abused the control plane
    t0 = time.monotonic()
    e.shutdown()
    print(f"{{time.monotonic() - t0:.3f}}", flush=True)
    """
)


def test_engine_with_a_stderr_nobody_reads_serves_and_shuts_down():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # stderr is a pipe this test never reads: once its 64 KiB fill up, every
    # write to it would block.
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_STDERR_TARGET.format(root=root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port, desc_hex, mem_hex = proc.stdout.readline().split()
        for _ in range(600):  # each makes the target log a warning (garbage first frame)
            with socket.create_connection(("127.0.0.1", int(port)), timeout=5) as s:
                s.sendall(b"\xee" * 4096)
        # Still serving: verified bytes in and out of its memory.
        e = make_engine("probe")
        e.register_remote_engine(EngineDesc.unpack(bytes.fromhex(desc_hex)))
        remote = MemoryDesc.unpack(bytes.fromhex(mem_hex))
        src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)[:8192].clone()
        back = torch.zeros(8192, dtype=torch.uint8)
        sd, bd = e.register_torch_tensor(src), e.register_torch_tensor(back)
        wait_ok(e.write(sd, 0, remote, 100, 8192, e.allocate_transfer_uid()))
        wait_ok(e.read(bd, 0, remote, 100, 8192, e.allocate_transfer_uid()))
        assert torch.equal(back, src)
        e.shutdown()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        took = proc.stdout.readline().strip()
        assert took, "shutdown() did not return"
        assert float(took) < 5.0, took
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
