#!/usr/bin/env bash
# Guest half of smoke_test.sh (runs inside the VM via run_in_vm.sh).
# Every process gets its own timeout: a server stuck after a failed connect
# would otherwise hold the VM until its overall timeout.
set -euo pipefail

probe=${1:?usage: smoke_guest.sh PATH/TO/verbs_probe}
dev=$MORI_RDMA_DEVICE
gidx=$MORI_RDMA_GID_INDEX
ip=$MORI_RDMA_IP
fail=0

echo "== ibv_devinfo -d $dev"
timeout 30 ibv_devinfo -d "$dev" || { echo "SMOKE: ibv_devinfo failed" >&2; fail=1; }

echo "== ib_write_bw -d $dev -x $gidx -s 65536 -n 200 (server + client to $ip)"
bw=(ib_write_bw -d "$dev" -x "$gidx" -s 65536 -n 200)
timeout 60 "${bw[@]}" >/tmp/bw_server.log 2>&1 &
srv=$!
# Wait until the server listens on perftest's port 18515 (0x4853). Builtins
# only: every exec costs 0.1-0.3 s under TCG.
exec {blk}<> <(:) # a pipe nobody writes to: `read -t` on it is a fork-free sleep
listening=0
for ((i = 0; i < 200; i++)); do
    for f in /proc/net/tcp /proc/net/tcp6; do
        while read -r _ local _ st _; do
            [[ $local == *:4853 && $st == 0A ]] && listening=1
        done <"$f"
    done
    ((listening)) && break
    kill -0 "$srv" 2>/dev/null || break
    read -r -t 0.05 -u "$blk" _ || true
done
if ((listening)) && timeout 60 "${bw[@]}" "$ip" >/tmp/bw_client.log 2>&1 && wait "$srv"; then
    # The header and result lines of the client's report (builtins, no exec).
    while IFS= read -r line; do
        [[ $line =~ ^\ *(#bytes|65536\ ) ]] && echo "$line"
    done </tmp/bw_client.log
else
    echo "SMOKE: ib_write_bw failed (listening=$listening)" >&2
    echo "-- server:" >&2; cat /tmp/bw_server.log >&2
    echo "-- client:" >&2; cat /tmp/bw_client.log >&2 2>/dev/null || true
    kill "$srv" 2>/dev/null || true
    fail=1
fi

echo "== $probe"
timeout 30 "$probe" || { echo "SMOKE: verbs_probe failed" >&2; fail=1; }

exit $fail
