"""torch.ops.mori.* on GPU streams: XGMI (copy kernel on the stream; remote
pages on the same GPU and, with two GPUs, on cuda:1) and TCP (doorbell
answered by the progress thread; host or GPU pages), eager, opcheck,
torch.compile, captured CUDA graphs replayed with new block tables, CPU block
lists refused under capture, doorbell slots freed with their graph,
reduce-overhead, the spin-kernel fallback, and a capture while engine threads
work."""
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import Pair, freeze, unique_key, wait_ok
from mori_torch import ops
from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, XgmiBackendConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2

PAGE = 4096
PAGES = 256
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class XgmiEnv:
    """Two XGMI engines in this process; the local pages on cuda:0, the remote
    pages on `remote_device` (cuda:0: one GPU; cuda:1: across GPUs). Ops run
    on cuda:0's current stream."""

    def __init__(self, remote_device="cuda:0"):
        self.a = IOEngine(unique_key("oxa"), IOEngineConfig("127.0.0.1", 0))
        self.b = IOEngine(unique_key("oxb"), IOEngineConfig("127.0.0.1", 0))
        for e in (self.a, self.b):
            e.create_backend(BackendType.XGMI, XgmiBackendConfig())
        self.a.register_remote_engine(self.b.get_engine_desc())
        self.local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, device="cuda:0")
        self.remote = torch.zeros(PAGE * PAGES, dtype=torch.uint8, device=remote_device)
        self.cross = self.remote.device != self.local.device
        ld = self.a.register_torch_tensor(self.local)
        rd = MemoryDesc.unpack(self.b.register_torch_tensor(self.remote).pack())
        self.sess = self.a.create_session(ld, rd)
        assert self.sess.backend_type == BackendType.XGMI
        self.h = ops.session_handle(self.sess)

    def sync(self):
        """Both GPUs: work on the remote GPU's streams is not ordered with
        cuda:0's."""
        torch.cuda.synchronize(self.local.device)
        torch.cuda.synchronize(self.remote.device)

    def close(self):
        self.sync()
        ops.release_session_handle(self.h)
        self.a.shutdown()
        self.b.shutdown()


class TcpEnv:
    """TCP engines in this process; the local pages are pinned host memory or
    GPU memory (moved by TCP through its staging buffers), the remote pages
    host memory. The doorbell orders both on the GPU stream."""

    def __init__(self, local="host"):
        self.kind = local
        self.pair = Pair(nbytes=PAGE * PAGES)
        p = self.pair
        p.init.deregister_memory(p.local_desc)
        if local == "gpu":
            self.local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, device="cuda")
        else:
            self.local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, pin_memory=True)
        p.local_desc = p.init.register_torch_tensor(self.local)
        self.remote = p.remote
        self.sess = p.init.create_session(p.local_desc, p.remote_desc)
        self.h = ops.session_handle(self.sess)

    def close(self):
        torch.cuda.synchronize()
        ops.release_session_handle(self.h)
        self.pair.close()


@pytest.fixture(scope="module", params=["cuda:0", "cuda:1"], ids=["xgmi-1gpu", "xgmi-2gpu"])
def xgmi(request):
    if request.param == "cuda:1" and not TWO_GPUS:
        pytest.skip("needs two GPUs")
    env = XgmiEnv(request.param)
    yield env
    env.close()


@pytest.fixture(scope="module", params=["host", "gpu"], ids=lambda p: f"tcp-{p}-pages")
def tcp(request):
    env = TcpEnv(request.param)
    yield env
    env.close()


def rand_pages(seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PAGE * PAGES,), dtype=torch.uint8, generator=g).to(device)


def pages_of(t, idx):
    return t.view(PAGES, PAGE)[idx].cpu()


def same(a, b):
    """Byte equality of tensors that may live on different devices."""
    return torch.equal(a.cpu(), b.cpu())


