#!/usr/bin/env bash
# Runs the whole test suite: the torch-free C++ core (CMake + GoogleTest via
# ctest), the HIP compile check, and the Python tests (pytest). Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VENV:-.venv}
JOBS=$(nproc)

cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/cmake -j "$JOBS"
(cd build/cmake && ctest --output-on-failure -j "$JOBS" --timeout 300)

scripts/check_hip.sh

"$VENV/bin/python" -m pytest -q -ra --timeout=600 tests/python "$@"
