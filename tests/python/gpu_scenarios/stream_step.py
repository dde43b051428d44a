"""Model steps that pull KV pages over a host-driven backend (TCP) with
torch.ops.mori, in a fresh process: the first kernel that uses the pulled
pages is launched while the read is still pending, as in a real step.

    python stream_step.py SCENARIO

Prefill processes (spawned) own GPU page caches on the same GPU (cuda:1 when
there are two) and serve them; this process is the decode side. Exit code 0
and a last line "OK ..." when every byte and output was checked. Run by
tests/python/test_stream_across_nodes.py under a timeout, so a hang fails.
"""
import multiprocessing as mp
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from mori_torch import ops  # noqa: E402
from mori_torch.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig  # noqa: E402

PAGE = 16384
PAGES = 256
PER_STEP = 32
OP_TIMEOUT_MS = 3000


def pattern(seed):
    """Page p of prefill `seed`: bytes that differ per page and per prefill."""
    p = torch.arange(PAGES, dtype=torch.int64)[:, None]
    k = torch.arange(PAGE, dtype=torch.int64)[None, :]
    return ((p * 131 + k * 7 + seed * 17) % 251).to(torch.uint8)


def prefill(conn, seed):
    torch.cuda.set_device(1 if torch.cuda.device_count() > 1 else 0)
    eng = IOEngine(f"prefill-{seed}-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
    eng.create_backend(BackendType.TCP, TcpBackendConfig(op_timeout_ms=OP_TIMEOUT_MS))
    cache = pattern(seed).reshape(-1).cuda()
    md = eng.register_torch_tensor(cache)
    torch.cuda.synchronize()
    conn.send((eng.get_engine_desc().pack(), md.pack()))
    while True:
        cmd = conn.recv()
        if cmd == "dereg":
            eng.deregister_memory(md)
            conn.send(True)
        elif cmd == "get":
            torch.cuda.synchronize()
            conn.send(bytes(cache.cpu().numpy()))
        elif cmd == "exit":
            eng.shutdown()
            conn.send(True)
            return


class Peer:
    def __init__(self, seed):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill, args=(child, seed), daemon=True)
        self.proc.start()
        eb, mb = self.conn.recv()
        self.engine_desc, self.mem_desc = EngineDesc.unpack(eb), MemoryDesc.unpack(mb)
        self.expected = pattern(seed).cuda()

    def call(self, cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self):
        if self.proc.is_alive():
            self.call("exit")
        self.proc.join(10)


