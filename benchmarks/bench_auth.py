"""Authentication cost (issue 11), in one run:

1. handshake time: opening a control connection without a secret and with
   one (build/cmake/mori_auth_bench, C++, alternating blocks of 100);
2. TCP throughput with a secret against without: a target process holds two
   engines (one open, one with a secret) and this process two initiators to
   match; transfers alternate between the two pairs one by one (ABBA), so
   that other load on the machine hits both alike. The whole measurement
   runs twice, with fresh processes, creating the open pair first and then
   the secret pair first: an A/A control (--aa) showed the pair created
   second up to a third slower on the 2-core VM with identical configs, so
   creation order is counterbalanced and the samples of both halves pooled.
   Data is verified once per case and pair before timing.

    python benchmarks/bench_auth.py --iters 40 --json docs/results/auth_tcp_cpu.json
"""
import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "benchmark secret"
NBYTES = 64 << 20
MODES = ("open", "secret")
# (name, segment bytes, segments)
CASES = [("1 x 64 MiB", 64 << 20, 1), ("1024 x 16 KiB", 16 << 10, 1024)]


def _secret_of(mode, aa):
    return SECRET if mode == "secret" and not aa else None


def _target(conn, aa, order):
    from mori_torch.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig

    keep, out = [], {}
    for mode in order:
        e = IOEngine(f"auth-bench-target-{mode}-{os.getpid()}",
                     IOEngineConfig("127.0.0.1", 0, secret=_secret_of(mode, aa)))
        e.create_backend(BackendType.TCP, TcpBackendConfig())
        buf = torch.zeros(NBYTES, dtype=torch.uint8)
        md = e.register_torch_tensor(buf)
        keep.append((e, buf))
        out[mode] = (e.get_engine_desc().pack(), md.pack())
    conn.send(out)
    conn.recv()
    for e, _ in keep:
        e.shutdown()


def measure(args, order):
    """Times every case with the pairs created in `order`: (case, op) -> mode -> [ns]."""
    from mori_torch.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, args.aa, order), daemon=True)
    proc.start()
    descs = conn.recv()
    pairs = {}
    for mode in order:
        e = IOEngine(f"auth-bench-init-{mode}-{os.getpid()}",
                     IOEngineConfig("127.0.0.1", 0, secret=_secret_of(mode, args.aa)))
        e.create_backend(BackendType.TCP, TcpBackendConfig())
        e.register_remote_engine(EngineDesc.unpack(descs[mode][0]))
        local = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)
        ld = e.register_torch_tensor(local)
        remote = MemoryDesc.unpack(descs[mode][1])
        pairs[mode] = (e, local, e.create_session(ld, remote))

    out = {}
    try:
        for name, seg, n in CASES:
            offs = [i * seg for i in range(n)]
            for op in ("write", "read"):
                def once(mode):
                    e, _, sess = pairs[mode]
                    uid = sess.allocate_transfer_uid()
                    t0 = time.perf_counter_ns()
                    if n == 1:
                        st = getattr(sess, op)(0, 0, seg, uid)
                    else:
                        st = getattr(sess, "batch_" + op)(offs, offs, [seg] * n, uid)
                    st.Wait()
                    dt = time.perf_counter_ns() - t0
                    assert st.Succeeded(), st.Message()
                    return dt

                for mode in order:  # warm up, and check the bytes arrive
                    once(mode)
                    e, local, sess = pairs[mode]
                    if op == "write":
                        saved = local[: seg * n].clone()
                        local[: seg * n].zero_()
                        sess.read(0, 0, seg * n, sess.allocate_transfer_uid()).Wait()
                        assert torch.equal(local[: seg * n], saved)
                times = {m: [] for m in MODES}
                for i in range(args.iters):
                    for mode in (order if i % 2 == 0 else order[::-1]):
                        times[mode].append(once(mode))
                out[(name, op)] = times
    finally:
        for e, _, _ in pairs.values():
            e.shutdown()
        conn.send("exit")
        proc.join(30)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=40,
                    help="timed transfers per case, op, mode and creation order")
    ap.add_argument("--handshakes", type=int, default=2000)
    ap.add_argument("--auth-bench", default=os.path.join(ROOT, "build/cmake/mori_auth_bench"))
    ap.add_argument("--aa", action="store_true",
                    help="control run: the 'secret' pair has no secret either (measures the noise of the A/B)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    hs = json.loads(subprocess.run([args.auth_bench, str(args.handshakes)], check=True, capture_output=True,
                                   text=True).stdout)
    print(f"handshake: open p50 {hs['open_p50_us']:.0f} us (p99 {hs['open_p99_us']:.0f}), with a secret p50 "
          f"{hs['secret_p50_us']:.0f} us (p99 {hs['secret_p99_us']:.0f})")

    times = {}  # (case, op) -> mode -> [ns]
    by_order = {}  # (case, op) -> {"open first": ratio, "secret first": ratio}
    for order in (MODES, MODES[::-1]):
        for key, per_mode in measure(args, order).items():
            by_order.setdefault(key, {})[f"{order[0]} first"] = (
                statistics.median(per_mode["open"]) / statistics.median(per_mode["secret"]))
            for mode, t in per_mode.items():
                times.setdefault(key, {m: [] for m in MODES})[mode].extend(t)

    rows = []
    for (name, op), per_mode in times.items():
        nbytes = next(seg * n for c, seg, n in CASES if c == name)
        gbps = {m: nbytes / statistics.median(per_mode[m]) for m in MODES}
        row = dict(case=name, op=op, samples_per_mode=len(per_mode["open"]),
                   open_gbps=gbps["open"], secret_gbps=gbps["secret"],
                   open_mean_gbps=nbytes * len(per_mode["open"]) / sum(per_mode["open"]),
                   secret_mean_gbps=nbytes * len(per_mode["secret"]) / sum(per_mode["secret"]),
                   ratio=gbps["secret"] / gbps["open"], ratio_by_creation_order=by_order[(name, op)])
        rows.append(row)
        b = "second open pair (A/A control)" if args.aa else "with a secret"
        print(f"{name} {op}: open {gbps['open']:.3f} GB/s, {b} {gbps['secret']:.3f} GB/s "
              f"(medians of both creation orders), ratio {row['ratio']:.3f} "
              f"(open first {by_order[(name, op)]['open first']:.3f}, "
              f"secret first {by_order[(name, op)]['secret first']:.3f})")

    out = dict(
        command=" ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]),
        machine=f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        time_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        aa_control=args.aa,
        handshake=hs,
        throughput=rows,
        note="GB/s = bytes / median transfer time over both creation orders (1 GB = 1e9 B); "
             "ratio = with a secret / open, same run",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
