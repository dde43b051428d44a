#!/usr/bin/env bash
# Smoke test of the Soft-RoCE VM harness: in one VM, ibv_devinfo, an
# ib_write_bw server/client pair on rxe0, and verbs_probe (built here on the
# host, run from the 9p share). Exits 0 only if all of them work.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
t0=$SECONDS

command -v gcc >/dev/null || { echo "smoke_test: gcc is needed" >&2; exit 1; }
# Host packages first (libibverbs-dev for the build below); a no-op when cached.
"$here/build_image.sh" >/dev/null

# build/ is inside the default share (the repo root), so the guest sees the
# binary at the same path. Plain -O2: -march=native would SIGILL in the guest.
mkdir -p "$here/build"
gcc -O2 -Wall -Wextra -o "$here/build/verbs_probe" "$here/verbs_probe.c" -libverbs

"$here/run_in_vm.sh" --timeout 180 -- bash "$here/smoke_guest.sh" "$here/build/verbs_probe"
echo "smoke_test: PASS ($((SECONDS - t0)) s)"
