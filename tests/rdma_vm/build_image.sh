#!/usr/bin/env bash
# Build (or reuse) the Soft-RoCE test guest: an ELF vmlinux from Debian's 6.1
# kernel package and an uncompressed cpio initramfs with a minimal bookworm
# userland, rdma-core, perftest and the needed kernel modules.
#
# Prints the image directory (vmlinux, initrd.cpio, kernel-version) on stdout;
# progress goes to stderr. Cached in $MORI_VM_CACHE (default
# ~/.cache/mori-torch/vm) under a hash of the package/module lists and the
# init script, so a cached call is a fast no-op. Safe to run concurrently.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
cache=${MORI_VM_CACHE:-$HOME/.cache/mori-torch/vm}

# Guest userland; --variant=extract also pulls in their dependencies.
GUEST_PACKAGES=(libc6 libgcc-s1 libstdc++6 bash coreutils busybox-static kmod iproute2
    libibverbs1 ibverbs-providers ibverbs-utils librdmacm1 rdmacm-utils perftest
    cmake)  # ctest runs the RDMA GoogleTests in the guest
# Loaded in this order by the guest's /init (crc32_generic first: `rdma link
# add` fails without it). Their dependency closure is copied into the image.
# virtio_pci serves -machine pc, virtio_mmio -machine microvm.
GUEST_MODULES="crc32_generic rdma_rxe ib_uverbs rdma_ucm virtio_pci virtio_mmio virtio_console 9pnet_virtio 9p dummy"
# Host side: QEMU + image tools, and verbs headers to build test binaries.
# rdma-core itself is not needed on the host (it would pull in udev/systemd).
HOST_PACKAGES=(qemu-system-x86 mmdebstrap cpio kmod xz-utils libibverbs-dev librdmacm-dev)
# Bump when a build step below changes what ends up in the image.
FORMAT=3

log() { echo "build_image: $*" >&2; }
die() { echo "build_image: ERROR: $*" >&2; exit 1; }

key=$({
    echo "$FORMAT"
    echo "${GUEST_PACKAGES[*]}"
    echo "$GUEST_MODULES"
    cat "$here/guest_init.sh"
} | sha256sum | cut -c1-16)
img=$cache/img-$key

apt_get() {
    # Another process may hold the dpkg lock (unattended upgrades, a parallel job).
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@"
}

ensure_host_packages() {
    local p missing=()
    local installed
    # One dpkg-query for all: this runs on every call, keep it cheap.
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${HOST_PACKAGES[@]}" 2>/dev/null | awk '$2 ~ /^ii/ {print $1}' || true)
    for p in "${HOST_PACKAGES[@]}"; do
        grep -qx "$p" <<<"$installed" || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    [[ $(id -u) -eq 0 ]] || die "missing host packages (need root to install): ${missing[*]}"
    log "installing host packages: ${missing[*]}"
    apt_get install -y -q --no-install-recommends "${missing[@]}" >&2 ||
        { apt_get update -q >&2 && apt_get install -y -q --no-install-recommends "${missing[@]}" >&2; }
}

ensure_host_packages

# Fast path: nothing to do.
if [[ -f $img/ok ]]; then
    echo "$img"
    exit 0
fi

mkdir -p "$cache"
# Serialize concurrent builders (parallel CI jobs); re-check after the wait.
exec 9>"$cache/.lock"
flock 9
if [[ -f $img/ok ]]; then
    echo "$img"
    exit 0
fi

t0=$SECONDS
work=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- kernel -----------------------------------------------------------------
# The newest bookworm 6.1 kernel, as the linux-image-amd64 metapackage names it.
kernel_pkg() {
    apt-cache depends linux-image-amd64 2>/dev/null |
        awk '/Depends: linux-image-6\.1\.[0-9.-]+-amd64$/ {print $2; exit}'
}
download_kernel() {
    kpkg=${MORI_VM_KERNEL_PKG:-$(kernel_pkg)}
    [[ -n $kpkg ]] || return 1
    log "downloading $kpkg (never installed on the host)"
    # Sandbox user off: _apt cannot write into our root-owned work dir.
    (cd "$work" && apt-get -q -o APT::Sandbox::User=root download "$kpkg" >&2)
}
# Missing or stale apt lists (a fresh machine, a kernel update since): update once.
if ! download_kernel; then
    log "no downloadable kernel package in the apt lists; running apt-get update"
    apt_get update -q >&2
    download_kernel || die "cannot download a linux-image-6.1.*-amd64 package"