def poll(fn, timeout=10.0):
    """fn() until it is true or `timeout` seconds passed; the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.02)


# ---------------------------------------------------------------------------
# Eager


def test_flag_mechanism_is_memops():
    assert ops.stream_flag_mechanism() == "memops"


@pytest.mark.parametrize("lists_on", ["cuda", "cpu"])
def test_xgmi_eager_all_ops(xgmi, lists_on):
    x = xgmi
    x.remote.copy_(rand_pages(1, "cuda"))
    x.local.zero_()
    t = lambda v: torch.tensor(v, device=lists_on)  # noqa: E731
    ops.read(x.h, x.local, 100, 5000, 3000)
    ops.batch_read(x.h, x.local, t([8192, 20000]), t([0, 40000]), t([4096, 77]))
    ops.read_pages(x.h, x.local, t([10, 11]), t([200, 3]), PAGE)
    torch.cuda.synchronize()
    assert same(x.local[100:3100], x.remote[5000:8000])
    assert same(x.local[8192:12288], x.remote[0:4096])
    assert same(x.local[20000:20077], x.remote[40000:40077])
    assert torch.equal(pages_of(x.local, [10, 11]), pages_of(x.remote, [200, 3]))
    x.local.copy_(rand_pages(2, "cuda"))
    ops.write(x.h, x.local, 1, 2, 333)
    ops.batch_write(x.h, x.local, t([0, 4096]), t([50000, 60000]), t([16]))
    ops.write_pages(x.h, x.local, t([7]), t([250]), PAGE)
    torch.cuda.synchronize()
    assert same(x.remote[2:335], x.local[1:334])
    assert same(x.remote[50000:50016], x.local[0:16])
    assert same(x.remote[60000:60016], x.local[4096:4112])
    assert torch.equal(pages_of(x.remote, [250]), pages_of(x.local, [7]))
    ops.check_errors(x.h)


def test_xgmi_orders_with_work_on_the_stream(xgmi):
    """The producer runs late (a long sleep first); the read must still see
    its bytes, and the consumer after the op must see the read's bytes."""
    x = xgmi
    if x.cross:
        pytest.skip("the producer writes the remote pages on this stream: one GPU only")
    s = torch.cuda.Stream()
    x.local.zero_()
    x.remote.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        x.remote.view(PAGES, PAGE)[5].fill_(42)
        ops.read_pages(x.h, x.local, torch.tensor([9], device="cuda"), torch.tensor([5], device="cuda"), PAGE)
        seen = x.local.view(PAGES, PAGE)[9].to(torch.int32).sum()
    s.synchronize()
    assert int(seen) == 42 * PAGE


def test_xgmi_out_of_range_entry_moves_nothing_and_is_reported(xgmi):
    x = xgmi
    x.remote.copy_(rand_pages(3, "cuda"))
    x.local.zero_()
    ops.read_pages(x.h, x.local, torch.tensor([1, 2, 3], device="cuda"),
                   torch.tensor([4, PAGES, 6], device="cuda"), PAGE)
    torch.cuda.synchronize()
    assert torch.equal(pages_of(x.local, [1, 3]), pages_of(x.remote, [4, 6]))
    assert int(x.local.view(PAGES, PAGE)[2].count_nonzero()) == 0
    with pytest.raises(ValueError, match="segment 1 out of range"):
        ops.check_errors(x.h)
    ops.check_errors(x.h)  # cleared
    ops.batch_write(x.h, x.local, torch.tensor([-5], device="cuda"), torch.tensor([0], device="cuda"),
                    torch.tensor([8], device="cuda"))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="segment 0 out of range"):
        ops.check_errors(x.h)


def test_tcp_eager_orders_host_memory_on_the_stream(tcp):
    """Producer: a late GPU kernel, then a copy into the pinned local pages;
    the doorbell write must send those bytes; the read after it must land
    before the copy back to the GPU."""
    t = tcp
    t.local.zero_()
    t.remote.zero_()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        produced = torch.full((PAGE,), 7, dtype=torch.uint8, device="cuda")
        t.local.view(PAGES, PAGE)[3].copy_(produced, non_blocking=True)
        ops.write_pages(t.h, t.local, torch.tensor([3], device="cuda"), torch.tensor([30], device="cuda"), PAGE)
        ops.read_pages(t.h, t.local, torch.tensor([4], device="cuda"), torch.tensor([30], device="cuda"), PAGE)
        back = t.local.view(PAGES, PAGE)[4].to("cuda", non_blocking=True).to(torch.int32).sum()
    s.synchronize()
    assert int(back) == 7 * PAGE
    assert int(t.remote.view(PAGES, PAGE)[30].to(torch.int32).sum()) == 7 * PAGE
    ops.check_errors(t.h)


