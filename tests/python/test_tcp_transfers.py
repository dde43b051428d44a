"""Read/write x engine/session x single/batch through the TCP backend, with
data verified byte for byte and target-side completion notices, over 1, 2
and 4 data connections."""
import random
import time

import pytest
import torch

from conftest import Pair, make_engine, pattern, pop_notice, wait_ok
from mori_torch.io import BackendType, StatusCode


def _seg_layout(batch, size, total, seed):
    """Non-overlapping local and (shuffled) remote offsets for `batch` segments."""
    slots = total // size
    assert slots >= batch
    rnd = random.Random(seed)
    local = [i * size for i in range(batch)]
    remote = [s * size for s in rnd.sample(range(slots), batch)]
    return local, remote


def _check(pair, op, local_offs, remote_offs, size):
    for lo, ro in zip(local_offs, remote_offs):
        src, dst = (pair.remote, pair.local) if op == "read" else (pair.local, pair.remote)
        s_off, d_off = (ro, lo) if op == "read" else (lo, ro)
        assert torch.equal(dst[d_off:d_off + size], src[s_off:s_off + size]), f"segment at {lo}/{ro} differs"


def _prepare(pair, op):
    # Source gets a pattern, destination a different one, so "unchanged" is visible.
    pair.local.copy_(pattern(pair.local.numel(), 1 if op == "write" else 2))
    pair.remote.copy_(pattern(pair.remote.numel(), 2 if op == "write" else 1) ^ 0x5A)


def poll_ok(status, timeout_s=20.0):
    """Ends a status by polling Succeeded(), as an application spins."""
    deadline = time.monotonic() + timeout_s
    while not status.Succeeded():
        assert not status.Failed(), status.Message()
        assert time.monotonic() < deadline, "transfer did not end"


def _assert_noticed_once(pair, uids):
    """Every uid's completion notice reaches the target, once."""
    for uid in uids:
        pop_notice(pair.target, pair.init.key, uid)


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("use_session", [False, True], ids=["engine", "session"])
@pytest.mark.parametrize("size", [8, 8192])
def test_single(pair, op, use_session, size):
    _prepare(pair, op)
    lo, ro = 3 * size, 7 * size
    before = (pair.local if op == "read" else pair.remote).clone()
    if use_session:
        sess = pair.init.create_session(pair.local_desc, pair.remote_desc)
        assert sess.alive() and sess.backend_type == BackendType.TCP
        uid = sess.allocate_transfer_uid()
        st = getattr(sess, op)(lo, ro, size, uid)
    else:
        uid = pair.init.allocate_transfer_uid()
        st = getattr(pair.init, op)(pair.local_desc, lo, pair.remote_desc, ro, size, uid)
    wait_ok(st)
    _check(pair, op, [lo], [ro], size)
    after = pair.local if op == "read" else pair.remote
    assert not torch.equal(before[(lo if op == "read" else ro):][:size], after[(lo if op == "read" else ro):][:size])
    _assert_notice(pair, uid)


def _assert_notice(pair, uid):
    st = pop_notice(pair.target, pair.init.key, uid, timeout_s=2)
    assert st.Succeeded()


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("use_session", [False, True], ids=["engine", "session"])
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("size", [8, 8192])
def test_batch(pair, op, use_session, batch, size):
    _prepare(pair, op)
    lo, ro = _seg_layout(batch, size, pair.local.numel(), seed=batch * size)
    sizes = [size] * batch
    if use_session:
        sess = pair.init.create_session(pair.local_desc, pair.remote_desc)
        uid = sess.allocate_transfer_uid()
        st = getattr(sess, f"batch_{op}")(lo, ro, sizes, uid)
        wait_ok(st)
        uids = [uid]
    else:
        uids = [pair.init.allocate_transfer_uid()]
        sts = getattr(pair.init, f"batch_{op}")([pair.local_desc], [lo], [pair.remote_desc], [ro], [sizes], uids)
        assert len(sts) == 1
        assert pair.init.wait_all(sts, 20000) == StatusCode.SUCCESS
    _check(pair, op, lo, ro, size)
    for uid in uids:
        _assert_notice(pair, uid)


