#!/usr/bin/env bash
# Creates the virtual environment the vLLM connector tests run in
# (.venv-vllm, or $MORI_VLLM_VENV): vLLM 0.33.0 on a CPU torch, with
# mori_torch built against that torch. scripts/test.sh runs tests/vllm in it
# when it exists.
#
# A plain `pip install vllm==0.33.0` fails (the wheel pins
# certifi>=2026.10.19, newer than any certifi on PyPI) and pulls the whole
# CUDA stack. This is the lean install of shared/notes/VLLM_ON_CPU.md:
#   1. torch==2.13.0 (CPU),
#   2. the part of vLLM's requirements its scheduler, config and KV-connector
#      paths import, with the wheel's own version bounds (certifi relaxed),
#   3. vllm --no-deps.
# mori_torch is built from a copy of the tracked sources under
# build/vllm-env/src, so the source tree's own build (.venv, a CUDA torch)
# is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VLLM_VENV:-.venv-vllm}
VLLM_SPEC=vllm==0.33.0
TORCH_SPEC=torch==2.13.0
WHEELS=${MORI_TORCH_COMPAT_CACHE:-$HOME/.cache/mori_torch/compat}
SRC=build/vllm-env/src

mkdir -p build
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "$TORCH_SPEC" ninja pytest pytest-timeout "etcd3gw>=2.7"

mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/vllm-0.33.0-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$WHEELS" "$VLLM_SPEC"
  wheel=$(ls "$WHEELS"/vllm-0.33.0-*.whl | head -n1)
fi

# vLLM's requirements that the scheduler/config/connector paths import, with
# the bounds the wheel declares (environment markers dropped: x86-64 Linux).
"$VENV/bin/python" - "$wheel" >build/vllm-env-requirements.txt <<'EOF'
import re, sys, zipfile
LEAN = """regex cachetools psutil numpy requests certifi tqdm blake3 py-cpuinfo transformers
huggingface_hub tokenizers safetensors pydantic msgspec pyzmq cloudpickle pyyaml einops
prometheus_client typing_extensions cbor2 aiohttp oss-harmony openai pillow pybase64 uvloop
xgrammar fastapi partial-json-parser llguidance msgpack""".split()
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wanted = {norm(n) for n in LEAN}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
found = {}
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:") or "extra ==" in line:
        continue
    req = line.split(":", 1)[1].split(";")[0].strip()
    name = norm(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
    if name == "certifi":
        req = "certifi"  # the wheel's pin is newer than any certifi released
    req = re.sub(r"\[[^\]]*\]", "", req)  # fastapi[standard]: the extras are server-only
    if name in wanted:
        found[name] = req
for name in sorted(wanted):
    print(found.get(name, name))  # not in the wheel's list (uvloop, msgpack): any version
EOF
"${PIP[@]}" -r build/vllm-env-requirements.txt
"${PIP[@]}" --no-deps "$wheel"

# mori_torch from a copy of the tracked (and new, unignored) sources. The
# copy keeps its build/ folder and the sources' times, so a rerun recompiles
# only what changed.
mkdir -p "$SRC"
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$SRC"
MAX_JOBS=${MAX_JOBS:-$(nproc)} "${PIP[@]}" --no-build-isolation "$SRC"
py=$(cd "$VENV/bin" && pwd)/python
(cd /tmp && "$py" -c "import mori_torch, torch, vllm; print('vllm', vllm.__version__, 'mori_torch on torch', torch.__version__)")
