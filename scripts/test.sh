#!/usr/bin/env bash
# Runs the whole test suite: the linters (scripts/lint.sh: ruff and
# clang-format), the torch-free C++ core (CMake + GoogleTest via ctest), again
# built with ASan + UBSan and with TSan, the libFuzzer targets for a bounded
# time each, the RDMA tests in a Soft-RoCE VM, the HIP compile
# check, the Python tests (pytest), and the vLLM connector tests when vLLM is
# installed (scripts/setup.sh adds it). Run scripts/setup.sh first.
#   FUZZ_SECONDS   time per fuzz target (default 25)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VENV:-.venv}
JOBS=$(nproc)

# Tests leave nothing in /tmp: everything this run makes in a temporary
# directory goes into one of its own, checked at the end. Only this run's
# directory is looked at (the machine's /tmp is shared with other users).
RUN_TMP=$(mktemp -d "${TMPDIR:-/tmp}/mori-test.XXXXXX")
export TMPDIR=$RUN_TMP
trap 'rm -rf "$RUN_TMP"' EXIT
# torch.compile's cache is a cache, not a leftover: it lives in build/.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/build/torchinductor}

PYTHON="$VENV/bin/python" scripts/lint.sh

cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/cmake -j "$JOBS"
# Host: everything but the tests that need an RDMA device ...
(cd build/cmake && ctest --output-on-failure -j "$JOBS" --timeout 300 -LE rdma_vm)

# The core tests under the sanitizers (the torch extension is not rebuilt).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp}
for san in address thread; do
  cmake -S . -B "build/$san" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMORI_SANITIZE=$san >/dev/null
  cmake --build "build/$san" -j "$JOBS" --target mori_core_tests
  (cd "build/$san" && ctest --output-on-failure -j "$JOBS" --timeout 300 -LE rdma_vm)
done

# libFuzzer targets (clang, ASan + UBSan), FUZZ_SECONDS each. They start from
# the kept corpus in tests/fuzz/corpus/<name> and write what they find to
# build/fuzz/corpus/<name> (merge it into the kept one with -merge=1).
CXX=clang++-15 CC=clang-15 cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMORI_FUZZ=ON \
  -DMORI_BUILD_TESTS=OFF >/dev/null
cmake --build build/fuzz -j "$JOBS"
for bin in build/fuzz/fuzz_*; do
  name=${bin##*/fuzz_}
  mkdir -p "build/fuzz/corpus/$name" "tests/fuzz/corpus/$name"
  "$bin" -max_total_time="${FUZZ_SECONDS:-25}" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    "build/fuzz/corpus/$name" "tests/fuzz/corpus/$name" 2>&1 | tail -n 12  # pipefail: a crash fails the run
done

# ... which run inside a QEMU VM with Soft-RoCE (image built once and cached;
# the VM and each test are bounded, and so is the whole stage).
timeout -k 10 1200 tests/rdma_vm/run_ctest.sh build/cmake

scripts/check_hip.sh

# pytest's own tmp_path directories (kept by design for debugging) go to
# build/pytest-tmp, outside the leftover check (pytest makes only the last level).
mkdir -p build/pytest-tmp
"$VENV/bin/python" -m pytest -q -ra --timeout=600 --basetemp="$PWD/build/pytest-tmp/python" tests/python "$@"

if "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pytest -q -ra --timeout=600 -p no:cacheprovider --basetemp="$PWD/build/pytest-tmp/vllm" \
    tests/vllm
else
  echo "tests/vllm not run: vLLM is not installed in $VENV (scripts/setup_vllm_env.sh adds it)"
fi

# torchinductor_<user>: torch.compile's precompiled headers, which torch
# always puts under the temporary directory (a cache, gone with RUN_TMP).
left=$(cd "$RUN_TMP" && find . -mindepth 1 -maxdepth 2 -not -path "./torchinductor_*" | sort | head -n 50)
if [ -n "$left" ]; then
  echo "FAILED: the tests left these in their temporary directory (TMPDIR=$RUN_TMP):" >&2
  echo "$left" >&2
  exit 1
fi
echo "nothing left behind in the temporary directory"
