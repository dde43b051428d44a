"""Authentication cost (issue 11), in one run:

1. handshake time: opening a control connection without a secret and with
   one (build/cmake/mori_auth_bench, C++, alternating blocks);
2. TCP throughput with a secret against without: the two-process benchmark
   CLI (python -m mori_torch.benchmark, data verified once per case) run
   alternately with and without MORI_TORCH_SECRET in both processes.

    python benchmarks/bench_auth.py --rounds 3 --json docs/results/auth_tcp_cpu.json
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    ["--buffer-size", "64M", "--transfer-batch-size", "1", "--enable-sess"],
    ["--buffer-size", "16K", "--transfer-batch-size", "1024", "--enable-batch-transfer", "--enable-sess"],
]


def run_cli(case, iters, secret):
    env = dict(os.environ)
    env.pop("MORI_TORCH_SECRET", None)
    if secret:
        env["MORI_TORCH_SECRET"] = secret
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "mori_torch.benchmark", "--op-type", "both", "--iters", str(iters),
               "--no-baseline", "--json", f.name] + case
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(f.name) as g:
            return json.load(g)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--handshakes", type=int, default=2000)
    ap.add_argument("--auth-bench", default=os.path.join(ROOT, "build/cmake/mori_auth_bench"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    hs = json.loads(subprocess.run([args.auth_bench, str(args.handshakes)], check=True, capture_output=True,
                                   text=True).stdout)
    print(f"handshake: open p50 {hs['open_p50_us']:.0f} us (p99 {hs['open_p99_us']:.0f}), with a secret p50 "
          f"{hs['secret_p50_us']:.0f} us (p99 {hs['secret_p99_us']:.0f})")

    secret = "benchmark secret"
    gbps = {}  # (case, op, mode) -> [GB/s per round]
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for case in CASES:
            for with_secret in order:
                for rec in run_cli(case, args.iters, secret if with_secret else None):
                    key = (" ".join(case), rec["op"], "secret" if with_secret else "open")
                    gbps.setdefault(key, []).append(rec["gbps"])
    rows = []
    for case in CASES:
        c = " ".join(case)
        for op in ("read", "write"):
            o, s = gbps[(c, op, "open")], gbps[(c, op, "secret")]
            mo, ms = sum(o) / len(o), sum(s) / len(s)
            rows.append(dict(case=c, op=op, open_gbps=o, secret_gbps=s, open_mean_gbps=mo, secret_mean_gbps=ms,
                             ratio=ms / mo))
            print(f"{c} {op}: open {mo:.3f} GB/s, secret {ms:.3f} GB/s, ratio {ms / mo:.3f}")
    out = dict(
        command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        machine=f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        time_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        handshake=hs,
        throughput=rows,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
