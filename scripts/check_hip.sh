#!/usr/bin/env bash
# Compile-checks the HIP path of csrc/gpu and the GPU backends with Debian's
# hipcc for gfx90a (no AMD GPU needed): one source must build for both vendors.
set -euo pipefail
cd "$(dirname "$0")/.."
export HIP_PLATFORM=amd  # nvcc is installed too; hipcc would otherwise pick it
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for f in csrc/gpu/*.cpp csrc/gpu/*.cu csrc/backends/xgmi/*.cpp; do
  # hipcc leaves two empty directories in $TMPDIR per compile: keep them in $out.
  TMPDIR=$out hipcc -x hip --offload-arch=gfx90a -std=c++17 -O1 -Werror=return-type -DMORI_WITH_GPU=1 -Icsrc \
    -c "$f" -o "$out/$(basename "$f").o"
done
echo "HIP compile check passed for gfx90a ($(ls "$out"/*.o | wc -l) files)"
