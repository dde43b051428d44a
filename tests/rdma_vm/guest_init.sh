#!/bin/busybox sh
# shellcheck shell=dash
# PID 1 of the Soft-RoCE test guest, installed as /init by build_image.sh.
#
# busybox ash runs its applets (mount, mkdir, usleep, ...) without exec; that
# matters because every exec of a dynamically linked program costs 0.1-0.3 s
# under TCG. Only modprobe, ip and rdma are real execs here; they are called
# by full path because ash would otherwise pick the busybox applets.
#
# Contract with run_in_vm.sh:
#   9p tag "morictl"   -> /run/mori: boot.env (SHARE_DIR, VM_IP, VM_GID_INDEX, VM_GID),
#                         cmd.sh; we write rc (exit code of cmd.sh) or
#                         setup_failed there.
#   9p tag "morishare" -> mounted at $SHARE_DIR (same path as on the host).
#   virtio-serial port 1 / 2 (/dev/vport0p1, /dev/vport0p2): stdout / stderr.
# Our own messages go to /dev/console (ttyS0), which the host keeps as a log.

export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CTL=/run/mori
# 9p: big msize for throughput; cache=mmap so shared-writable mmap works too.
P9OPTS=trans=virtio,version=9p2000.L,msize=262144

log() {
    read -r up _ </proc/uptime 2>/dev/null
    echo "mori-init: [$up] $*"
}
die() {
    log "FATAL: $*"
    # The host reports this file (when the ctl share is up) plus the console log.
    echo "$*" >"$CTL/setup_failed" 2>/dev/null
    /bin/busybox poweroff -f
    while :; do /bin/busybox sleep 60; done # never let PID 1 exit (kernel panic)
}

# Non-NOFORK applets are re-executed via /proc/self/exe: mount /proc first.
/bin/busybox mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm "$CTL"
# devtmpfs lacks these; bash process substitution needs /dev/fd.
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ulimit -l unlimited # ibv_reg_mr pins memory (root has CAP_IPC_LOCK anyway)

# One modprobe for everything; crc32_generic is listed first on purpose:
# `rdma link add` needs it and it is not a declared dependency of rdma_rxe.
log "loading modules"
read -r MODULES </etc/mori/modules
# shellcheck disable=SC2086 # one word per module
/sbin/modprobe -a $MODULES || die "modprobe -a $MODULES failed"

log "mounting 9p shares"
mount -t 9p -o "$P9OPTS" morictl "$CTL" || die "cannot mount the control share"
# shellcheck disable=SC1091 # written by run_in_vm.sh
. "$CTL/boot.env" || die "cannot read boot.env"
mkdir -p "$SHARE_DIR" || die "cannot create $SHARE_DIR"
mount -t 9p -o "$P9OPTS,cache=mmap" morishare "$SHARE_DIR" || die "cannot mount $SHARE_DIR"

log "setting up dummy0/rxe0 and dummy1/rxe1"
# Soft-RoCE on a dummy netdev: no NIC exists, nothing can leave the VM.
# MTU 9000 gives active_mtu 4096. rxe is RoCE v2 only: GID index 0 is the
# link-local default GID, index 1 the IPv4-mapped GID of $VM_IP (the one to use).
# dummy0 itself comes from loading dummy.ko (numdummies=1, /etc/modprobe.d/mori.conf).
# lo too: TCP to dummy0's own address is delivered through lo (perftest and
# the project's control planes connect that way).
# A second device, rxe1 on dummy1 ($VM_IP2), lets tests use two rails; each
# rail's QPs pair with the same rail on the other engine, which rxe loops
# back locally. Everything else uses rxe0 (MORI_RDMA_DEVICE).
/bin/ip -batch - <<EOF || die "ip setup of lo/dummy0/dummy1 failed"
link set lo up
link set dummy0 mtu 9000
addr add $VM_IP/24 dev dummy0
link set dummy0 up
link add dummy1 type dummy
link set dummy1 mtu 9000
addr add $VM_IP2/24 dev dummy1
link set dummy1 up
EOF
/usr/bin/rdma link add rxe0 type rxe netdev dummy0 || die "rdma link add rxe0 failed"
/usr/bin/rdma link add rxe1 type rxe netdev dummy1 || die "rdma link add rxe1 failed"

# GIDs and the virtio-serial ports appear asynchronously (workqueues): wait,
# bounded, so the command never races them.
GIDDIR=/sys/class/infiniband/rxe0/ports/1
i=0
while :; do
    gid=; type=
    read -r gid <"$GIDDIR/gids/$VM_GID_INDEX" 2>/dev/null
    read -r type <"$GIDDIR/gid_attrs/types/$VM_GID_INDEX" 2>/dev/null
    type1=
    read -r type1 <"/sys/class/infiniband/rxe1/ports/1/gid_attrs/types/$VM_GID_INDEX" 2>/dev/null
    [ "$gid" = "$VM_GID" ] && [ "$type" = "RoCE v2" ] && [ "$type1" = "RoCE v2" ] &&
        [ -e /dev/vport0p1 ] && [ -e /dev/vport0p2 ] && break
    i=$((i + 1))
    [ $i -gt 500 ] && die "rxe0 GID $VM_GID_INDEX is '$gid' ($type), want $VM_GID (RoCE v2); rxe1's is '$type1'; or no vports"
    usleep 10000
done

log "running the command"
cd /
/bin/bash "$CTL/cmd.sh" </dev/null >/dev/vport0p1 2>/dev/vport0p2
echo $? >"$CTL/rc"
log "powering off"
poweroff -f
while :; do sleep 60; done
