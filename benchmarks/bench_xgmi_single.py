"""One large transfer on one GPU, both engines in this process: the
distribution of the call and of call-to-completion times, against torch
copy_ of the same bytes timed call to synchronize, in the same run. Where
the CLI's single 64 MiB case (two processes) loses to copy_, this tells the
waiting (Wait() or polling Succeeded()) and the copy path (copy engines or
the kernel) apart.

    python benchmarks/bench_xgmi_single.py [--mib 64] [--iters 300] [--rounds 5] [--json out.json]

The cases take turns round by round (the host has slow phases).
"""
import argparse
import json
import platform
import statistics
import time

import torch

from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, XgmiBackendConfig

KEEP = []  # an IOEngine shuts down when it is collected


def session(src, dst, tag, **cfg):
    a = IOEngine(f"single-a{tag}", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine(f"single-b{tag}", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.XGMI, XgmiBackendConfig(**cfg))
    a.register_remote_engine(b.get_engine_desc())
    KEEP.extend([a, b])
    return a.create_session(a.register_torch_tensor(src), MemoryDesc.unpack(b.register_torch_tensor(dst).pack()))


def pct(x, q):
    x = sorted(x)
    return x[min(len(x) - 1, int(len(x) * q))]


def summary(name, calls, dones, machine, size):
    r = dict(case=name, bytes=size, call_p50_us=pct(calls, .5), call_p90_us=pct(calls, .9),
             done_p50_us=pct(dones, .5), done_p90_us=pct(dones, .9), done_p99_us=pct(dones, .99),
             done_mean_us=statistics.mean(dones), done_min_us=min(dones), samples=len(dones), machine=machine)
    print(f"{name:38}: call p50 {r['call_p50_us']:6.1f} p90 {r['call_p90_us']:6.1f} | done p50 {r['done_p50_us']:6.1f}"
          f" p90 {r['done_p90_us']:6.1f} p99 {r['done_p99_us']:6.1f} mean {r['done_mean_us']:6.1f}"
          f" min {r['done_min_us']:6.1f} us", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=300, help="timed transfers per case, over all rounds")
    ap.add_argument("--rounds", type=int, default=5, help="the cases take turns, round by round")
    ap.add_argument("--json")
    args = ap.parse_args()
    size = args.mib << 20
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
    machine = f"{platform.node()} {torch.cuda.get_device_name(0)}"
    per_round = max(1, args.iters // args.rounds)
    warm = max(1, per_round // 15)  # untimed, at the start of every round

    def copy_round(calls, dones):
        for i in range(warm + per_round):
            t0 = time.perf_counter()
            dst.copy_(src)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= warm:
                calls.append((t1 - t0) * 1e6)
                dones.append((t2 - t0) * 1e6)

    def engine_round(name, sess, poll, calls, dones):
        for i in range(warm + per_round):
            uid = sess.allocate_transfer_uid()
            t0 = time.perf_counter()
            st = sess.read(0, 0, size, uid)
            t1 = time.perf_counter()
            if poll:
                while not st.Succeeded():
                    if st.Failed():
                        break
            else:
                st.Wait()
            t2 = time.perf_counter()
            if not st.Succeeded():
                raise SystemExit(f"{name}: transfer failed: {st.Message()}")
            if i >= warm:
                calls.append((t1 - t0) * 1e6)
                dones.append((t2 - t0) * 1e6)

    kernel = dict(kernel_min_segments=1, kernel_max_avg_bytes=1 << 40)
    cases = [("copy_ + synchronize (baseline)", None, False),
             ("session read, Wait()", session(src, dst, "w"), False),
             ("session read, polling Succeeded()", session(src, dst, "p"), True),
             ("session read, kernel, Wait()", session(src, dst, "k", **kernel), False)]
    samples = {name: ([], []) for name, _, _ in cases}
    # Round by round, each case in turn: a slow phase of the host (they
    # come and go on the GPU VMs) hits every case alike.
    for _ in range(args.rounds):
        for name, sess, poll in cases:
            if sess is None:
                copy_round(*samples[name])
            else:
                engine_round(name, sess, poll, *samples[name])
    records = []
    base = summary(cases[0][0], *samples[cases[0][0]], machine, size)
    records.append(base)
    for name, _, _ in cases[1:]:
        r = summary(name, *samples[name], machine, size)
        r["ratio_mean"] = base["done_mean_us"] / r["done_mean_us"]
        r["ratio_p50"] = base["done_p50_us"] / r["done_p50_us"]
        r["baseline"] = "copy_ of the same bytes, same device, call to synchronize, same run, rounds alternated"
        records.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    for e in KEEP:
        e.shutdown()


if __name__ == "__main__":
    main()
