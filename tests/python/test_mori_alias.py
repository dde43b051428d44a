"""The opt-in `mori` alias: unmodified `mori`/`mori.io`/`mori.cpp` imports
get mori_torch's objects, in spawned workers too; a real mori is never
shadowed; upstream keyword names and FABRIC are accepted."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import Pair, pattern, wait_ok
from mori_torch.io import BackendType, FabricBackendConfig, IOEngine, IOEngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code: str, env_extra=None, cwd=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "MORI_TORCH_MORI_ALIAS"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd or "/", text=True,
                          capture_output=True, timeout=timeout)


# Unmodified serving-engine style code: imports from mori, moves bytes over
# TCP between two engines, in a worker started with spawn.
SERVING_CODE = """
import multiprocessing as mp

def worker(q):
    import torch
    from mori.cpp import TransferStatus
    from mori.io import (BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, StatusCode,
                         TcpBackendConfig)
    a = IOEngine("alias-a", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("alias-b", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.TCP, TcpBackendConfig())
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    a.register_remote_engine(engine_desc=EngineDesc.unpack(b.get_engine_desc().pack()))
    ls = a.register_torch_tensor(src)
    rd = MemoryDesc.unpack(b.register_torch_tensor(dst).pack())
    sess = a.create_session(local_mem=ls, remote_mem=rd)
    st = sess.batch_write([0], [0], [src.numel()], a.allocate_transfer_uid())
    ok = a.wait_all([st], timeout_ms=20000) == StatusCode.SUCCESS and isinstance(st, TransferStatus)
    q.put((ok, torch.equal(src, dst), type(st).__module__))
    a.shutdown(); b.shutdown()

if __name__ == "__main__":
    import mori, mori.io, mori.cpp, mori_torch.io
    assert mori.io.IOEngine is mori_torch.io.IOEngine and mori.cpp.TransferStatus is mori_torch.io.TransferStatus
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(q,))
    p.start()
    print("RESULT", q.get(timeout=120))
    p.join(60)
    print("EXIT", p.exitcode)
