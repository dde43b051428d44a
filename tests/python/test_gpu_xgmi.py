"""GPU memory and the GPU peer backend (BackendType.XGMI): same process and
across processes, same device and across devices. Skipped without a GPU."""
import multiprocessing as mp
import random
import resource
import time

import pytest
import torch

from conftest import settle, unique_key, wait_ok
from mori_torch.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TcpBackendConfig,
    XgmiBackendConfig,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def xgmi_engine(prefix, tcp=False, **cfg):
    e = IOEngine(unique_key(prefix), IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.XGMI, XgmiBackendConfig(**cfg))
    if tcp:
        e.create_backend(BackendType.TCP, TcpBackendConfig())
    return e


def rand_bytes(n, dev, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev)


def _pair_with(where, **cfg):
    """Engines a -> b with XgmiBackendConfig(**cfg), 8 MiB registered on each
    side: on cuda:0 both ("same-device") or cuda:0 -> cuda:1."""
    if where == "cross-device" and not TWO_GPUS:
        pytest.skip("needs two GPUs")
    dst_dev = "cuda:1" if where == "cross-device" else "cuda:0"
    a, b = xgmi_engine("ga", **cfg), xgmi_engine("gb", **cfg)
    a.register_remote_engine(b.get_engine_desc())
    n = 8 << 20
    local = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    remote = torch.zeros(n, dtype=torch.uint8, device=dst_dev)
    ld = a.register_torch_tensor(local)
    rd = MemoryDesc.unpack(b.register_torch_tensor(remote).pack())
    settle()
    return a, b, local, remote, ld, rd


@pytest.fixture(params=["same-device", "cross-device"])
def gpu_pair(request):
    p = _pair_with(request.param)
    yield p
    p[0].shutdown()
    p[1].shutdown()


def test_gpu_registration_fields():
    e = xgmi_engine("greg")
    big = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda:0")
    view = big[1 << 20: 2 << 20]
    d = e.register_torch_tensor(view)
    whole = e.register_torch_tensor(big)
    assert d.loc == MemoryLocationType.GPU and d.device_id == 0 and d.numa_node == -1
    assert d.device_bus_id and d.device_bus_id == d.device_bus_id.lower() and ":" in d.device_bus_id
    assert d.data == view.data_ptr() and d.size == 1 << 20
    assert d.ipc_handle != bytes(64)
    # Both name the allocation base's handle; the offsets place each range in it.
    assert d.ipc_handle == whole.ipc_handle
    assert d.ipc_offset - whole.ipc_offset == 1 << 20
    assert whole.ipc_offset == big.data_ptr() - (d.data - d.ipc_offset)
    assert MemoryDesc.unpack(d.pack()) == d
    # Registering past the end of the device allocation is refused.
    with pytest.raises(ValueError, match="exceeds its device allocation"):
        e.register_memory(view.data_ptr(), 1 << 40, 0, MemoryLocationType.GPU)
    with pytest.raises(ValueError, match="does not match"):
        e.register_memory(view.data_ptr(), 16, 5, MemoryLocationType.GPU)
    with pytest.raises(ValueError, match="not device memory"):
        cpu = torch.zeros(16, dtype=torch.uint8)
        e.register_memory(cpu.data_ptr(), 16, 0, MemoryLocationType.GPU)
    e.shutdown()


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("use_session", [False, True], ids=["engine", "session"])
def test_single_transfers(gpu_pair, op, use_session):
    a, b, local, remote, ld, rd = gpu_pair
    src, dst = (remote, local) if op == "read" else (local, remote)
    src.copy_(rand_bytes(src.numel(), src.device, 1))
    for size in (8, 8192, 1 << 20, 8 << 20):
        dst.zero_()
        settle()
        uid = a.allocate_transfer_uid()
        if use_session:
            sess = a.create_session(ld, rd)
            assert sess.backend_type == BackendType.XGMI
            st = getattr(sess, op)(0, 0, size, uid)
        else:
            st = getattr(a, op)(ld, 0, rd, 0, size, uid)
        wait_ok(st)
        torch.cuda.synchronize()
        assert torch.equal(dst[:size].cpu(), src[:size].cpu())
        assert int(dst[size:].count_nonzero()) == 0


