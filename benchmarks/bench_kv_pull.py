"""Per-layer KV pulls inside the forward pass against host-driven pulls
before it (issue 13's figures; needs a GPU).

    python benchmarks/bench_kv_pull.py [--backend xgmi|tcp|both] [--remote-device cuda:1]
                                       [--layers 32] [--pages 32] [--hidden 2048] [--tokens 512]
                                       [--replays 200] [--json PATH]

A step is LAYERS layers; each layer pulls PAGES pages of 16 KiB (vLLM 0.33
per-layer views [blocks, 8 heads, 16 tokens, 2*64] bf16 in one registered
buffer, random remote block ids each step) and runs a matmul stand-in for the
layer's compute ([tokens, hidden] x [hidden, hidden]) that reads the pulled
pages' first bytes, so it depends on them. Cases, all timed by CUDA events /
wall clock over REPLAYS steps (median), in one run:

* ``compute_only``: the 32 matmuls, captured in a CUDA graph (no pulls).
* ``pull_only_graph``: the 32 per-layer ``read_pages``, captured.
* ``stream_ordered_graph``: per layer,
  ``read_pages`` then the matmul, captured once and replayed with new page
  tables (StaticPageTables); on one stream, layer l's pull waits for layer
  l-1's compute.
* ``pulls_ahead_graph`` (mori-torch's connector on GPU caches): the same
  step with ``PullsAhead``: every layer's ``read_pages`` first, round robin
  on ``--lanes`` side streams (layers in flight), each layer's matmul
  waiting only for its own layer's pages (captured once, replayed with new
  tables); ``pulls_ahead_one_lane_graph``: the same on one side stream.
* ``host_before_step``: one ``session.batch_read`` of all layers' pages
  from the host, wait, then the compute graph (host-driven pull before the
  step).
* ``moriio_pattern``: vLLM's MoRIIO connector pattern: one host-side
  ``batch_read`` per layer, then wait for all, then the compute graph.

``overlap`` (``overlap_ahead``) = (pull_only + compute_only - stream_ordered
(pulls_ahead)) / min(pull_only,
compute_only): 1 means the pulls are hidden completely behind compute, 0
means none of them is. Ratios against the host-driven cases are printed
and written to the JSON with the machine.
"""
import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time

import torch

from bench_ops import capture_graph  # benchmarks/ is this script's folder
from mori_torch import ops
from mori_torch.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    TcpBackendConfig,
    XgmiBackendConfig,
)
from mori_torch.paged_kv import KVLayout, PullsAhead, StaticPageTables

HEADS, BS, C2 = 8, 16, 64  # a block of one layer: [8 heads, 16 tokens, 2*32] bf16
PAGE = HEADS * BS * C2 * 2  # 16 KiB


def caches(layers, blocks, device):
    buf = torch.zeros(layers * blocks * PAGE, dtype=torch.uint8, device=device)
    t = buf.view(torch.bfloat16).view(layers, blocks, BS, HEADS, C2)  # LBNHC
    return buf, {f"model.layers.{i}.self_attn.attn": t[i].permute(0, 2, 1, 3) for i in range(layers)}


def median_graph_ms(g, replays, before=None):
    times = []
    for _ in range(replays):
        if before:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _engine(key, backend):
    e = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    e.create_backend(*((BackendType.XGMI, XgmiBackendConfig()) if backend == "xgmi"
                       else (BackendType.TCP, TcpBackendConfig())))
    return e


def remote_bytes(n):
    """The remote caches' content: the same on both sides, so pulls are checked."""
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


def _target(conn, backend, layers, blocks, device):
    """The prefill side, in its own process as in a deployment: holds the
    remote caches (random bytes) and serves the pulls until told to stop."""
    b = _engine(f"bkv-{backend}-target", backend)
    rbuf, _ = caches(layers, blocks, device)
    rbuf.copy_(remote_bytes(rbuf.numel()))
    torch.cuda.synchronize()
    conn.send((b.get_engine_desc().pack(), b.register_torch_tensor(rbuf).pack()))
    conn.recv()
    b.shutdown()


