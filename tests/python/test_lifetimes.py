"""Dropped statuses, deregistration and shutdown with transfers in flight."""
import gc
import os
import threading
import time

import pytest
import torch

from conftest import Pair, make_engine, wait_ok
from mori_torch.io import BackendType, StatusCode


def _threads():
    return len(os.listdir("/proc/self/task"))


def test_dropped_statuses_do_not_crash_or_leak_threads():
    p = Pair(nbytes=1 << 20, num_data_conns=4, striping_threshold_bytes=4096)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    wait_ok(sess.write(0, 0, 1 << 20, sess.allocate_transfer_uid()))  # all connections open
    before = _threads()
    for i in range(1000):
        if i % 2:
            sess.write((i % 64) * 4096, (i % 64) * 4096, 4096, sess.allocate_transfer_uid())
        else:
            p.init.read(p.local_desc, 0, p.remote_desc, 0, 65536, p.init.allocate_transfer_uid())
    gc.collect()
    wait_ok(sess.write(0, 0, 8, sess.allocate_transfer_uid()))
    time.sleep(0.2)
    assert _threads() == before
    p.close()
    time.sleep(0.2)
    assert _threads() < before


def test_engine_shutdown_with_transfers_in_flight():
    p = Pair(nbytes=64 << 20, num_data_conns=2)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    sts = [sess.write(0, 0, 64 << 20, sess.allocate_transfer_uid()) for _ in range(8)]
    p.init.shutdown()
    codes = [s.WaitFor(10000) for s in sts]
    assert all(c in (StatusCode.SUCCESS, StatusCode.ERR_BAD_STATE) for c in codes), codes
    assert any(c == StatusCode.ERR_BAD_STATE for c in codes), "shutdown should cut some transfers short"
    # Every later call on the engine or its sessions raises (issue #18).
    with pytest.raises(RuntimeError, match="shut down"):
        sess.write(0, 0, 8, 1)
    with pytest.raises(RuntimeError, match="shut down"):
        sess.alive()
    p.target.shutdown()


def test_target_shutdown_fails_initiator_transfers():
    p = Pair(nbytes=64 << 20, num_data_conns=2)
    sts = [p.init.read(p.local_desc, 0, p.remote_desc, 0, 64 << 20, i) for i in range(8)]
    p.target.shutdown()
    codes = [s.WaitFor(15000) for s in sts]
    assert all(c in (StatusCode.SUCCESS, StatusCode.ERR_BAD_STATE) for c in codes), codes
    p.init.shutdown()


def test_remove_backend_and_deregister_remote_engine_end_transfers():
    p = Pair(nbytes=64 << 20, num_data_conns=2)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    sts = [sess.write(0, 0, 64 << 20, sess.allocate_transfer_uid()) for _ in range(4)]
    p.init.deregister_remote_engine(p.target.get_engine_desc())
    assert all(s.WaitFor(10000) in (StatusCode.SUCCESS, StatusCode.ERR_BAD_STATE) for s in sts)
    st = p.init.write(p.local_desc, 0, p.remote_desc, 0, 8, 99)
    assert st.Code() == StatusCode.ERR_NOT_FOUND
    p.init.register_remote_engine(p.target.get_engine_desc())
    wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 8, 100))
    sts = [p.init.write(p.local_desc, 0, p.remote_desc, 0, 64 << 20, 200 + i) for i in range(4)]
    p.init.remove_backend(BackendType.TCP)
    assert all(s.WaitFor(10000) in (StatusCode.SUCCESS, StatusCode.ERR_BAD_STATE) for s in sts)
    assert p.init.write(p.local_desc, 0, p.remote_desc, 0, 8, 300).Code() == StatusCode.ERR_BAD_STATE
    p.close()


def test_deregister_memory_while_transfers_run():
    """Deregistration waits only for bytes already moving; later parts fail,
    and the buffer is never touched after deregister_memory returns."""
    p = Pair(nbytes=32 << 20, num_data_conns=2)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    sts = [sess.read(0, 0, 32 << 20, sess.allocate_transfer_uid()) for _ in range(16)]
    p.init.deregister_memory(p.local_desc)
    snapshot = p.local.clone()
    codes = [s.WaitFor(15000) for s in sts]
    assert all(c in (StatusCode.SUCCESS, StatusCode.ERR_NOT_FOUND, StatusCode.ERR_BAD_STATE) for c in codes), codes
    assert torch.equal(p.local, snapshot)
    p.close()


def test_concurrent_submitters():
    p = Pair(nbytes=4 << 20, num_data_conns=4)
    p.local.copy_(torch.arange(4 << 20, dtype=torch.int64).to(torch.uint8))
    errors = []

    def worker(k):
        try:
            sess = p.init.create_session(p.local_desc, p.remote_desc)
            base = k * (1 << 20)
            sts = [sess.write(base + i * 4096, base + i * 4096, 4096, sess.allocate_transfer_uid())
                   for i in range(256)]
            assert p.init.wait_all(sts, 20000) == StatusCode.SUCCESS
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.equal(p.local, p.remote)
    p.close()


def test_engine_garbage_collected_without_shutdown():
    e = make_engine("gc")
    t = torch.zeros(16, dtype=torch.uint8)
    e.register_torch_tensor(t)
    before = _threads()
    del e
    gc.collect()
    time.sleep(0.1)
    assert _threads() < before
