"""Faults between two processes. Delay: a userspace proxy that holds every
chunk for a fixed time. Loss and a black hole: nftables rules on the target's
side of a veth pair into a network namespace (this kernel has no netem).
Transfers are verified byte for byte."""
import collections
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import pattern, unique_key
from mori_torch.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    StatusCode,
    TcpBackendConfig,
)

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE = 8 << 20
SEED = 3


def _unpack(cls, b: bytes):
    return cls.unpack(b)


class Target:
    """tests/python/fault_target.py in its own process (optionally in a netns)."""

    def __init__(self, host="127.0.0.1", netns=None):
        cmd = [sys.executable, os.path.join(HERE, "fault_target.py"), "--host", host, "--size", str(SIZE), "--seed",
               str(SEED)]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        fields = self.proc.stdout.readline().split()
        assert len(fields) == 2, "fault target did not start"
        self.engine_bytes, self.mem_bytes = bytes.fromhex(fields[0]), bytes.fromhex(fields[1])
        self.mem = _unpack(MemoryDesc, self.mem_bytes)

    def desc(self, port=None) -> EngineDesc:
        b = bytearray(self.engine_bytes)
        if port is not None:
            b[-16:-12] = struct.pack("<i", port)  # a packed EngineDesc ends with port, pid, incarnation
        return _unpack(EngineDesc, bytes(b))

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class DelayProxy:
    """TCP proxy on 127.0.0.1 that forwards each chunk `delay_s` after it
    arrived, in both directions (bandwidth is kept, latency added)."""

    def __init__(self, upstream, delay_s):
        self.upstream, self.delay = upstream, delay_s
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            for s in (c, u):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks += [c, u]
            self._pump(c, u)
            self._pump(u, c)

    def _pump(self, src, dst):
        q = collections.deque()
        cv = threading.Condition()

        def reader():
            while True:
                try:
                    b = src.recv(1 << 20)
                except OSError:
                    b = b""
                with cv:
                    q.append((time.monotonic() + self.delay, b))
                    cv.notify()
                if not b:
                    return

        def writer():
            while True:
                with cv:
                    cv.wait_for(lambda: q)
                    due, b = q.popleft()
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    if not b:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(b)
                except OSError:
                    return

        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=writer, daemon=True).start()

    def close(self):
        self.lsock.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def _initiator(**tcp):
    e = IOEngine(unique_key("fault-init"), IOEngineConfig("", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(**tcp))
    return e


def _verified_round_trips(e, target, desc, count, size=1 << 20):
    """Writes random bytes into the target, reads them back; reads the
    target's pattern region. Every transfer must succeed and verify."""
    e.register_remote_engine(desc)
    src = torch.zeros(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    sd, dd = e.register_torch_tensor(src), e.register_torch_tensor(dst)
    ref = pattern(SIZE, SEED)
    sess = e.create_session(dd, target.mem)
    for i in range(count):
        off = (i * size) % (SIZE // 2)
        # The pattern half first (nobody writes it), then a write + read back in the other half.
        st = sess.read(0, off, size, sess.allocate_transfer_uid())
        assert st.WaitFor(60000) == StatusCode.SUCCESS, st.Message()
        assert torch.equal(dst, ref[off:off + size])
        src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        w = e.write(sd, 0, target.mem, SIZE // 2 + off, size, e.allocate_transfer_uid())
        assert w.WaitFor(60000) == StatusCode.SUCCESS, w.Message()
        r = e.read(dd, 0, target.mem, SIZE // 2 + off, size, e.allocate_transfer_uid())
        assert r.WaitFor(60000) == StatusCode.SUCCESS, r.Message()
        assert torch.equal(dst, src)
    return sd, dd


def test_delay_of_20ms_each_way_through_a_proxy():
    target = Target()
    desc = target.desc()
    proxy = DelayProxy((desc.host, desc.port), 0.020)
    e = _initiator(num_data_conns=2)
    try:
        _, dd = _verified_round_trips(e, target, target.desc(port=proxy.port), count=4)
        t0 = time.monotonic()
        st = e.read(dd, 0, target.mem, 0, 64, e.allocate_transfer_uid())
        assert st.WaitFor(10000) == StatusCode.SUCCESS, st.Message()
        assert time.monotonic() - t0 >= 0.035  # the proxy's delay, both ways
    finally:
        e.shutdown()
        proxy.close()
        target.close()


def _sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


@pytest.fixture
def netns():
    """A network namespace with a veth pair into it: the target's address
    inside, this process's on the host end."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nft"):
        pytest.skip("needs root, iproute2 and nftables (scripts/setup.sh installs them)")
    pid = os.getpid()
    ns, host_if, ns_if = f"mori{pid}", f"mh{pid}", f"mn{pid}"
    net = f"10.{(pid >> 8) & 0xff}.{pid & 0xff}"
    if _sh("ip", "netns", "add", ns, check=False).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _sh("ip", "link", "set", ns_if, "netns", ns)
        _sh("ip", "addr", "add", f"{net}.2/30", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{net}.1/30", "dev", ns_if)
        _sh("ip", "-n", ns, "link", "set", ns_if, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "mori")
        _sh("ip", "netns", "exec", ns, "nft", "add chain inet mori in { type filter hook input priority 0 ; }")
        yield ns, f"{net}.1"
    finally:
        _sh("ip", "netns", "del", ns, check=False)  # takes the veth pair with it
        _sh("ip", "link", "del", host_if, check=False)


def _nft(ns, rule):
    _sh("ip", "netns", "exec", ns, "nft", rule)


def test_ten_percent_loss_keeps_live_transfers_alive(netns):
    ns, addr = netns
    _nft(ns, "add rule inet mori in meta l4proto tcp numgen random mod 100 < 10 drop")
    target = Target(host=addr, netns=ns)
    e = _initiator()  # default timeouts: the inactivity timeout does not cut slow transfers off
    try:
        _verified_round_trips(e, target, target.desc(), count=6)
    finally:
        e.shutdown()
        target.close()


def test_black_hole_fails_transfers_by_the_inactivity_timeout_then_recovers(netns):
    ns, addr = netns
    target = Target(host=addr, netns=ns)
    e = _initiator(op_timeout_ms=120000, inactivity_timeout_ms=1000, connect_timeout_ms=1000)
    try:
        sd, dd = _verified_round_trips(e, target, target.desc(), count=1)
        _nft(ns, "add rule inet mori in meta l4proto tcp drop")
        t0 = time.monotonic()
        sts = [e.write(sd, 0, target.mem, SIZE // 2, 1 << 20, e.allocate_transfer_uid()) for _ in range(4)]
        for st in sts:
            assert st.WaitFor(30000) == StatusCode.ERR_BAD_STATE, st.Message()
        took = time.monotonic() - t0
        assert took < 10, took  # the inactivity timeout, not op_timeout_ms (120 s)
        assert any("inactivity" in st.Message() for st in sts), [st.Message() for st in sts]
        _nft(ns, "flush chain inet mori in")
        # Reconnects and moves verified bytes again.
        _verified_round_trips(e, target, target.desc(), count=2)
    finally:
        e.shutdown()
        target.close()
