#!/usr/bin/env bash
# Run one command inside a throwaway QEMU (TCG) guest with Soft-RoCE (rxe0).
#
#   run_in_vm.sh [--timeout SEC] [--share DIR] [--mem SIZE] [--env NAME=VALUE]... -- CMD [ARGS...]
#
# DIR (default: the repo root) is shared over 9p at the same absolute path and
# is CMD's working directory, so host-built binaries run unchanged. CMD's
# stdout/stderr stream back to this script's stdout/stderr, and its exit code
# becomes this script's. Exit 124: the VM timed out; 125: the VM failed to
# boot or to set up RDMA (the guest console is then printed on stderr).
#
# CMD's environment: PATH, HOME, LANG, CI, every MORI_* variable of the
# caller, the --env ones, and MORI_RDMA_DEVICE=rxe0, MORI_VM_GID_INDEX=1 (for
# perftest's -x), MORI_RDMA_NETDEV=dummy0, MORI_RDMA_IP=<dummy0's IPv4>,
# MORI_IN_VM=1. MORI_RDMA_GID_INDEX is not set (unless the caller or --env
# sets it): the backend then picks the GID itself, as it must in production.
#
# Knobs: MORI_VM_TIMEOUT (default 300 s, same as --timeout), MORI_VM_MEM (2G),
# MORI_VM_MACHINE (auto|microvm|pc), MORI_VM_DEBUG=1 (kernel log + init stage
# times on stderr), MORI_VM_CACHE (see build_image.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
repo=$(cd "$here/../.." && pwd -P)

usage() {
    sed -n '4p' "${BASH_SOURCE[0]}" | sed 's/^#  *//' >&2
    exit 2
}

timeout_s=${MORI_VM_TIMEOUT:-300}
share=$repo
mem=${MORI_VM_MEM:-2G}
extra_env=()
while [[ $# -gt 0 ]]; do
    case $1 in
    --timeout) timeout_s=${2:?}; shift 2 ;;
    --share) share=${2:?}; shift 2 ;;
    --mem) mem=${2:?}; shift 2 ;;
    --env) [[ ${2:?} == *=* ]] || usage; extra_env+=("$2"); shift 2 ;;
    --) shift; break ;;
    -h | --help) usage ;;
    *) echo "run_in_vm: unknown option $1" >&2; usage ;;
    esac