def _layout(kind, count, seg, total, seed):
    rnd = random.Random(seed)
    if kind == "strided":
        lo = [i * 2 * seg for i in range(count)]
        ro = [i * 3 * seg for i in range(count)]
        sizes = [seg] * count
    elif kind == "shuffled":
        lo = [i * seg for i in range(count)]
        ro = [s * seg for s in rnd.sample(range(total // seg), count)]
        sizes = [seg] * count
    else:  # varying sizes
        lo, ro, sizes = [], [], []
        slots = list(range(count))
        rnd.shuffle(slots)
        for i in range(count):
            sz = rnd.choice([1, 3, 16, 100, seg // 2, seg])
            lo.append(i * seg)
            ro.append(slots[i] * seg)
            sizes.append(sz)
    return lo, ro, sizes


@pytest.mark.parametrize("kind", ["strided", "shuffled", "varying"])
@pytest.mark.parametrize("count", [1, 7, 256, 16384])
@pytest.mark.parametrize("op", ["read", "write"])
def test_segment_batches(gpu_pair, kind, count, op):
    a, b, local, remote, ld, rd = gpu_pair
    seg = 128 if kind == "strided" and count == 16384 else (512 if count == 16384 else 4096)
    lo, ro, sizes = _layout(kind, count, seg, remote.numel(), seed=count)
    src, dst = (remote, local) if op == "read" else (local, remote)
    src.copy_(rand_bytes(src.numel(), src.device, count))
    dst.zero_()
    settle()
    sess = a.create_session(ld, rd)
    st = getattr(sess, f"batch_{op}")(lo, ro, sizes, sess.allocate_transfer_uid())
    wait_ok(st)
    s_offs, d_offs = (ro, lo) if op == "read" else (lo, ro)
    src_cpu, dst_cpu = src.cpu(), dst.cpu()
    for so, do, sz in zip(s_offs, d_offs, sizes):
        assert torch.equal(dst_cpu[do:do + sz], src_cpu[so:so + sz])


def test_status_completes_by_polling_alone(gpu_pair):
    a, b, local, remote, ld, rd = gpu_pair
    local.fill_(5)
    settle()
    st = a.write(ld, 0, rd, 0, 8 << 20, a.allocate_transfer_uid())
    deadline = time.monotonic() + 10
    while not st.Succeeded():
        assert not st.Failed(), st.Message()
        assert time.monotonic() < deadline
    assert bool((remote == 5).all())


def test_status_nobody_polls_ends_by_itself(gpu_pair):
    """The completion thread leaves a young copy to its status's pollers, but
    not for good: transfers whose statuses nobody touches still succeed, as
    the engine's counters (ended on the thread that ends the status) show."""
    a, b, local, remote, ld, rd = gpu_pair
    local.fill_(7)
    settle()
    before = a.stats()["total"]["succeeded"]
    sizes = [4096, 1 << 20, 4096, 2 << 20]
    statuses = [a.write(ld, i << 21, rd, i << 21, n, a.allocate_transfer_uid()) for i, n in enumerate(sizes)]
    deadline = time.monotonic() + 10
    while a.stats()["total"]["succeeded"] < before + len(sizes):
        assert time.monotonic() < deadline, a.stats()["total"]
        time.sleep(0.001)
    assert all(s.Succeeded() for s in statuses)
    for i, n in enumerate(sizes):
        assert bool((remote[i << 21:(i << 21) + n] == 7).all())


def _poll_small_transfers(conn, transfers):
    """In a fresh process (no threads left behind by other tests): polls
    4 KiB writes to their end and sends back the polling thread's voluntary
    context switches while it polled, and whether the bytes arrived (or
    what went wrong)."""
    try:
        a, b, local, remote, ld, rd = _pair_with("same-device")
        sess = a.create_session(ld, rd)
        local[:4096] = rand_bytes(4096, "cuda:0", 11)
        torch.cuda.synchronize()
        slept = 0
        for i in range(200 + transfers):
            st = sess.write(0, 0, 4096, 1)
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
            while not st.Succeeded():
                assert not st.Failed(), st.Message()
            if i >= 200:
                slept += resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
        conn.send((slept, torch.equal(remote[:4096], local[:4096])))
        a.shutdown()
        b.shutdown()
    except BaseException:
        import traceback

        conn.send(("failed", traceback.format_exc()))


def test_polling_small_transfers_never_sleeps_the_caller():
    """A caller polling its small transfers to their end never sleeps on a
    lock the completion thread holds, nor queries events alongside it: such
    a sleep and its wake-up cost the caller 10-20 us on the GPU VMs, the p99
    of a 4 KiB transfer. Counted as the polling thread's voluntary context
    switches while polling 4,000 transfers (20-43 before the completion
    thread left young copies to their pollers, 0 after, on one H200)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_poll_small_transfers, args=(child, 4000))
    p.start()
    try:
        assert parent.poll(120), "the polling process did not answer"
        slept, bytes_ok = parent.recv()
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert slept != "failed", bytes_ok
    assert bytes_ok
    assert slept <= 3, f"the polling thread slept {slept} times while polling 4,000 transfers"


@pytest.mark.parametrize("where", ["same-device", "cross-device"])
def test_shutdown_while_threads_submit_ends_every_status(where):
    """The engine shuts down while four threads keep submitting single
    transfers and page batches: every status a call returned ends (success,
    or an error: the backend or peer is gone), calls made afterwards fail
    cleanly, and what was reported copied was copied."""
    import threading

    a, b, local, remote, ld, rd = _pair_with(where)
    local.fill_(3)
    settle()
    sess = a.create_session(ld, rd)
    offs = torch.randperm(2048, generator=torch.Generator().manual_seed(1))[:64] * 4096
    sizes = torch.full((64,), 4096)
    returned, raised = [], []
    shutting, shut = threading.Event(), threading.Event()

    def submit(k):
        after = 0
        while after < 50:  # calls once shutdown() returned
            after += shut.is_set()
            try:
                st = sess.write(0, 0, 4096, 1) if k % 2 else sess.batch_write(offs, offs, sizes, 1)
            except Exception as e:  # noqa: BLE001 - any refusal is fine once the engine is going
                raised.append((shutting.is_set(), repr(e)))
                return
            returned.append((k % 2, st))

    threads = [threading.Thread(target=submit, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    shutting.set()
    a.shutdown()
    shut.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a submitting call hung after shutdown"
    assert not [r for r in raised if not r[0]], f"calls failed before the shutdown: {raised[:3]}"
    codes = [(single, st.WaitFor(10000)) for single, st in returned]
    pending = sum(c in (StatusCode.INIT, StatusCode.IN_PROGRESS) for _, c in codes)
    assert pending == 0, f"{pending} of {len(codes)} statuses never ended"
    settle()
    for single, region in ((1, remote[:4096]), (0, remote.view(-1, 4096)[offs // 4096])):
        if (single, StatusCode.SUCCESS) in codes:
            assert int(region.ne(3).sum()) == 0, "a transfer reported done did not copy"
        else:
            pytest.fail(f"no {'single transfer' if single else 'batch'} succeeded before the shutdown")
    b.shutdown()


def test_backend_chosen_by_memory_kind():
    a, b = xgmi_engine("auto-a", tcp=True), xgmi_engine("auto-b", tcp=True)
    a.register_remote_engine(b.get_engine_desc())
    g1 = a.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8, device="cuda:0"))
    g2 = b.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8, device="cuda:0"))
    c1 = a.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8))
    c2 = b.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8))
    assert a.create_session(g1, g2).backend_type == BackendType.XGMI
    assert a.create_session(c1, c2).backend_type == BackendType.TCP
    a.shutdown()
    b.shutdown()


def test_bad_offsets(gpu_pair):
    a, b, local, remote, ld, rd = gpu_pair
    st = a.write(ld, 0, rd, remote.numel() - 4, 8, 1)
    assert st.Code() == StatusCode.ERR_INVALID_ARGS and "remote" in st.Message()
    st = a.read(ld, local.numel(), rd, 0, 1, 2)
    assert st.Code() == StatusCode.ERR_INVALID_ARGS


# ---------------------------------------------------------------------------
# The batched path: segment merging, copy kernel vs copy engines, lists cut
# into chunks whose uploads overlap the kernel, large segments cut into
# pieces, and lanes reused while earlier batches still run.

KERNEL_ALWAYS = dict(kernel_min_segments=1, kernel_max_avg_bytes=1 << 40)
COPY_ENGINES_ALWAYS = dict(kernel_min_segments=1 << 30)


@pytest.fixture(params=["same-device", "cross-device"])
def kernel_pair(request):
    """Every batch, whatever its shape, goes to the copy kernel."""
    p = _pair_with(request.param, **KERNEL_ALWAYS)
    yield p
    p[0].shutdown()
    p[1].shutdown()


def _check_pages(src, dst, s_pages, d_pages, seg):
    """dst's page d_pages[i] equals src's page s_pages[i] (pages of `seg` bytes)."""
    got = dst.view(-1, seg)[torch.as_tensor(d_pages, device=dst.device)]
    want = src.view(-1, seg)[torch.as_tensor(s_pages, device=src.device)].to(dst.device)
    assert torch.equal(got, want)


def _expected_copy(src_cpu, s_offs, d_offs, sizes):
    """A zeroed destination after the segments were copied into it."""
    expect = torch.zeros_like(src_cpu)
    for so, do, sz in zip(s_offs, d_offs, sizes):
        expect[do:do + sz] = src_cpu[so:so + sz]
    return expect


@pytest.mark.parametrize("count", [1023, 1024, 1025, 5120, 5121, 21505])
@pytest.mark.parametrize("op", ["read", "write"])
def test_batches_across_chunk_boundaries(kernel_pair, count, op):
    """Lists of 1,024, then 4,096, then 16,384 entries are uploaded and
    launched one after the other; counts at and around those boundaries."""
    a, b, local, remote, ld, rd = kernel_pair
    seg = 256
    pages = (8 << 20) // seg
    rp = torch.randperm(pages, generator=torch.Generator().manual_seed(count))[:count]
    lp = torch.arange(count)
    src, dst = (remote, local) if op == "read" else (local, remote)
    src.copy_(rand_bytes(src.numel(), src.device, count))
    dst.zero_()
    settle()
    sess = a.create_session(ld, rd)
    st = getattr(sess, f"batch_{op}")(lp * seg, rp * seg, torch.full((count,), seg), sess.allocate_transfer_uid())
    wait_ok(st)
    s_pages, d_pages = (rp, lp) if op == "read" else (lp, rp)
    _check_pages(src, dst, s_pages, d_pages, seg)
    untouched = torch.ones(pages, dtype=torch.bool)
    untouched[d_pages] = False
    assert int(dst.view(-1, seg)[untouched.to(dst.device)].count_nonzero()) == 0


@pytest.mark.parametrize("op", ["read", "write"])
def test_large_segments_cut_into_pieces(kernel_pair, op):
    """Few large segments through the kernel: each is cut into pieces that
    several thread groups copy; odd sizes and offsets keep their bytes."""
    a, b, local, remote, ld, rd = kernel_pair
    lo = [0, 1 << 20, (3 << 20) + 5, (5 << 20) + 7]
    ro = [4 << 20, 0, (1 << 20) + 5, (6 << 20) + 3]
    sizes = [1 << 20, (1 << 20) + 3, (1 << 20) + 11, 999_999]
    src, dst = (remote, local) if op == "read" else (local, remote)
    src.copy_(rand_bytes(src.numel(), src.device, 7))
    dst.zero_()
    settle()
    sess = a.create_session(ld, rd)
    wait_ok(getattr(sess, f"batch_{op}")(lo, ro, sizes, sess.allocate_transfer_uid()))
    s_offs, d_offs = (ro, lo) if op == "read" else (lo, ro)
    assert torch.equal(dst.cpu(), _expected_copy(src.cpu(), s_offs, d_offs, sizes))


@pytest.mark.parametrize("count", [1, 2, 15, 16, 17, 40])
def test_kernel_alignments_and_inline_lists(kernel_pair, count):
    """Up to 16 pieces travel in the launch parameters, more in a device list.
    Sizes and offsets of every alignment: 16-byte vectors with bytewise heads
    and tails when source and destination align alike, bytes otherwise."""
    a, b, local, remote, ld, rd = kernel_pair
    rnd = random.Random(count)
    lo, ro, sizes = [], [], []
    for i in range(count):
        sz = rnd.choice([1, 3, 15, 16, 17, 100, 4095, 4096, 4097, 70_000])
        skew = rnd.choice([0, 0, 1, 3, 8, 13])
        lo.append(i * 131_072 + rnd.choice([0, 1, 7, 16]))
        ro.append(i * 131_072 + (lo[-1] % 16 + skew) % 16)
        sizes.append(sz)
    local.copy_(rand_bytes(local.numel(), local.device, count))
    remote.zero_()
    settle()
    sess = a.create_session(ld, rd)
    wait_ok(sess.batch_write(lo, ro, sizes, sess.allocate_transfer_uid()))
    assert torch.equal(remote.cpu(), _expected_copy(local.cpu(), lo, ro, sizes))


@pytest.mark.parametrize("cfg", [KERNEL_ALWAYS, COPY_ENGINES_ALWAYS], ids=["kernel", "copy-engines"])
@pytest.mark.parametrize("layout", ["all-contiguous", "pairs", "one-side-only"])
def test_merged_segments(cfg, layout):
    """Contiguous neighbours merge before the copy (a fully contiguous batch
    becomes one segment); segments contiguous on one side only do not."""
    a, b, local, remote, ld, rd = _pair_with("same-device", **cfg)
    seg, count = 512, 8192
    if layout == "all-contiguous":
        lo = [i * seg for i in range(count)]
        ro = [(1 << 20) + i * seg for i in range(count)]
    elif layout == "pairs":  # page pairs contiguous on both sides, pairs shuffled
        order = random.Random(3).sample(range(count // 2), count // 2)
        lo = [i * seg for i in range(count)]
        ro = [(order[i // 2] * 2 + i % 2) * seg for i in range(count)]
    else:  # contiguous locally, every other page remotely
        lo = [i * seg for i in range(count)]
        ro = [2 * i * seg for i in range(count)]
    local.copy_(rand_bytes(local.numel(), local.device, 11))
    settle()
    sess = a.create_session(ld, rd)
    wait_ok(sess.batch_write(lo, ro, [seg] * count, sess.allocate_transfer_uid()))
    assert torch.equal(remote.cpu(), _expected_copy(local.cpu(), lo, ro, [seg] * count))
    a.shutdown()
    b.shutdown()


def test_one_lane_reused_while_batches_run():
    """With one lane, each batch must wait for the previous one's kernel
    (which reads the list) before reusing (and growing) the lane's lists: submit batches
    of growing size back to back, wait at the end, check every byte."""
    a, b, local, remote, ld, rd = _pair_with("same-device", num_streams=1, **KERNEL_ALWAYS)
    sess, dest = _random_source(a, local, ld, rd, seg=128, seed=5)
    _write_back_to_back(sess, local, remote, 128, dest, (700, 3000, 1500, 9000, 20000, 2000), seed=0)
    a.shutdown()
    b.shutdown()


def _random_source(a, local, ld, rd, seg, seed):
    """Random bytes in `local`, a session a -> rd, and the remote pages of
    `seg` bytes in a random order (destinations to use once each)."""
    local.copy_(rand_bytes(local.numel(), local.device, seed))
    settle()
    pages = local.numel() // seg
    return a.create_session(ld, rd), torch.randperm(pages, generator=torch.Generator().manual_seed(seed))


def _write_back_to_back(sess, local, remote, seg, dest, counts, seed):
    """Session batch writes of `counts` random local pages each to the next
    unused pages of `dest`, all submitted before any is waited for; checks
    every page. Returns how many pages of `dest` were used."""
    pages = local.numel() // seg
    statuses, plan, start = [], [], 0
    for count in counts:
        rp = dest[start:start + count]
        lp = torch.randperm(pages, generator=torch.Generator().manual_seed(seed + count + start))[:count]
        statuses.append(sess.batch_write(lp * seg, rp * seg, torch.full((count,), seg), sess.allocate_transfer_uid()))
        plan.append((lp, rp))
        start += count
    for st in statuses:
        wait_ok(st)
    for lp, rp in plan:
        _check_pages(local, remote, lp, rp, seg)
    return start


@pytest.mark.parametrize("where", ["same-device", "cross-device"])
def test_batches_in_flight_keep_the_lists_the_kernel_reads(where):
    """A session's batch list is built in pinned, device-mapped memory and
    the kernel reads it there: many batches submitted back to back (more
    than the pooled lists and the lanes), each to its own destination pages,
    must each copy what their own list said, whatever was built after them.
    A list too long for the pinned cache (180,000 entries, over 4 MiB) takes
    the copied path; its bytes must be right too."""
    import mori_torch

    a, b, local, remote, ld, rd = _pair_with(where, **KERNEL_ALWAYS)
    seg = 32
    sess, dest = _random_source(a, local, ld, rd, seg, seed=11)
    used = _write_back_to_back(sess, local, remote, seg, dest, [2048 + 512 * (i % 5) for i in range(24)], seed=100)
    assert mori_torch.pinned_segment_list_bytes() > 0, "session batches were not built in pinned memory"
    _write_back_to_back(sess, local, remote, seg, dest[used:], [180_000], seed=7)  # 4.3 MB of entries
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("where", ["same-device", "cross-device"])
def test_kernel_and_copy_engine_batches_interleaved(where):
    """Many transfers in flight at once over all lanes, mixing the copy
    engines (single segments) and the kernel (8-segment batches, some few
    enough for the launch parameters, some not): all end with the right bytes."""
    a, b, local, remote, ld, rd = _pair_with(where, kernel_min_segments=4)
    local.copy_(rand_bytes(local.numel(), local.device, 13))
    settle()
    sess = a.create_session(ld, rd)
    seg = 4096
    statuses = []
    for i in range(200):
        base = i * 8 * seg
        if i % 3 == 0:
            statuses.append(sess.write(base, base, 8 * seg, i))
        else:  # every other page, so nothing merges
            count = 8 if i % 3 == 1 else 4
            offs = [base + 2 * k * seg for k in range(count)]
            statuses.append(sess.batch_write(offs, offs, [seg] * count, i))
    for st in statuses:
        wait_ok(st)
    src_cpu, dst_cpu = local.cpu(), remote.cpu()
    for i in range(200):
        base = i * 8 * seg
        if i % 3 == 0:
            assert torch.equal(dst_cpu[base:base + 8 * seg], src_cpu[base:base + 8 * seg])
        else:
            count = 8 if i % 3 == 1 else 4
            for k in range(8):
                lo = base + k * seg
                moved = k % 2 == 0 and k // 2 < count
                assert torch.equal(dst_cpu[lo:lo + seg], src_cpu[lo:lo + seg] if moved else torch.zeros(seg,
                                   dtype=torch.uint8)), (i, k)
    a.shutdown()
    b.shutdown()


def _pair_layouts(region, seg, seed):
    """Offsets of one pair per layout, inside [0, region): shuffled pages,
    one large segment, a few pages, one page."""
    rnd = random.Random(seed)
    pages = region // seg
    out = []
    for count in (300, 0, 17, 1):
        if count == 0:
            out.append(([0], [seg], [region // 2]))
            continue
        lp = rnd.sample(range(pages), count)
        rp = rnd.sample(range(pages), count)
        out.append(([p * seg for p in lp], [p * seg for p in rp], [seg] * count))
    return out


# 8 pairs: a few sets; 32: 16 sets on a GPU (the most one launch table
# takes); 40: more sets than a table takes (the rewrite into addresses).
@pytest.mark.parametrize("npairs", [8, 32, 40])
@pytest.mark.parametrize("cfg", [{}, KERNEL_ALWAYS, COPY_ENGINES_ALWAYS, dict(kernel_max_avg_bytes=1 << 20)],
                         ids=["default", "kernel", "copy-engines", "large-alone"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_engine_batch_of_pairs(op, cfg, npairs):
    """The engine-level multi-pair batch (SGLang's): pairs to two remote
    engines, pages and a large segment mixed, local memories on every GPU
    (the pairs of small segments on one GPU share one kernel launch when
    together they suit it: one segment list, as offsets with a table of
    bases for up to 16 of them, rewritten into addresses beyond that or when
    a segment must be cut; else each goes alone. Pairs of large segments go
    alone: with "large-alone" the 2 MiB pair is one, beside shared pages).
    Every pair's bytes land; a pair with a bad offset or a deregistered
    remote memory fails alone."""
    a, b, c = xgmi_engine("gba", **cfg), xgmi_engine("gbb", **cfg), xgmi_engine("gbc", **cfg)
    for e in (b, c):
        a.register_remote_engine(e.get_engine_desc())
    seg, region = 4096, 4 << 20
    devs = [0, 1] if TWO_GPUS else [0]
    owners = [b, c]
    layouts = _pair_layouts(region, seg, seed=3)
    pairs = []  # (local tensor, local desc, remote tensor, remote desc, (lo, ro, sz))
    for k in range(npairs):
        dev = devs[k % len(devs)]
        owner = owners[k % 2]
        remote_dev = devs[(k // 2) % len(devs)]
        local = rand_bytes(region, f"cuda:{dev}", 100 + k) if op == "write" else torch.zeros(
            region, dtype=torch.uint8, device=f"cuda:{dev}")
        remote = rand_bytes(region, f"cuda:{remote_dev}", 200 + k) if op == "read" else torch.zeros(
            region, dtype=torch.uint8, device=f"cuda:{remote_dev}")
        rd = MemoryDesc.unpack(owner.register_torch_tensor(remote).pack())
        pairs.append((local, a.register_torch_tensor(local), remote, rd, layouts[k % len(layouts)]))
    # Two pairs that fail on their own: an offset past the end, and remote
    # memory its owner deregistered (after we mapped it).
    bad_local = torch.zeros(region, dtype=torch.uint8, device="cuda:0")
    bad_ld = a.register_torch_tensor(bad_local)
    gone = torch.zeros(region, dtype=torch.uint8, device="cuda:0")
    gone_rd = MemoryDesc.unpack(c.register_torch_tensor(gone).pack())
    settle()
    wait_ok(a.read(bad_ld, 0, gone_rd, 0, seg, a.allocate_transfer_uid()))
    c.deregister_memory(gone_rd)
    lds = [p[1] for p in pairs] + [bad_ld, bad_ld]
    rds = [p[3] for p in pairs] + [pairs[0][3], gone_rd]
    los = [p[4][0] for p in pairs] + [[0], [0]]
    ros = [p[4][1] for p in pairs] + [[region - seg + 1], [0]]
    szs = [p[4][2] for p in pairs] + [[seg], [seg]]
    statuses = getattr(a, f"batch_{op}")(lds, los, rds, ros, szs, [a.allocate_transfer_uid() for _ in lds])
    for st in statuses[:len(pairs)]:
        wait_ok(st)
    assert statuses[-2].WaitFor(10000) == StatusCode.ERR_INVALID_ARGS, statuses[-2].Message()
    assert statuses[-1].WaitFor(10000) == StatusCode.ERR_NOT_FOUND, statuses[-1].Message()
    torch.cuda.synchronize()
    for local, _, remote, _, (lo, ro, sz) in pairs:
        src, dst = (remote.cpu(), local.cpu()) if op == "read" else (local.cpu(), remote.cpu())
        s_offs, d_offs = (ro, lo) if op == "read" else (lo, ro)
        expect = torch.zeros_like(dst)
        for so, do, n in zip(s_offs, d_offs, sz):
            expect[do:do + n] = src[so:so + n]
        assert torch.equal(dst, expect)
    assert int(bad_local.count_nonzero()) == 0
    for e in (a, b, c):
        e.shutdown()


@pytest.mark.parametrize("npairs", [12, 5])
@pytest.mark.parametrize("cfg", [{}, COPY_ENGINES_ALWAYS], ids=["default", "copy-engines"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_engine_batch_of_one_page_pairs(op, cfg, npairs):
    """Pairs of one page each (fewer segments than kernel_min_segments
    apiece): 12 of them (11 valid) are together enough for the kernel by
    default, so they share one launch and one completion; 5 (4 valid) are
    not, and each goes on its own, as with the copy engines forced. Every
    page lands where its own pair says, whichever way they went (the
    grouping itself is not visible from here), and a pair whose page is out
    of range fails alone (refused before submission)."""
    a, b = xgmi_engine("opa", **cfg), xgmi_engine("opb", **cfg)
    a.register_remote_engine(b.get_engine_desc())
    seg, bad = 4096, npairs // 2
    locals_ = [torch.zeros(8 * seg, dtype=torch.uint8, device="cuda:0") for _ in range(npairs)]
    remotes = [torch.zeros(8 * seg, dtype=torch.uint8, device="cuda:0") for _ in range(npairs)]
    for k, t in enumerate(locals_ if op == "write" else remotes):
        t.copy_(rand_bytes(8 * seg, "cuda:0", 300 + k))
    lds = [a.register_torch_tensor(t) for t in locals_]
    rds = [MemoryDesc.unpack(b.register_torch_tensor(t).pack()) for t in remotes]
    los = [[(k % 8) * seg] for k in range(npairs)]
    ros = [[((k * 3) % 8) * seg] for k in range(npairs)]
    ros[bad] = [8 * seg - seg // 2]  # past the end of its remote memory
    statuses = getattr(a, f"batch_{op}")(lds, los, rds, ros, [[seg]] * npairs,
                                         [a.allocate_transfer_uid() for _ in range(npairs)])
    for k, st in enumerate(statuses):
        if k == bad:
            assert st.WaitFor(10000) == StatusCode.ERR_INVALID_ARGS, st.Message()
        else:
            wait_ok(st)
    torch.cuda.synchronize()
    for k in range(npairs):
        lo, ro = los[k][0], ros[k][0]
        if k == bad:
            assert int((locals_[k] if op == "read" else remotes[k]).count_nonzero()) == 0
        elif op == "read":
            assert torch.equal(locals_[k][lo:lo + seg], remotes[k][ro:ro + seg])
        else:
            assert torch.equal(remotes[k][ro:ro + seg], locals_[k][lo:lo + seg])
    for e in (a, b):
        e.shutdown()


# ---------------------------------------------------------------------------
# Across processes: the target lives in another process on another GPU.


def _gpu_target(conn, key, device):
    import torch  # noqa: F811

    from mori_torch.io import BackendType, IOEngine, IOEngineConfig, XgmiBackendConfig

    torch.cuda.set_device(device)
    eng = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    eng.create_backend(BackendType.XGMI, XgmiBackendConfig())
    big = torch.randint(0, 256, (128 << 20,), dtype=torch.uint8, device=f"cuda:{device}",
                        generator=torch.Generator(device=f"cuda:{device}").manual_seed(42))
    view = big[64 << 20: (64 << 20) + (1 << 20)]
    whole = eng.register_torch_tensor(big)
    vd = eng.register_torch_tensor(view)
    torch.cuda.synchronize()
    conn.send((eng.get_engine_desc().pack(), whole.pack(), vd.pack(), bytes(view.cpu().numpy())))
    while True:
        cmd = conn.recv()
        if cmd == "dereg_view":
            eng.deregister_memory(vd)
            conn.send(True)
        elif isinstance(cmd, tuple) and cmd[0] == "pages":
            idx = torch.tensor(cmd[1], device=big.device)
            conn.send(bytes(big.view(-1, 4096).index_select(0, idx).cpu().numpy()))
        elif cmd == "sum":
            conn.send(int(big.sum().item()))
        elif cmd == "exit":
            eng.shutdown()
            conn.send(True)
            return


@pytest.fixture(params=[0, 1], ids=["remote-on-cuda0", "remote-on-cuda1"])
def gpu_remote(request):
    """A target engine in another process, on the same GPU as ours or on the other."""
    dev = request.param
    if dev == 1 and not TWO_GPUS:
        pytest.skip("needs two GPUs")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_target, args=(child, unique_key("gpu-remote"), dev), daemon=True)
    proc.start()
    assert conn.poll(120), "GPU target did not start"
    eng_b, whole_b, view_b, view_bytes = conn.recv()
    yield conn, EngineDesc.unpack(eng_b), MemoryDesc.unpack(whole_b), MemoryDesc.unpack(view_b), view_bytes
    conn.send("exit")
    conn.poll(30)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def test_view_at_offset_read_from_another_process(gpu_remote):
    conn, edesc, whole, view, view_bytes = gpu_remote
    a = xgmi_engine("gx")
    a.register_remote_engine(edesc)
    local = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    ld = a.register_torch_tensor(local)
    settle()
    assert view.ipc_offset >= 64 << 20
    wait_ok(a.read(ld, 0, view, 0, 1 << 20, a.allocate_transfer_uid()))
    assert bytes(local.cpu().numpy()) == view_bytes
    # Batched read of shuffled 4 KiB pages from the whole allocation.
    pages = random.Random(1).sample(range((128 << 20) // 4096), 256)
    sess = a.create_session(ld, whole)
    wait_ok(sess.batch_read([i * 4096 for i in range(256)], [p * 4096 for p in pages], [4096] * 256,
                            sess.allocate_transfer_uid()))
    conn.send(("pages", pages))
    assert bytes(local[:256 * 4096].cpu().numpy()) == conn.recv()
    # Write back into the remote allocation and check through its sum.
    before = conn.send("sum") or conn.recv()
    local.fill_(0)
    settle()
    wait_ok(a.write(ld, 0, view, 0, 1 << 20, a.allocate_transfer_uid()))
    after = conn.send("sum") or conn.recv()
    assert after == before - sum(view_bytes)
    assert a.mapped_remote_memories() == 2  # the view and the whole allocation
    # Forgetting the peer closes its mappings (shutdown does the same; after
    # it, every call raises, so this is where they can be counted).
    a.deregister_remote_engine(edesc)
    assert a.mapped_remote_memories() == 0
    a.shutdown()


def test_engine_batch_of_pairs_from_another_process(gpu_remote):
    """The engine-level batch with the remote memories in another process
    (mapped through their IPC handles): pages of the whole allocation and
    the view, in one call."""
    conn, edesc, whole, view, view_bytes = gpu_remote
    a = xgmi_engine("gbx")
    a.register_remote_engine(edesc)
    l1 = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    l2 = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    settle()
    d1, d2 = a.register_torch_tensor(l1), a.register_torch_tensor(l2)
    pages = random.Random(2).sample(range((128 << 20) // 4096), 200)
    st = a.batch_read([d1, d2], [[i * 4096 for i in range(200)], [0, 4096 * 3]], [whole, view],
                      [[p * 4096 for p in pages], [0, 4096 * 3]], [[4096] * 200, [4096 * 3, (1 << 20) - 4096 * 3]],
                      [a.allocate_transfer_uid(), a.allocate_transfer_uid()])
    for s in st:
        wait_ok(s)
    conn.send(("pages", pages))
    assert bytes(l1[:200 * 4096].cpu().numpy()) == conn.recv()
    assert int(l1[200 * 4096:].count_nonzero()) == 0
    assert bytes(l2.cpu().numpy()) == view_bytes
    a.shutdown()


def test_owner_deregistering_takes_the_memory_back(gpu_remote):
    """The target deregisters a memory we hold mapped: its deregister_memory
    returns only after we closed the mapping, and every later transfer to it
    fails (engine call and session alike) without touching its bytes; the
    other memory of the same allocation keeps working."""
    conn, edesc, whole, view, view_bytes = gpu_remote
    a = xgmi_engine("grevoke")
    a.register_remote_engine(edesc)
    local = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    ld = a.register_torch_tensor(local)
    settle()
    sess = a.create_session(ld, view)
    wait_ok(sess.read(0, 0, 4096, 1))
    assert bytes(local[:4096].cpu().numpy()) == view_bytes[:4096]
    wait_ok(a.read(ld, 0, whole, 0, 4096, a.allocate_transfer_uid()))
    assert a.mapped_remote_memories() == 2
    local.fill_(7)
    settle()
    before = conn.send("sum") or conn.recv()
    conn.send("dereg_view")
    assert conn.recv() is True
    assert a.mapped_remote_memories() == 1  # closed before the owner's call returned
    for st in (a.write(ld, 0, view, 0, 1 << 20, a.allocate_transfer_uid()), sess.write(0, 0, 4096, 2),
               sess.batch_write([0, 8192], [0, 8192], [4096, 4096], 3)):
        assert st.WaitFor(10000) == StatusCode.ERR_NOT_FOUND
        assert "deregistered" in st.Message(), st.Message()
    assert (conn.send("sum") or conn.recv()) == before  # nothing was written
    # The rest of the allocation is registered on its own and still served.
    wait_ok(a.write(ld, 0, whole, 0, 4096, a.allocate_transfer_uid()))
    assert (conn.send("sum") or conn.recv()) != before
    a.shutdown()


def test_owner_deregistering_in_one_process_is_revoked_too():
    """Same process (no IPC mapping): transfers to memory its owner
    deregistered fail instead of writing into memory torch may reuse."""
    a, b = xgmi_engine("grv-a"), xgmi_engine("grv-b")
    a.register_remote_engine(b.get_engine_desc())
    local = torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")
    remote = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    ld = a.register_torch_tensor(local)
    rd_b = b.register_torch_tensor(remote)
    rd = MemoryDesc.unpack(rd_b.pack())
    settle()
    wait_ok(a.write(ld, 0, rd, 0, 4096, 1))
    assert int(remote[:4096].sum()) == 4096
    b.deregister_memory(rd_b)
    remote.zero_()
    settle()  # so that a write let through by a regression would show below
    st = a.write(ld, 0, rd, 0, 1 << 20, 2)
    assert st.WaitFor(10000) == StatusCode.ERR_NOT_FOUND and "deregistered" in st.Message()
    torch.cuda.synchronize()
    assert int(remote.sum()) == 0
    a.shutdown()
    b.shutdown()


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs: the caller's device must differ from the memory's")
def test_calls_leave_the_callers_device_alone():
    """torch reads the calling thread's current device (torch.empty(device="cuda")
    allocates there): registering memory of cuda:0, the first transfers (which
    set up that GPU's streams), batches, an engine-level group and a stream
    handle leave a caller on cuda:1 on cuda:1."""
    from mori_torch import ops

    torch.cuda.set_device(1)
    try:
        a, b, local, remote, ld, rd = _pair_with("same-device")
        assert torch.cuda.current_device() == 1
        local.copy_(rand_bytes(local.numel(), local.device, 3))
        settle()
        wait_ok(a.write(ld, 0, rd, 0, 4096, a.allocate_transfer_uid()))
        assert torch.cuda.current_device() == 1
        sess = a.create_session(ld, rd)
        wait_ok(sess.batch_write([i * 4096 for i in range(16)], [(15 - i) * 4096 for i in range(16)], [4096] * 16,
                                 sess.allocate_transfer_uid()))
        assert torch.cuda.current_device() == 1
        settle()
        assert torch.equal(remote[:16 * 4096].cpu().view(16, 4096), local[:16 * 4096].cpu().view(16, 4096).flip(0))
        for st in a.batch_read([ld, ld], [[0], [4096]], [rd, rd], [[0], [8192]], [[64], [64]],
                               [a.allocate_transfer_uid(), a.allocate_transfer_uid()]):
            wait_ok(st)
        assert torch.cuda.current_device() == 1
        h = ops.session_handle(sess)
        assert torch.cuda.current_device() == 1
        ops.release_session_handle(h)
        settle()
        assert torch.equal(local[4096:4096 + 64].cpu(), remote[8192:8192 + 64].cpu())
        a.shutdown()
        b.shutdown()
    finally:
        torch.cuda.set_device(0)
