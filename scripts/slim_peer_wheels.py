#!/usr/bin/env python3
"""Download the two peer libraries' wheels (NIXL, Mooncake Transfer Engine) and
slim them so that, together with the project, they fit the GPU machine's
64 MiB transfer (see docs/PEER_WHEELS.md).

    python scripts/slim_peer_wheels.py [--dest .peer_wheels] [--download-dir DIR]

The GPU machine reaches no registry, so the wheels are fetched here for its
Python (3.12, manylinux x86_64) and rewritten with zipfile: the parts the
transfer API does not use are dropped (NIXL's expert-parallel extensions and
storage plugins; Mooncake's store, EP and PG modules and binaries), then every
vendored shared library that no kept binary needs (ELF NEEDED, followed
transitively) goes too, and RECORD lists only what is left. The result is
installed there with `pip install --no-index --no-deps --target DIR`
(scripts/gpu_verify.sh peers).
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, Iterable, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")


# What each wheel loses outright (fnmatch on the archive path). Libraries that
# are loaded with dlopen rather than through NEEDED are listed in "dlopened",
# so that the NEEDED pruning keeps them.
WHEELS = {
    "nixl-cu13": dict(
        version="1.5.1",
        drop=["nixl_ep_cu13/*",  # three 31 MB expert-parallel extensions
              "*.data/headers/*", "nixl_cu13.scripts/*",
              "nixl_cu13.libs/ucx/libucx_perftest*",
              # plugins other than UCX (storage, object stores, DOCA) and telemetry exporters
              "nixl_cu13.libs/nixl/*", ".nixl_cu13.mesonpy.libs/plugins/*"],
        keep=["nixl_cu13.libs/nixl/libplugin_UCX.so", ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so"],
        dlopened=["nixl_cu13.libs/ucx/*", "*/libplugin_UCX.so"],
    ),
    "mooncake-transfer-engine-cuda13": dict(
        version="0.3.14",
        drop=["mooncake/_store*", "mooncake/_ep*", "mooncake/libmooncake_pg*", "mooncake/libmooncake_ep*",
              "mooncake/mooncake_master", "mooncake/mooncake_client", "mooncake/transfer_engine_bench",
              "mooncake/mooncake_ep_jit/*", "mooncake/_pg_jit/*"],
        keep=[],
        dlopened=[],
    ),
}


def download(name: str, version: str, dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", dest, f"{name}=={version}"]
    for p in PLATFORMS:
        cmd[5:5] = ["--platform", p]
    subprocess.run(cmd, check=True)
    stem = name.replace("-", "_") + f"-{version}-"
    for f in os.listdir(dest):
        if f.startswith(stem) and f.endswith(".whl"):
            return os.path.join(dest, f)
    raise SystemExit(f"slim_peer_wheels: pip downloaded no {name} {version} wheel into {dest}")


def is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


def needed(data: bytes) -> List[str]:
    """The ELF's NEEDED entries, read with binutils' readelf."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        try:
            out = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True, check=True).stdout
        except FileNotFoundError as e:
            raise SystemExit("slim_peer_wheels: needs readelf (binutils)"
                             " to follow the libraries' NEEDED entries") from e
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def matches(path: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def slim(src: str, dest_dir: str, spec: dict) -> str:
    zin = zipfile.ZipFile(src)
    names = [i.filename for i in zin.infolist() if not i.is_dir()]
    kept = [n for n in names if matches(n, spec["keep"]) or not matches(n, spec["drop"])]
    elf: Dict[str, List[str]] = {}
    for n in kept:
        data = zin.read(n)
        if is_elf(data):
            elf[n] = needed(data)
    # Shared libraries (lib*.so*) stay only when a kept binary needs them,
    # directly or through another library, or when they are loaded by dlopen.
    def is_lib(n: str) -> bool:
        return posixpath.basename(n).startswith("lib") and ".so" in posixpath.basename(n)

    by_base: Dict[str, List[str]] = {}
    for n in elf:
        by_base.setdefault(posixpath.basename(n), []).append(n)
    reached: Set[str] = set()
    todo = [n for n in elf if not is_lib(n) or matches(n, spec["dlopened"])]
    while todo:
        n = todo.pop()
        if n in reached:
            continue
        reached.add(n)
        for dep in elf[n]:
            todo.extend(by_base.get(dep, []))
    kept = [n for n in kept if n not in elf or n in reached]
    keep_set = set(kept)

    os.makedirs(dest_dir, exist_ok=True)
    out = os.path.join(dest_dir, os.path.basename(src))
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.is_dir() or info.filename not in keep_set or info.filename == record:
                continue
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        lines = [ln for ln in zin.read(record).decode().splitlines() if ln.split(",", 1)[0] in keep_set]
        lines.append(f"{record},,")
        zout.writestr(record, "\n".join(lines) + "\n")
    dropped = len(names) - len(kept)
    print(f"{os.path.basename(src)}: {os.path.getsize(src) / 1e6:.1f} MB -> {os.path.getsize(out) / 1e6:.1f} MB "
          f"({dropped} of {len(names)} files dropped)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=os.path.join(ROOT, ".peer_wheels"), help="where the slim wheels go")
    ap.add_argument("--download-dir", default=None, help="reuse wheels already downloaded here (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dl = args.download_dir or tmp
        os.makedirs(dl, exist_ok=True)
        for name, spec in WHEELS.items():
            stem = name.replace("-", "_") + f"-{spec['version']}-"
            have = [f for f in os.listdir(dl) if f.startswith(stem) and f.endswith(".whl")]
            src = os.path.join(dl, have[0]) if have else download(name, spec["version"], dl)
            slim(src, args.dest, spec)
    total = sum(os.path.getsize(os.path.join(args.dest, f)) for f in os.listdir(args.dest))
    print(f"{args.dest}: {total / 2**20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
