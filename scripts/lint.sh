#!/usr/bin/env bash
# Lints the tree: ruff over all Python (config: [tool.ruff] in pyproject.toml)
# and clang-format-15 --dry-run --Werror over csrc/ and tests/cpp/ (*.cpp, *.h,
# *.cu; style: .clang-format at the repo root). Nothing is rewritten.
#
# A missing tool (or a missing .clang-format) fails the run with a message;
# with MORI_TORCH_LINT_OPTIONAL=1 that check is skipped instead.
# Exit status: 0 when every check that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."

optional=${MORI_TORCH_LINT_OPTIONAL:-0}
status=0

missing() {  # $1: what is missing and how to get it
  if [ "$optional" = 1 ]; then
    echo "lint: SKIPPED: $1 (MORI_TORCH_LINT_OPTIONAL=1)"
  else
    echo "lint: ERROR: $1 (set MORI_TORCH_LINT_OPTIONAL=1 to skip this check)" >&2
    status=1
  fi
}

# --- Python: ruff -----------------------------------------------------------
ruff=()
if command -v ruff >/dev/null 2>&1; then
  ruff=(ruff)
elif "${PYTHON:-python3}" -m ruff --version >/dev/null 2>&1; then
  ruff=("${PYTHON:-python3}" -m ruff)
fi
if [ ${#ruff[@]} -eq 0 ]; then
  missing "ruff not found on PATH nor as '${PYTHON:-python3} -m ruff' (pip install ruff)"
else
  n=$("${ruff[@]}" check --show-files . 2>/dev/null | grep -c '\.py')
  echo "lint: ruff check . ($("${ruff[@]}" --version), $n Python files)"
  if "${ruff[@]}" check .; then
    echo "lint: ruff: clean"
  else
    echo "lint: ruff: FAILED" >&2
    status=1
  fi
fi

# --- C++/CUDA: clang-format-15 ----------------------------------------------
if ! command -v clang-format-15 >/dev/null 2>&1; then
  missing "clang-format-15 not found on PATH (apt-get install clang-format-15)"
elif [ ! -f .clang-format ]; then
  missing "no .clang-format at the repo root; clang-format would fall back to its default style"
else
  mapfile -d '' files < <(find csrc tests/cpp -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' \) \
                          -print0 2>/dev/null | sort -z)
  echo "lint: clang-format-15 --dry-run --Werror over csrc/ and tests/cpp/ (${#files[@]} files: *.cpp, *.h, *.cu)"
  if [ ${#files[@]} -eq 0 ]; then
    echo "lint: clang-format: no files found" >&2
    status=1
  elif clang-format-15 --style=file --dry-run --Werror "${files[@]}"; then
    echo "lint: clang-format: clean"
  else
    echo "lint: clang-format: FAILED (fix with: clang-format-15 -i <files>)" >&2
    status=1
  fi
fi

exit $status
