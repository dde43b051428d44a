"""Host cost of the engine-level batch (one transfer per memory pair, as
SGLang calls it): the native call that mori_torch.io makes
(_C.engine_batch), from lists of lists and from int64 tensors, against the
TorchScript method path that io took before (lists converted to tensors,
then batch_transfer_tensors), alternated in one process. Host memory,
no GPU needed. By default the remote engine is left unregistered, so every
pair is checked, its lists read and its segments built, and then ends with
an error status before any backend submits: the binding and the engine's
per-pair work are what is timed. --routed registers it and moves the bytes
over TCP (then the TCP submission dominates).

    python benchmarks/bench_engine_batch.py --shape 8x2048 --shape 64x16 --shape 8x1 [--json out.json]
"""
import argparse
import json
import platform
import random
import statistics
import time

import torch

import mori_torch.io as io
from mori_torch._int64s import int64s_each as _int64s_each
from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig

SEG = 4096


def measure(a, ld, rd, pairs, per, routed, path, repeats):
    """Median call time of one batch_write of `pairs` pairs x `per` segments:
    path "lists" (mori_torch.io, native call reading the lists), "tensors"
    (io, the same call taking int64 tensors in place) or "torchscript" (what
    io did before: lists converted to tensors, then the TorchScript method)."""
    n = pairs * per
    perm = random.Random(1).sample(range(2 * n), n)
    lo = [[(p * per + i) * SEG for i in range(per)] for p in range(pairs)]
    ro = [[perm[p * per + i] * SEG for i in range(per)] for p in range(pairs)]
    sz = [[SEG] * per for _ in range(pairs)]
    if path == "tensors":
        lo, ro, sz = ([torch.tensor(x, dtype=torch.int64) for x in v] for v in (lo, ro, sz))

    def torchscript(lds, lo, rds, ro, sz, uids):
        with torch._C.DisableTorchFunction():
            natives = a._e.batch_transfer_tensors(False, [d._d for d in lds], _int64s_each("local_offsets", lo),
                                                  [d._d for d in rds], _int64s_each("remote_offsets", ro),
                                                  _int64s_each("sizes", sz), uids)
        return [io.TransferStatus(s) for s in natives]

    submit = torchscript if path == "torchscript" else a.batch_write
    ts = []
    for _ in range(repeats + 5):
        uids = [a.allocate_transfer_uid() for _ in range(pairs)]
        t0 = time.perf_counter_ns()
        sts = submit([ld] * pairs, lo, [rd] * pairs, ro, sz, uids)
        ts.append(time.perf_counter_ns() - t0)
        for s in sts:
            s.Wait()
            if routed and not s.Succeeded():
                raise SystemExit(f"transfer failed: {s.Message()}")
    return statistics.median(ts[5:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", help="PAIRSxSEGMENTS per pair (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=35)
    ap.add_argument("--routed", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shape or ["8x2048", "64x16", "8x1"])]
    most = max(p * q for p, q in shapes)
    src = torch.zeros(most * SEG, dtype=torch.uint8)
    dst = torch.zeros(2 * most * SEG, dtype=torch.uint8)
    a = IOEngine("bench-eb-a", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("bench-eb-b", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.TCP, TcpBackendConfig())
    if args.routed:
        a.register_remote_engine(b.get_engine_desc())
    ld = a.register_torch_tensor(src)
    rd = MemoryDesc.unpack(b.register_torch_tensor(dst).pack())
    machine = f"{platform.node()}, {torch.get_num_threads()} threads"
    records = []
    for pairs, per in shapes:
        for r in range(args.rounds):
            t = {path: measure(a, ld, rd, pairs, per, args.routed, path, args.repeats)
                 for path in ("lists", "tensors", "torchscript")}
            n = pairs * per
            print(f"{pairs:3} pairs x {per:5}: native call, lists {t['lists'] / 1e3:8.1f} us "
                  f"({t['lists'] / n:7.2f} ns/segment), tensors {t['tensors'] / 1e3:8.1f} us "
                  f"({t['tensors'] / n:7.2f}) | TorchScript path {t['torchscript'] / 1e3:8.1f} us "
                  f"({t['torchscript'] / n:7.2f}) | lists: {(t['torchscript'] - t['lists']) / pairs / 1e3:5.2f} us "
                  "less per pair", flush=True)
            records.append(dict(pairs=pairs, segments_per_pair=per, segment_bytes=SEG, round=r, routed=args.routed,
                                native_call_us=t["lists"] / 1e3, native_call_tensors_us=t["tensors"] / 1e3,
                                torchscript_path_us=t["torchscript"] / 1e3,
                                baseline="the TorchScript method path (lists converted, then "
                                         "batch_transfer_tensors), same process, alternated", machine=machine))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    a.shutdown()
    b.shutdown()


if __name__ == "__main__":
    main()
