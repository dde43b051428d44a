#!/usr/bin/env bash
# Guest half of smoke_test.sh (runs inside the VM via run_in_vm.sh).
# Every process gets its own timeout: a server stuck after a failed connect
# would otherwise hold the VM until its overall timeout.
set -euo pipefail

probe=${1:?usage: smoke_guest.sh PATH/TO/verbs_probe}
dev=$MORI_RDMA_DEVICE
gidx=${MORI_RDMA_GID_INDEX:-$MORI_VM_GID_INDEX}
ip=$MORI_RDMA_IP
fail=0

echo "== ibv_devinfo -d $dev"
timeout 30 ibv_devinfo -d "$dev" || { echo "SMOKE: ibv_devinfo failed" >&2; fail=1; }

echo "== ib_write_bw -d $dev -x $gidx -s 65536 -n 200 (server + client to $ip)"
# shellcheck source=guest_lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/guest_lib.sh"
if perftest_pair /tmp/bw_client.log ib_write_bw -s 65536 -n 200; then
    # The header and result lines of the client's report (builtins, no exec).
    while IFS= read -r line; do
        [[ $line =~ ^\ *(#bytes|65536\ ) ]] && echo "$line"
    done </tmp/bw_client.log
else
    echo "SMOKE: ib_write_bw failed" >&2
    fail=1
fi

echo "== $probe"
timeout 30 "$probe" || { echo "SMOKE: verbs_probe failed" >&2; fail=1; }

exit $fail
