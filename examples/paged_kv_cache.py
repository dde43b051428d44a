"""Paged KV cache pulled inside a compiled, CUDA-graph-captured model step.

Two processes. The prefill process owns a paged KV cache on a GPU (cuda:1
when the machine has two GPUs, else cuda:0; page p holds a pattern derived
from p) and publishes its descriptors in a rendezvous directory (a TCPStore
the decode process hosts). The decode process (cuda:0) keeps its
own paged cache; every iteration a block table (a GPU int64 tensor) names
which of the prefill's pages to pull into which local pages. The pages move
by GPU peer copies (--backend xgmi: a copy kernel on the stream) or over TCP
(--backend tcp: a doorbell on the stream; a kernel on the stream unpacks the
pages from the doorbell slot's pinned staging, so the engine's threads make
no CUDA call while the stream waits).
The model-like step, compiled with torch.compile(mode="reduce-overhead",
fullgraph=True) so it runs as a CUDA graph, does

    pull the listed pages (torch.ops.mori.read_pages)
    -> "attention": scores of a query against the pulled pages, softmax,
       weighted sum

and the decode process checks, for every iteration, that the pulled pages
hold the prefill's bytes and that the output matches an eager reference on
those bytes.

    python examples/paged_kv_cache.py [--iters 50] [--pages 512] [--page-kib 16]
                                      [--pages-per-step 64] [--backend xgmi|tcp]
"""
import argparse
import multiprocessing as mp
import sys
import time

import torch

import mori_torch
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
from mori_torch.rendezvous import LookupTimeout, TorchStoreDirectory

HEAD_DIM = 128  # bf16 elements per row; a page holds page_bytes / (2 * HEAD_DIM) rows


def page_pattern(num_pages, page_bytes, device):
    """Page p of the prefill cache: bf16 values depending on p and position,
    computed on the CPU so that both processes get the same bits whatever
    their GPU."""
    rows = page_bytes // (2 * HEAD_DIM)
    p = torch.arange(num_pages, dtype=torch.float32)[:, None, None]
    r = torch.arange(rows, dtype=torch.float32)[None, :, None]
    c = torch.arange(HEAD_DIM, dtype=torch.float32)[None, None, :]
    return (torch.sin(p * 0.37 + r * 0.11 + c * 0.013)).to(torch.bfloat16).to(device)


def attend(pages, query):
    """The "attention" of the step: scores of `query` against every row of the
    pulled pages, softmax, weighted sum."""
    keys = pages.reshape(-1, HEAD_DIM).float()
    weights = torch.softmax((keys @ query[:, None])[:, 0], dim=0)
    return (weights[:, None] * keys).sum(dim=0)


def describe_mismatch(got, want, expected_pages, local_blocks, remote_blocks, repull):
    """Which pulled pages are wrong and what they hold instead (all zeros: never
    written; another prefill page: a wrong index; bytes found elsewhere in the
    prefill cache: an offset; else foreign bytes), and whether pulling them
    again with a plain session read (`repull`, off the stream) gets them right."""
    bad = [i for i in range(got.shape[0]) if not torch.equal(got[i], want[i])]
    flat = expected_pages.reshape(expected_pages.shape[0], -1)
    cache = expected_pages.view(torch.uint8).cpu().numpy().tobytes()
    page_bytes = flat.shape[1] * flat.element_size()
    notes = []
    for i in bad[:4]:
        page = got[i].reshape(-1)
        same = (flat == page).all(dim=1).nonzero().flatten().tolist()
        wrong_rows = (got[i] != want[i]).any(dim=1).nonzero().flatten().tolist()
        if not page.any():
            what = "zeros"
        elif same:
            what = f"prefill page {same[0]}"
        else:
            head = got[i].reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
            at = cache.find(head)
            what = (f"bytes of the prefill cache from byte {at} (page {at // page_bytes} + {at % page_bytes})"
                    if at >= 0 else "bytes found nowhere in the prefill cache")
        notes.append(f"local page {int(local_blocks[i])} (remote {int(remote_blocks[i])}): {what}, "
                     f"rows {wrong_rows[0]}..{wrong_rows[-1]} of {got.shape[1]} wrong")
    again = repull([int(local_blocks[i]) for i in bad], [int(remote_blocks[i]) for i in bad])
    right = sum(torch.equal(a, want[i]) for a, i in zip(again, bad))
    return (f"{len(bad)} of {got.shape[0]} pages; " + "; ".join(notes) +
            f"; pulled again by a session read, {right} of {len(bad)} are right")


