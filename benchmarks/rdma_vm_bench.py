#!/usr/bin/env python3
"""RDMA backend against perftest on the same Soft-RoCE device, in one VM run.

    python3 benchmarks/rdma_vm_bench.py [--build build/cmake] [--scale 1] [--out docs/results/rdma_vm.json]

Builds nothing: configure and build the CMake tree first (target mori_rdma_bench).
Boots the test VM (tests/rdma_vm/run_in_vm.sh), runs ib_write_bw / ib_read_bw and
then mori_rdma_bench there, and prints and records each case's MB/s with its
perftest baseline and the ratio. Figures are emulation figures: only the ratio
means anything.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = {"write": "ib_write_bw", "read": "ib_read_bw"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "cmake"))
    ap.add_argument("--scale", default="1", help="integer factor on every case's iteration count")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "rdma_vm.json"))
    args = ap.parse_args()
    bench = os.path.join(os.path.abspath(args.build), "mori_rdma_bench")
    if not os.access(bench, os.X_OK):
        print(f"rdma_vm_bench: {bench} is not built", file=sys.stderr)
        return 2
    cmd = [os.path.join(ROOT, "tests", "rdma_vm", "run_in_vm.sh"), "--timeout", "1200", "--",
           "bash", "benchmarks/rdma_vm_guest.sh", bench, str(args.scale)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        print(f"rdma_vm_bench: the VM run failed ({p.returncode})", file=sys.stderr)
        return 1
    perf, records = {}, []
    for line in p.stdout.splitlines():
        if line.startswith("PERFTEST "):
            _, tool, size, iters, mbps = line.split()
            perf[(tool, int(size))] = (float(mbps), int(iters))
        elif line.startswith("{"):
            records.append(json.loads(line))
    for r in records:
        base = perf.get((TOOL[r["op"]], r["segment_bytes"]))
        r["baseline"] = f"{TOOL[r['op']]} -s {r['segment_bytes']}"
        r["baseline_mb_per_s"] = base[0] if base else None
        r["ratio"] = round(r["mb_per_s"] / base[0], 3) if base and base[0] > 0 else None
    print(f"{'op':6} {'segment':>9} {'segs':>5} {'notices':>7} {'MB/s':>8} {'perftest':>9} {'ratio':>6} verified")
    for r in records:
        print(f"{r['op']:6} {r['segment_bytes']:>9} {r['segments']:>5} {str(r['notifications']):>7} "
              f"{r['mb_per_s']:>8.1f} {r['baseline_mb_per_s'] or float('nan'):>9.1f} "
              f"{r['ratio'] or float('nan'):>6.2f} {r['verified']}")
    out = {
        "benchmark": "rdma_vm",
        "date": datetime.date.today().isoformat(),
        "machine": "QEMU TCG guest (2 vCPUs, Debian 6.1 kernel, Soft-RoCE rxe0 on dummy0, MTU 4096) on a "
                   f"{os.cpu_count()}-core host",
        "command": "python3 benchmarks/rdma_vm_bench.py " + " ".join(sys.argv[1:]),
        "config": {"qp_per_transfer": 1, "enable_notification": "per record (off, then on)",
                   "transfers_in_flight": 128, "poll_cq_mode": "POLLING"},
        "records": records,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0 if all(r["verified"] for r in records) and records else 1


if __name__ == "__main__":
    sys.exit(main())
