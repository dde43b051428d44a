"""TCP with GPU memory against TCP with host memory, measured in the same run.

Runs the mori_torch.benchmark CLI (two processes, engine + socket baseline) for
each case once with host buffers and once with GPU buffers (cuda:0 in both
processes; the bytes go through pinned staging buffers), alternating the two
--rounds times, and records each GPU figure as a ratio to the host figure.

    python benchmarks/bench_tcp_gpu.py --json docs/results/tcp_gpu.json
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mori_torch import benchmark as cli  # noqa: E402

CASES = {
    "64M": ["--op-type", "both", "--buffer-size", "64M", "--transfer-batch-size", "1", "--iters", "20"],
    "4M": ["--op-type", "both", "--buffer-size", "4M", "--transfer-batch-size", "1", "--iters", "50"],
    "256K": ["--op-type", "both", "--buffer-size", "256K", "--transfer-batch-size", "1", "--iters", "200"],
    "4096x16K": ["--op-type", "both", "--buffer-size", "16K", "--transfer-batch-size", "4096",
                 "--enable-batch-transfer", "--enable-sess", "--shuffle", "--iters", "10"],
}


def run_cli(mem, case_args, extra=()):
    argv = ["--mem-type", mem, "--warmup", "2", "--quiet", *case_args, *extra]
    args = cli.build_parser().parse_args(argv)
    cli.check_args(args)
    return cli.run(args, ["mori_torch.benchmark", *argv])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="host/GPU alternations per case (default 3)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--staging-chunk-bytes", default=None, help="TcpBackendConfig.staging_chunk_bytes (e.g. 512K)")
    p.add_argument("--staging-depth", default=None, help="TcpBackendConfig.staging_depth")
    p.add_argument("--num-data-conns", default=None, help="TcpBackendConfig.num_data_conns (default: the CLI's 8)")
    a = p.parse_args()
    extra = []
    for flag in ("staging_chunk_bytes", "staging_depth", "num_data_conns"):
        if getattr(a, flag) is not None:
            extra += ["--" + flag.replace("_", "-"), getattr(a, flag)]

    out = []
    print(f"{'case':>10} {'op':>5} {'host GB/s':>10} {'GPU GB/s':>9} {'GPU/host':>8}")
    for name in a.cases.split(","):
        runs = {"cpu": [], "gpu": []}
        for _ in range(a.rounds):
            for mem in ("cpu", "gpu"):
                runs[mem].append(run_cli(mem, CASES[name], extra))
        for i, op in enumerate(r["op"] for r in runs["cpu"][0]):
            host = statistics.median(rs[i]["gbps"] for rs in runs["cpu"])
            gpu = statistics.median(rs[i]["gbps"] for rs in runs["gpu"])
            rec = dict(runs["gpu"][0][i])
            rec.update(
                case=name,
                gbps=gpu,
                gpu_gbps_rounds=[rs[i]["gbps"] for rs in runs["gpu"]],
                host_gbps=host,
                host_gbps_rounds=[rs[i]["gbps"] for rs in runs["cpu"]],
                ratio_to_host=gpu / host,
                socket_baseline_gbps=statistics.median(rs[i]["baseline_gbps"] for rs in runs["cpu"]),
                rounds=a.rounds,
                command=["python", "benchmarks/bench_tcp_gpu.py", *sys.argv[1:]],
            )
            # The baseline of this comparison is the same case with host memory.
            rec.update(baseline="tcp host memory, same run", baseline_gbps=host, ratio=gpu / host,
                       baseline_label="TCP with host memory, same run")
            out.append(rec)
            print(f"{name:>10} {op:>5} {host:10.3f} {gpu:9.3f} {gpu / host:8.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
