"""RDMA on a host without working verbs: the package imports and works
without libibverbs, and create_backend(RDMA) says clearly why it cannot.

libibverbs is loaded (or found missing) once per process, so each case runs
in a fresh interpreter. MORI_TORCH_IBVERBS_LIB names the library to load
(default libibverbs.so.1; csrc/backends/rdma/verbs_loader.cpp): pointing it
at a path that does not exist is a host without rdma-core's libibverbs1,
whether or not this machine has the library."""
import os
import subprocess
import sys
import textwrap

import pytest

MISSING = "/nonexistent/mori-test/libibverbs.so.1"

# Runs in the child: imports the package, tries RDMA twice, then shows that
# the engine still moves data over TCP; prints one line per fact.
_CHILD = r"""
import sys
import mori_torch  # noqa: F401  (the import itself must not need libibverbs)
import torch
from mori_torch.io import (BackendType, IOEngine, IOEngineConfig, MemoryDesc, RdmaBackendConfig,
                           StatusCode, TcpBackendConfig)

def maps_verbs():
    with open("/proc/self/maps") as f:
        return "libibverbs" in f.read()

print("IMPORTED", "verbs-mapped" if maps_verbs() else "verbs-not-mapped")
a = IOEngine("rdma-host-a", IOEngineConfig("127.0.0.1", 0))
b = IOEngine("rdma-host-b", IOEngineConfig("127.0.0.1", 0))
if sys.argv[1] == "rdma":
    for attempt in range(2):
        try:
            a.create_backend(BackendType.RDMA, RdmaBackendConfig())
        except RuntimeError as e:
            print("RDMA-ERROR", str(e).replace("\n", " "))
        else:
            print("RDMA-CREATED")
# The engine is unharmed: a TCP write between the two engines.
for e in (a, b):
    e.create_backend(BackendType.TCP, TcpBackendConfig())
a.register_remote_engine(b.get_engine_desc())
b.register_remote_engine(a.get_engine_desc())
src = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
dst = torch.zeros(4096, dtype=torch.uint8)
ld = a.register_torch_tensor(src)
rd = MemoryDesc.unpack(b.register_torch_tensor(dst).pack())
st = a.write(ld, 0, rd, 0, 4096, a.allocate_transfer_uid())
code = st.WaitFor(20000)
print("TCP", "ok" if code == StatusCode.SUCCESS and torch.equal(src, dst) else f"failed {code!r} {st.Message()}")
print("END", "verbs-mapped" if maps_verbs() else "verbs-not-mapped")
a.shutdown()
b.shutdown()
"""


def _run(mode, **env):
    e = dict(os.environ)
    e.pop("MORI_TORCH_IBVERBS_LIB", None)
    e.update(env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), mode], env=e, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, f"child exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    lines = {}
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        lines.setdefault(word, []).append(rest)
    return lines, r


def test_missing_libibverbs_import_works_and_create_backend_rdma_raises_clearly():
    lines, r = _run("rdma", MORI_TORCH_IBVERBS_LIB=MISSING)
    assert lines.get("IMPORTED") == ["verbs-not-mapped"], r.stdout + r.stderr
    assert "RDMA-CREATED" not in lines, r.stdout
    errors = lines.get("RDMA-ERROR", [])
    assert len(errors) == 2, r.stdout + r.stderr
    for msg in errors:  # the same clear message every time, not a crash or a hang
        assert "no active RDMA device/port found" in msg, msg
        assert f"cannot load {MISSING}" in msg, msg
        assert "libibverbs1" in msg, msg  # what to install
    assert lines.get("TCP") == ["ok"], r.stdout + r.stderr
    assert lines.get("END") == ["verbs-not-mapped"], r.stdout


def test_libibverbs_is_not_loaded_until_an_rdma_backend_is_asked_for():
    # Importing and using the package for TCP never touches libibverbs (it is
    # dlopen'ed by create_backend(RDMA) only), with or without it installed.
    lines, r = _run("tcp-only")
    assert lines.get("IMPORTED") == ["verbs-not-mapped"], r.stdout + r.stderr
    assert lines.get("TCP") == ["ok"], r.stdout + r.stderr
    assert lines.get("END") == ["verbs-not-mapped"], r.stdout + r.stderr


def test_control_the_maps_check_sees_libibverbs_once_loaded():
    # Without the override, create_backend(RDMA) loads the real library (it
    # then succeeds or fails for want of a device): the check above would
    # have seen it, so "not mapped" there means something.
    import ctypes.util

    if not ctypes.util.find_library("ibverbs"):
        pytest.skip("libibverbs is not installed here")
    lines, r = _run("rdma")
    assert lines.get("IMPORTED") == ["verbs-not-mapped"], r.stdout + r.stderr
    assert lines.get("END") == ["verbs-mapped"], r.stdout + r.stderr
    for msg in lines.get("RDMA-ERROR", []):
        assert "cannot load" not in msg, msg
