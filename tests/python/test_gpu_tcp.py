"""GPU memory over the TCP backend (pinned staging buffers, copies pipelined
with the socket): GPU<->GPU, CPU<->GPU, both directions, in one process and
across processes, payloads spanning many staging chunks, and staging
buffers that fail to pin half-way. Skipped without a GPU."""
import multiprocessing as mp
import random

import pytest
import torch

import mori_torch
from conftest import settle, unique_key, wait_ok
from mori_torch.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    StatusCode,
    TcpBackendConfig,
    XgmiBackendConfig,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")

# Small chunks so that modest payloads cross many chunk boundaries.
CHUNK = (256 << 10) + 4096


def tcp_engine(prefix, **kw):
    e = IOEngine(unique_key(prefix), IOEngineConfig("127.0.0.1", 0))
    kw.setdefault("staging_chunk_bytes", CHUNK)
    e.create_backend(BackendType.TCP, TcpBackendConfig(**kw))
    return e


def rand_bytes(n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


KINDS = {"gpu-gpu": ("cuda:0", "cuda:0"), "cpu-gpu": ("cpu", "cuda:0"), "gpu-cpu": ("cuda:0", "cpu"),
         "gpu0-gpu1": ("cuda:0", "cuda:1")}


@pytest.fixture(params=list(KINDS), ids=list(KINDS))
def tcp_pair(request):
    ldev, rdev = KINDS[request.param]
    if rdev == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    a, b = tcp_engine("gt-a", num_data_conns=4), tcp_engine("gt-b", num_data_conns=4)
    a.register_remote_engine(b.get_engine_desc())
    n = 6 << 20
    local = torch.zeros(n, dtype=torch.uint8, device=ldev)
    remote = torch.zeros(n, dtype=torch.uint8, device=rdev)
    ld = a.register_torch_tensor(local)
    rd = MemoryDesc.unpack(b.register_torch_tensor(remote).pack())
    settle()
    yield a, b, local, remote, ld, rd
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("size", [1, 8, 4095, CHUNK, 3 * CHUNK + 17, 5 << 20])
def test_single_write_and_read(tcp_pair, size):
    a, b, local, remote, ld, rd = tcp_pair
    assert a.create_session(ld, rd).backend_type == BackendType.TCP
    src = rand_bytes(size, size)
    local[100 : 100 + size] = src.to(local.device)
    settle()
    wait_ok(a.write(ld, 100, rd, 333, size, 1))
    assert torch.equal(remote[333 : 333 + size].cpu(), src)
    local.zero_()
    settle()
    wait_ok(a.read(ld, 7, rd, 333, size, 2))
    assert torch.equal(local[7 : 7 + size].cpu(), src)
    assert int(local[:7].count_nonzero()) == 0 and int(local[7 + size :].count_nonzero()) == 0


@pytest.mark.parametrize("op", ["read", "write"])
def test_shuffled_batch_spans_chunks(tcp_pair, op):
    a, b, local, remote, ld, rd = tcp_pair
    page, n = 16 << 10, 300  # 4.7 MiB: about 18 chunks, pages split across chunk ends
    lo = [i * page for i in range(n)]
    ro = [i * page for i in range(n)]
    random.Random(5).shuffle(ro)
    src = rand_bytes(n * page, 9)
    sess = a.create_session(ld, rd)
    if op == "write":
        local[: n * page] = src.to(local.device)
        settle()
        wait_ok(sess.batch_write(lo, ro, [page] * n, 11))
        got, want = remote.cpu(), local.cpu()
        for i in range(n):
            assert torch.equal(got[ro[i] : ro[i] + page], want[lo[i] : lo[i] + page]), f"page {i}"
    else:
        remote[: n * page] = src.to(remote.device)
        settle()
        wait_ok(sess.batch_read(lo, ro, [page] * n, 12))
        got, want = local.cpu(), remote.cpu()
        for i in range(n):
            assert torch.equal(got[lo[i] : lo[i] + page], want[ro[i] : ro[i] + page]), f"page {i}"


@pytest.mark.parametrize("op", ["read", "write"])
def test_small_unaligned_segments(tcp_pair, op):
    """Hundreds of odd-sized, odd-offset pieces per staging chunk (the
    gather/scatter kernel's byte path)."""
    a, b, local, remote, ld, rd = tcp_pair
    n = 2000
    sizes = [1 + (i * 37) % 999 for i in range(n)]
    lo, at = [], 5
    for sz in sizes:  # local layout: in order, 3-byte gaps
        lo.append(at)
        at += sz + 3
    ro, rat = [0] * n, 11
    for i in random.Random(8).sample(range(n), n):  # remote layout: permuted, 5-byte gaps
        ro[i] = rat
        rat += sizes[i] + 5
    order = random.Random(9).sample(range(n), n)  # and submitted in a third order
    lo, ro, sizes = [lo[i] for i in order], [ro[i] for i in order], [sizes[i] for i in order]
    at = max(at, rat)
    span = at + 64
    src = rand_bytes(span, 17)
    sess = a.create_session(ld, rd)
    if op == "write":
        local[:span] = src.to(local.device)
        settle()
        wait_ok(sess.batch_write(lo, ro, sizes, 21))
        got, want = remote.cpu(), local.cpu()
        for i in range(n):
            assert torch.equal(got[ro[i] : ro[i] + sizes[i]], want[lo[i] : lo[i] + sizes[i]]), f"segment {i}"
    else:
        remote[:span] = src.to(remote.device)
        settle()
        wait_ok(sess.batch_read(lo, ro, sizes, 22))
        got, want = local.cpu(), remote.cpu()
        for i in range(n):
            assert torch.equal(got[lo[i] : lo[i] + sizes[i]], want[ro[i] : ro[i] + sizes[i]]), f"segment {i}"


def test_many_transfers_in_flight_keep_order_per_byte(tcp_pair):
    a, b, local, remote, ld, rd = tcp_pair
    n, size = 64, 64 << 10
    local[: n * size] = rand_bytes(n * size, 3).to(local.device)
    settle()
    sts = [a.write(ld, i * size, rd, i * size, size, 100 + i) for i in range(n)]
    for st in sts:
        wait_ok(st)
    assert torch.equal(remote[: n * size].cpu(), local[: n * size].cpu())


def test_views_and_two_registrations_of_one_block():
    """Sub-allocations of torch's caching allocator move the view's bytes."""
    a, b = tcp_engine("gv-a"), tcp_engine("gv-b")
    a.register_remote_engine(b.get_engine_desc())
    block = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda:0")
    view = block[1 << 20 : 2 << 20]
    view.copy_(rand_bytes(1 << 20, 4, "cuda:0"))
    settle()
    remote = torch.zeros(1 << 20, dtype=torch.uint8)
    ld = a.register_torch_tensor(view)
    rd = MemoryDesc.unpack(b.register_torch_tensor(remote).pack())
    wait_ok(a.write(ld, 0, rd, 0, 1 << 20, 1))
    assert torch.equal(remote, view.cpu())
    a.shutdown()
    b.shutdown()


def test_staging_that_fails_half_way_frees_what_it_pinned(monkeypatch):
    a, b = tcp_engine("gf-a", num_data_conns=1), tcp_engine("gf-b", num_data_conns=1)
    a.register_remote_engine(b.get_engine_desc())
    gpu = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    cpu = torch.zeros(1 << 20, dtype=torch.uint8)
    ld = a.register_torch_tensor(gpu)
    settle()
    rd = MemoryDesc.unpack(b.register_torch_tensor(cpu).pack())
    before = mori_torch.pinned_host_bytes()
    monkeypatch.setenv("MORI_TORCH_FAIL_PINNED_CHUNK", "2")  # chunk 1 pins, chunk 2 fails
    st = a.write(ld, 0, rd, 0, 1 << 20, 1)
    assert st.WaitFor(10000) == StatusCode.ERR_GPU_OP
    assert "staging" in st.Message() and "chunk 2" in st.Message()
    assert mori_torch.pinned_host_bytes() == before, "the chunk pinned before the failure leaked"
    assert int(cpu.count_nonzero()) == 0
    # The engine goes on working once pinning succeeds; its set stays pinned.
    monkeypatch.delenv("MORI_TORCH_FAIL_PINNED_CHUNK")
    wait_ok(a.write(ld, 0, rd, 0, 1 << 20, 2))
    assert bool((cpu == 7).all())
    assert mori_torch.pinned_host_bytes() >= before + 4 * CHUNK  # the default staging_depth
    a.shutdown()
    b.shutdown()
    assert mori_torch.pinned_host_bytes() == before  # engines gone: nothing stays pinned


def test_pinned_bytes_return_to_zero_after_engines_end():
    before = mori_torch.pinned_host_bytes()
    a, b = tcp_engine("gz-a", num_data_conns=2), tcp_engine("gz-b", num_data_conns=2)
    a.register_remote_engine(b.get_engine_desc())
    g1 = torch.ones(2 << 20, dtype=torch.uint8, device="cuda:0")
    g2 = torch.zeros(2 << 20, dtype=torch.uint8, device="cuda:0")
    ld = a.register_torch_tensor(g1)
    rd = MemoryDesc.unpack(b.register_torch_tensor(g2).pack())
    settle()
    wait_ok(a.write(ld, 0, rd, 0, 2 << 20, 1))
    wait_ok(a.read(ld, 0, rd, 0, 2 << 20, 2))
    assert mori_torch.pinned_host_bytes() > before
    a.shutdown()
    b.shutdown()
    assert mori_torch.pinned_host_bytes() == before


def test_target_without_staging_rejects_cleanly(monkeypatch):
    """The target cannot pin: the initiator's status says so, nothing moves,
    the connection stays usable."""
    a, b = tcp_engine("gr-a", num_data_conns=1), tcp_engine("gr-b", num_data_conns=1)
    a.register_remote_engine(b.get_engine_desc())
    cpu = torch.full((1 << 20,), 9, dtype=torch.uint8)
    gpu = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    ld = a.register_torch_tensor(cpu)
    rd = MemoryDesc.unpack(b.register_torch_tensor(gpu).pack())
    settle()
    monkeypatch.setenv("MORI_TORCH_FAIL_PINNED_CHUNK", "3")
    st = a.write(ld, 0, rd, 0, 1 << 20, 1)
    assert st.WaitFor(10000) == StatusCode.ERR_GPU_OP
    assert "rejected by target" in st.Message()
    assert int(gpu.count_nonzero()) == 0
    monkeypatch.delenv("MORI_TORCH_FAIL_PINNED_CHUNK")
    wait_ok(a.write(ld, 0, rd, 0, 1 << 20, 2))
    wait_ok(a.read(ld, 0, rd, 0, 1 << 20, 3))
    assert bool((gpu == 9).all()) and bool((cpu == 9).all())
    a.shutdown()
    b.shutdown()


def test_bad_offsets_on_gpu_memory():
    a, b = tcp_engine("gb-a"), tcp_engine("gb-b")
    a.register_remote_engine(b.get_engine_desc())
    ld = a.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8, device="cuda:0"))
    rd = MemoryDesc.unpack(b.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8, device="cuda:0")).pack())
    st = a.write(ld, 0, rd, 4090, 8, 1)
    assert st.Code() == StatusCode.ERR_INVALID_ARGS and "remote" in st.Message()
    st = a.read(ld, 4096, rd, 0, 1, 2)
    assert st.Code() == StatusCode.ERR_INVALID_ARGS and "local" in st.Message()
    a.shutdown()
    b.shutdown()


