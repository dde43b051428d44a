"""Shared fixtures: TCP engine pairs in this process and target engines in
other processes (real sockets, real processes)."""
import multiprocessing as mp
import os
import signal
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Long offset lists are read and checked with WorkCrew helpers (automatic
# count: 0 below 8 CPUs, as on CI): two here whatever the machine, so the
# suite runs that path. test_batch_forms compares it with none.
os.environ.setdefault("MORI_TORCH_SUBMIT_HELPERS", "2")

from mori_torch.io import (  # noqa: E402
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    StatusCode,
    TcpBackendConfig,
)

_counter = [0]


def unique_key(prefix: str) -> str:
    _counter[0] += 1
    return f"{prefix}-{os.getpid()}-{_counter[0]}"


def make_engine(prefix="eng", **tcp_kwargs) -> IOEngine:
    e = IOEngine(unique_key(prefix), IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(**tcp_kwargs))
    return e


def pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def settle():
    """Engine calls are host calls, not stream-ordered (README): the kernels
    that filled a buffer (zeros, fill_, copy_, slice copies) must end, on
    every GPU, before a transfer uses it, or they may land after its copy."""
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def wait_ok(status, timeout_ms=20000):
    code = status.WaitFor(timeout_ms)
    assert code == StatusCode.SUCCESS, f"{code!r}: {status.Message()}"


def pop_notice(target, initiator_key, uid, timeout_s=10.0, poll_s=0.001):
    """The completion notice of transfer `uid` from `initiator_key`, popped at
    `target`: waits for it (a read's notice trails the initiator's status and
    may wait for its next request), then checks that it came only once."""
    deadline = time.monotonic() + timeout_s
    while (st := target.pop_inbound_transfer_status(initiator_key, uid)) is None:
        assert time.monotonic() < deadline, f"no completion notice from {initiator_key} for uid {uid} in {timeout_s} s"
        time.sleep(poll_s)
    assert target.pop_inbound_transfer_status(initiator_key, uid) is None, f"uid {uid} notified twice"
    return st


class Pair:
    """Initiator and target engines in this process, registered both ways."""

    def __init__(self, nbytes=1 << 20, **tcp_kwargs):
        self.init = make_engine("init", **tcp_kwargs)
        self.target = make_engine("target", **tcp_kwargs)
        self.init.register_remote_engine(self.target.get_engine_desc())
        self.target.register_remote_engine(self.init.get_engine_desc())
        self.local = torch.zeros(nbytes, dtype=torch.uint8)
        self.remote = torch.zeros(nbytes, dtype=torch.uint8)
        self.local_desc = self.init.register_torch_tensor(self.local)
        # The initiator only ever sees the target's memory as packed bytes.
        self.remote_desc = MemoryDesc.unpack(self.target.register_torch_tensor(self.remote).pack())

    def close(self):
        self.init.shutdown()
        self.target.shutdown()


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"conns{n}")
def pair(request):
    p = Pair(nbytes=4 << 20, num_data_conns=request.param, striping_threshold_bytes=4096)
    yield p
    p.close()


# ---------------------------------------------------------------------------
# Target engine in another process, driven over a pipe.


def _target_main(conn, key, nbytes, tcp_kwargs, opts):
    # opts: "log" (file for this process's stderr), "env" (set before the
    # engine exists), "port", "secret", "shm" (a file to map as the buffer,
    # so the test process sees its bytes even while this one is stopped).
    if opts.get("log"):
        fd = os.open(opts["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
    os.environ.update(opts.get("env", {}))
    import torch  # noqa: F811

    from mori_torch.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, TcpBackendConfig

    eng = IOEngine(key, IOEngineConfig("127.0.0.1", opts.get("port", 0), secret=opts.get("secret")))
    eng.create_backend(BackendType.TCP, TcpBackendConfig(**tcp_kwargs))
    if opts.get("shm"):
        buf = torch.from_file(opts["shm"], shared=True, size=nbytes, dtype=torch.uint8)
    else:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
    md = eng.register_torch_tensor(buf)
    conn.send((eng.get_engine_desc().pack(), md.pack(), os.getpid()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "fill":
            g = torch.Generator().manual_seed(arg)
            buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
            conn.send(True)
        elif cmd == "get":
            lo, hi = arg
            conn.send(bytes(buf[lo:hi].numpy()))
        elif cmd == "register_remote":
            eng.register_remote_engine(EngineDesc.unpack(arg))
            conn.send(True)
        elif cmd == "pop":
            conn.send(eng.pop_inbound_transfer_status(*arg) is not None)
        elif cmd == "exit":
            eng.shutdown()
            conn.send(True)
            return


def _thread_state(pid, tid):
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread ended
        return None


def freeze(pid, timeout_s=10.0):
    """SIGSTOP, then wait until every thread of the process has stopped:
    kill() returns before they all have, and until then the process may still
    serve a transfer issued right after (which made stalled-peer tests flaky)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all(_thread_state(pid, t) in ("T", "t", None) for t in os.listdir(f"/proc/{pid}/task")):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP")
        time.sleep(0.005)


def resume(pid):
    """SIGCONT for a process a test froze (SIGSTOP); gone already is fine."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


class RemoteTarget:
    """A target engine in a separate process (spawned, so no forked threads)."""

    def __init__(self, nbytes=1 << 20, key=None, opts=None, **tcp_kwargs):
        ctx = mp.get_context("spawn")
        self.key = key or unique_key("remote")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(child, self.key, nbytes, tcp_kwargs, opts or {}),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("remote target did not start")
        engine_bytes, mem_bytes, self.pid = self.conn.recv()
        self.engine_desc = EngineDesc.unpack(engine_bytes)
        self.mem_desc = MemoryDesc.unpack(mem_bytes)

    def call(self, cmd, arg=None, timeout=30):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"remote target did not answer {cmd}")
        return self.conn.recv()

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ---- rendezvous: real etcd and TCPStore ------------------------------------

def free_port() -> int:
    from mori_torch.rendezvous.local_etcd import free_port as _free_port

    return _free_port()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    """Debian's etcd-server on free loopback ports (scripts/setup.sh installs it)."""
    from mori_torch.rendezvous.local_etcd import LocalEtcd

    try:
        srv = LocalEtcd(str(tmp_path_factory.mktemp("etcd") / "data")).start()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield srv
    srv.kill()


def make_directory(kind: str, address: str, namespace: str, ttl_s: float, **kw):
    """A directory of `kind` ("tcpstore": address host:port of a TCPStore
    server; "etcd": its endpoint URL) as a client."""
    from mori_torch.rendezvous import EtcdDirectory, TorchStoreDirectory

    if kind == "etcd":
        return EtcdDirectory(namespace, address, ttl_s=ttl_s, **kw)
    host, port = address.rsplit(":", 1)
    return TorchStoreDirectory(namespace, host=host, port=int(port), ttl_s=ttl_s, **kw)
