# shellcheck shell=bash
# Helpers for scripts that run inside the test VM (sourced). Builtins only
# where it matters: every exec costs 0.1-0.3 s under TCG.

# wait_listening HEXPORT PID: waits (up to 10 s) until a TCP socket listens on
# port HEXPORT (upper-case hex, as /proc/net/tcp shows it) while PID lives.
wait_listening() {
    local port=$1 pid=$2 i f local_addr st
    local blk
    exec {blk}<> <(:) # a pipe nobody writes to: `read -t` on it is a fork-free sleep
    for ((i = 0; i < 200; i++)); do
        for f in /proc/net/tcp /proc/net/tcp6; do
            while read -r _ local_addr _ st _; do
                if [[ $local_addr == *:$port && $st == 0A ]]; then
                    exec {blk}>&-
                    return 0
                fi
            done <"$f"
        done
        kill -0 "$pid" 2>/dev/null || break
        read -r -t 0.05 -u "$blk" _ || true
    done
    exec {blk}>&-
    return 1
}

# perftest_pair OUTFILE TOOL ARGS...: runs a perftest server and client on
# the guest's RDMA device; the client's report goes to OUTFILE.
perftest_pair() {
    local out=$1 tool=$2
    shift 2
    local cmd=("$tool" -d "$MORI_RDMA_DEVICE" -x "${MORI_RDMA_GID_INDEX:-$MORI_VM_GID_INDEX}" -F "$@")
    timeout 120 "${cmd[@]}" >"$out.server" 2>&1 &
    local srv=$!
    # perftest's default port 18515 = 0x4853
    if wait_listening 4853 "$srv" && timeout 120 "${cmd[@]}" "$MORI_RDMA_IP" >"$out" 2>&1 && wait "$srv"; then
        return 0
    fi
    kill "$srv" 2>/dev/null || true
    cat "$out.server" "$out" >&2 2>/dev/null || true
    return 1
}