def test_tcp_serves_mixed_pairs_when_xgmi_exists():
    def eng(p):
        e = IOEngine(unique_key(p), IOEngineConfig("127.0.0.1", 0))
        e.create_backend(BackendType.XGMI, XgmiBackendConfig())
        e.create_backend(BackendType.TCP, TcpBackendConfig())
        return e

    a, b = eng("gm-a"), eng("gm-b")
    a.register_remote_engine(b.get_engine_desc())
    g1 = a.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8, device="cuda:0"))
    g2 = b.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8, device="cuda:0"))
    c2 = b.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8))
    assert a.create_session(g1, g2).backend_type == BackendType.XGMI
    assert a.create_session(g1, c2).backend_type == BackendType.TCP
    a.shutdown()
    b.shutdown()


# ---------------------------------------------------------------------------
# Across processes: the target's GPU memory lives in another process.


def _gpu_tcp_target(conn, key, nbytes):
    import torch  # noqa: F811

    from mori_torch.io import IOEngine, IOEngineConfig, TcpBackendConfig

    eng = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    eng.create_backend(BackendType.TCP, TcpBackendConfig(staging_chunk_bytes=CHUNK))
    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    md = eng.register_torch_tensor(buf)
    conn.send((eng.get_engine_desc().pack(), md.pack()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "fill":
            g = torch.Generator().manual_seed(arg)
            buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).cuda())
            torch.cuda.synchronize()
            conn.send(True)
        elif cmd == "get":
            conn.send(bytes(buf.cpu().numpy()))
        elif cmd == "exit":
            eng.shutdown()
            conn.send(True)
            return


@pytest.mark.parametrize("local_dev", ["cuda:0", "cpu"])
def test_two_processes(local_dev):
    n = 3 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_tcp_target, args=(child, unique_key("gt-remote"), n), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "target process did not start"
        eng_bytes, mem_bytes = parent.recv()
        a = tcp_engine("gt-local")
        a.register_remote_engine(EngineDesc.unpack(eng_bytes))
        rd = MemoryDesc.unpack(mem_bytes)
        local = torch.zeros(n, dtype=torch.uint8, device=local_dev)
        ld = a.register_torch_tensor(local)
        settle()
        parent.send(("fill", 21))
        assert parent.recv()
        wait_ok(a.read(ld, 0, rd, 0, n, 1))
        assert torch.equal(local.cpu(), rand_bytes(n, 21))
        local.copy_(rand_bytes(n, 22).to(local_dev))
        settle()
        wait_ok(a.write(ld, 0, rd, 0, n, 2))
        parent.send(("get", None))
        assert parent.recv() == bytes(rand_bytes(n, 22).numpy())
        a.shutdown()
    finally:
        parent.send(("exit", None))
        parent.poll(20)
        proc.join(20)
        if proc.is_alive():
            proc.kill()
