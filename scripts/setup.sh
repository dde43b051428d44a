#!/usr/bin/env bash
# Installs everything mori_torch needs into a virtual environment (.venv, or
# $MORI_VENV) and builds the extension into it against that torch.
# Incremental: a step whose result is already there is skipped, so a second
# run with nothing changed takes seconds (apt: all packages present; pip: all
# requirements satisfied; the extension: its build key matches, see below).
#   TORCH_SPEC          torch to install (default torch==2.14.1, a CUDA build, so
#                       the CUDAExtension path compiles even without a GPU;
#                       torch==2.13.0 gives the CPU-only build)
#   MORI_SKIP_VLLM_ENV  1: leave out the vLLM environment of tests/vllm
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
LOG_DIR=build/setup-logs
mkdir -p "$LOG_DIR"

# step LABEL FIRST_RUN_TIME: says what starts and how long it roughly takes;
# step_done says how long it took.
step() {
  STEP_START=$SECONDS
  echo "==> $1${2:+ (first run: $2)}"
}
step_done() { echo "    ${1:-done} in $((SECONDS - STEP_START)) s"; }
# quietly LOG CMD...: runs CMD with its output in LOG, shown only if CMD fails.
quietly() {
  local log=$1
  shift
  if ! "$@" >"$log" 2>&1; then
    echo "FAILED: $*  (output below, also in $log)" >&2
    tail -n 40 "$log" >&2
    return 1
  fi
}

# System packages: a compiler toolchain, CMake + Ninja and GoogleTest for the
# torch-free C++ tests, Debian's hipcc and HIP headers for the AMD compile check,
# verbs headers (the RDMA backend compiles against them; libibverbs itself is
# loaded at run time), OpenSSL 3's libcrypto (loaded at run time for peer
# authentication), clang 15 with its compiler-rt (libFuzzer, ASan/UBSan) for the
# fuzz targets, QEMU + image tools for the Soft-RoCE test VM, etcd-server, which
# the rendezvous tests start on a free loopback port, and iproute2 + nftables for
# the fault tests in network namespaces; clang-format-15 for scripts/lint.sh.
missing() { for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done; }
mapfile -t need < <(missing g++ cmake ninja-build libgtest-dev hipcc libamdhip64-dev rocm-device-libs libibverbs-dev \
  etcd-server libssl3 clang-15 libclang-common-15-dev clang-format-15 iproute2 nftables)
