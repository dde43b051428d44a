"""Soak: several initiator processes against one target process over TCP, with
mixed verified reads and writes (single, batched, through sessions and not),
reporting lost, corrupt and hung transfers (all must be zero).

  lost     a transfer that ended with an error (with kill_every_s, the target's
           connections are killed with `ss -K` meanwhile: retries must
           hide every kill, so lost stays 0)
  corrupt  a transfer that succeeded but whose bytes are wrong
  hung     a transfer not ended within --hang-ms (or a process that never reported)

Each initiator owns a region of the target's buffer: it writes random bytes
there and reads them back, and reads a reference region the target filled
with a known pattern. The short form runs in CI (tests/python/test_soak.py);
the long form is scripts/soak.sh.

    python tests/python/soak.py --initiators 4 --seconds 60
"""
import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mori_torch.io import (  # noqa: E402
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    StatusCode,
    TcpBackendConfig,
)

REF_SEED = 12345


def _pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _target(conn, region: int, initiators: int, tcp: dict):
    e = IOEngine(f"soak-target-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(**tcp))
    # [reference region][one region per initiator]
    buf = torch.zeros(region * (initiators + 1), dtype=torch.uint8)
    buf[:region] = _pattern(region, REF_SEED)
    d = e.register_torch_tensor(buf)
    conn.send((e.get_engine_desc().pack(), d.pack()))
    conn.recv()  # until the initiators are done
    e.shutdown()


def _initiator(idx: int, target_desc: bytes, mem_desc: bytes, region: int, seconds: float, hang_ms: int, seed: int,
               tcp: dict, out):
    try:
        _initiate(idx, target_desc, mem_desc, region, seconds, hang_ms, seed, tcp, out)
    except Exception as ex:  # an API call raised: counted as lost, with the reason, not as a silent hang
        out.put((idx, {"ops": 0, "bytes": 0, "lost": 1, "corrupt": 0, "hung": 0,
                       "errors": [f"initiator {idx} raised {type(ex).__name__}: {ex}"]}))


def _initiate(idx: int, target_desc: bytes, mem_desc: bytes, region: int, seconds: float, hang_ms: int, seed: int,
              tcp: dict, out):
    rng = random.Random(seed * 1000 + idx)
    e = IOEngine(f"soak-init-{idx}-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig(**tcp))
    td = EngineDesc.unpack(target_desc)
    rd = MemoryDesc.unpack(mem_desc)
    e.register_remote_engine(td)
    src = torch.zeros(region, dtype=torch.uint8)
    dst = torch.zeros(region, dtype=torch.uint8)
    sd, dd = e.register_torch_tensor(src), e.register_torch_tensor(dst)
    sess_w, sess_r = e.create_session(sd, rd), e.create_session(dd, rd)
    ref = _pattern(region, REF_SEED)
    mine = region * (idx + 1)  # offset of this initiator's region in the target
    counts = {"ops": 0, "bytes": 0, "lost": 0, "corrupt": 0, "hung": 0, "errors": []}

    def finish(st) -> bool:
        code = st.WaitFor(hang_ms)
        if code == StatusCode.SUCCESS:
            return True
        if code in (StatusCode.INIT, StatusCode.IN_PROGRESS):
            counts["hung"] += 1
        else:
            counts["lost"] += 1
            if len(counts["errors"]) < 5:
                counts["errors"].append(f"{StatusCode(code).name}: {st.Message()}")
        return False

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        kind = rng.randrange(4)
        if kind == 3:
            # A batch of pages of the reference region, read into place.
            n = rng.randint(1, 64)
            page = 4096
            offs = rng.sample(range(region // page), n)
            dst.zero_()
            st = sess_r.batch_read([o * page for o in offs], [o * page for o in offs], [page] * n,
                                   sess_r.allocate_transfer_uid())
            if finish(st):
                counts["ops"] += 1
                counts["bytes"] += n * page
                for o in offs:
                    if not torch.equal(dst[o * page:(o + 1) * page], ref[o * page:(o + 1) * page]):
                        counts["corrupt"] += 1
                        break
            continue
        size = rng.choice([64, 4096, 65536, 1 << 20, region])
        off = rng.randrange(0, region - size + 1)
        src[off:off + size] = torch.randint(0, 256, (size,), dtype=torch.uint8)
        if kind == 0:
            w = e.write(sd, off, rd, mine + off, size, e.allocate_transfer_uid())
        else:
            w = sess_w.write(off, mine + off, size, sess_w.allocate_transfer_uid())
        if not finish(w):
            continue
        dst.zero_()
        if kind == 2:
            r = e.batch_read([dd], [[off]], [rd], [[mine + off]], [[size]], [e.allocate_transfer_uid()])[0]
        else:
            r = sess_r.read(off, mine + off, size, sess_r.allocate_transfer_uid())
        if finish(r):
            counts["ops"] += 2
            counts["bytes"] += 2 * size
            if not torch.equal(dst[off:off + size], src[off:off + size]):
                counts["corrupt"] += 1
    e.shutdown()
    out.put((idx, counts))


def run(initiators: int = 4, seconds: float = 10.0, region: int = 4 << 20, hang_ms: int = 30000, seed: int = 1,
        tcp: dict = None, kill_every_s: float = 0.0) -> dict:
    tcp = dict(tcp or {})
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(child, region, initiators, tcp))
    target.start()
    target_desc, mem_desc = parent.recv()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_initiator,
                    args=(i, target_desc, mem_desc, region, seconds, hang_ms, seed, tcp, out))
        for i in range(initiators)
    ]
    for p in procs:
        p.start()
    total = {"initiators": initiators, "seconds": seconds, "ops": 0, "bytes": 0, "lost": 0, "corrupt": 0,
             "hung": 0, "errors": [], "kills": 0}
    killer = None
    if kill_every_s > 0:
        import socket_kill
        killer = socket_kill.Killer(EngineDesc.unpack(target_desc).port, kill_every_s, seed).__enter__()
    reported = 0
    wait_until = time.monotonic() + seconds + hang_ms / 1000 * 4 + 60
    while reported < initiators and time.monotonic() < wait_until:
        try:
            _, c = out.get(timeout=1)
        except Exception:  # queue.Empty
            continue
        reported += 1
        for k in ("ops", "bytes", "lost", "corrupt", "hung"):
            total[k] += c[k]
        total["errors"] += c["errors"]
    if killer:
        killer.__exit__(None, None, None)
        total["kills"] = killer.kills
    total["hung"] += initiators - reported  # a process that never reported hung
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    parent.send("done")
    target.join(timeout=20)
    if target.is_alive():
        target.kill()
        total["hung"] += 1
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--initiators", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--region-bytes", type=int, default=4 << 20)
    ap.add_argument("--hang-ms", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--num-data-conns", type=int, default=8)
    ap.add_argument("--kill-every-s", type=float, default=0.0,
                    help="kill the target's TCP connections (ss -K, needs root) this often")
    args = ap.parse_args(argv)
    r = run(args.initiators, args.seconds, args.region_bytes, args.hang_ms, args.seed,
            {"num_data_conns": args.num_data_conns}, args.kill_every_s)
    print(json.dumps(r))
    return 0 if r["ops"] > 0 and r["lost"] == r["corrupt"] == r["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