def test_engine_batch_of_many_pairs(pair):
    """N memory pairs -> N independent statuses."""
    _prepare(pair, "write")
    n = 16
    lo = [[i * 4096] for i in range(n)]
    ro = [[(n - 1 - i) * 4096] for i in range(n)]
    sizes = [[4096]] * n
    uids = [pair.init.allocate_transfer_uid() for _ in range(n)]
    sts = pair.init.batch_write([pair.local_desc] * n, lo, [pair.remote_desc] * n, ro, sizes, uids)
    assert len(sts) == n
    assert pair.init.wait_all(sts) == StatusCode.SUCCESS
    for i in range(n):
        _check(pair, "write", lo[i], ro[i], 4096)
        _assert_notice(pair, uids[i])


def test_large_striped_transfer_and_varying_sizes(pair):
    _prepare(pair, "write")
    n = pair.local.numel()
    sess = pair.init.create_session(pair.local_desc, pair.remote_desc)
    wait_ok(sess.write(0, 0, n, sess.allocate_transfer_uid()))
    assert torch.equal(pair.local, pair.remote)
    # Varying sizes, contiguous runs (mergeable) mixed with gaps.
    rnd = random.Random(7)
    lo, ro, sizes, off = [], [], [], 0
    while off < n // 2:
        sz = rnd.choice([1, 7, 512, 4096, 65536, 300000])
        lo.append(off)
        ro.append(n - off - sz)
        sizes.append(sz)
        off += sz + rnd.choice([0, 0, 13])
    pair.remote.zero_()
    wait_ok(sess.batch_write(lo, ro, sizes, sess.allocate_transfer_uid()))
    for a, b, s in zip(lo, ro, sizes):
        assert torch.equal(pair.remote[b:b + s], pair.local[a:a + s])
    pair.local.zero_()
    wait_ok(sess.batch_read(ro, lo, sizes, sess.allocate_transfer_uid()))
    for a, b, s in zip(lo, ro, sizes):
        assert torch.equal(pair.local[b:b + s], pair.remote[a:a + s])


def test_many_concurrent_small_transfers(pair):
    _prepare(pair, "write")
    sess = pair.init.create_session(pair.local_desc, pair.remote_desc)
    sts = [sess.write(i * 64, i * 64, 64, sess.allocate_transfer_uid()) for i in range(2000)]
    assert pair.init.wait_all(sts, 30000) == StatusCode.SUCCESS
    assert torch.equal(pair.remote[: 2000 * 64], pair.local[: 2000 * 64])


def test_empty_batch_succeeds(pair):
    sess = pair.init.create_session(pair.local_desc, pair.remote_desc)
    wait_ok(sess.batch_write([], [], [], sess.allocate_transfer_uid()))
    assert pair.init.batch_write([], [], [], [], [], []) == []
    assert pair.init.wait_all([]) == StatusCode.SUCCESS


@pytest.mark.parametrize("op", ["read", "write"])
def test_session_batch_with_int64_tensors(pair, op):
    _prepare(pair, op)
    lo, ro = _seg_layout(300, 512, pair.local.numel(), seed=5)
    sess = pair.init.create_session(pair.local_desc, pair.remote_desc)
    st = getattr(sess, f"batch_{op}")(torch.tensor(lo), torch.tensor(ro), torch.full((300,), 512), 77)
    wait_ok(st)
    _check(pair, op, lo, ro, 512)
    with pytest.raises(TypeError, match="int64"):
        sess.batch_write(torch.tensor(lo, dtype=torch.int32), torch.tensor(ro), torch.full((300,), 512), 78)
    with pytest.raises(ValueError, match="1-D"):
        sess.batch_write(torch.zeros(2, 2, dtype=torch.int64), torch.tensor(ro), torch.full((300,), 512), 79)


@pytest.mark.parametrize("inline_max_bytes,poller_receives", [(0, True), (64 << 10, True), (64 << 10, False),
                                                              (1 << 20, True)],
                         ids=["handed-off", "default", "poller-off", "1MiB"])