# Without recommends: QEMU's would pull in a desktop stack.
mapfile -t need_vm < <(missing qemu-system-x86 mmdebstrap cpio kmod xz-utils)
if ((${#need[@]} + ${#need_vm[@]})); then
  step "apt: installing ${need[*]} ${need_vm[*]}" "2-5 min"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  quietly "$LOG_DIR/apt.log" $SUDO apt-get update -q
  ((${#need[@]} == 0)) || quietly "$LOG_DIR/apt.log" $SUDO apt-get install -y -q "${need[@]}"
  ((${#need_vm[@]} == 0)) || quietly "$LOG_DIR/apt.log" $SUDO apt-get install -y -q --no-install-recommends "${need_vm[@]}"
  step_done
else
  echo "==> apt: all system packages present"
fi

# Disk: a first run puts about 10 GB here (the CUDA torch and its libraries
# about 6, vLLM 1.3, the builds 1.5). Said up front, so that a short disk is
# named before pip fails midway with "No space left on device".
free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
echo "==> disk: ${free_gb} GB free here"
if [ ! -x "$VENV/bin/python" ] && [ "$free_gb" -lt 10 ]; then
  echo "WARNING: a first run needs about 10 GB free, ${free_gb} GB are; it may fail with 'No space left on device'" >&2
fi

[ -x "$VENV/bin/python" ] || { step "creating the virtual environment $VENV" "seconds"; python3 -m venv "$VENV"; step_done; }
PY="$VENV/bin/python"

# satisfied REQ...: true if every requirement is installed in the venv at a
# version it allows (a second or two; pip itself would also ask the index).
satisfied() {
  "$PY" - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
from pip._vendor.packaging.requirements import Requirement
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        installed = version(req.name)
    except PackageNotFoundError:
        sys.exit(1)
    if not req.specifier.contains(installed, prereleases=True):
        sys.exit(1)
EOF
}

# etcd3gw: the etcd v3 client of mori_torch.rendezvous (README "Rendezvous");
# prometheus_client: mori_torch.metrics (IOEngineConfig(metrics_port=...)), as vLLM uses it;
# ruff: scripts/lint.sh (pinned: a new release may add findings).
reqs=(pip "setuptools>=64" wheel "$TORCH_SPEC" ninja numpy pytest pytest-timeout "etcd3gw>=2.7" "prometheus_client>=0.20"
  "ruff==0.17.6")
if satisfied "${reqs[@]}"; then
  echo "==> pip: ${reqs[*]} already installed"
else
  step "pip: installing ${reqs[*]} (torch with its CUDA libraries is about 3 GB to download)" "2-6 min"
  quietly "$LOG_DIR/pip.log" "$VENV/bin/pip" install --disable-pip-version-check --upgrade pip "setuptools>=64" wheel
  quietly "$LOG_DIR/pip.log" "$VENV/bin/pip" install --disable-pip-version-check "${reqs[@]:3}"
  step_done
fi
# NIXL for benchmarks/compare_peers.py's host-memory test (its UCX runs over TCP
# without a GPU), in its own directory so that nothing else imports it.
if PYTHONPATH="$VENV/peers" satisfied nixl-cu13==1.5.1; then
  echo "==> pip: nixl-cu13==1.5.1 already in $VENV/peers"
else
  step "pip: installing nixl-cu13==1.5.1 into $VENV/peers" "under a minute"
  quietly "$LOG_DIR/pip.log" "$VENV/bin/pip" install --disable-pip-version-check --no-deps --upgrade \
    --target "$VENV/peers" nixl-cu13==1.5.1
  step_done
fi

# The extension's build key: everything its compiled code depends on (the C++
# sources and build files, the torch and Python it compiles against, the
# variables setup.py reads). It lives in the venv, never in the source tree;
# the build is skipped while the key matches and the package is installed.
build_key() {
  {
    find csrc setup.py pyproject.toml mori_torch/_version.py mori_torch_alias.pth _mori_torch_alias.py -type f \
      -print0 | sort -z |
      xargs -0 sha256sum
    "$PY" -c "import sys, importlib.metadata as m; print(sys.version, m.version('torch'))"
    echo "${MORI_TORCH_FORCE_CPU:-} ${TORCH_CUDA_ARCH_LIST:-} ${CUDA_HOME:-} ${CUDA_PATH:-} ${ROCM_HOME:-}"
  } | sha256sum | cut -d' ' -f1
}
KEY_FILE="$VENV/.mori_torch_build_key"
key=$(build_key)
if [ -f "$KEY_FILE" ] && [ "$(cat "$KEY_FILE")" = "$key" ] && ls mori_torch/_C*.so >/dev/null 2>&1 &&
  satisfied mori_torch; then
  echo "==> mori_torch: build is current (build key ${key:0:12}), not rebuilt"
else
  rm -f "$KEY_FILE"
  jobs=${MAX_JOBS:-$(nproc)}
  step "building the mori_torch extension with $jobs jobs (log: $LOG_DIR/build.log)" \
    "about $((200 / jobs + 30)) s on $jobs idle cores with the CUDA torch, longer on a busy machine"
  # --no-build-isolation: compile against the torch just installed, not a fresh one.
  MAX_JOBS=$jobs quietly "$LOG_DIR/build.log" "$VENV/bin/pip" install --disable-pip-version-check \
    --no-build-isolation --no-deps -e .
  "$PY" -c "import mori_torch, torch; print('    mori_torch', mori_torch.__version__, 'built against torch', \
torch.__version__, 'with GPU support' if mori_torch._C.WITH_GPU else 'CPU-only (no CUDA/ROCm toolkit found)')"
  echo "$key" >"$KEY_FILE"
  step_done
fi

# The vLLM 0.33.0 environment the connector tests run in (tests/vllm);
# MORI_SKIP_VLLM_ENV=1 leaves it out.
if [ "${MORI_SKIP_VLLM_ENV:-0}" != 1 ]; then
  if satisfied vllm==0.33.0; then
    echo "==> vLLM 0.33.0 already installed"
  else
    step "vLLM 0.33.0 beside mori_torch (tests/vllm; MORI_SKIP_VLLM_ENV=1 leaves it out)" "1-3 min"
    quietly "$LOG_DIR/vllm.log" scripts/setup_vllm_env.sh
    tail -n 1 "$LOG_DIR/vllm.log" | sed 's/^/    /'
    step_done
  fi
fi
echo "==> set up: $VENV is ready"
