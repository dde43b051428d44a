#!/usr/bin/env bash
# Long soak: several initiator processes with mixed verified reads and writes
# against one target (tests/python/soak.py); prints a JSON summary and fails
# unless lost, corrupt and hung transfers are all zero.
#   scripts/soak.sh [--initiators 4] [--seconds 600] [--region-bytes N] ...
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VENV:-.venv}
exec "$VENV/bin/python" tests/python/soak.py --initiators 4 --seconds 600 "$@"
