#!/usr/bin/env bash
# Adds vLLM 0.33.0 to the project's virtual environment (.venv, or
# $MORI_VENV), for the vLLM connector tests (tests/vllm). One environment,
# not a second one with its own torch and its own build of mori_torch: that
# doubled the disk a fresh machine needs (about 4 GB more) and ran CI out of
# space.
#
# A plain `pip install vllm==0.33.0` fails (the wheel pins
# certifi>=2026.10.19, newer than any certifi on PyPI) and pulls the whole
# CUDA stack again. This is the lean install of docs/VLLM_ON_CPU.md:
#   1. the part of vLLM's requirements its scheduler, config and KV-connector
#      paths import, with the wheel's own version bounds (certifi relaxed),
#   2. vllm --no-deps, beside the torch already there (the wheel pins
#      torch==2.14.0; its scheduler and connector paths run on 2.14.1, and
#      vllm._C, which needs the exact torch, is on none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MORI_VENV:-.venv}
VLLM_SPEC=vllm==0.33.0
WHEELS=${MORI_TORCH_COMPAT_CACHE:-$HOME/.cache/mori_torch/compat}
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir)

mkdir -p build
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

py=$(cd "$VENV/bin" && pwd)/python
(cd /tmp && "$py" -c "import mori_torch, torch, vllm; print('vllm', vllm.__version__, 'beside mori_torch on torch', torch.__version__)")
