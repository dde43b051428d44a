"""Main demo: two processes move 256 MiB through the TCP backend.

Process A registers a 256 MiB tensor and publishes its descriptors in a
rendezvous directory (a TCPStore that process B hosts); B connects to A
through it, registers its own tensor, then reads and writes A's memory in batches of
16 KiB pages and in 64 MiB chunks, verifies every byte, and prints GB/s per
phase. Run: python examples/tcp_demo.py [--size-mib 256] [--num-data-conns 8]
"""
import argparse
import multiprocessing as mp
import time

import torch

from mori_torch.io import BackendType, IOEngine, IOEngineConfig, StatusCode, TcpBackendConfig
from mori_torch.rendezvous import TorchStoreDirectory

PAGE = 16 << 10
CHUNK = 64 << 20
PAGES_PER_BATCH = 4096
T0 = time.perf_counter()


def say(msg):
    """A progress line with the seconds since start, so that no phase is silent."""
    print(f"[{time.perf_counter() - T0:5.1f}s] {msg}", flush=True)


def fill(n, seed):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def make_engine(key, conns):
    e = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(num_data_conns=conns))
    return e


def process_a(conn, store_port, nbytes, conns):
    engine = make_engine("demo-A", conns)
    buf = fill(nbytes, seed=1)
    directory = TorchStoreDirectory("tcp-demo", host="127.0.0.1", port=store_port)
    directory.publish(engine, {"buf": engine.register_torch_tensor(buf)})
    while True:
        cmd, seed = conn.recv()
        if cmd == "verify":  # B wrote fill(nbytes, seed) into our buffer
            conn.send(torch.equal(buf, fill(nbytes, seed)))
        elif cmd == "stop":
            directory.close()
            engine.shutdown()
            conn.send("bye")
            return


def check(statuses, engine, what):
    code = engine.wait_all(statuses, 120000)
    if code != StatusCode.SUCCESS:
        bad = next(s for s in statuses if not s.Succeeded())
        raise SystemExit(f"{what} failed: {code.name}: {bad.Message()}")


def timed(label, nbytes, fn):
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    print(f"  {label:<40} {nbytes / dt / 1e9:7.2f} GB/s  ({dt * 1e3:8.1f} ms)", flush=True)


def process_b(conn, directory, nbytes, conns):
    engine = make_engine("demo-B", conns)
    say("waiting for process A to start, fill its buffer and publish it in the directory ...")
    remote = directory.connect(engine, "demo-A", timeout_s=60).memories["buf"]  # waits for A, registers it
    say("connected to A; preparing B's buffer and the expected bytes ...")
    local_buf = torch.zeros(nbytes, dtype=torch.uint8)
    local = engine.register_torch_tensor(local_buf)
    sess = engine.create_session(local, remote)
    expected_a = fill(nbytes, seed=1)
    npages = nbytes // PAGE
    # Pages land in shuffled places, as KV-cache blocks do.
    perm = torch.randperm(npages, generator=torch.Generator().manual_seed(3)).tolist()

    def paged(op):
        batches = []
        for start in range(0, npages, PAGES_PER_BATCH):
            idx = range(start, min(start + PAGES_PER_BATCH, npages))
            local_offs = [perm[i] * PAGE for i in idx]
            remote_offs = [i * PAGE for i in idx]
            batches.append(getattr(sess, f"batch_{op}")(local_offs, remote_offs, [PAGE] * len(idx),
                                                        sess.allocate_transfer_uid()))
        check(batches, engine, f"paged {op}")

    def chunked(op):
        sts = [getattr(sess, op)(off, off, CHUNK, sess.allocate_transfer_uid()) for off in range(0, nbytes, CHUNK)]
        check(sts, engine, f"chunked {op}")

    say(f"moving {nbytes >> 20} MiB between the two processes over TCP ({conns} data connections), "
        "verifying after each phase:")
    # Read phases: A's pattern into B.
    timed(f"read  {npages} x 16 KiB pages", nbytes, lambda: paged("read"))
    unpermuted = local_buf.view(npages, PAGE)[torch.tensor(perm)].reshape(-1)
    assert torch.equal(unpermuted, expected_a), "paged read: data mismatch"
    local_buf.zero_()
    timed(f"read  {nbytes // CHUNK} x 64 MiB chunks", nbytes, lambda: chunked("read"))
    assert torch.equal(local_buf, expected_a), "chunked read: data mismatch"
    # Write phases: B's patterns into A, verified by A itself.
    local_buf.copy_(fill(nbytes, seed=7).view(npages, PAGE)[torch.argsort(torch.tensor(perm))].reshape(-1))
    timed(f"write {npages} x 16 KiB pages", nbytes, lambda: paged("write"))
    conn.send(("verify", 7))
    assert conn.recv(), "paged write: data mismatch in A"
    local_buf.copy_(fill(nbytes, seed=9))
    timed(f"write {nbytes // CHUNK} x 64 MiB chunks", nbytes, lambda: chunked("write"))
    conn.send(("verify", 9))
    assert conn.recv(), "chunked write: data mismatch in A"
    say("stopping both engines ...")
    conn.send(("stop", 0))
    conn.recv()
    engine.shutdown()
    say("demo: all bytes verified in every phase")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--num-data-conns", type=int, default=8)
    args = ap.parse_args()
    nbytes = args.size_mib << 20
    if nbytes % CHUNK:
        ap.error("--size-mib must be a multiple of 64")
    ctx = mp.get_context("spawn")
    a_end, b_end = ctx.Pipe()  # commands only; descriptors go through the directory
    directory = TorchStoreDirectory("tcp-demo", host="127.0.0.1", port=0, is_server=True)
    say(f"starting process A (a fresh Python: imports torch and mori_torch, fills {args.size_mib} MiB) ...")
    a = ctx.Process(target=process_a, args=(a_end, directory.port, nbytes, args.num_data_conns))
    a.start()
    try:
        process_b(b_end, directory, nbytes, args.num_data_conns)
    finally:
        directory.close()
        a.join(30)
        if a.is_alive():
            a.kill()
    if a.exitcode != 0:
        raise SystemExit(f"process A exited with {a.exitcode}")


if __name__ == "__main__":
    main()