def test_tcp_failed_transfer_releases_the_stream_and_is_reported(tcp):
    t = tcp
    ops.read_pages(t.h, t.local, torch.tensor([0], device="cuda"), torch.tensor([PAGES + 3], device="cuda"), PAGE)
    torch.cuda.synchronize()  # must not hang
    with pytest.raises(ValueError, match="remote range out of bounds"):
        ops.check_errors(t.h)


def _l(values, dev):
    return torch.tensor(values, device=dev)


# (handle, local, device of the block lists) -> op arguments.
OPCHECK_CASES = {
    "read": lambda h, t, d: (h, t, 0, 128, 64),
    "write": lambda h, t, d: (h, t, 64, 0, 32),
    "batch_read": lambda h, t, d: (h, t, _l([0, 512], d), _l([1024, 256], d), _l([16, 40], d)),
    "batch_write": lambda h, t, d: (h, t, _l([0, 512], d), _l([2048, 4096], d), _l([24], d)),
    "read_pages": lambda h, t, d: (h, t, _l([0, 3], d), _l([5, 1], d), PAGE),
    "write_pages": lambda h, t, d: (h, t, _l([2, 3], d), _l([50, 51], d), PAGE),
}


@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck_xgmi(xgmi, name):
    xgmi.remote.copy_(rand_pages(4, "cuda"))
    xgmi.local.copy_(rand_pages(5, "cuda"))
    torch.library.opcheck(getattr(torch.ops.mori, name).default, OPCHECK_CASES[name](xgmi.h, xgmi.local, "cuda"))


@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck_tcp(tcp, name):
    """Block lists on the GPU, so the CUDA implementation runs even for host
    pages: opcheck hands the op copies of `local`, which go through the
    registration (a host copy after a stream sync; a GPU copy by staging
    kernels around the doorbell)."""
    tcp.remote.copy_(rand_pages(4, "cpu"))
    tcp.local.copy_(rand_pages(5, tcp.local.device))
    torch.library.opcheck(getattr(torch.ops.mori, name).default, OPCHECK_CASES[name](tcp.h, tcp.local, "cuda"))
    torch.cuda.synchronize()
    ops.check_errors(tcp.h)


# ---------------------------------------------------------------------------
# torch.compile(fullgraph=True)


def xgmi_step(h):
    def step(local, out_pages, remote_out, in_pages, remote_in, scale):
        lv = local.view(PAGES, PAGE)
        col = torch.arange(PAGE, device=local.device, dtype=torch.int32)
        lv[out_pages] = ((col * scale + out_pages.to(torch.int32)[:, None]) % 251).to(torch.uint8)
        ops.write_pages(h, local, out_pages, remote_out, PAGE)
        ops.read_pages(h, local, in_pages, remote_in, PAGE)
        return lv[in_pages].to(torch.float32).sum(dim=1) * scale

    return step


def run_xgmi_steps(step, x, n=4):
    x.remote.copy_(rand_pages(6, "cuda"))
    x.local.zero_()
    outs = []
    for i in range(n):
        d = lambda v: torch.tensor(v, device="cuda")  # noqa: E731
        scale = torch.tensor(3 + i, device="cuda")  # a tensor: new values need no recompile or re-record
        out = step(x.local, d([i, i + 8]), d([100 + i, 120 + i]), d([50 + i, 60 + i]), d([100 + i, 7 + i]), scale)
        outs.append(out.clone())  # CUDA-graph outputs are overwritten by the next replay
    torch.cuda.synchronize()
    return torch.stack(outs).cpu(), x.local.cpu(), x.remote.cpu()


def test_compile_fullgraph_xgmi_matches_eager(xgmi):
    torch._dynamo.reset()
    step = xgmi_step(xgmi.h)
    want = run_xgmi_steps(step, xgmi)
    got = run_xgmi_steps(torch.compile(step, fullgraph=True), xgmi)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def tcp_step(h):
    """GPU compute around TCP transfers of pinned host pages: produce on the
    GPU, copy into the local pages, write them out, read others back, consume
    them on the GPU. Block lists are GPU tensors."""

    def step(local, staging, out_pages, remote_out, in_pages, remote_in, scale):
        lv = local.view(PAGES, PAGE)
        col = torch.arange(PAGE, device=staging.device, dtype=torch.int32)
        staging.copy_(((col * scale + 1) % 251).to(torch.uint8).expand(2, PAGE))
        lv[0:2].copy_(staging, non_blocking=True)
        ops.write_pages(h, local, out_pages, remote_out, PAGE)
        ops.read_pages(h, local, in_pages, remote_in, PAGE)
        back = lv[2:4].to(staging.device, non_blocking=True)
        return back.to(torch.float32).sum(dim=1) * scale

    return step


