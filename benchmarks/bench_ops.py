"""Cost of the stream-ordered torch ops (torch.ops.mori.*) on one GPU.

    python benchmarks/bench_ops.py [--json PATH] [--iters N]

1. Eager host overhead: host time of one op call (enqueue only) against the
   direct engine call moving the same pages (session.batch_read with tensors,
   which returns a status), for XGMI (GPU pages, GPU block table) and for TCP
   with the CPU path (host pages, synchronous: call to completion, against
   session read + Wait).
2. Eager stream-ordered TCP (case eager_stream_host_us / eager_stream_roundtrip_us):
   the op with a GPU block table on a GPU stream (doorbell) against the direct
   engine call; enqueue only (the op returns once the doorbell is on the
   stream; the direct call once the transfer is posted, its status awaited
   outside the timing), and the round trip (op + stream synchronize against
   direct call + Wait).
3. Graph-replay cost: a CUDA graph of NODES transfer nodes (read_pages of
   PAGES_PER_NODE pages from a device block table) against a graph of NODES
   raw copies of the same bytes (one copy_ of a contiguous range each, and a
   gather/scatter kernel pair index_select + index_copy_); GPU time per node
   from CUDA events around the replay. TCP doorbell nodes are measured the
   same way, against the same transfer issued as a direct engine call
   (session.batch_read + Wait) in the same run; a doorbell-only row (backend
   tcp-doorbell: an empty block table, nothing to move) is the doorbell round
   trip alone, and an 8-byte row adds the smallest loopback transfer.
4. TCP with GPU pages (backend tcp-gpu-pages): graph nodes of 1, 32 and 1024
   pages on the staged path (pages packed/unpacked on the stream through the
   slot's pinned staging) against the direct engine call on the same GPU
   memory; the 1024-page row gives the staged path's extra cost per page.
"""
import argparse
import json
import platform
import statistics
import time

import torch

from mori_torch import ops
from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig, XgmiBackendConfig

PAGE = 4096
PAGES = 1024
NODES = 100


def host_us(fn, iters, sync_every=64, drain=None):
    """Median host microseconds per call, syncing between bursts (and calling
    drain(), outside the timing) so the launch queue never fills."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    if drain:
        drain()
    samples = []
    done = 0
    while done < iters:
        n = min(sync_every, iters - done)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
        if drain:
            drain()
        done += n
    return statistics.median(samples)


def capture_graph(fn, warmup=None):
    """A CUDA graph of fn(), captured after one warm-up call (warmup(), or
    fn()) on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (warmup or fn)()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_us_per_node(body, replays):
    """Captures NODES calls of body() in one graph; GPU microseconds per node."""
    g = capture_graph(lambda: [body() for _ in range(NODES)], warmup=body)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / NODES)
    return statistics.median(times)