def make_engine(key, backend):
    engine = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    if backend == "xgmi":
        engine.create_backend(BackendType.XGMI, XgmiBackendConfig())
    else:
        engine.create_backend(BackendType.TCP, TcpBackendConfig())
    return engine


def prefill_device():
    """The peer's GPU: a second GPU when there is one (transfers cross GPUs)."""
    return 1 if torch.cuda.device_count() > 1 else 0


def prefill(conn, store_port, num_pages, page_bytes, backend):
    torch.cuda.set_device(prefill_device())
    engine = make_engine("kv-prefill", backend)
    cache = page_pattern(num_pages, page_bytes, "cuda").view(torch.uint8).reshape(-1).contiguous()
    desc = engine.register_torch_tensor(cache)
    torch.cuda.synchronize()
    directory = TorchStoreDirectory("paged-kv", host="127.0.0.1", port=store_port)
    directory.publish(engine, {"cache": desc})
    conn.recv()  # "done"
    directory.close()
    engine.shutdown()
    # Nothing may have written the cache: only reads came.
    want = page_pattern(num_pages, page_bytes, "cuda").view(torch.uint8).reshape(-1)
    changed = (cache != want).view(num_pages, -1).any(dim=1).nonzero().flatten().tolist()
    conn.send(changed)


def decode(remote_engine, remote_mem, num_pages, page_bytes, pages_per_step, iters, backend):
    torch.cuda.set_device(0)
    engine = make_engine("kv-decode", backend)
    engine.register_remote_engine(EngineDesc.unpack(remote_engine))
    rows = page_bytes // (2 * HEAD_DIM)
    kv = torch.zeros(num_pages * page_bytes, dtype=torch.uint8, device="cuda")
    sess = engine.create_session(engine.register_torch_tensor(kv), MemoryDesc.unpack(remote_mem))
    if sess is None:
        raise SystemExit(f"no {backend} session between cuda:0 and the prefill's cuda:{prefill_device()}")
    h = ops.session_handle(sess)

    def repull(local_pages, remote_pages):
        # The same pages again through a plain session read (no stream, no graph).
        offsets = [b * page_bytes for b in local_pages]
        wait = sess.batch_read(offsets, [b * page_bytes for b in remote_pages], [page_bytes] * len(offsets),
                               sess.allocate_transfer_uid())
        wait.Wait()
        pages = kv.view(torch.bfloat16).view(num_pages, rows, HEAD_DIM)
        return [pages[b] for b in local_pages]
    torch._dynamo.mark_static_address(kv)

    def step(kv, local_blocks, remote_blocks, query):
        ops.read_pages(h, kv, local_blocks, remote_blocks, page_bytes)
        pages = kv.view(torch.bfloat16).view(num_pages, rows, HEAD_DIM)[local_blocks]
        return attend(pages, query)

    import torch._inductor.config as inductor_config

    inductor_config.triton.cudagraph_or_error = True  # a silently skipped CUDA graph is an error
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    expected_pages = page_pattern(num_pages, page_bytes, "cuda")
    gen = torch.Generator().manual_seed(0)
    t_total = 0.0
    for it in range(iters):
        remote_blocks = torch.randperm(num_pages, generator=gen)[:pages_per_step].cuda()
        local_blocks = torch.randperm(num_pages, generator=gen)[:pages_per_step].cuda()
        query = torch.randn(HEAD_DIM, generator=gen).cuda()
        torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        out = compiled(kv, local_blocks, remote_blocks, query).clone()
        torch.cuda.synchronize()
        t_total += time.perf_counter() - t0 if it >= 3 else 0.0
        ops.check_errors(h)  # a failed pull leaves its pages as they were: raise its error, not "differ"
        got = kv.view(torch.bfloat16).view(num_pages, rows, HEAD_DIM)[local_blocks]
        want = expected_pages[remote_blocks]
        if not torch.equal(got, want):
            raise SystemExit(f"iteration {it}: pulled pages differ from the prefill's: "
                             f"{describe_mismatch(got, want, expected_pages, local_blocks, remote_blocks, repull)}")
        ref = attend(want, query)
        if not torch.allclose(out, ref, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"iteration {it}: output differs from the eager reference")
    ops.check_errors(h)
    ops.release_session_handle(h)
    engine.shutdown()
    steps = max(1, iters - 3)
    moved = pages_per_step * page_bytes
    print(f"{iters} steps verified ({backend}, cuda:{prefill_device()} -> cuda:0): {pages_per_step} pages of "
          f"{page_bytes} B pulled per step inside a CUDA graph; "
          f"{t_total / steps * 1e6:.1f} us per step ({moved / (t_total / steps) / 1e9:.2f} GB/s incl. compute)")
    print("paged KV cache example: all pages and outputs verified")