def run(backend, args, record):
    layers, pages = args.layers, args.pages
    blocks = max(4 * pages, 256)
    conn, child_conn = mp.Pipe()
    target = mp.get_context("spawn").Process(target=_target,
                                             args=(child_conn, backend, layers, blocks, args.remote_device))
    target.start()
    edesc, mdesc = conn.recv()
    a = _engine(f"bkv-{backend}-initiator", backend)
    a.register_remote_engine(EngineDesc.unpack(edesc))
    lbuf, local = caches(layers, blocks, "cuda:0")
    # The remote caches' layout, from same-shaped views of a host buffer
    # (byte offsets depend only on shapes and strides).
    shadow, remote = caches(layers, blocks, "cpu")
    shadow.copy_(remote_bytes(shadow.numel()))
    sess = a.create_session(a.register_torch_tensor(lbuf), MemoryDesc.unpack(mdesc))
    h = ops.session_handle(sess)
    ll, rl = KVLayout.from_caches(local, lbuf), KVLayout.from_caches(remote, shadow)
    names = list(local)
    st = StaticPageTables(ll, rl, capacity=pages, device="cuda")
    g = torch.Generator().manual_seed(0)

    def new_tables():
        lids = (torch.randperm(blocks - 1, generator=g)[:pages] + 1).tolist()
        rids = (torch.randperm(blocks - 1, generator=g)[:pages] + 1).tolist()
        st.set(lids, rids)
        return lids, rids

    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.hidden, args.hidden, device="cuda", dtype=torch.bfloat16) / args.hidden ** 0.5
    acc = torch.zeros(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    first = {n: st[n].local[:1] for n in names}

    def compute(name):
        # Depends on the layer's pulled pages: a scalar read from the first one.
        dep = lbuf.view(-1, PAGE)[first[name], :2].view(torch.bfloat16).float().nan_to_num(0.0).clamp(-1, 1)
        acc.copy_(torch.matmul(x + acc * 1e-3, w) + dep.to(torch.bfloat16))

    def compute_only():
        for n in names:
            compute(n)

    def pull_only():
        for n in names:
            ops.read_pages(h, lbuf, st[n].local, st[n].remote, PAGE)

    def stream_ordered():
        for n in names:
            ops.read_pages(h, lbuf, st[n].local, st[n].remote, PAGE)
            compute(n)

    def pulls_ahead_with(lanes):
        ahead = PullsAhead("cuda:0", lanes=lanes)

        def step():
            ahead.start([(h, lbuf, st)], names)
            for n in names:
                ahead.wait(n)
                compute(n)
            ahead.finish()
        return step

    pulls_ahead, pulls_ahead_one_lane = pulls_ahead_with(args.lanes), pulls_ahead_with(1)

    new_tables()
    g_compute = capture_graph(compute_only)
    g_pull = capture_graph(pull_only)
    g_step = capture_graph(stream_ordered)
    g_ahead = capture_graph(pulls_ahead)
    g_ahead1 = capture_graph(pulls_ahead_one_lane)
    t_compute = median_graph_ms(g_compute, args.replays)
    t_pull = median_graph_ms(g_pull, args.replays, before=new_tables)
    t_step = median_graph_ms(g_step, args.replays, before=new_tables)
    t_ahead = median_graph_ms(g_ahead, args.replays, before=new_tables)
    t_ahead1 = median_graph_ms(g_ahead1, args.replays, before=new_tables)
    ops.check_errors(h)
    for graph, what in ((g_step, "stream-ordered"), (g_ahead, "pulls ahead"), (g_ahead1, "pulls ahead, one lane")):
        # One more step, its pulled pages checked against the remote bytes.
        lbuf.zero_()
        lids, rids = new_tables()
        graph.replay()
        torch.cuda.synchronize()
        ops.check_errors(h)
        got = lbuf.cpu()
        for n in names:
            for lo, ro in zip(ll.layers[n].byte_offsets(torch.tensor(lids)).tolist(),
                              rl.layers[n].byte_offsets(torch.tensor(rids)).tolist()):
                if not torch.equal(got[lo:lo + PAGE], shadow[ro:ro + PAGE]):
                    raise SystemExit(f"{backend}, {what}: layer {n} page at {lo} differs from the remote page "
                                     f"at {ro}")

    def host_step(per_layer):
        lids, rids = new_tables()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lo = {n: ll.layers[n].byte_offsets(torch.tensor(lids)) for n in names}
        ro = {n: rl.layers[n].byte_offsets(torch.tensor(rids)) for n in names}
        if per_layer:  # MoRIIO: one batch per layer, then wait for all
            statuses = [sess.batch_read(lo[n], ro[n], torch.full_like(lo[n], PAGE), sess.allocate_transfer_uid())
                        for n in names]
        else:
            lo_all, ro_all = torch.cat([lo[n] for n in names]), torch.cat([ro[n] for n in names])
            statuses = [sess.batch_read(lo_all, ro_all, torch.full_like(lo_all, PAGE), sess.allocate_transfer_uid())]
        for s in statuses:
            s.Wait()
            assert s.Succeeded(), s.Message()
        g_compute.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(5):
        host_step(False), host_step(True)
    t_host = statistics.median(host_step(False) for _ in range(args.replays))
    t_moriio = statistics.median(host_step(True) for _ in range(args.replays))
    overlap = (t_pull + t_compute - t_step) / min(t_pull, t_compute)
    overlap_ahead = (t_pull + t_compute - t_ahead) / min(t_pull, t_compute)
    record(backend=backend, remote_device=args.remote_device, layers=layers, pages_per_layer=pages,
           page_bytes=PAGE, matmul=f"[{args.tokens},{args.hidden}]x[{args.hidden},{args.hidden}] bf16",
           compute_only_ms=round(t_compute, 4), pull_only_graph_ms=round(t_pull, 4),
           stream_ordered_graph_ms=round(t_step, 4), pulls_ahead_graph_ms=round(t_ahead, 4), lanes=args.lanes,
           pulls_ahead_one_lane_graph_ms=round(t_ahead1, 4),
           overlap_ahead=round(overlap_ahead, 3), host_before_step_ms=round(t_host, 4),
           moriio_pattern_ms=round(t_moriio, 4), overlap=round(overlap, 3),
           host_before_over_stream_ordered=round(t_host / t_step, 3),
           moriio_over_stream_ordered=round(t_moriio / t_step, 3))
    torch.cuda.synchronize()
    ops.release_session_handle(h)
    a.shutdown()
    conn.send("stop")
    target.join(60)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["xgmi", "tcp", "both"], default="both")
    ap.add_argument("--remote-device", default="cuda:0")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--lanes", type=int, default=4, help="PullsAhead side streams (layers in flight)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kv_pull.py needs a CUDA/HIP GPU")
    machine = f"{platform.node()} {torch.cuda.get_device_name(0)}"
    records = []

    def record(**r):
        r.update(machine=machine, torch=torch.__version__, flags=ops.stream_flag_mechanism())
        records.append(r)
        print(json.dumps(r), flush=True)

    for backend in (["xgmi", "tcp"] if args.backend == "both" else [args.backend]):
        run(backend, args, record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/bench_kv_pull.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json" and v is not None),
                "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