fi
mkdir "$work/k"
dpkg-deb -x "$work"/"$kpkg"_*.deb "$work/k"
rm -f "$work"/*.deb
kver=$(ls "$work/k/lib/modules")
[[ -n $kver && -f $work/k/boot/vmlinuz-$kver ]] || die "unexpected layout of $kpkg"

# Extract the ELF vmlinux from the bzImage: booting it via PVH (-kernel
# vmlinux) skips the in-guest decompression, ~3.5 s instead of 9-10 s under TCG.
# The setup header gives the payload position: setup_sects at 0x1f1,
# payload_offset at 0x248 and payload_length at 0x24c.
bz=$work/k/boot/vmlinuz-$kver
setup_sects=$(od -An -tu1 -j $((0x1f1)) -N1 "$bz")
pl_off=$(od -An -tu4 -j $((0x248)) -N4 "$bz")
pl_len=$(od -An -tu4 -j $((0x24c)) -N4 "$bz")
off=$(((setup_sects + 1) * 512 + pl_off))
# --single-stream: the kernel appends the 4-byte decompressed size after the xz stream.
dd if="$bz" iflag=skip_bytes,count_bytes skip="$off" count="$pl_len" bs=1M status=none | xz -dc --single-stream >"$work/vmlinux" ||
    die "cannot decompress the kernel payload (not xz?)"
[[ $(head -c4 "$work/vmlinux" | od -An -tx1 | tr -d ' ') == 7f454c46 ]] || die "extracted vmlinux is not ELF"

# --- userland ---------------------------------------------------------------
# Same mirror as the host's apt sources when they are deb822 Debian sources.
mirror=${MORI_VM_MIRROR:-}
if [[ -z $mirror ]]; then
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
        mirror=/etc/apt/sources.list.d/debian.sources
    else
        mirror=http://deb.debian.org/debian
    fi
fi
log "mmdebstrap --variant=extract bookworm ($mirror)"
root=$work/root
# </dev/null: mmdebstrap reads extra sources from a non-tty stdin.
mmdebstrap --quiet --variant=extract --include="$(IFS=,; echo "${GUEST_PACKAGES[*]}")" \
    bookworm "$root" "$mirror" </dev/null >&2

# Drop what a test guest never reads (smaller cpio, faster unpack at boot).
rm -rf "${root:?}"/usr/share/{doc,man,info,locale,lintian,linda,bash-completion,common-licenses} \
    "$root"/usr/lib/x86_64-linux-gnu/gconv "$root"/var/cache/* "$root"/var/lib/apt/lists/* \
    "$root"/etc/hostname "$root"/etc/resolv.conf "${root:?}"/boot
# cmake (for ctest) drags in perl and its manual; ctest needs neither.
rm -rf "${root:?}"/usr/share/perl "$root"/usr/lib/x86_64-linux-gnu/perl "$root"/usr/share/cmake-*/Help

# Kernel modules: the dependency closure, then depmod so the guest's modprobe works.
mdir=$root/lib/modules/$kver
mkdir -p "$mdir"
depmod -b "$work/k" "$kver"
for m in $GUEST_MODULES; do
    modprobe -d "$work/k" -S "$kver" --show-depends "$m" || die "module $m not found in $kpkg"
done | awk '$1 == "insmod" {print $2}' | sort -u | while read -r ko; do
    rel=${ko#"$work/k/lib/modules/$kver/"}
    mkdir -p "$mdir/$(dirname "$rel")"
    cp "$ko" "$mdir/$rel"
done
cp "$work/k/lib/modules/$kver"/modules.{builtin,builtin.modinfo,order} "$mdir/"
depmod -b "$root" "$kver"
rm -rf "$work/k"

# Minimal identity files (base-passwd is not part of the extract).
printf 'root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
echo mori-vm >"$root/etc/hostname"
mkdir -p "$root/etc/mori" "$root/run" "$root/tmp"
chmod 1777 "$root/tmp"
chmod 755 "$work"
echo "$GUEST_MODULES" >"$root/etc/mori/modules"
# Loading dummy.ko creates dummy0 (the module default, made explicit).
echo 'options dummy numdummies=1' >"$root/etc/modprobe.d/mori.conf"
install -m 0755 "$here/guest_init.sh" "$root/init"
# Busybox applets for the commands the package list lacks (grep, sed, ps, ...)
# so test scripts find them; never shadowing a real program.
mkdir -p "$root/usr/local/bin"
for a in $("$root/bin/busybox" --list); do
    [[ -e $root/bin/$a || -e $root/sbin/$a || -e $root/usr/bin/$a || -e $root/usr/sbin/$a ]] ||
        ln -s /bin/busybox "$root/usr/local/bin/$a"
done
# ld.so.cache: the loader finds libraries without scanning directories.
ldconfig -r "$root"

# Uncompressed: the kernel unpacks it faster than it would decompress it.
(cd "$root" && find . -print0 | LC_ALL=C sort -z |
    cpio --null --create --format=newc --quiet --reproducible --owner=0:0) >"$work/initrd.cpio"
rm -rf "$root"

echo "$kver" >"$work/kernel-version"
echo "$kpkg ${GUEST_PACKAGES[*]}" >"$work/packages"
mv "$work" "$img"
trap - EXIT
touch "$img/ok"
# Keep only the current image (each is ~120 MB).
for old in "$cache"/img-*; do
    [[ $old == "$img" ]] || rm -rf "$old"
done
log "built $img ($kver, initrd $(du -m "$img/initrd.cpio" | cut -f1) MiB) in $((SECONDS - t0)) s"
echo "$img"