def missing_hardware():
    """Why this machine cannot run the example, or None."""
    if not mori_torch._C.WITH_GPU:
        return "mori_torch was built without GPU support (no CUDA toolkit at build time; see README \"Set up\")"
    if not torch.cuda.is_available():
        return "no CUDA/ROCm GPU is visible to torch (torch.cuda.is_available() is False)"
    return None


def wait_for_prefill(directory, proc, timeout_s=300):
    """The prefill's directory entry; raises SystemExit if the prefill process
    dies first (its traceback is on stderr) instead of waiting it out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return directory.lookup("kv-prefill", timeout_s=1)
        except LookupTimeout as e:
            if not proc.is_alive():
                raise SystemExit(f"the prefill process exited (code {proc.exitcode})"
                                 " before publishing its cache") from e
            if time.monotonic() >= deadline:
                raise


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--pages-per-step", type=int, default=64)
    ap.add_argument("--backend", choices=["xgmi", "tcp"], default="xgmi",
                    help="xgmi: GPU peer copies (a copy kernel on the stream); tcp: TCP with GPU pages "
                         "(a doorbell on the stream, pages unpacked on the stream from pinned staging)")
    args = ap.parse_args()
    why = missing_hardware()
    if why:
        raise SystemExit(f"paged_kv_cache.py needs a GPU: {why}")
    page_bytes = args.page_kib << 10
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # The processes meet in a rendezvous directory on a TCPStore this one hosts.
    directory = TorchStoreDirectory("paged-kv", host="127.0.0.1", port=0, is_server=True)
    proc = ctx.Process(target=prefill, args=(child, directory.port, args.pages, page_bytes, args.backend),
                       daemon=True)
    proc.start()
    child.close()  # so that recv() below sees the prefill's end close if it dies
    try:
        entry = wait_for_prefill(directory, proc)
        remote_engine, remote_mem = entry.engine_desc.pack(), entry.memories["cache"].pack()
        decode(remote_engine, remote_mem, args.pages, page_bytes, args.pages_per_step, args.iters, args.backend)
    finally:
        changed = []
        try:
            parent.send("done")
            changed = parent.recv() if parent.poll(30) else []
            if changed:
                print(f"the prefill's cache changed under the pulls: pages {changed[:16]}", file=sys.stderr)
        except (BrokenPipeError, EOFError):
            pass  # the prefill already exited
        proc.join(30)
        directory.close()
    if changed:
        raise SystemExit("the prefill's cache changed although it was only read")


if __name__ == "__main__":
    main()
