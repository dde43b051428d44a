"""Every `mori` name, attribute and keyword that vLLM's MoRIIO connector and
SGLang's mori backend use exists in mori_torch with a compatible signature.

The real sources come from the pinned wheels, downloaded with
`pip download --no-deps` (cached under ~/.cache/mori_torch/compat, or
$MORI_TORCH_COMPAT_CACHE) and read with `ast` (tests/python/mori_api_uses.py).
The test skips only when the download fails for want of a network, and not
even then under CI (CI=true), where PyPI is reachable.
"""
import ast
import glob
import os
import subprocess
import sys
import zipfile

import pytest

from mori_api_uses import analyze

CACHE = os.environ.get("MORI_TORCH_COMPAT_CACHE", os.path.expanduser("~/.cache/mori_torch/compat"))
PINS = {
    # wheel spec, folder inside the wheel with the mori code
    "vllm": ("vllm==0.33.0", "vllm/distributed/kv_transfer/kv_connector/v1/moriio/"),
    "sglang": ("sglang==0.5.23", "sglang/srt/disaggregation/mori/"),
}
# What each must be found using (guards against a checker that finds nothing).
EXPECTED = {
    "vllm": {"IOEngine(...)", "IOEngineConfig(...)", "RdmaBackendConfig(...)", "XgmiBackendConfig(...)",
             "IOEngine.create_backend", "IOEngine.get_engine_desc", "IOEngine.register_remote_engine",
             "IOEngine.register_torch_tensor", "IOEngine.create_session", "IOEngine.allocate_transfer_uid",
             "IOEngine.wait_all", "IOEngineSession.batch_read", "IOEngineSession.batch_write",
             "IOEngineSession.write", "EngineDesc.unpack", "MemoryDesc.unpack", "EngineDesc.pack",
             "TransferStatus.Failed", "TransferStatus.Succeeded", "TransferStatus.Message", "TransferStatus.Code",
             "StatusCode.SUCCESS", "BackendType.XGMI", "BackendType.RDMA", "PollCqMode.POLLING"},
    "sglang": {"mori.cpp.TransferStatus", "IOEngine(...)", "IOEngineConfig(...)", "RdmaBackendConfig(...)",
               "IOEngine.create_backend", "IOEngine.register_memory", "IOEngine.deregister_memory",
               "IOEngine.register_remote_engine", "IOEngine.batch_write", "IOEngine.allocate_transfer_uid",
               "IOEngine.wait_all", "IOEngine.get_engine_desc", "EngineDesc.port", "EngineDesc.unpack",
               "MemoryDesc.unpack", "MemoryDesc.pack", "TransferStatus.Failed", "TransferStatus.InProgress",
               "TransferStatus.Wait", "MemoryLocationType.GPU", "MemoryLocationType.CPU", "StatusCode.IN_PROGRESS"},
}

_NETWORK_SIGNS = ("Could not find a version", "No matching distribution", "Temporary failure in name resolution",
                  "Failed to establish a new connection", "Network is unreachable", "Max retries exceeded",
                  "ConnectTimeout", "ReadTimeout")


def fetch_sources(name: str):
    spec, folder = PINS[name]
    dist = spec.split("==")[0]
    wheels = glob.glob(os.path.join(CACHE, f"{dist}-{spec.split('==')[1]}-*.whl"))
    if not wheels:
        os.makedirs(CACHE, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--disable-pip-version-check", "-d", CACHE, spec], capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0:
            msg = f"cannot download {spec} with pip: {r.stderr.strip()[-800:]}"
            if any(s in r.stderr for s in _NETWORK_SIGNS) and os.environ.get("CI", "").lower() != "true":
                pytest.skip(msg + " (no network; under CI this fails)")
            pytest.fail(msg)
        wheels = glob.glob(os.path.join(CACHE, f"{dist}-{spec.split('==')[1]}-*.whl"))
    assert wheels, f"pip downloaded no {spec} wheel into {CACHE}"
    with zipfile.ZipFile(wheels[0]) as z:
        sources = {n: z.read(n).decode("utf-8") for n in z.namelist() if n.startswith(folder) and n.endswith(".py")}
    assert sources, f"{wheels[0]} has no {folder}*.py: did the package move its mori code?"
    return sources


@pytest.mark.parametrize("name", sorted(PINS))
def test_serving_engine_mori_uses_exist_in_mori_torch(name):
    uses = analyze(fetch_sources(name))
    table = "\n".join(f"  {'ok ' if u.ok else 'BAD'} {u.file}:{u.line} {u.what}{u.call} [{u.how}] {u.problem}"
                      for u in uses)
    print(f"{PINS[name][0]}: {len(uses)} uses of mori\n{table}")
    bad = [u for u in uses if not u.ok]
    assert not bad, f"{PINS[name][0]} uses mori API that mori_torch lacks:\n" + "\n".join(
        f"  {u.file}:{u.line} {u.what}{u.call}: {u.problem}" for u in bad)
    missing = EXPECTED[name] - {u.what for u in uses}
    assert not missing, f"the checker no longer finds these uses in {PINS[name][0]}: {sorted(missing)}"


# MORI environment variables each serving engine sets or reads in its mori
# code (guards against a scan that finds nothing).
EXPECTED_ENV = {"vllm": set(), "sglang": {"MORI_RDMA_DEVICES"}}


def mori_env_names(sources) -> set:
    """String constants naming MORI_* variables in the sources (os.environ
    keys, getenv arguments, ...)."""
    found = set()
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("MORI_") \
                    and node.value.replace("_", "").isalnum() and node.value.isupper():
                found.add(node.value)
    return found


@pytest.mark.parametrize("name", sorted(PINS))
def test_serving_engine_mori_environment_is_read_by_mori_torch(name):
    """A MORI variable a serving engine sets for mori (SGLang picks each
    rank's RDMA devices with MORI_RDMA_DEVICES) is one mori_torch reads too."""
    from mori_torch import config

    declared = {e.name for e in config.entries(config.ENV)}
    used = mori_env_names(fetch_sources(name))
    assert EXPECTED_ENV[name] <= used, f"the scan no longer finds {sorted(EXPECTED_ENV[name] - used)}"
    unknown = sorted(used - declared)
    assert not unknown, f"{PINS[name][0]} sets or reads {unknown}, which mori_torch ignores"


def test_checker_reports_a_missing_name_and_a_bad_keyword():
    src = """
from mori.io import IOEngine, IOEngineConfig, NoSuchThing
from mori.cpp import TransferStatus
e = IOEngine("k", IOEngineConfig(host="h", port=1))
e.create_session(local_mem=1, remote_mem=2)
e.create_session(local_mem=1, remote_memory=2)
e.register_memory(1, 2, 3)
s = e.create_session(1, 2)
s.batch_write([0], [0], [8], transfer_uid=3)
s.batch_wrte([0], [0], [8], 3)
statuses: list[TransferStatus] = []
for st in statuses:
    st.WaitBusy(timeout_ms=5)
    st.Waitt()
"""
    bad = {(u.what, u.problem.split(":")[0]) for u in analyze({"x.py": src}) if not u.ok}
    assert bad == {
        ("mori.io.NoSuchThing", "mori.io has no NoSuchThing"),
        ("IOEngine.create_session", "does not bind to IOEngine.create_session(local"),
        ("IOEngine.register_memory", "does not bind to IOEngine.register_memory(ptr"),
        ("IOEngineSession.batch_wrte", "IOEngineSession has no attribute 'batch_wrte'"),
        ("TransferStatus.Waitt", "TransferStatus has no attribute 'Waitt'"),
    }, bad
