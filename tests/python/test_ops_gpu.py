"""torch.ops.mori.* on GPU streams: XGMI (copy kernel on the stream) and TCP
(doorbell answered by the progress thread), eager, opcheck, torch.compile,
captured CUDA graphs replayed with new block tables, reduce-overhead, the
spin-kernel fallback, and a capture while engine threads work."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import Pair, unique_key, wait_ok
from mori_torch import ops
from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, XgmiBackendConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")

PAGE = 4096
PAGES = 256
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class XgmiEnv:
    """Two XGMI engines in this process; local and remote pages on cuda:0."""

    def __init__(self):
        self.a = IOEngine(unique_key("oxa"), IOEngineConfig("127.0.0.1", 0))
        self.b = IOEngine(unique_key("oxb"), IOEngineConfig("127.0.0.1", 0))
        for e in (self.a, self.b):
            e.create_backend(BackendType.XGMI, XgmiBackendConfig())
        self.a.register_remote_engine(self.b.get_engine_desc())
        self.local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, device="cuda:0")
        self.remote = torch.zeros(PAGE * PAGES, dtype=torch.uint8, device="cuda:0")
        ld = self.a.register_torch_tensor(self.local)
        rd = MemoryDesc.unpack(self.b.register_torch_tensor(self.remote).pack())
        self.sess = self.a.create_session(ld, rd)
        assert self.sess.backend_type == BackendType.XGMI
        self.h = ops.session_handle(self.sess)

    def close(self):
        torch.cuda.synchronize()
        ops.release_session_handle(self.h)
        self.a.shutdown()
        self.b.shutdown()


class TcpEnv:
    """TCP engines in this process; the local pages are pinned host memory or
    GPU memory (moved by TCP through its staging buffers), the remote pages
    host memory. The doorbell orders both on the GPU stream."""

    def __init__(self, local="host"):
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


@pytest.fixture(scope="module")
def xgmi():
    env = XgmiEnv()
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
    assert torch.equal(x.local[100:3100], x.remote[5000:8000])
    assert torch.equal(x.local[8192:12288], x.remote[0:4096])
    assert torch.equal(x.local[20000:20077], x.remote[40000:40077])
    assert torch.equal(pages_of(x.local, [10, 11]), pages_of(x.remote, [200, 3]))
    x.local.copy_(rand_pages(2, "cuda"))
    ops.write(x.h, x.local, 1, 2, 333)
    ops.batch_write(x.h, x.local, t([0, 4096]), t([50000, 60000]), t([16]))
    ops.write_pages(x.h, x.local, t([7]), t([250]), PAGE)
    torch.cuda.synchronize()
    assert torch.equal(x.remote[2:335], x.local[1:334])
    assert torch.equal(x.remote[50000:50016], x.local[0:16])
    assert torch.equal(x.remote[60000:60016], x.local[4096:4112])
    assert torch.equal(pages_of(x.remote, [250]), pages_of(x.local, [7]))
    ops.check_errors(x.h)


def test_xgmi_orders_with_work_on_the_stream(xgmi):
    """The producer runs late (a long sleep first); the read must still see
    its bytes, and the consumer after the op must see the read's bytes."""
    x = xgmi
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


OPCHECK_CASES = {
    "read": lambda h, t: (h, t, 0, 128, 64),
    "write": lambda h, t: (h, t, 64, 0, 32),
    "batch_read": lambda h, t: (h, t, torch.tensor([0, 512], device=t.device), torch.tensor([1024, 256], device=t.device),
                                torch.tensor([16, 40], device=t.device)),
    "batch_write": lambda h, t: (h, t, torch.tensor([0, 512], device=t.device),
                                 torch.tensor([2048, 4096], device=t.device), torch.tensor([24], device=t.device)),
    "read_pages": lambda h, t: (h, t, torch.tensor([0, 3], device=t.device), torch.tensor([5, 1], device=t.device), PAGE),
    "write_pages": lambda h, t: (h, t, torch.tensor([2, 3], device=t.device), torch.tensor([50, 51], device=t.device),
                                 PAGE),
}


@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck_xgmi(xgmi, name):
    xgmi.remote.copy_(rand_pages(4, "cuda"))
    xgmi.local.copy_(rand_pages(5, "cuda"))
    torch.library.opcheck(getattr(torch.ops.mori, name).default, OPCHECK_CASES[name](xgmi.h, xgmi.local))


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


def run_tcp_steps(step, t, n=4):
    t.remote.copy_(rand_pages(7, "cpu"))
    t.local.zero_()
    staging = torch.zeros(2, PAGE, dtype=torch.uint8, device="cuda")
    d = lambda v: torch.tensor(v, device="cuda")  # noqa: E731
    outs = []
    for i in range(n):
        outs.append(step(t.local, staging, d([0, 1]), d([100 + i, 120 + i]), d([2, 3]), d([100 + i, 7 + i]), 3 + i))
    torch.cuda.synchronize()
    return torch.stack(outs).cpu(), t.local.clone(), t.remote.clone()


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


def settled_watched_slots():
    deadline = time.monotonic() + 5
    last = -1
    while time.monotonic() < deadline:
        now = torch.ops.mori.doorbell_slots_watched()
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


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
    thread polls events and TCP threads move data on another thread."""
    stop = threading.Event()
    errors = []

    def traffic():
        try:
            while not stop.is_set():
                wait_ok(xgmi.sess.batch_read([0, 8192], [4096, 65536], [4096, 4096], xgmi.sess.allocate_transfer_uid()))
                wait_ok(tcp.sess.read(0, 0, 65536, tcp.sess.allocate_transfer_uid()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    # The engines are in use already (their lanes set up) when capture starts.
    wait_ok(xgmi.sess.batch_read([0, 8192], [4096, 65536], [4096, 4096], xgmi.sess.allocate_transfer_uid()))
    th = threading.Thread(target=traffic)
    th.start()
    try:
        pages = torch.tensor([5], device="cuda")
        for _ in range(20):
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    ops.read_pages(xgmi.h, xgmi.local, pages, pages, PAGE)
                    ops.read_pages(tcp.h, tcp.local, pages, pages, PAGE)
            g.replay()
            torch.cuda.synchronize()
    finally:
        stop.set()
        th.join()
    assert not errors, errors


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
        os.kill(target.pid, signal.SIGSTOP)
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
        with pytest.raises(RuntimeError, match="stream-ordered transfer failed"):
            ops.check_errors(h)
        ops.release_session_handle(h)
    finally:
        eng.shutdown()
        target.close()
