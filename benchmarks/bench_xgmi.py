"""GPU-peer (XGMI backend) figures on two GPUs of one node, each against
torch's copy_ between the same two devices measured in the same run.

    python benchmarks/bench_xgmi.py [--json PATH]

Cases: single 64 MiB / 1 GiB read and write; one batch of 16,384 segments of
4/16/64 KiB with permuted remote offsets (nothing merges); a 4 KiB transfer's
latency from submit to Succeeded(); host time per segment to submit a
16,384-segment session batch.
"""
import argparse
import json
import platform
import random
import statistics
import time

import torch

from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, XgmiBackendConfig


def cuda_time(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    machine = f"{platform.node()} {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    a = IOEngine("bench-a", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("bench-b", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.XGMI, XgmiBackendConfig())
    a.register_remote_engine(b.get_engine_desc())
    n = 1 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:1")
    ld = a.register_torch_tensor(src)
    rd = MemoryDesc.unpack(b.register_torch_tensor(dst).pack())
    sess = a.create_session(ld, rd)
    records = []

    def record(op, seg, segs, t, base_t, **extra):
        total = seg * segs
        r = dict(backend="xgmi", op=op, mem="gpu", segment_bytes=seg, segments=segs, gbps=total / t / 1e9,
                 baseline="torch copy_ cuda:0->cuda:1", baseline_gbps=n / base_t / 1e9 if extra.pop("vs_1g", False)
                 else total / base_t / 1e9, machine=machine, **extra)
        r["ratio"] = r["gbps"] / r["baseline_gbps"]
        records.append(r)
        print(f"{op:5} seg {seg:>11} x {segs:>6}: {r['gbps']:8.1f} GB/s  baseline {r['baseline_gbps']:8.1f}"
              f"  ratio {r['ratio']:.3f} {extra}")

    for size in (64 << 20, 1 << 30):
        base = cuda_time(lambda: dst[:size].copy_(src[:size], non_blocking=True), args.iters)
        for op in ("write", "read"):
            def run():
                st = getattr(sess, op)(0, 0, size, 1)
                st.Wait()
            t = cuda_time(run, args.iters)
            record(op, size, 1, t, base)
    base_1g = cuda_time(lambda: dst.copy_(src, non_blocking=True), args.iters)
    for seg in (4 << 10, 16 << 10, 64 << 10):
        count = 16384
        lo = torch.arange(count, dtype=torch.int64) * seg
        ro = torch.tensor(random.Random(seg).sample(range(n // seg), count), dtype=torch.int64) * seg
        sizes = torch.full((count,), seg, dtype=torch.int64)
        for op in ("write", "read"):
            def run():
                getattr(sess, f"batch_{op}")(lo, ro, sizes, 1).Wait()
            t = cuda_time(run, args.iters)
            record(op, seg, count, t, base_1g, vs_1g=True)
    # Submit cost per segment (host time of the batch call only).
    lo = [i * 4096 for i in range(16384)]
    ro = [s * 4096 for s in random.Random(1).sample(range(n // 4096), 16384)]
    sizes = [4096] * 16384
    for form, args3 in (("lists", (lo, ro, sizes)),
                        ("tensors", (torch.tensor(lo), torch.tensor(ro), torch.tensor(sizes)))):
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            st = sess.batch_write(*args3, 1)
            times.append(time.perf_counter() - t0)
            st.Wait()
        per_seg_ns = statistics.median(times) / 16384 * 1e9
        print(f"submit host time per segment (16,384-segment session batch, {form}): {per_seg_ns:.1f} ns")
        records.append(dict(backend="xgmi", op="write", mem="gpu", segment_bytes=4096, segments=16384,
                            metric=f"submit_ns_per_segment_{form}", value=per_seg_ns, machine=machine))
    # 4 KiB latency to Succeeded().
    lat = []
    for _ in range(2000):
        t0 = time.perf_counter()
        st = sess.write(0, 0, 4096, 1)
        while not st.Succeeded():
            pass
        lat.append((time.perf_counter() - t0) * 1e6)
    lat.sort()
    p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
    print(f"4 KiB write latency to Succeeded(): p50 {p50:.1f} us, p99 {p99:.1f} us")
    records.append(dict(backend="xgmi", op="write", mem="gpu", segment_bytes=4096, segments=1, metric="latency",
                        p50_us=p50, p99_us=p99, machine=machine))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    a.shutdown()
    b.shutdown()


if __name__ == "__main__":
    main()