def test_inline_and_handed_off_requests_interleave(inline_max_bytes, poller_receives, monkeypatch):
    """Small requests go inline (sent by the submitting thread, received and
    served by the event loops, or received by the thread polling the status),
    larger ones through the workers; mixed and concurrent from several
    threads, statuses waited for or polled, every byte lands where it should
    and every completion notice arrives once."""
    import threading

    # Event loops that sleep between events (where pollers receive), whatever this machine's CPUs.
    monkeypatch.setenv("MORI_TORCH_LOOP_SPIN_US", "0")
    p = Pair(nbytes=8 << 20, num_data_conns=2, inline_max_bytes=inline_max_bytes, poller_receives=poller_receives)
    try:
        p.local.copy_(pattern(p.local.numel(), 3))
        p.remote.copy_(pattern(p.remote.numel(), 4))
        expect_remote = p.remote.clone()
        sess = p.init.create_session(p.local_desc, p.remote_desc)
        sizes = [64, 4096, (64 << 10) - 64, 64 << 10, (64 << 10) + 64, 1 << 20]
        region = 2 << 20  # per thread: [0, 1 MiB) written to the target, [1 MiB, 2 MiB) read from it
        errors, uids = [], []

        def worker(t):
            rnd = random.Random(t)
            base = t * region
            try:
                for _ in range(60):
                    size = rnd.choice(sizes)
                    off = rnd.randrange(0, (region // 2) - size + 1) // 64 * 64
                    uid = sess.allocate_transfer_uid()
                    uids.append(uid)
                    end = wait_ok if rnd.random() < 0.5 else poll_ok
                    if rnd.random() < 0.5:
                        end(sess.write(base + off, base + off, size, uid))
                    else:
                        roff = base + region // 2 + off
                        end(sess.read(roff, roff, size, uid))
                        if not torch.equal(p.local[roff:roff + size], expect_remote[roff:roff + size]):
                            errors.append(f"thread {t}: read of {size} B at {roff} differs")
            except AssertionError as e:
                errors.append(f"thread {t}: {e}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors[:3]
        for t in range(4):
            w = slice(t * region, t * region + region // 2)
            assert torch.equal(p.remote[w], p.local[w]), f"thread {t}'s written region differs"
        _assert_noticed_once(p, uids)
    finally:
        p.close()


@pytest.mark.parametrize("inline_max_bytes", [0, 64 << 10], ids=["handed-off", "default"])
def test_pipelined_requests_across_the_read_ahead(inline_max_bytes):
    """Hundreds of reads and writes in flight on one data connection, of
    sizes around the 16 KiB read-ahead of each end (tcp_inline.h): a recv
    brings several requests (or responses) at once, or part of one, and
    payloads straddle the buffer. Every byte lands where it should and every
    notice arrives once."""
    p = Pair(nbytes=16 << 20, num_data_conns=1, inline_max_bytes=inline_max_bytes)
    try:
        p.local.copy_(pattern(p.local.numel(), 5))
        p.remote.copy_(pattern(p.remote.numel(), 6))
        expect_remote, expect_local = p.remote.clone(), p.local.clone()
        sess = p.init.create_session(p.local_desc, p.remote_desc)
        sizes = [1, 7, 80, 4096, (16 << 10) - 176, (16 << 10) - 1, 16 << 10, (16 << 10) + 1, 40000, 64 << 10,
                 (64 << 10) + 1]
        rnd = random.Random(11)
        statuses, uids, off = [], [], 0
        for i in range(300):
            size = sizes[i % len(sizes)]
            uid = sess.allocate_transfer_uid()
            if rnd.random() < 0.5:
                statuses.append(sess.write(off, off, size, uid))
                expect_remote[off:off + size] = expect_local[off:off + size]
            else:
                statuses.append(sess.read(off, off, size, uid))
                expect_local[off:off + size] = expect_remote[off:off + size]
            uids.append(uid)
            off += size + rnd.randrange(0, 64)
        assert off <= p.local.numel()
        for st in statuses:
            wait_ok(st)
        assert torch.equal(p.local, expect_local)
        assert torch.equal(p.remote, expect_remote)
        _assert_noticed_once(p, uids)
    finally:
        p.close()


def test_inline_max_bytes_is_checked():
    with pytest.raises(ValueError, match="inline_max_bytes"):
        make_engine("bad", inline_max_bytes=-1)