def engines(backend, cfg):
    a = IOEngine(f"bops-a-{backend.name}", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine(f"bops-b-{backend.name}", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(backend, cfg)
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    return a, b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    machine = f"{platform.node()} {torch.cuda.get_device_name(0)}"
    records = []

    def record(**r):
        r.update(machine=machine, flags=ops.stream_flag_mechanism())
        records.append(r)
        print(json.dumps(r))

    # ---------------------------------------------------------------- XGMI
    a, b = engines(BackendType.XGMI, XgmiBackendConfig())
    local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, device="cuda")
    remote = torch.randint(0, 256, (PAGE * PAGES,), dtype=torch.uint8, device="cuda")
    sess = a.create_session(a.register_torch_tensor(local),
                            MemoryDesc.unpack(b.register_torch_tensor(remote).pack()))
    h = ops.session_handle(sess)
    for pages in (1, 32):
        lp = torch.arange(pages, device="cuda")
        rp = torch.randperm(PAGES, device="cuda")[:pages]
        lo_cpu, ro_cpu = (lp * PAGE).cpu(), (rp * PAGE).cpu()
        sizes_cpu = torch.full((pages,), PAGE, dtype=torch.int64)
        op_us = host_us(lambda: torch.ops.mori.read_pages(h, local, lp, rp, PAGE), args.iters)
        direct_us = host_us(lambda: sess._s.batch_read_tensors(lo_cpu, ro_cpu, sizes_cpu, 0), args.iters)
        record(case="eager_host_us", backend="xgmi", pages=pages, page_bytes=PAGE, op_us=op_us,
               direct_engine_us=direct_us, extra_us=op_us - direct_us,
               baseline="session.batch_read_tensors (host lists, returns a status)")
        # Graph replay: transfer nodes against raw copies of the same bytes.
        n = pages * PAGE
        lv, rv = local.view(PAGES, PAGE), remote.view(PAGES, PAGE)
        t_op = graph_us_per_node(lambda: torch.ops.mori.read_pages(h, local, lp, rp, PAGE), args.replays)
        t_copy = graph_us_per_node(lambda: local[:n].copy_(remote[n:2 * n]), args.replays)
        t_gather = graph_us_per_node(lambda: lv.index_copy_(0, lp, rv.index_select(0, rp)), args.replays)
        record(case="graph_node_us", backend="xgmi", pages=pages, page_bytes=PAGE, op_us=t_op,
               raw_copy_us=t_copy, gather_scatter_us=t_gather, extra_us=t_op - t_copy,
               baseline="copy_ of one contiguous range of the same bytes (memcpy node)")
    torch.cuda.synchronize()
    ops.release_session_handle(h)
    a.shutdown()
    b.shutdown()

    # ----------------------------------------------------------------- TCP
    a, b = engines(BackendType.TCP, TcpBackendConfig())
    local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, pin_memory=True)
    remote = torch.randint(0, 256, (PAGE * PAGES,), dtype=torch.uint8)
    sess = a.create_session(a.register_torch_tensor(local),
                            MemoryDesc.unpack(b.register_torch_tensor(remote).pack()))
    h = ops.session_handle(sess)
    # Doorbell only: a node with an empty block table (nothing to move): the
    # stream writes the doorbell, the progress thread answers it, the stream
    # goes on. (GPU block tables, so the op runs on the stream: with host
    # lists and a host tensor it would be the synchronous CPU path.)
    none = torch.zeros(0, dtype=torch.int64, device="cuda")
    t_bell = graph_us_per_node(lambda: torch.ops.mori.read_pages(h, local, none, none, PAGE), args.replays)
    tiny_src = torch.zeros(8, dtype=torch.uint8, device="cuda")
    t_tiny = graph_us_per_node(lambda: local[:8].copy_(tiny_src, non_blocking=True), args.replays)
    record(case="graph_node_us", backend="tcp-doorbell", pages=0, page_bytes=PAGE, bytes=0, op_us=t_bell,
           raw_copy_us=t_tiny, extra_us=t_bell - t_tiny,
           baseline="copy_ of 8 bytes GPU -> pinned host (memcpy node); the op is the doorbell round trip alone")
    first = torch.zeros(1, dtype=torch.int64, device="cuda")
    t_8 = graph_us_per_node(lambda: torch.ops.mori.read_pages(h, local, first, first, 8), args.replays)
    record(case="graph_node_us", backend="tcp-doorbell-8B", pages=1, page_bytes=8, bytes=8, op_us=t_8,
           raw_copy_us=t_tiny, extra_us=t_8 - t_tiny,
           baseline="copy_ of 8 bytes GPU -> pinned host (memcpy node); the op adds an 8-byte TCP read over loopback")
    for pages in (1, 32):
        lp_cpu = torch.arange(pages)
        rp_cpu = torch.randperm(PAGES)[:pages]
        lo, ro = (lp_cpu * PAGE).tolist(), (rp_cpu * PAGE).tolist()
        sizes = [PAGE] * pages

        def direct():
            sess._s.batch_read(lo, ro, sizes, 0).Wait()

        op_us = host_us(lambda: torch.ops.mori.read_pages(h, local, lp_cpu, rp_cpu, PAGE), args.iters // 4)
        direct_us = host_us(direct, args.iters // 4)
        record(case="eager_host_us", backend="tcp", pages=pages, page_bytes=PAGE, op_us=op_us,
               direct_engine_us=direct_us, extra_us=op_us - direct_us,
               baseline="session.batch_read + Wait (CPU path of the op is synchronous)")
        lp, rp = lp_cpu.cuda(), rp_cpu.cuda()
        # Stream-ordered eager path: GPU block table, doorbell on the stream.
        pending = []

        def direct_posted():
            pending.append(sess._s.batch_read(lo, ro, sizes, 0))

        def drain():
            for st in pending:
                st.Wait()
            pending.clear()

        def op_roundtrip():
            torch.ops.mori.read_pages(h, local, lp, rp, PAGE)
            torch.cuda.current_stream().synchronize()

        op_us = host_us(lambda: torch.ops.mori.read_pages(h, local, lp, rp, PAGE), args.iters // 4)
        direct_us = host_us(direct_posted, args.iters // 4, drain=drain)
        record(case="eager_stream_host_us", backend="tcp", pages=pages, page_bytes=PAGE, op_us=op_us,
               direct_engine_us=direct_us, extra_us=op_us - direct_us,
               baseline="session.batch_read (host lists, returns a status; awaited outside the timing); the op "
                        "enqueues the block-table copies and the doorbell on the current stream")
        op_us = host_us(op_roundtrip, args.iters // 4)
        direct_us = host_us(direct, args.iters // 4)
        record(case="eager_stream_roundtrip_us", backend="tcp", pages=pages, page_bytes=PAGE, op_us=op_us,
               direct_engine_us=direct_us, extra_us=op_us - direct_us,
               baseline="session.batch_read + Wait; the op: enqueue + stream synchronize (doorbell round trip)")
        t_op = graph_us_per_node(lambda: torch.ops.mori.read_pages(h, local, lp, rp, PAGE), args.replays)
        direct_us = host_us(direct, args.iters // 4)
        record(case="graph_node_us", backend="tcp", pages=pages, page_bytes=PAGE, op_us=t_op,
               direct_engine_us=direct_us, ratio=t_op / direct_us, extra_us=t_op - direct_us,
               baseline="the same transfer as a direct engine call: session.batch_read + Wait, measured in this run")
    torch.cuda.synchronize()
    ops.release_session_handle(h)
    a.shutdown()
    b.shutdown()

    # ------------------------------------------------- TCP with GPU pages
    # The staged path: a kernel on the stream packs/unpacks the pages into the
    # slot's pinned staging, the progress thread moves host bytes only.
    a, b = engines(BackendType.TCP, TcpBackendConfig())
    local = torch.zeros(PAGE * PAGES, dtype=torch.uint8, device="cuda")
    remote = torch.randint(0, 256, (PAGE * PAGES,), dtype=torch.uint8)
    sess = a.create_session(a.register_torch_tensor(local),
                            MemoryDesc.unpack(b.register_torch_tensor(remote).pack()))
    h = ops.session_handle(sess)
    for pages in (1, 32, PAGES):
        lp_cpu = torch.randperm(PAGES)[:pages]
        rp_cpu = torch.randperm(PAGES)[:pages]
        lo, ro = (lp_cpu * PAGE).tolist(), (rp_cpu * PAGE).tolist()
        sizes = [PAGE] * pages

        def direct():
            sess._s.batch_read(lo, ro, sizes, 0).Wait()

        lp, rp = lp_cpu.cuda(), rp_cpu.cuda()
        t_op = graph_us_per_node(lambda: torch.ops.mori.read_pages(h, local, lp, rp, PAGE), args.replays)
        direct_us = host_us(direct, args.iters // 8)
        r = dict(case="graph_node_us", backend="tcp-gpu-pages", pages=pages, page_bytes=PAGE, op_us=t_op,
                 direct_engine_us=direct_us, ratio=t_op / direct_us, extra_us=t_op - direct_us,
                 baseline="the same transfer of GPU pages as a direct engine call (session.batch_read + Wait; "
                          "the backend stages through its pinned buffers with CUDA copies), this run")
        if pages == PAGES:
            r["staged_extra_ns_per_page"] = (t_op - direct_us) * 1e3 / pages
        record(**r)
    torch.cuda.synchronize()
    ops.release_session_handle(h)
    a.shutdown()
    b.shutdown()

    print()
    print(f"{'case':26} {'backend':13} {'pages':>5} {'bytes':>7} {'op us':>9} {'baseline us':>12} {'extra us':>9}")
    for r in records:
        base = r.get("direct_engine_us", r.get("raw_copy_us"))
        nbytes = r.get("bytes", r["pages"] * r["page_bytes"])
        print(f"{r['case']:26} {r['backend']:13} {r['pages']:5d} {nbytes:7d} {r['op_us']:9.2f} {base:12.2f} "
              f"{r['extra_us']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
