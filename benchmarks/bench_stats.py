"""What the transfer counters cost on the TCP path (issue #15, observability):
the same transfers with the counters on (the default) and off
(MORI_TORCH_STATS=0, the baseline), each run in fresh processes, the two
alternated round by round so that load on the machine hits both alike.

Two engines in one process, TCP over loopback, host memory:
- "sync 64 B": one 64-byte session write at a time, waited for: per-transfer latency.
- "pipelined 4 KiB": 256 session writes of 4 KiB in flight, then wait_all: transfers per second.

Per round and mode: medians within the process; across rounds: the median of
those, and the ratio on/off (latency: > 1 means slower with counters). On a
busy machine that end-to-end difference drowns in noise, so the counters'
own cost is also measured directly (build/cmake/mori_stats_bench: a status's
life with and without them, 1 and 4 threads on one pair) and set against the
sync 64 B latency of the same run.

    cmake --build build/cmake --target mori_stats_bench
    python benchmarks/bench_stats.py --rounds 6 --json docs/results/stats_overhead_tcp_cpu.json
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(iters: int) -> dict:
    sys.path.insert(0, ROOT)
    import torch

    from mori_torch.io import BackendType, IOEngine, IOEngineConfig, StatusCode

    a = IOEngine("stats-a", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("stats-b", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.TCP)
    a.register_remote_engine(b.get_engine_desc())
    src = torch.ones(1 << 20, dtype=torch.uint8)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    sess = a.create_session(a.register_torch_tensor(src), b.register_torch_tensor(dst))

    lat = []
    for i in range(iters + 100):
        t0 = time.perf_counter_ns()
        st = sess.write(0, 0, 64, i)
        st.Wait()
        if i >= 100:  # warm-up left out
            lat.append(time.perf_counter_ns() - t0)
        assert st.Code() == StatusCode.SUCCESS, st.Message()

    rates = []
    for _ in range(max(iters // 256, 5)):
        t0 = time.perf_counter_ns()
        sts = [sess.write(k * 4096, k * 4096, 4096, k) for k in range(256)]
        assert a.wait_all(sts) == StatusCode.SUCCESS
        rates.append(256 / ((time.perf_counter_ns() - t0) / 1e9))
    counted = a.stats()["total"]["transfers"]
    a.shutdown()
    b.shutdown()
    return {"sync_64B_p50_us": statistics.median(lat) / 1000,
            "sync_64B_p99_us": sorted(lat)[int(len(lat) * 0.99)] / 1000,
            "pipelined_4KiB_per_s": statistics.median(rates), "transfers_counted": counted}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.iters)))
        return

    runs = {"on": [], "off": []}
    for r in range(args.rounds):
        order = ["on", "off"] if r % 2 == 0 else ["off", "on"]  # counterbalanced
        for mode in order:
            env = dict(os.environ, MORI_TORCH_STATS="1" if mode == "on" else "0")
            out = subprocess.run([sys.executable, __file__, "--child", "--iters", str(args.iters)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            runs[mode].append(res)
            print(f"round {r} {mode:3}: sync 64 B p50 {res['sync_64B_p50_us']:.1f} us, "
                  f"pipelined 4 KiB {res['pipelined_4KiB_per_s']:.0f}/s, counted {res['transfers_counted']}")
    assert all(x["transfers_counted"] == 0 for x in runs["off"]) and all(x["transfers_counted"] > 0 for x in runs["on"])

    micro_bin = os.path.join(ROOT, "build", "cmake", "mori_stats_bench")
    micro = json.loads(subprocess.run([micro_bin], capture_output=True, text=True, check=True).stdout)

    def med(mode, key):
        return statistics.median(x[key] for x in runs[mode])

    summary = {}
    for key in ("sync_64B_p50_us", "sync_64B_p99_us", "pipelined_4KiB_per_s"):
        on, off = med("on", key), med("off", key)
        summary[key] = {"on": on, "off_baseline": off, "ratio_on_over_off": on / off}
    print("\n| measure | counters on | off (baseline) | ratio on/off |")
    print("|---|---|---|---|")
    for key, v in summary.items():
        print(f"| {key} | {v['on']:.1f} | {v['off_baseline']:.1f} | {v['ratio_on_over_off']:.3f} |")
    sync_ns = summary["sync_64B_p50_us"]["off_baseline"] * 1000
    print("\n| counters' own cost | with | without (baseline) | added ns | added / sync 64 B TCP transfer |")
    print("|---|---|---|---|---|")
    for k, v in micro.items():
        v["added_over_sync_64B_transfer"] = v["counters_add_ns"] / sync_ns
        print(f"| {k.replace('_', ' ')} | {v['status_with_counters_ns']:.0f} ns | {v['status_alone_ns']:.0f} ns | "
              f"{v['counters_add_ns']:.0f} | {v['added_over_sync_64B_transfer']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/bench_stats.py " + " ".join(sys.argv[1:]),
                       "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus "
                                  f"(load {os.getloadavg()[0]:.1f} at the end)",
                       "baseline": "the same transfers with MORI_TORCH_STATS=0 (counters off), alternated rounds",
                       "rounds": args.rounds, "iters": args.iters, "summary": summary, "counters_cost": micro,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