"""


def test_env_alias_reaches_spawned_worker(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SERVING_CODE)
    r = run_py(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
               {"MORI_TORCH_MORI_ALIAS": "1"}, cwd=str(tmp_path))
    assert "RESULT (True, True, 'mori_torch.io')" in r.stdout, r.stdout + r.stderr
    assert "EXIT 0" in r.stdout, r.stdout + r.stderr


def test_explicit_install_reaches_spawned_worker(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SERVING_CODE.replace('if __name__ == "__main__":\n',
                                           'if __name__ == "__main__":\n    import mori_torch; '
                                           'mori_torch.install_mori_alias()\n'))
    r = run_py(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", cwd=str(tmp_path))
    assert "RESULT (True, True, 'mori_torch.io')" in r.stdout, r.stdout + r.stderr


def test_without_opt_in_there_is_no_mori():
    r = run_py("import mori")
    assert r.returncode != 0 and "No module named 'mori'" in r.stderr, r.stderr


def test_modules_and_names():
    r = run_py("""
        import mori, mori.io, mori.cpp
        from mori.io import BackendType, FabricBackendConfig, IOEngine, StatusCode
        from mori.cpp import TransferStatus, MemoryLocationType
        assert BackendType.FABRIC == 4 and StatusCode.ERR_BAD_STATE == 14
        for name in ("IOEngine", "Nope"):
            try:
                getattr(mori.cpp, name)
            except AttributeError as e:
                print("ERR", e)
        try:
            import mori.ops
        except ModuleNotFoundError as e:
            print("NOMOD", e)
    """, {"MORI_TORCH_MORI_ALIAS": "1"})
    assert r.returncode == 0, r.stderr
    assert "ERR mori.cpp.IOEngine (upstream's raw C++ binding) is not provided by mori-torch" in r.stdout
    assert "has no attribute 'Nope'" in r.stdout
    assert "NOMOD No module named 'mori.ops'" in r.stdout


def test_bad_env_value_is_named_and_ignored():
    r = run_py("import mori", {"MORI_TORCH_MORI_ALIAS": "maybe"})
    assert "ignoring MORI_TORCH_MORI_ALIAS='maybe'" in r.stderr, r.stderr
    assert "No module named 'mori'" in r.stderr


@pytest.fixture
def real_mori(tmp_path):
    pkg = tmp_path / "mori"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    return tmp_path


def test_env_alias_refuses_to_shadow_a_real_mori(real_mori):
    r = run_py("import mori", {"MORI_TORCH_MORI_ALIAS": "1", "PYTHONPATH": str(real_mori)})
    assert r.returncode != 0
    assert "MoriAliasRefused" in r.stderr and "refuses to alias `mori`" in r.stderr, r.stderr
    assert str(real_mori / "mori") in r.stderr


def test_install_refuses_to_shadow_a_real_mori(real_mori):
    r = run_py("""
        import os, mori_torch
        try:
            mori_torch.install_mori_alias()
        except ImportError as e:
            print("REFUSED", type(e).__name__, e)
        print("ENV", os.environ.get("MORI_TORCH_MORI_ALIAS"))
        import mori
        print("REAL", mori.REAL)
    """, {"PYTHONPATH": str(real_mori)})
    assert "REFUSED MoriAliasRefused" in r.stdout and str(real_mori / "mori") in r.stdout, r.stdout + r.stderr
    assert "ENV None" in r.stdout and "REAL True" in r.stdout


def test_upstream_keyword_names_move_data():
    p = Pair(nbytes=1 << 16)
    try:
        p.local.copy_(pattern(p.local.numel(), 5))
        sess = p.init.create_session(local_mem=p.local_desc, remote_mem=p.remote_desc)
        wait_ok(sess.write(0, 0, 4096, transfer_uid=sess.allocate_transfer_uid()))
        wait_ok(sess.batch_write([4096], [4096], [4096], transfer_uid=p.init.allocate_transfer_uid()))
        wait_ok(p.init.write(p.local_desc, 8192, p.remote_desc, 8192, 4096, transfer_uid=7))
        [st] = p.init.batch_write([p.local_desc], [[12288]], [p.remote_desc], [[12288]], [[4096]], transfer_uid=[8])
        wait_ok(st)
        assert torch.equal(p.remote[:16384], p.local[:16384])
        assert p.target.pop_inbound_transfer_status(p.init.key, transfer_uid=7) is not None
        with pytest.raises(TypeError, match="got both uid= and its upstream name transfer_uid="):
            sess.write(0, 0, 8, uid=1, transfer_uid=1)
        with pytest.raises(TypeError, match=r"IOEngineSession.read\(\) missing its uid"):
            sess.read(0, 0, 8)
        with pytest.raises(TypeError, match=r"IOEngine.write\(\) missing its uid"):
            p.init.write(p.local_desc, 0, p.remote_desc, 0, 8)
        p.init.deregister_remote_engine(engine_desc=p.target.get_engine_desc())
        p.init.register_remote_engine(engine_desc=p.target.get_engine_desc())
        p.init.deregister_memory(mem_desc=p.local_desc)
    finally:
        p.close()


def test_fabric_backend_exists_and_is_refused_clearly():
    cfg = FabricBackendConfig(num_streams=4, num_events=16)
    assert (cfg.num_streams, cfg.num_events) == (4, 16)
    e = IOEngine("fabric-test", IOEngineConfig("127.0.0.1", 0))
    try:
        with pytest.raises(NotImplementedError, match="FABRIC .* not supported by mori-torch"):
            e.create_backend(BackendType.FABRIC, cfg)
        with pytest.raises(NotImplementedError, match="not supported by mori-torch"):
            e.create_backend(BackendType.FABRIC)
    finally:
        e.shutdown()


def test_a_bare_folder_named_mori_is_not_a_real_mori(tmp_path):
    (tmp_path / "mori").mkdir()  # e.g. a data folder in the working directory: no __init__.py
    r = run_py("import mori.io, mori_torch.io; print(mori.io.IOEngine is mori_torch.io.IOEngine)",
               {"MORI_TORCH_MORI_ALIAS": "1", "PYTHONPATH": str(tmp_path)})
    assert r.stdout.strip() == "True", r.stdout + r.stderr
