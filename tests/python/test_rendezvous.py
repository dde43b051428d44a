"""Rendezvous directories with real stores: a TCPStore hosted by the test
process and Debian's etcd started on a free loopback port. Engines publish
from other processes; the test process discovers them, moves bytes through
the looked-up descriptors and watches them leave and come back."""
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from conftest import freeze, make_directory, make_engine, pattern, wait_ok
from mori_torch.io import MemoryDesc, StatusCode
from mori_torch.rendezvous import LookupTimeout, MalformedEntryError, RendezvousError, TorchStoreDirectory

HERE = os.path.dirname(os.path.abspath(__file__))
TTL_S = 2.0


@pytest.fixture(params=["tcpstore", "etcd"])
def store(request):
    """(kind, address) of a running store."""
    if request.param == "etcd":
        yield "etcd", request.getfixturevalue("etcd_server").endpoint
        return
    host = TorchStoreDirectory("hosting", host="127.0.0.1", port=0, is_server=True)
    yield "tcpstore", f"127.0.0.1:{host.port}"
    host.close()


def ns():
    return "t" + uuid.uuid4().hex[:10]


def read_all(engine, remote: MemoryDesc) -> torch.Tensor:
    """Reads the whole of a looked-up remote memory into a new tensor."""
    local = torch.zeros(remote.size, dtype=torch.uint8)
    wait_ok(engine.read(engine.register_torch_tensor(local), 0, remote, 0, remote.size,
                        engine.allocate_transfer_uid()))
    return local


