#!/usr/bin/env bash
# Runs the RDMA GoogleTests (ctest label rdma_vm) inside the Soft-RoCE VM.
#   run_ctest.sh [BUILD_DIR] [-- extra ctest args]
# BUILD_DIR (default build/cmake) must hold a configured and built tree of
# this checkout; it lies under the repo root, which the VM mounts at the same
# path. Exit code: ctest's (an error too when no test matches: --no-tests=error),
# or run_in_vm.sh's 124 (VM timeout) / 125 (no boot).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
root=$(cd "$here/../.." && pwd -P)
build=$root/build/cmake
if [[ $# -gt 0 && $1 != -- ]]; then build=$(cd "$1" && pwd -P); shift; fi
[[ ${1:-} == -- ]] && shift
[[ -x $build/mori_rdma_vm_tests ]] || { echo "run_ctest: $build/mori_rdma_vm_tests is not built" >&2; exit 2; }
# Each test gets ctest's timeout, the whole VM a bound of its own.
exec "$here/run_in_vm.sh" --timeout "${MORI_RDMA_VM_TIMEOUT:-900}" -- \
    ctest --test-dir "$build" -L rdma_vm --no-tests=error --output-on-failure --timeout 300 "$@"