def run_tcp_steps(step, t, n=4, staging=None, scale=lambda i: 3 + i):
    t.remote.copy_(rand_pages(7, "cpu"))
    t.local.zero_()
    if staging is None:
        staging = torch.zeros(2, PAGE, dtype=torch.uint8, device="cuda")
    d = lambda v: torch.tensor(v, device="cuda")  # noqa: E731
    outs = []
    for i in range(n):
        out = step(t.local, staging, d([0, 1]), d([100 + i, 120 + i]), d([2, 3]), d([100 + i, 7 + i]), scale(i))
        outs.append(out.clone())  # CUDA-graph outputs are overwritten by the next replay
    torch.cuda.synchronize()
    return torch.stack(outs).cpu(), t.local.cpu().clone(), t.remote.clone()


def test_compile_fullgraph_tcp_matches_eager(tcp):
    torch._dynamo.reset()
    step = tcp_step(tcp.h)
    want = run_tcp_steps(step, tcp)
    got = run_tcp_steps(torch.compile(step, fullgraph=True), tcp)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


# ---------------------------------------------------------------------------
# CUDA graphs: capture once, replay 100 times with new block tables


def test_cuda_graph_xgmi_replays_with_new_block_tables(xgmi):
    x = xgmi
    x.remote.copy_(rand_pages(8, "cuda"))
    x.local.zero_()
    out_pages = torch.tensor([0, 1], device="cuda")
    remote_out = torch.zeros(2, dtype=torch.int64, device="cuda")
    in_pages = torch.tensor([2, 3], device="cuda")
    remote_in = torch.zeros(2, dtype=torch.int64, device="cuda")
    seed = torch.zeros((), dtype=torch.int32, device="cuda")
    col = torch.arange(PAGE, device="cuda", dtype=torch.int32)
    rows = torch.tensor([[0], [1]], device="cuda", dtype=torch.int32)
    lv = x.local.view(PAGES, PAGE)

    def step():
        lv[0:2] = ((col[None, :] + seed + rows) % 251).to(torch.uint8)
        ops.write_pages(x.h, x.local, out_pages, remote_out, PAGE)
        ops.read_pages(x.h, x.local, in_pages, remote_in, PAGE)
        return lv[2:4].to(torch.int64).sum(dim=1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sums = step()
    for i in range(100):
        ro = [(7 * i) % 120 + 128, (7 * i) % 120 + 128 + 1]
        ri = [ro[0], (13 * i) % 128]  # one page just written, one untouched
        remote_out.copy_(torch.tensor(ro))
        remote_in.copy_(torch.tensor(ri))
        seed.fill_(i)
        g.replay()
        torch.cuda.synchronize()
        want0 = ((torch.arange(PAGE) + i) % 251).to(torch.uint8)
        want1 = ((torch.arange(PAGE) + i + 1) % 251).to(torch.uint8)
        assert torch.equal(pages_of(x.remote, ro[0]), want0), f"replay {i}"
        assert torch.equal(pages_of(x.remote, ro[1]), want1), f"replay {i}"
        assert torch.equal(pages_of(x.local, 2), want0), f"replay {i}"
        assert torch.equal(pages_of(x.local, 3), pages_of(x.remote, ri[1])), f"replay {i}"
        assert int(sums[0]) == int(want0.to(torch.int64).sum()), f"replay {i}"
    ops.check_errors(x.h)


def settled(read):
    """read() once two reads 50 ms apart agree (the progress thread settled)."""
    deadline = time.monotonic() + 5
    last = -1
    while time.monotonic() < deadline:
        now = read()
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


def settled_watched_slots():
    return settled(torch.ops.mori.doorbell_slots_watched)


def test_cuda_graph_tcp_replays_with_new_block_tables(tcp):
    t = tcp
    t.remote.copy_(rand_pages(9, "cpu"))
    t.local.zero_()
    remote_out = torch.zeros(2, dtype=torch.int64, device="cuda")
    remote_in = torch.zeros(2, dtype=torch.int64, device="cuda")
    local_out = torch.tensor([0, 1], device="cuda")
    local_in = torch.tensor([2, 3], device="cuda")
    seed = torch.zeros((), dtype=torch.int32, device="cuda")
    col = torch.arange(PAGE, device="cuda", dtype=torch.int32)
    rows = torch.tensor([[0], [1]], device="cuda", dtype=torch.int32)
    staging = torch.zeros(2, PAGE, dtype=torch.uint8, device="cuda")
    lv = t.local.view(PAGES, PAGE)

    def step():
        staging.copy_(((col[None, :] + seed + rows) % 251).to(torch.uint8))
        lv[0:2].copy_(staging, non_blocking=True)
        ops.write_pages(t.h, t.local, local_out, remote_out, PAGE)
        ops.read_pages(t.h, t.local, local_in, remote_in, PAGE)
        back = lv[2:4].to("cuda", non_blocking=True)
        return back.to(torch.int64).sum(dim=1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    watched = settled_watched_slots()  # the warm-up's one-shot slots are back in the pool
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sums = step()
    assert torch.ops.mori.doorbell_slots_watched() >= watched + 2  # two persistent doorbells
    for i in range(100):
        ro = [(5 * i) % 100 + 100, (5 * i) % 100 + 101]
        ri = [ro[1], (11 * i) % 100]
        remote_out.copy_(torch.tensor(ro))
        remote_in.copy_(torch.tensor(ri))
        seed.fill_(i)
        g.replay()
        torch.cuda.synchronize()
        want0 = ((torch.arange(PAGE) + i) % 251).to(torch.uint8)
        want1 = ((torch.arange(PAGE) + i + 1) % 251).to(torch.uint8)
        assert torch.equal(pages_of(t.remote, ro[0]), want0), f"replay {i}"
        assert torch.equal(pages_of(t.remote, ro[1]), want1), f"replay {i}"
        assert torch.equal(pages_of(t.local, 2), want1), f"replay {i}"
        assert torch.equal(pages_of(t.local, 3), pages_of(t.remote, ri[1])), f"replay {i}"
        assert int(sums[0]) == int(want1.to(torch.int64).sum()), f"replay {i}"
    ops.check_errors(t.h)


def test_capture_while_engine_threads_work(xgmi, tcp):
    """Default (global) capture mode on this thread while XGMI's completion
    thread polls events and TCP threads move data on another thread. Every
    replay must move the right bytes (a page the traffic never touches, from
    a remote page chosen per replay) and report no error."""
    stop = threading.Event()
    errors = []
    xgmi.remote.copy_(rand_pages(10, "cuda"))
    tcp.remote.copy_(rand_pages(11, "cpu"))
    xgmi.sync()

    def traffic():
        # Reads into local pages 0-15 only (remote pages 0-16).
        try:
            while not stop.is_set():
                wait_ok(xgmi.sess.batch_read([0, 8192], [4096, 65536], [4096, 4096], xgmi.sess.allocate_transfer_uid()))
                wait_ok(tcp.sess.read(0, 0, 65536, tcp.sess.allocate_transfer_uid()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    # The engines are in use already (their lanes set up) when capture starts:
    # XGMI's lanes, and with GPU pages the TCP staging buffers of every data
    # connection (a 1 MiB read is striped over all of them). TCP pins those on
    # a connection's first GPU transfer, on a thread that is not yet in
    # relaxed capture mode: done during a global-mode capture, that pinning
    # would invalidate the capture.
    wait_ok(xgmi.sess.batch_read([0, 8192], [4096, 65536], [4096, 4096], xgmi.sess.allocate_transfer_uid()))
    for _ in range(2):
        wait_ok(tcp.sess.read(0, 0, PAGE * PAGES, tcp.sess.allocate_transfer_uid()))
        wait_ok(tcp.sess.read(0, 0, 65536, tcp.sess.allocate_transfer_uid()))
    th = threading.Thread(target=traffic)
    th.start()
    try:
        local_pages = torch.tensor([40], device="cuda")
        remote_pages = torch.zeros(1, dtype=torch.int64, device="cuda")
        for i in range(20):
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    ops.read_pages(xgmi.h, xgmi.local, local_pages, remote_pages, PAGE)
                    ops.read_pages(tcp.h, tcp.local, local_pages, remote_pages, PAGE)
            xgmi.local.view(PAGES, PAGE)[40].zero_()
            tcp.local.view(PAGES, PAGE)[40].zero_()
            remote_pages.fill_(20 + i)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(pages_of(xgmi.local, 40), pages_of(xgmi.remote, 20 + i)), f"capture {i}: XGMI bytes"
            assert torch.equal(pages_of(tcp.local, 40), pages_of(tcp.remote, 20 + i)), f"capture {i}: TCP bytes"
            ops.check_errors(xgmi.h)
            ops.check_errors(tcp.h)
    finally:
        stop.set()
        th.join()
    assert not errors, errors


# ---------------------------------------------------------------------------
# Block lists under capture: a graph reads them at replay, so CPU lists (which
# would be captured once) are refused, naming the argument, before anything
# is enqueued.


def assert_capture_refuses_cpu_lists(h, local):
    gpu = torch.tensor([1], device="cuda")
    cpu = torch.tensor([2])
    sizes = torch.tensor([64], device="cuda")
    cases = [
        ("remote_pages", lambda: ops.read_pages(h, local, gpu, cpu, PAGE)),
        ("local_pages", lambda: ops.write_pages(h, local, cpu, gpu, PAGE)),
        ("sizes", lambda: ops.batch_read(h, local, gpu, gpu, torch.tensor([64]))),
        ("local_offsets", lambda: ops.batch_write(h, local, cpu, gpu, sizes)),
    ]
    keep = torch.zeros(1, device="cuda")
    for name, call in cases:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        raised = None
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                keep.add_(1)  # the graph is not empty
                try:
                    call()
                except ValueError as e:
                    raised = e
        assert raised is not None, f"a CPU {name} was accepted under capture"
        assert "under CUDA graph capture" in str(raised) and f"{name} is a CPU tensor" in str(raised), str(raised)
        del g
    torch.cuda.synchronize()


def test_tcp_capture_refuses_cpu_block_lists(tcp):
    assert_capture_refuses_cpu_lists(tcp.h, tcp.local)
    # Eager, the same CPU lists are fine (staged at the call).
    tcp.remote.copy_(rand_pages(13, "cpu"))
    ops.read_pages(tcp.h, tcp.local, torch.tensor([1], device="cuda"), torch.tensor([2]), PAGE)
    torch.cuda.synchronize()
    assert torch.equal(pages_of(tcp.local, 1), pages_of(tcp.remote, 2))
    ops.check_errors(tcp.h)


def test_xgmi_capture_refuses_cpu_block_lists(xgmi):
    assert_capture_refuses_cpu_lists(xgmi.h, xgmi.local)
    ops.check_errors(xgmi.h)


# ---------------------------------------------------------------------------
# A captured doorbell lives as long as its graph


def test_destroying_a_captured_graph_frees_its_doorbell_slots(tcp):
    """Each captured TCP op holds a doorbell slot that the progress thread
    watches (and that keeps the session) while the graph may replay. A user
    object owned by the graph releases it: once the graph is destroyed the
    slot is no longer watched."""
    t = tcp
    t.remote.copy_(rand_pages(14, "cpu"))
    local_pages = torch.tensor([6], device="cuda")
    remote_pages = torch.tensor([70], device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            ops.read_pages(t.h, t.local, local_pages, remote_pages, PAGE)
            ops.write_pages(t.h, t.local, local_pages, remote_pages + 1, PAGE)
    held = ops.doorbell_slots()
    assert held["captured"] >= 2, held  # both doorbells tied to the live graph
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(pages_of(t.local, 6), pages_of(t.remote, 70))
    assert torch.equal(pages_of(t.remote, 71), pages_of(t.remote, 70))
    ops.check_errors(t.h)
    del g
    gc.collect()
    torch.cuda.synchronize()
    # The graph's user object is released on a driver thread, then the
    # progress thread frees the slots: both asynchronous.
    assert poll(lambda: ops.doorbell_slots()["captured"] <= held["captured"] - 2), ops.doorbell_slots()
    assert poll(lambda: ops.doorbell_slots()["watched"] <= held["watched"] - 2), ops.doorbell_slots()
    # The freed slots serve eager ops (and new captures) again.
    ops.read_pages(t.h, t.local, torch.tensor([7], device="cuda"), torch.tensor([71], device="cuda"), PAGE)
    torch.cuda.synchronize()
    assert torch.equal(pages_of(t.local, 7), pages_of(t.remote, 70))
    ops.check_errors(t.h)


# ---------------------------------------------------------------------------
# torch.compile(mode="reduce-overhead"): really under CUDA graphs


def test_reduce_overhead_runs_under_cuda_graphs(xgmi):
    import torch._inductor.config as inductor_config

    x = xgmi
    torch._dynamo.reset()
    torch._dynamo.mark_static_address(x.local)
    step = xgmi_step(x.h)
    want = run_xgmi_steps(step, x, n=6)
    from torch._dynamo.utils import counters

    counters.clear()
    # A skipped CUDA graph (mutated input, CPU tensor, ...) is an error here.
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        got = run_xgmi_steps(compiled, x, n=6)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert counters["inductor"]["cudagraph_skips"] == 0


def settled_captured_slots():
    return settled(lambda: ops.doorbell_slots()["captured"])


def test_reduce_overhead_tcp_runs_under_cuda_graphs(tcp):
    """TCP doorbells inside inductor's CUDA graphs (GPU pages). Host pages are
    CPU tensors, which inductor keeps out of its CUDA graphs (README, ops
    section); torch.cuda.graph captures them (test above)."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    t = tcp
    if t.kind != "gpu":
        pytest.skip("host pages are CPU tensors: inductor does not CUDA-graph them (README)")
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    staging = torch.zeros(2, PAGE, dtype=torch.uint8, device="cuda")
    torch._dynamo.mark_static_address(t.local)
    torch._dynamo.mark_static_address(staging)
    scale = lambda i: torch.tensor(3 + i, device="cuda")  # noqa: E731  (new values: no recompile)
    step = tcp_step(t.h)
    want = run_tcp_steps(step, t, n=6, staging=staging, scale=scale)
    captured = settled_captured_slots()
    counters.clear()
    # A skipped CUDA graph (mutated input, CPU tensor, ...) is an error here.
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        got = run_tcp_steps(compiled, t, n=6, staging=staging, scale=scale)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert counters["inductor"]["cudagraph_skips"] == 0
    # The doorbells were captured into a graph, not run beside one (graph
    # partitioning would run an op it refuses eagerly, without a skip).
    assert ops.doorbell_slots()["captured"] >= captured + 2
    ops.check_errors(t.h)


# ---------------------------------------------------------------------------
# Spin-kernel fallback (forced), in a fresh process


def test_spin_kernel_fallback():
    env = dict(os.environ, MORI_TORCH_STREAM_FLAGS="spin", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "ops_spin_check.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "spin fallback ok" in out.stdout


# ---------------------------------------------------------------------------
# A stalled peer while the stream waits: the stream is released with an
# error, and a kernel this process never launched before (lazy module
# loading synchronizes with the device) stalls only until then.


def test_stalled_peer_releases_the_stream_and_a_first_kernel_launch_is_bounded():
    import signal

    from conftest import RemoteTarget, make_engine

    target = RemoteTarget(nbytes=PAGE * PAGES, op_timeout_ms=2000)
    eng = make_engine("stall", op_timeout_ms=2000)
    try:
        eng.register_remote_engine(target.engine_desc)
        local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, pin_memory=True)
        sess = eng.create_session(eng.register_torch_tensor(local), target.mem_desc)
        h = ops.session_handle(sess)
        freeze(target.pid)
        try:
            s = torch.cuda.Stream()
            t0 = time.monotonic()
            with torch.cuda.stream(s):
                ops.read_pages(h, local, torch.tensor([0], device="cuda"), torch.tensor([1], device="cuda"), PAGE)
            # A torch kernel never launched in this process, on another stream.
            y = torch.special.bessel_j1(torch.linspace(0, 1, 64, device="cuda"))
            torch.cuda.synchronize()
            waited = time.monotonic() - t0
        finally:
            os.kill(target.pid, signal.SIGCONT)
        assert float(y[-1]) > 0.4
        assert waited < 30, f"the stream stayed blocked {waited:.1f} s"
        with pytest.raises(RuntimeError, match="stream-ordered read from engine .* failed"):
            ops.check_errors(h)
        ops.release_session_handle(h)
    finally:
        eng.shutdown()
        target.close()