class PeerProcess:
    """rendezvous_peer.py: an engine that publishes itself from its own process."""

    def __init__(self, store, namespace, key, seed, ttl_s=TTL_S):
        kind, address = store
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "rendezvous_peer.py"), kind, address,
                                      namespace, key, str(ttl_s), str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)
        self.incarnation = self.expect("READY", 120)[0]

    def expect(self, word, timeout=60):
        result = []

        def read():
            for line in self.proc.stdout:
                if line.startswith(word):
                    result.append(line.split()[1:])
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        assert result, f"peer process did not say {word} within {timeout}s (exit code {self.proc.poll()})"
        return result[0]

    def ask(self, cmd, word):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.expect(word)

    def signal(self, sig):
        if sig == signal.SIGSTOP:
            freeze(self.proc.pid)
        else:
            os.kill(self.proc.pid, sig)

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.ask("exit", "BYE")
            except (AssertionError, BrokenPipeError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            try:
                p.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        p.stop()


def test_discovery_and_transfer_two_processes(store, procs):
    namespace = ns()
    procs.append(PeerProcess(store, namespace, "prefill-0", seed=1))
    engine = make_engine("decode")
    with make_directory(*store, namespace, TTL_S) as d:
        peer = d.connect(engine, "prefill-0", timeout_s=30)
        assert peer.incarnation == procs[0].incarnation and list(peer.memories) == ["kv"]
        remote = peer.memories["kv"]
        local = torch.zeros(remote.size, dtype=torch.uint8)
        sess = engine.create_session(engine.register_torch_tensor(local), remote)
        wait_ok(sess.read(0, 0, remote.size, sess.allocate_transfer_uid()))
        assert torch.equal(local, pattern(remote.size, 1))
        local.copy_(pattern(remote.size, 2))
        wait_ok(sess.write(0, 0, remote.size, sess.allocate_transfer_uid()))
        assert procs[0].ask("verify 2", "VERIFY") == ["True"]
        # A clean exit removes the entry at once; the peer is told.
        procs[0].stop()
        assert peer.wait_left(TTL_S + 3), peer
        with pytest.raises(LookupTimeout):
            d.lookup("prefill-0")
    engine.shutdown()


def test_three_processes_wait_for_a_late_engine(store, procs):
    namespace = ns()
    procs.append(PeerProcess(store, namespace, "prefill-a", seed=3))
    engine = make_engine("decode3")
    with make_directory(*store, namespace, TTL_S) as d:
        late = {}
        waiter = threading.Thread(target=lambda: late.setdefault("peer", d.connect(engine, "prefill-b", 60)))
        waiter.start()  # waits for an engine that is not there yet
        time.sleep(0.5)
        procs.append(PeerProcess(store, namespace, "prefill-b", seed=4))
        waiter.join(60)
        peers = {"prefill-a": d.connect(engine, "prefill-a", 10), "prefill-b": late["peer"]}
        for key, seed in (("prefill-a", 3), ("prefill-b", 4)):
            assert torch.equal(read_all(engine, peers[key].memories["kv"]), pattern(1 << 20, seed)), key
    engine.shutdown()


def test_frozen_then_killed_engine_leaves_and_transfers_end_with_peer_left(store, procs):
    """The engine stops answering (SIGSTOP: as when its host dies, no
    FIN/RST reaches us), then is SIGKILLed. Its entry vanishes within the
    TTL, and transfers in flight to it end with "peer left" (ERR_BAD_STATE)
    long before the 120 s op timeout."""
    namespace = ns()
    procs.append(PeerProcess(store, namespace, "prefill-k", seed=5))
    engine = make_engine("decodek", op_timeout_ms=120000)
    with make_directory(*store, namespace, TTL_S) as d:
        peer = d.connect(engine, "prefill-k", 30)
        remote = peer.memories["kv"]
        local = torch.zeros(remote.size, dtype=torch.uint8)
        ld = engine.register_torch_tensor(local)
        wait_ok(engine.read(ld, 0, remote, 0, remote.size, 1))
        procs[0].signal(signal.SIGSTOP)
        t0 = time.monotonic()
        in_flight = [engine.read(ld, 0, remote, 0, remote.size, 10 + i) for i in range(8)]
        assert peer.wait_left(TTL_S * 2 + 3), peer
        left_after = time.monotonic() - t0
        procs[0].signal(signal.SIGKILL)
        for st in in_flight:
            assert st.WaitFor(10000) == StatusCode.ERR_BAD_STATE, st.Message()
            assert "peer left" in st.Message(), st.Message()
        ended_after = time.monotonic() - t0
        assert left_after < TTL_S * 2 + 3 and ended_after < 30, (left_after, ended_after)
        with pytest.raises(LookupTimeout):
            d.lookup("prefill-k")  # the entry is gone from the store itself
        # New transfers to it fail at once: it is no longer registered.
        st = engine.read(ld, 0, remote, 0, 8, 99)
        assert st.WaitFor(5000) in (StatusCode.ERR_NOT_FOUND, StatusCode.ERR_BAD_STATE), st.Message()
    engine.shutdown()


def test_killed_engine_restarted_under_same_key_is_picked_up(store, procs):
    namespace = ns()
    procs.append(PeerProcess(store, namespace, "prefill-r", seed=6))
    engine = make_engine("decoder")
    with make_directory(*store, namespace, TTL_S) as d:
        changes = []
        peer = d.connect(engine, "prefill-r", 30, on_change=lambda p: changes.append((p.alive, p.incarnation)))
        first = peer.incarnation
        procs[0].signal(signal.SIGKILL)
        t0 = time.monotonic()
        procs[0].proc.wait(10)
        # Its entry vanishes within the TTL (plus etcd's 0.5 s expiry tick, polling and a loaded CI machine).
        assert peer.wait_left(TTL_S + 2), peer
        assert time.monotonic() - t0 < TTL_S + 2
        with pytest.raises(LookupTimeout):
            d.lookup("prefill-r")
        # The restarted engine publishes under the same key, a new incarnation.
        procs.append(PeerProcess(store, namespace, "prefill-r", seed=7))
        assert procs[1].incarnation != first
        assert peer.wait_incarnation(first, TTL_S * 2 + 10), peer
        assert peer.incarnation == procs[1].incarnation and changes[-1] == (True, procs[1].incarnation)
        assert torch.equal(read_all(engine, peer.memories["kv"]), pattern(1 << 20, 7))
    engine.shutdown()


def test_etcd_killed_and_restarted_keep_alive_recovers(etcd_server, procs):
    store = ("etcd", etcd_server.endpoint)
    namespace = ns()
    procs.append(PeerProcess(store, namespace, "prefill-e", seed=8, ttl_s=5))
    engine = make_engine("decodee")
    d = make_directory(*store, namespace, 5)
    try:
        peer = d.connect(engine, "prefill-e", 30)
        etcd_server.kill()
        time.sleep(2)  # shorter than the TTL: etcd restores leases when it comes back
        assert procs[0].ask("status", "STATUS") == ["True", "0"]
        etcd_server.start()
        time.sleep(3)
        assert d.lookup("prefill-e", 10).incarnation == procs[0].incarnation
        assert peer.alive and procs[0].ask("status", "STATUS") == ["True", "0"]
        time.sleep(6)  # past the TTL: keep-alive really did resume
        assert d.lookup("prefill-e").incarnation == procs[0].incarnation and peer.alive
        assert torch.equal(read_all(engine, peer.memories["kv"]), pattern(1 << 20, 8))

        # etcd comes back without its data (lease lost): the engine publishes
        # itself again and says so; peers see the same incarnation again.
        etcd_server.kill()
        etcd_server.start(fresh=True)
        deadline = time.monotonic() + 15
        while procs[0].ask("status", "STATUS") != ["True", "1"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert procs[0].ask("status", "STATUS") == ["True", "1"]
        assert d.lookup("prefill-e", 10).incarnation == procs[0].incarnation
        assert peer.wait_incarnation("", 10) and peer.alive
    finally:
        d.close()
        engine.shutdown()


# ---- bad input -----------------------------------------------------------------

def test_missing_key_and_wrong_namespace(store):
    engine = make_engine("pub")
    namespace = ns()
    with make_directory(*store, namespace, TTL_S) as d, make_directory(*store, namespace + "x", TTL_S) as other:
        d.publish(engine, {"kv": engine.register_torch_tensor(torch.zeros(64, dtype=torch.uint8))})
        t0 = time.monotonic()
        with pytest.raises(LookupTimeout, match=f"engine 'nope' is not published in namespace '{namespace}'"):
            d.lookup("nope", timeout_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 5
        with pytest.raises(LookupTimeout, match=f"namespace '{namespace}x'"):
            other.lookup(engine.key, timeout_s=0.2)
        assert d.lookup(engine.key).engine_desc == engine.get_engine_desc()
    engine.shutdown()


def test_malformed_entries_are_named_and_leave_the_directory_usable(store):
    namespace = ns()
    with make_directory(*store, namespace, TTL_S) as d, make_directory(*store, "other" + namespace, TTL_S) as o:
        engine = make_engine("ok")
        o.publish(engine, {})
        foreign = o._read(engine.key)
        for key, raw, why in (("garbage", b"\xff\x00not json", "not JSON"),
                              ("obj", b"[1,2]", "expected a JSON object"),
                              (engine.key, foreign, "written for namespace 'other"),
                              ("bad-b64", foreign.replace(b'"engine":"', b'"engine":"!!'), "field|base64|key")):
            assert d._create(key, raw) is None
            with pytest.raises(MalformedEntryError, match=why):
                d.lookup(key)
            with pytest.raises(MalformedEntryError, match=f"key {key!r}"):
                d.connect(make_engine("c"), key, timeout_s=0)
        e2 = make_engine("fine")
        d.publish(e2, {"m": e2.register_torch_tensor(torch.zeros(8, dtype=torch.uint8))})
        assert d.lookup(e2.key).memories["m"].size == 8
        engine.shutdown()
        e2.shutdown()


def test_two_engines_publishing_the_same_key(store):
    namespace = ns()
    from mori_torch.io import IOEngine, IOEngineConfig

    a = IOEngine("same-key", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("same-key", IOEngineConfig("127.0.0.1", 0))
    with make_directory(*store, namespace, TTL_S) as da, make_directory(*store, namespace, TTL_S) as db:
        da.publish(a)
        with pytest.raises(RendezvousError, match=f"key 'same-key' in namespace '{namespace}' is held by another "
                                                  f"live engine \\(pid {os.getpid()}"):
            db.publish(b, takeover_timeout_s=TTL_S + 1)  # longer than the TTL: a live holder keeps it
        assert da.lookup("same-key").engine_desc == a.get_engine_desc() and not db.published
    a.shutdown()
    b.shutdown()


def test_unreachable_stores_and_bad_arguments():
    from mori_torch.rendezvous import EtcdDirectory

    port = __import__("conftest").free_port()
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=f"etcd status at http://127.0.0.1:{port} failed"):
        EtcdDirectory("ns", f"http://127.0.0.1:{port}", timeout_s=1)
    with pytest.raises(RendezvousError, match=f"cannot reach the TCPStore at 127.0.0.1:{port}"):
        TorchStoreDirectory("ns", host="127.0.0.1", port=port, timeout_s=1)
    assert time.monotonic() - t0 < 15
    with pytest.raises(ValueError, match="'etcd:2379' is not of the form"):
        EtcdDirectory("ns", "etcd:2379")
    with pytest.raises(ValueError, match="namespace 'a/b'"):
        TorchStoreDirectory("a/b", host="127.0.0.1", port=port)
    with pytest.raises(ValueError, match="ttl_s"):
        TorchStoreDirectory("ns", host="127.0.0.1", port=port, ttl_s=0)


def test_entry_holds_descriptors_only(store):
    import json

    engine = make_engine("sec")
    with make_directory(*store, ns(), TTL_S) as d:
        d.publish(engine, {"kv": engine.register_torch_tensor(torch.zeros(8, dtype=torch.uint8))})
        doc = json.loads(d._read(engine.key))
        assert set(doc) == {"format", "version", "namespace", "key", "incarnation", "hostname", "pid", "engine",
                            "memories"}
        assert MemoryDesc.unpack(__import__("base64").b64decode(doc["memories"]["kv"])).size == 8
    engine.shutdown()


def test_process_exiting_without_close_removes_its_entry(store):
    namespace = ns()
    code = f"""
import sys; sys.path.insert(0, {HERE!r})
from conftest import make_directory, make_engine
e = make_engine("noclose")
d = make_directory({store[0]!r}, {store[1]!r}, {namespace!r}, 30)
d.publish(e, {{}})
print(e.key, flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert r.returncode == 0, r.stderr
    with make_directory(*store, namespace, TTL_S) as d:
        with pytest.raises(LookupTimeout):  # gone at once, not after the 30 s TTL
            d.lookup(r.stdout.split()[0])


def test_any_torch_distributed_store_works(tmp_path):
    """A FileStore wrapped in a PrefixStore (as a process group's store
    often is) serves two directories, one publishing, one connecting."""
    import torch.distributed as dist

    base = dist.FileStore(str(tmp_path / "store"), -1)
    a, b = make_engine("fsa"), make_engine("fsb")
    with TorchStoreDirectory("fs", dist.PrefixStore("pg0", base)) as da, \
            TorchStoreDirectory("fs", dist.PrefixStore("pg0", base)) as db:
        buf = pattern(4096, 9)
        da.publish(a, {"buf": a.register_torch_tensor(buf)})
        peer = db.connect(b, a.key, timeout_s=5)
        assert torch.equal(read_all(b, peer.memories["buf"]), buf)
        a.shutdown()  # takes the entry out of the directory first
        assert peer.wait_left(5) and "shut down" in peer.left_reason and not da.published
    with pytest.raises(TypeError, match="torch.distributed.Store"):
        TorchStoreDirectory("fs", store="not a store")
    a.shutdown()
    b.shutdown()


def test_publish_rejects_bad_memories(store):
    e, other = make_engine("bad"), make_engine("other")
    with make_directory(*store, ns(), TTL_S) as d:
        with pytest.raises(TypeError, match="memories must be a mapping"):
            d.publish(e, [1, 2])
        with pytest.raises(TypeError, match=r"memories\['kv'\] must be a MemoryDesc, got int"):
            d.publish(e, {"kv": 5})
        foreign = other.register_torch_tensor(torch.zeros(8, dtype=torch.uint8))
        with pytest.raises(ValueError, match=f"memories\\['kv'\\] belongs to engine '{other.key}'"):
            d.publish(e, {"kv": foreign})
        with pytest.raises(TypeError, match="engine must be an IOEngine"):
            d.publish("engine")
        assert not d.published  # nothing half-published
        with pytest.raises(ValueError, match="timeout_s must be a non-negative number"):
            d.lookup("x", timeout_s=-1)
    e.shutdown()
    other.shutdown()
