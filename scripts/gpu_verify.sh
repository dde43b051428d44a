#!/usr/bin/env bash
# The GPU-machine run of the project, in stages that each fit one device call
# (10 minutes at most). Every stage builds the extension first (incremental:
# seconds once built on a warm machine) and writes its logs and JSON records
# under $OUT (default build/gpu_verify), named after the stage and the GPU.
#
#   scripts/gpu_verify.sh build        # the extension only
#   scripts/gpu_verify.sh stream       # stream ordering across nodes, ops, examples
#   scripts/gpu_verify.sh rest         # every other test, GPU and CPU (XGMI, TCP GPU pages, paged KV, trust, hardening)
#   scripts/gpu_verify.sh gpu          # only the other files with GPU tests (rest without the CPU-only files: minutes)
#   scripts/gpu_verify.sh bench        # bench_ops, bench_kv_pull, bench_auth
#   scripts/gpu_verify.sh peers        # compare_peers: mori_torch, NIXL, Mooncake TE on GPU and host memory
#   scripts/gpu_verify.sh all          # everything above but peers, in this order (over 10 minutes)
#
# peers needs the slim wheels in .peer_wheels/ (python scripts/slim_peer_wheels.py
# where a registry is reachable; carry .peer_wheels to the GPU machine): they are
# installed into a temporary --target directory, never into the image's Python.
#
# The device image has torch, nvcc, ninja and pytest but no network: nothing
# is installed here, and tests that need etcd skip.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_verify}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9\n' _ | tr 'A-Z' 'a-z')
gpu=${gpu:-nogpu}
status=0

step() {  # step NAME COMMAND...: runs it, logs to $OUT/NAME_$gpu.log, remembers a failure
  local name=$1
  shift
  local t0=$SECONDS
  echo "== $name: $*"
  "$@" >"$OUT/${name}_$gpu.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 5 "$OUT/${name}_$gpu.log"
  ((rc == 0)) || status=1
  return $rc
}

build() {
  step build env MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace
}

STREAM_TESTS=(tests/python/test_stream_across_nodes.py tests/python/test_ops_gpu.py tests/python/test_examples.py
  tests/python/test_benchmark_cli.py)

stream() {
  step pytest_stream python3 -m pytest -q -ra --timeout=300 -p no:cacheprovider --durations=20 "${STREAM_TESTS[@]}"
}

# CPU-only tests that need what the device image lacks: the `mori` alias's
# .pth hook (a pip install), the rendezvous stores' network set-up, the
# downloaded serving-engine sources, pip's isolated build environment
# (test_install: setuptools from the index). CI runs them.
CPU_ONLY_TESTS=(tests/python/test_mori_alias.py tests/python/test_mori_compat.py tests/python/test_rendezvous.py
  tests/python/test_install.py)

rest() {
  local deselect=()
  for t in "${STREAM_TESTS[@]}" "${CPU_ONLY_TESTS[@]}"; do deselect+=(--ignore "$t"); done
  step pytest_rest python3 -m pytest -q -ra --timeout=300 -p no:cacheprovider --durations=20 tests/python \
    "${deselect[@]}"
}

# The files besides STREAM_TESTS that hold GPU tests (the rest of `rest` is
# CPU tests, which CI runs).
GPU_TESTS=(tests/python/test_gpu_xgmi.py tests/python/test_gpu_tcp.py tests/python/test_gpu_failover.py
  tests/python/test_paged_kv_gpu.py tests/python/test_observability.py tests/python/test_errors.py
  tests/python/test_compare_peers.py)

gpu() {
  step pytest_gpu python3 -m pytest -q -ra --timeout=300 -p no:cacheprovider --durations=20 "${GPU_TESTS[@]}"
}

bench() {
  step bench_ops python3 benchmarks/bench_ops.py --json "$OUT/ops_$gpu.json" --iters 1000
  step bench_kv_pull python3 benchmarks/bench_kv_pull.py --backend both --json "$OUT/kv_pull_$gpu.json"
  [ -x build/cmake/mori_auth_bench ] || step cmake_auth_bench bash -c \
    "cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DMORI_BUILD_TESTS=OFF >/dev/null && cmake --build build/cmake -j 16 --target mori_auth_bench"
  step bench_auth python3 benchmarks/bench_auth.py --iters 200 --json "$OUT/auth_tcp_$gpu.json"
  step bench_auth_aa python3 benchmarks/bench_auth.py --aa --iters 200 --json "$OUT/auth_tcp_aa_$gpu.json"
}

peers() {
  local site
  site=$(mktemp -d)/site
  if ls .peer_wheels/*.whl >/dev/null 2>&1; then
    step peers_install python3 -m pip install --no-index --no-deps --target "$site" .peer_wheels/*.whl
  else
    echo "== peers: no wheels in .peer_wheels/ (run scripts/slim_peer_wheels.py here first): mori_torch only"
  fi
  PYTHONPATH=$site:$PYTHONPATH step compare_peers python3 benchmarks/compare_peers.py --mem gpu cpu --timeout 150 \
    --json "$OUT/peers_$gpu.json" --plot "$OUT/peers_$gpu.png" --markdown "$OUT/peers_$gpu.md"
  cat "$OUT/peers_$gpu.md" 2>/dev/null
}

stage=${1:-all}
case "$stage" in
  build) build ;;
  stream) build && stream ;;
  rest) build && rest ;;
  gpu) build && gpu ;;
  bench) build && bench ;;
  peers) build && peers ;;
  all) build && stream && rest && bench ;;
  *)
    echo "unknown stage '$stage': build, stream, rest, gpu, bench, peers or all" >&2
    exit 2
    ;;
esac
exit $status