done
[[ $# -gt 0 ]] || usage
[[ $timeout_s =~ ^[0-9]+$ ]] || { echo "run_in_vm: --timeout needs seconds" >&2; exit 2; }
share=$(cd "$share" && pwd -P) || { echo "run_in_vm: no such directory: $share" >&2; exit 2; }
case $share in
/ | /bin* | /sbin* | /lib* | /usr | /usr/* | /etc* | /dev* | /proc* | /sys* | /run | /run/*)
    # Mounting over these would hide the guest's own system.
    echo "run_in_vm: cannot share $share (it would shadow the guest system)" >&2; exit 2 ;;
esac

img=$("$here/build_image.sh")

# dummy0's address: TEST-NET-1 (RFC 5737). It exists only inside the guest,
# which has no network device at all.
VM_IP=192.0.2.1
VM_IP2=192.0.2.2 # dummy1 / rxe1, the second rail
VM_GID_INDEX=1
VM_GID=0000:0000:0000:0000:0000:ffff:c000:0201 # ::ffff:192.0.2.1

# --- machine ------------------------------------------------------------------
# microvm (virtio-mmio, no PCI/ACPI-IRQ setup, no SeaBIOS) boots ~1 s faster
# than pc, but has no HPET/PM timer: the guest cannot reliably calibrate its
# TSC against the PIT under TCG and then sometimes hangs early in boot. So we
# hand it the TSC frequency (TCG's guest TSC is the host TSC) and only when the
# host's "cpu MHz" is that frequency: constant TSC, no aperfmperf or cpufreq
# (those make "cpu MHz" the current clock). Otherwise: pc, which calibrates
# against its HPET.
machine=${MORI_VM_MACHINE:-auto}
tsc_khz=$(awk '/^flags/ && !f {f = ($0 ~ / constant_tsc/ && $0 !~ / aperfmperf/)}
               /^cpu MHz/ && !k {k = int($4 * 1000)}
               END {if (f && k > 0) print k}' /proc/cpuinfo)
if [[ $machine == auto ]]; then
    machine=pc
    [[ -n $tsc_khz && ! -e /sys/devices/system/cpu/cpu0/cpufreq ]] && machine=microvm
fi
case $machine in
microvm)
    [[ -n $tsc_khz ]] || { echo "run_in_vm: microvm needs the host TSC frequency (cpu MHz)" >&2; exit 2; }
    # shellcheck disable=SC2054 # commas belong to QEMU's option syntax
    machine_args=(-machine microvm,pcie=off,x-option-roms=off)
    dev=device
    tsc_args="tsc_early_khz=$tsc_khz"
    ;;
pc)
    machine_args=(-machine pc)
    dev=pci
    tsc_args=
    ;;
*) echo "run_in_vm: MORI_VM_MACHINE must be auto, microvm or pc" >&2; exit 2 ;;
esac

ctl=$(mktemp -d "${TMPDIR:-/tmp}/mori-vm.XXXXXX")
qpid='' tout='' terr=''
# shellcheck disable=SC2317 # called from the trap
cleanup() {
    # Ends only what we started: the timeout wrapper (it passes the signal on
    # to QEMU) and the two tails, which would otherwise hold our stdout open.
    local p
    for p in $qpid $tout $terr; do kill "$p" 2>/dev/null || true; done
    rm -rf "$ctl"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

{
    printf 'SHARE_DIR=%q\n' "$share"
    printf 'VM_IP=%s\nVM_IP2=%s\nVM_GID_INDEX=%s\nVM_GID=%s\n' "$VM_IP" "$VM_IP2" "$VM_GID_INDEX" "$VM_GID"
} >"$ctl/boot.env"

{
    echo 'export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8'
    echo 'unset TERM' # the kernel's TERM=linux; the output is no terminal
    # Pass-through: the project's own knobs, and CI.
    while IFS= read -r name; do
        [[ $name == MORI_* || $name == CI ]] && printf 'export %s=%q\n' "$name" "${!name}"
    done < <(compgen -e)
    for kv in "${extra_env[@]+"${extra_env[@]}"}"; do
        printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}"
    done
    # No MORI_RDMA_GID_INDEX: the tests exercise the automatic GID choice.
    printf 'export MORI_RDMA_DEVICE=rxe0 MORI_VM_GID_INDEX=%s MORI_RDMA_NETDEV=dummy0 MORI_RDMA_IP=%s MORI_IN_VM=1\n' \
        "$VM_GID_INDEX" "$VM_IP"
    printf 'cd %q || exit 125\n' "$share"
    printf 'exec'
    printf ' %q' "$@"
    printf '\n'
} >"$ctl/cmd.sh"

# passthrough keeps real ownership but needs root; "none" is the same minus chown.
p9sec=passthrough
[[ $(id -u) -eq 0 ]] || p9sec=none
kdebug=quiet
[[ -n ${MORI_VM_DEBUG:-} ]] && kdebug=printk.time=1
# -nodefaults and no -nic: no network device, nothing can leave the VM.
# Default CPU model: -cpu max halves rxe bandwidth (slow emulated PCLMUL).
# -smp 2: with one vCPU two polling processes run ~20x slower.
# -no-reboot + panic=-1: a dead init ends QEMU instead of rebooting forever.
# tsc=reliable: keep the TSC clocksource (TCG's TSCs look "unsynchronized" to
# the kernel, which would then read the slow emulated HPET on every clock call).
# mitigations=off, cryptomgr.notests: less work for the emulated CPU.
# shellcheck disable=SC2054 # commas belong to QEMU's option syntax
qemu=(
    qemu-system-x86_64 -nodefaults -no-user-config -nographic
    -accel tcg "${machine_args[@]}" -smp 2 -m "$mem" -no-reboot
    -kernel "$img/vmlinux" -initrd "$img/initrd.cpio"
    -append "console=ttyS0 panic=-1 tsc=reliable $tsc_args mitigations=off cryptomgr.notests $kdebug"
    -serial "file:$ctl/console.log"
    -device "virtio-serial-$dev,id=vser"
    -chardev "file,id=gout,path=$ctl/stdout,append=on"
    -device virtserialport,bus=vser.0,nr=1,chardev=gout,name=mori.stdout
    -chardev "file,id=gerr,path=$ctl/stderr,append=on"
    -device virtserialport,bus=vser.0,nr=2,chardev=gerr,name=mori.stderr
    -fsdev "local,id=fsctl,path=$ctl,security_model=$p9sec,multidevs=remap"
    -device "virtio-9p-$dev,fsdev=fsctl,mount_tag=morictl"
    -fsdev "local,id=fsshare,path=$share,security_model=$p9sec,multidevs=remap"
    -device "virtio-9p-$dev,fsdev=fsshare,mount_tag=morishare"
)

show_console() {
    echo "run_in_vm: ---- guest console ($machine) ----" >&2
    tail -n "${MORI_VM_CONSOLE_LINES:-40}" "$ctl/console.log" >&2 || true
    if [[ -s $ctl/qemu.log ]]; then
        echo "run_in_vm: ---- qemu ----" >&2
        tail -n 20 "$ctl/qemu.log" >&2
    fi
}

# One boot. Sets qrc (QEMU's exit status) and hung=1 if the guest was not set
# up within the boot timeout (then nothing of CMD has run yet).
boot_timeout=${MORI_VM_BOOT_TIMEOUT:-30}
boot() {
    rm -f "$ctl/rc" "$ctl/setup_failed"
    : >"$ctl/stdout"
    : >"$ctl/stderr"
    : >"$ctl/console.log"
    hung=0
    qrc=0
    timeout -k 5 "$timeout_s" "${qemu[@]}" </dev/null >"$ctl/qemu.log" 2>&1 &
    qpid=$!
    # Stream the guest's stdout/stderr while it runs; tail exits once QEMU is
    # gone, after a final read, so nothing written before power-off is lost.
    tail -q -c +1 -s 0.1 --pid="$qpid" -f "$ctl/stdout" &
    tout=$!
    tail -q -c +1 -s 0.1 --pid="$qpid" -f "$ctl/stderr" >&2 &
    terr=$!
    # Boot watchdog: init logs "running the command" on the console once the
    # guest is fully set up; a guest stuck before that is retried.
    local deadline=$((SECONDS + boot_timeout))
    while kill -0 "$qpid" 2>/dev/null && ! grep -q '^mori-init: .* running the command' "$ctl/console.log"; do
        if ((SECONDS >= deadline)); then
            hung=1
            kill "$qpid" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
    wait "$qpid" || qrc=$?
    qpid=
    wait "$tout" "$terr" || true
    tout='' terr=''
}

attempts=$((1 + ${MORI_VM_BOOT_RETRIES:-1}))
for ((attempt = 1; attempt <= attempts; attempt++)); do
    boot
    [[ $hung -eq 1 ]] || break
    echo "run_in_vm: WARNING: guest not up after ${boot_timeout}s (attempt $attempt/$attempts)" >&2
    show_console
done

# MORI_VM_DEBUG=1: show the guest console (kernel log, init's stage times).
[[ -n ${MORI_VM_DEBUG:-} ]] && MORI_VM_CONSOLE_LINES=${MORI_VM_CONSOLE_LINES:-1000} show_console

if [[ -f $ctl/rc ]]; then
    rc=$(<"$ctl/rc")
    [[ $rc =~ ^[0-9]+$ ]] || { echo "run_in_vm: bad exit code from the guest: '$rc'" >&2; exit 125; }
    exit "$rc"
fi
if [[ $hung -eq 1 ]]; then
    echo "run_in_vm: ERROR: VM failed to boot ($attempts attempts of ${boot_timeout}s)" >&2
    exit 125
fi
if [[ $qrc -eq 124 || $qrc -eq 137 ]]; then
    echo "run_in_vm: ERROR: VM timed out after ${timeout_s}s (the command did not finish)" >&2
    show_console
    exit 124
fi
if [[ -f $ctl/setup_failed ]]; then
    echo "run_in_vm: ERROR: guest setup failed: $(<"$ctl/setup_failed")" >&2
else
    echo "run_in_vm: ERROR: VM died before the command finished (qemu exit $qrc)" >&2
fi
show_console
exit 125
