"""Engines in two processes: transfers, notices, and a peer that dies or
hangs mid-transfer while another peer keeps working."""
import os
import signal
import time

import pytest
import torch

from conftest import RemoteTarget, freeze, make_engine, pattern, pop_notice, resume, wait_ok
from mori_torch.io import StatusCode


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"conns{n}")
def remote(request):
    init = make_engine("init2p", num_data_conns=request.param, striping_threshold_bytes=4096)
    tgt = RemoteTarget(nbytes=8 << 20, num_data_conns=request.param)
    init.register_remote_engine(tgt.engine_desc)
    tgt.call("register_remote", init.get_engine_desc().pack())
    yield init, tgt
    tgt.close()
    init.shutdown()


@pytest.mark.parametrize("use_session", [False, True], ids=["engine", "session"])
def test_write_then_read_across_processes(remote, use_session):
    init, tgt = remote
    n = tgt.mem_desc.size
    local = pattern(n, 11)
    ld = init.register_torch_tensor(local)
    sess = init.create_session(ld, tgt.mem_desc) if use_session else None

    def xfer(op, lo, ro, size):
        uid = init.allocate_transfer_uid()
        if sess:
            return uid, getattr(sess, op)(lo, ro, size, uid)
        return uid, getattr(init, op)(ld, lo, tgt.mem_desc, ro, size, uid)

    uid, st = xfer("write", 0, 0, n)
    wait_ok(st)
    assert tgt.call("get", (0, n)) == bytes(local.numpy())
    assert tgt.call("pop", (init.key, uid)) is True
    assert tgt.call("pop", (init.key, uid)) is False

    # Batches of 8 B and 8 KiB segments, 1 and 64 of them, shuffled.
    for size in (8, 8192):
        for batch in (1, 64):
            tgt.call("fill", size + batch)
            expected = pattern(n, size + batch)
            ro = [((i * 7919) % batch) * size * 2 for i in range(batch)]
            lo = [i * size for i in range(batch)]
            local.zero_()
            uid = init.allocate_transfer_uid()
            if sess:
                st = sess.batch_read(lo, ro, [size] * batch, uid)
            else:
                (st,) = init.batch_read([ld], [lo], [tgt.mem_desc], [ro], [[size] * batch], [uid])
            wait_ok(st)
            for a, b in zip(lo, ro):
                assert torch.equal(local[a:a + size], expected[b:b + size])
            deadline = time.time() + 5
            while not tgt.call("pop", (init.key, uid)):
                assert time.time() < deadline, "read notice never arrived"
                time.sleep(0.005)


def test_first_transfer_to_a_stopped_peer_fails_by_op_timeout():
    # The peer's kernel still accepts the connection, but the engine never
    # answers its handshake: the transfer must fail by op_timeout_ms, not
    # wait out the much longer connect_timeout_ms.
    init = make_engine("init-first", num_data_conns=1, op_timeout_ms=800, connect_timeout_ms=30000)
    tgt = RemoteTarget(nbytes=1 << 20)
    try:
        init.register_remote_engine(tgt.engine_desc)
        ld = init.register_torch_tensor(pattern(4096, 5))
        freeze(tgt.pid)
        t0 = time.monotonic()
        st = init.write(ld, 0, tgt.mem_desc, 0, 4096, init.allocate_transfer_uid())
        code = st.WaitFor(20000)
        took = time.monotonic() - t0
        assert code not in (StatusCode.SUCCESS, StatusCode.IN_PROGRESS), st.Message()
        assert 0.5 < took < 5, f"failed after {took:.2f} s: {st.Message()}"
        assert "timed out" in st.Message() and "(connecting bound: 800 ms)" in st.Message(), st.Message()
    finally:
        resume(tgt.pid)
        tgt.close()
        init.shutdown()


def _stalled_transfers(init, ld, desc, count=8, size=8 << 20):
    return [init.write(ld, 0, desc, 0, size, init.allocate_transfer_uid()) for _ in range(count)]


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_peer_dies_mid_transfer_other_peer_unaffected(how):
    timeout_ms = 3000
    init = make_engine("init-kill", num_data_conns=2, op_timeout_ms=timeout_ms, connect_timeout_ms=2000)
    victim = RemoteTarget(nbytes=64 << 20, num_data_conns=2, op_timeout_ms=timeout_ms)
    healthy = RemoteTarget(nbytes=1 << 20, num_data_conns=2)
    try:
        for t in (victim, healthy):
            init.register_remote_engine(t.engine_desc)
        local = pattern(64 << 20, 3)
        ld = init.register_torch_tensor(local)
        wait_ok(init.write(ld, 0, victim.mem_desc, 0, 1 << 20, init.allocate_transfer_uid()))  # connections up
        # Freeze the victim so our transfers are certainly in flight, then
        # kill it (connections reset) or leave it frozen (only the timeout helps).
        freeze(victim.pid)
        sts = _stalled_transfers(init, ld, victim.mem_desc, size=64 << 20)
        time.sleep(0.2)
        t0 = time.monotonic()
        if how == "killed":
            os.kill(victim.pid, signal.SIGKILL)
        codes = [s.WaitFor(timeout_ms + 5000) for s in sts]
        elapsed = time.monotonic() - t0
        assert all(c not in (StatusCode.IN_PROGRESS, StatusCode.SUCCESS) for c in codes), codes
        assert all(s.Failed() for s in sts)
        assert elapsed < timeout_ms / 1000 + 3, elapsed
        assert "engine '" + victim.key + "'" in sts[0].Message()
        # The other peer still works.
        st = init.write(ld, 0, healthy.mem_desc, 0, 1 << 20, init.allocate_transfer_uid())
        wait_ok(st)
        assert healthy.call("get", (0, 1 << 20)) == bytes(local[: 1 << 20].numpy())
    finally:
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        victim.proc.join(5)
        healthy.close()
        init.shutdown()


