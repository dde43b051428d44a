#!/usr/bin/env bash
# Installs everything mori_torch needs into a new virtual environment (.venv,
# or $MORI_VENV) and builds the extension into it against that torch.
#   TORCH_SPEC   torch to install (default torch==2.14.1, a CUDA build, so the
#                CUDAExtension path compiles even without a GPU; torch==2.13.0
#                gives the CPU-only build)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}

# System packages: a compiler toolchain, CMake + Ninja and GoogleTest for the
# torch-free C++ tests, Debian's hipcc and HIP headers for the AMD compile check,
# verbs headers (the RDMA backend compiles against them; libibverbs itself is
# loaded at run time), OpenSSL 3's libcrypto (loaded at run time for peer
# authentication), clang 15 with its compiler-rt (libFuzzer, ASan/UBSan) for the
# fuzz targets, QEMU + image tools for the Soft-RoCE test VM, etcd-server, which
# the rendezvous tests start on a free loopback port, and iproute2 + nftables for
# the fault tests in network namespaces.
missing() { for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done; }
mapfile -t need < <(missing g++ cmake ninja-build libgtest-dev hipcc libamdhip64-dev rocm-device-libs libibverbs-dev \
  etcd-server libssl3 clang-15 libclang-common-15-dev iproute2 nftables)
# Without recommends: QEMU's would pull in a desktop stack.
mapfile -t need_vm < <(missing qemu-system-x86 mmdebstrap cpio kmod xz-utils)
if ((${#need[@]} + ${#need_vm[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  ((${#need[@]} == 0)) || $SUDO apt-get install -y -q "${need[@]}"
  ((${#need_vm[@]} == 0)) || $SUDO apt-get install -y -q --no-install-recommends "${need_vm[@]}"
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip setuptools wheel
# etcd3gw: the etcd v3 client of mori_torch.rendezvous (README "Rendezvous").
"$VENV/bin/pip" install -q "$TORCH_SPEC" ninja numpy pytest pytest-timeout "etcd3gw>=2.7"
# NIXL for benchmarks/compare_peers.py's host-memory test (its UCX runs over TCP
# without a GPU), in its own directory so that nothing else imports it.
"$VENV/bin/pip" install -q --no-deps --upgrade --target "$VENV/peers" nixl-cu13==1.5.1
# --no-build-isolation: compile against the torch just installed, not a fresh one.
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/pip" install -q --no-build-isolation -e .
"$VENV/bin/python" -c "import mori_torch, torch; print('mori_torch built against torch', torch.__version__)"

# The vLLM 0.33.0 environment the connector tests run in (tests/vllm);
# MORI_SKIP_VLLM_ENV=1 leaves it out.
if [ "${MORI_SKIP_VLLM_ENV:-0}" != 1 ]; then
  scripts/setup_vllm_env.sh
fi
