#!/usr/bin/env bash
# Runs the whole test suite: the torch-free C++ core (CMake + GoogleTest via
# ctest), the RDMA tests in a Soft-RoCE VM, the HIP compile check, and the
# Python tests (pytest), and the vLLM connector tests in .venv-vllm when it
# exists (scripts/setup.sh creates it). Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VENV:-.venv}
JOBS=$(nproc)

cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/cmake -j "$JOBS"
# Host: everything but the tests that need an RDMA device ...
(cd build/cmake && ctest --output-on-failure -j "$JOBS" --timeout 300 -LE rdma_vm)
# ... which run inside a QEMU VM with Soft-RoCE (image built once and cached;
# the VM and each test are bounded, and so is the whole stage).
timeout -k 10 1200 tests/rdma_vm/run_ctest.sh build/cmake

scripts/check_hip.sh

"$VENV/bin/python" -m pytest -q -ra --timeout=600 tests/python "$@"

VLLM_VENV=${MORI_VLLM_VENV:-.venv-vllm}
if [ -x "$VLLM_VENV/bin/pytest" ]; then
  # Its own pytest script, not `python -m pytest`: the working directory must
  # not come first on sys.path, or this tree's mori_torch (built for .venv's
  # torch) would shadow the one built into the vLLM environment.
  "$VLLM_VENV/bin/pytest" -q -ra --timeout=600 -p no:cacheprovider tests/vllm
else
  echo "tests/vllm not run: $VLLM_VENV does not exist (scripts/setup_vllm_env.sh creates it)"
fi