def test_restarted_peer_is_reached_again():
    init = make_engine("init-restart", num_data_conns=2)
    first = RemoteTarget(nbytes=1 << 16)
    init.register_remote_engine(first.engine_desc)
    ld = init.register_torch_tensor(pattern(1 << 16, 5))
    wait_ok(init.write(ld, 0, first.mem_desc, 0, 1 << 16, init.allocate_transfer_uid()))
    first.close()
    # A transfer to the dead peer fails cleanly, without hanging.
    st = init.write(ld, 0, first.mem_desc, 0, 1 << 16, init.allocate_transfer_uid())
    assert st.WaitFor(10000) == StatusCode.ERR_BAD_STATE
    second = RemoteTarget(nbytes=1 << 16)
    try:
        init.register_remote_engine(second.engine_desc)
        wait_ok(init.write(ld, 0, second.mem_desc, 0, 1 << 16, init.allocate_transfer_uid()))
    finally:
        second.close()
        init.shutdown()


def test_submitting_threads_never_wait_for_a_full_send_buffer():
    """Small writes are sent by the thread that submits them only while they
    fit the socket's send buffer; the rest waits for the sender threads.
    With the target frozen the buffers fill, and no submitting call may
    wait for the peer to read again (8 threads at once, so a thread that
    takes the sender's turn also finds other threads' writes queued: it
    sends only those that still fit). Every byte lands once the target
    runs again."""
    import threading

    tgt = RemoteTarget(nbytes=32 << 20, num_data_conns=1, sock_rcvbuf_bytes=64 << 10)
    init = make_engine("init-room", num_data_conns=1, sock_sndbuf_bytes=64 << 10, op_timeout_ms=60000)
    try:
        init.register_remote_engine(tgt.engine_desc)
        local = pattern(32 << 20, 21)
        ld = init.register_torch_tensor(local)
        wait_ok(init.write(ld, 0, tgt.mem_desc, 0, 4096, init.allocate_transfer_uid()))  # connected
        freeze(tgt.pid)
        # Writes just under inline_max_bytes (64 KiB), so that two of them
        # fill the send buffer; 24 MiB in all, many times both buffers.
        threads, size, per_thread = 8, 60 << 10, 50
        slowest, statuses = [0.0] * threads, [[] for _ in range(threads)]

        def submit(t):
            for i in range(per_thread):
                off = (t * per_thread + i) * size
                t0 = time.perf_counter()
                st = init.write(ld, off, tgt.mem_desc, off, size, init.allocate_transfer_uid())
                slowest[t] = max(slowest[t], time.perf_counter() - t0)
                statuses[t].append(st)

        workers = [threading.Thread(target=submit, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        stuck = any(w.is_alive() for w in workers)
        os.kill(tgt.pid, signal.SIGCONT)
        for w in workers:
            w.join(60)
        assert not stuck, "a submitting thread waited for the frozen peer"
        assert max(slowest) < 2.0, f"slowest submitting call {max(slowest):.2f} s while the peer was frozen"
        for sts in statuses:
            for st in sts:
                wait_ok(st, timeout_ms=60000)
        end = threads * per_thread * size
        assert tgt.call("get", (0, end)) == bytes(local[:end].numpy())
    finally:
        resume(tgt.pid)
        tgt.close()
        init.shutdown()


def _read_then_exit(engine_bytes, mem_bytes, key, delay_us, conn):
    """Initiator in its own process: one 4 KiB read, then a normal exit
    (no shutdown call: the engine goes with the interpreter)."""
    from mori_torch.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig

    try:
        e = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
        e.create_backend(BackendType.TCP, TcpBackendConfig(notice_delay_us=delay_us))
        e.register_remote_engine(EngineDesc.unpack(engine_bytes))
        local = torch.zeros(4096, dtype=torch.uint8)
        uid = e.allocate_transfer_uid()
        st = e.read(e.register_torch_tensor(local), 0, MemoryDesc.unpack(mem_bytes), 0, 4096, uid)
        st.Wait()
        conn.send((st.Code() == StatusCode.SUCCESS, bytes(local.numpy()), uid))
    except Exception as ex:  # reported, not a 60 s wait
        conn.send((None, repr(ex), None))


@pytest.mark.parametrize("delay_us", [None, 10_000_000], ids=["default-delay", "10s-delay"])
def test_held_read_notice_reaches_the_target_when_the_initiator_exits(delay_us):
    # A read's notice may wait (notice_delay_us) for the initiator's next
    # request; an initiator that exits right after its read has none, and the
    # target must still learn of the read (the engine flushes on shutdown).
    import multiprocessing as mp

    from mori_torch.io import TcpBackendConfig

    delay = TcpBackendConfig().notice_delay_us if delay_us is None else delay_us
    tgt = make_engine("notice-tgt")
    data = pattern(4096, 21)
    md = tgt.register_torch_tensor(data)
    key = f"notice-init-{os.getpid()}-{delay}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_read_then_exit, args=(tgt.get_engine_desc().pack(), md.pack(), key, delay, child))
    try:
        p.start()
        assert parent.poll(60), "initiator did not report"
        ok, got, uid = parent.recv()
        assert ok is not None, got  # the initiator's exception
        assert ok and got == bytes(data.numpy())
        p.join(30)
        assert p.exitcode == 0
        pop_notice(tgt, key, uid, timeout_s=5, poll_s=0.005)  # after the initiator exited
    finally:
        if p.is_alive():
            p.kill()
        tgt.shutdown()