class Decode:
    def __init__(self, npeers=1):
        self.peers = [Peer(s) for s in range(npeers)]
        self.eng = IOEngine(f"decode-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
        self.eng.create_backend(BackendType.TCP, TcpBackendConfig(op_timeout_ms=OP_TIMEOUT_MS))
        self.kv = torch.zeros(PAGES * PAGE, dtype=torch.uint8, device="cuda")
        local = self.eng.register_torch_tensor(self.kv)
        self.handles = []
        for p in self.peers:
            self.eng.register_remote_engine(p.engine_desc)
            sess = self.eng.create_session(local, p.mem_desc)
            assert sess is not None and sess.backend_type == BackendType.TCP
            self.handles.append(ops.session_handle(sess))
        self.gen = torch.Generator().manual_seed(1)

    def pages(self):
        return self.kv.view(PAGES, PAGE)

    def blocks(self, n=PER_STEP):
        lp = torch.randperm(PAGES, generator=self.gen)[:n]
        rp = torch.randperm(PAGES, generator=self.gen)[:n]
        return lp, rp

    def check(self, lp, rp, peer=0, what=""):
        got = self.pages()[lp.to(self.kv.device)]
        want = self.peers[peer].expected[rp.to(self.kv.device)]
        if not torch.equal(got, want):
            raise SystemExit(f"FAIL {what}: pulled pages differ from prefill {peer}'s")

    def close(self):
        torch.cuda.synchronize()
        for h in self.handles:
            ops.check_errors(h)
            ops.release_session_handle(h)
        self.eng.shutdown()
        for p in self.peers:
            p.close()


def use_pages(kv, lp):
    """A kernel over the pulled pages (never launched before in this process)."""
    return kv.view(PAGES, PAGE)[lp].to(torch.int64).sum(1)


def eager(stream_kind):
    d = Decode()
    h = d.handles[0]
    side = torch.cuda.Stream() if stream_kind == "side" else torch.cuda.current_stream()
    busy = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    for it in range(20):
        lp, rp = d.blocks()
        lpg, rpg = lp.cuda(), rp.cuda()
        with torch.cuda.stream(busy):  # other GPU work, on another stream, meanwhile
            junk = a @ a
        with torch.cuda.stream(side):
            x = a @ a  # work before the read
            ops.read_pages(h, d.kv, lpg, rpg, PAGE)
            sums = use_pages(d.kv, lpg)  # first use right behind the pending read
            y = x.sum()
        torch.cuda.synchronize()
        d.check(lp, rp, what=f"eager read {it}")
        want = d.peers[0].expected[rpg].to(torch.int64).sum(1)
        if not torch.equal(sums, want):
            raise SystemExit(f"FAIL eager {it}: the kernel after the read saw other bytes")
        del junk, y
    # Writes: local pages out, then read back into other pages, no sync between.
    for it in range(5):
        lp, rp = d.blocks(8)
        src = torch.randint(0, 256, (8, PAGE), dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            d.pages()[lp[:4].cuda()] = src[:4]
            ops.write_pages(h, d.kv, lp[:4].cuda(), rp[:4].cuda(), PAGE)
            ops.read_pages(h, d.kv, lp[4:].cuda(), rp[:4].cuda(), PAGE)
            back = d.pages()[lp[4:].cuda()].clone()
        torch.cuda.synchronize()
        if not torch.equal(back, src[:4]):
            raise SystemExit(f"FAIL eager write {it}: read-back differs")
    d.close()
    return f"{stream_kind} stream: 20 reads + 5 write/read-backs checked"


def make_step(d, hs):
    n = len(hs)

    def step(kv, lps, rps, w):
        x = torch.tanh(w @ w)  # compute before the pulls
        for i in range(n):
            ops.read_pages(hs[i], kv, lps[i], rps[i], PAGE)
        pulled = torch.cat([kv.view(PAGES, PAGE)[lps[i]] for i in range(n)])
        return pulled.to(torch.float32).sum(1) + x.sum()

    return step


def expect(d, lps, rps, w):
    parts = [d.peers[i].expected[rps[i]] for i in range(len(lps))]
    return torch.cat(parts).to(torch.float32).sum(1) + torch.tanh(w @ w).sum()


def compiled(mode):
    d = Decode()
    torch._dynamo.mark_static_address(d.kv)
    step = make_step(d, d.handles)
    if mode == "reduce-overhead":
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraph_or_error = True
        fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    else:
        fn = torch.compile(step, fullgraph=True)
    w = torch.randn(256, 256, device="cuda")
    for it in range(20):
        lp, rp = d.blocks()
        lps, rps = [lp.cuda()], [rp.cuda()]
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        out = fn(d.kv, lps, rps, w).clone()
        torch.cuda.synchronize()
        d.check(lp, rp, what=f"{mode} step {it}")
        if not torch.allclose(out, expect(d, lps, rps, w), rtol=1e-4, atol=1e-2):
            raise SystemExit(f"FAIL {mode} step {it}: output differs")
    d.close()
    return f"torch.compile({mode}, fullgraph=True): 20 steps checked"


def captured(npeers, replays=100):
    d = Decode(npeers)
    step = make_step(d, d.handles)
    w = torch.randn(256, 256, device="cuda")
    static_l = [torch.zeros(PER_STEP, dtype=torch.int64, device="cuda") for _ in range(npeers)]
    static_r = [torch.zeros(PER_STEP, dtype=torch.int64, device="cuda") for _ in range(npeers)]

    def fill():
        used = torch.randperm(PAGES, generator=d.gen)[:PER_STEP * npeers].view(npeers, PER_STEP)
        for i in range(npeers):
            static_l[i].copy_(used[i])
            static_r[i].copy_(torch.randperm(PAGES, generator=d.gen)[:PER_STEP])

    fill()
    s = torch.cuda.Stream()  # warm-up on a side stream, as every capture needs
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(d.kv, static_l, static_r, w)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(d.kv, static_l, static_r, w)
    busy = torch.cuda.Stream()
    a = torch.randn(1024, 1024, device="cuda")
    for r in range(replays):
        fill()
        with torch.cuda.stream(busy):
            junk = a @ a  # concurrent GPU work on another stream
        g.replay()
        torch.cuda.synchronize()
        for i in range(npeers):
            d.check(static_l[i].cpu(), static_r[i].cpu(), peer=i, what=f"replay {r}")
        if not torch.allclose(out, expect(d, static_l, static_r, w), rtol=1e-4, atol=1e-2):
            raise SystemExit(f"FAIL replay {r}: output differs")
        del junk
    del g
    d.close()
    return f"CUDA graph with {npeers} session(s): {replays} replays with new block tables checked"


def expect_error(h, kind, *needles):
    try:
        ops.check_errors(h)
    except (ValueError, RuntimeError) as e:
        msg = str(e)
        for n in needles:
            if n not in msg:
                raise SystemExit(f"FAIL {kind}: error lacks {n!r}: {msg}") from e
        return msg
    raise SystemExit(f"FAIL {kind}: no error raised")


def errors():
    d = Decode()
    h = d.handles[0]
    peer_key = d.peers[0].engine_desc.key
    # Out-of-range page: the step ends, the error names the page and the peer.
    before = d.kv.clone()
    ops.read_pages(h, d.kv, torch.tensor([3, PAGES + 7], device="cuda"), torch.tensor([1, 2], device="cuda"), PAGE)
    use_pages(d.kv, torch.tensor([3], device="cuda"))
    torch.cuda.synchronize()
    m1 = expect_error(h, "out-of-range page", f"local page {PAGES + 7}", peer_key)
    if not torch.equal(d.kv, before):
        raise SystemExit("FAIL out-of-range: a failed read changed local pages")
    ops.read_pages(h, d.kv, torch.tensor([3], device="cuda"), torch.tensor([PAGES], device="cuda"), PAGE)
    torch.cuda.synchronize()
    m2 = expect_error(h, "out-of-range remote page", peer_key)
    # A captured graph stays alive through the rest (exit with it alive).
    lp, rp = torch.tensor([5], device="cuda"), torch.tensor([9], device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.read_pages(h, d.kv, lp, rp, PAGE)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.read_pages(h, d.kv, lp, rp, PAGE)
    g.replay()
    torch.cuda.synchronize()
    d.check(lp.cpu(), rp.cpu(), what="captured before errors")
    # Remote memory deregistered by its owner.
    d.peers[0].call("dereg")
    ops.read_pages(h, d.kv, lp, rp, PAGE)
    torch.cuda.synchronize()
    m3 = expect_error(h, "deregistered remote", peer_key)
    # Peer killed: released within op_timeout_ms, never hung.
    d.peers[0].proc.kill()
    d.peers[0].proc.join(10)
    t0 = time.monotonic()
    g.replay()
    ops.read_pages(h, d.kv, lp, rp, PAGE)
    use_pages(d.kv, lp)
    torch.cuda.synchronize()
    waited = time.monotonic() - t0
    m4 = expect_error(h, "peer killed", peer_key)
    if waited > OP_TIMEOUT_MS / 1000 * 2 + 5:
        raise SystemExit(f"FAIL peer killed: the stream waited {waited:.1f} s")
    for m in (m1, m2, m3, m4):
        print("  error:", m)
    # Exit with the graph g still alive and its session handle unreleased.
    d.eng.shutdown()
    return f"errors named page and peer; stream released {waited:.2f} s after the peer died"


SCENARIOS = {
    "eager-default": lambda: eager("default"),
    "eager-side": lambda: eager("side"),
    "compiled": lambda: compiled("default"),
    "reduce-overhead": lambda: compiled("reduce-overhead"),
    "graph": lambda: captured(1),
    "graph-two-peers": lambda: captured(2),
    "errors": errors,
}

if __name__ == "__main__":
    print("OK", SCENARIOS[sys.argv[1]](), flush=True)
