#!/usr/bin/env bash
# Guest half of benchmarks/rdma_vm_bench.py (runs inside the Soft-RoCE VM):
# perftest on the device, then the backend's benchmark, same sizes, same run.
# Prints "PERFTEST <tool> <bytes> <iters> <MB/s>" lines and the benchmark's
# JSON lines.
set -euo pipefail
bench=${1:?usage: rdma_vm_guest.sh PATH/TO/mori_rdma_bench [ITERS_SCALE]}
scale=${2:-1}
# shellcheck source=../tests/rdma_vm/guest_lib.sh
. tests/rdma_vm/guest_lib.sh

perf() {  # perf TOOL BYTES ITERS
    local tool=$1 bytes=$2 iters=$3 line f
    iters=$(((iters * ${scale%.*}) > 0 ? iters * ${scale%.*} : iters))
    perftest_pair /tmp/perf.log "$tool" -s "$bytes" -n "$iters" || { echo "perftest $tool failed" >&2; return 1; }
    while read -r line; do
        read -ra f <<<"$line"
        # "#bytes #iterations BW-peak BW-average MsgRate"
        if [[ ${f[0]:-} == "$bytes" ]]; then echo "PERFTEST $tool $bytes $iters ${f[3]}"; fi
    done </tmp/perf.log
}

# Same bytes per case as mori_rdma_bench (the 4 KiB batch: 60 x 1,024).
for tool in ib_write_bw ib_read_bw; do
    perf "$tool" 1048576 300
    perf "$tool" 65536 3000
    perf "$tool" 4096 61440
done
timeout 600 "$bench" --iters-scale "$scale"
