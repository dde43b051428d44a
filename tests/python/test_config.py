"""The one configuration table (csrc/base/config_table.cpp, mori_torch.config):
the README shows it, the sources read nothing it does not declare, the
Python config classes agree with it, bad values are clear errors, and
enable_ctrl_nodelay sets TCP_NODELAY on the backend's connections."""
import dataclasses
import os
import pathlib
import re
import socket

import pytest
import torch

from conftest import Pair, wait_ok
from mori_torch import config
from mori_torch.io import IOEngine, IOEngineConfig, RdmaBackendConfig, TcpBackendConfig, XgmiBackendConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Where the package reads settings: the native library, the Python package,
# the build script and the start-up hook of the `mori` alias.
SOURCES = [ROOT / "csrc", ROOT / "mori_torch", ROOT / "setup.py", ROOT / "_mori_torch_alias.py",
           ROOT / "mori_torch_alias.pth"]


def _source_files():
    for p in SOURCES:
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in (".cpp", ".h", ".cu", ".py"))
        for f in files:
            yield f, f.read_text()


def test_readme_configuration_section_is_the_table():
    readme = (ROOT / "README.md").read_text()
    assert config.readme_with_section(readme) == readme, (
        "README.md's configuration section differs from the table: run `python -m mori_torch.config --write-readme`")
    for e in config.ENTRIES:
        assert f"| `{e.name}` |" in readme


def test_check_command_fails_on_a_stale_readme(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace("| `MORI_TORCH_SECRET` |", "| `MORI_TORCH_SECRET_OLD` |"))
    assert config.main(["--check", str(stale)]) == 1
    assert "differs from the table" in capsys.readouterr().err
    assert config.main(["--write-readme", str(stale)]) == 0
    assert stale.read_text() == readme
    assert config.main(["--check", str(stale)]) == 0


def test_every_mori_name_the_sources_quote_is_declared_and_every_declared_one_is_read():
    macros, quoted = set(), {}
    table = ROOT / "csrc" / "base" / "config_table.cpp"
    for f, text in _source_files():
        if f == table:
            continue
        macros |= set(re.findall(r"#\s*(?:define|ifn?def|if|elif)\s+!?\(?(?:defined\s*\(?)?\s*(MORI_\w+)", text))
        for name in re.findall(r"[\"'](MORI_[A-Z0-9_]+)", text):
            quoted.setdefault(name, f.relative_to(ROOT))
    macros.add("MORI_WITH_GPU")  # a compiler definition that setup.py passes (-D), not a variable
    declared = {e.name for e in config.entries(config.ENV)}
    undeclared = {n: str(f) for n, f in quoted.items() if n not in declared and n not in macros}
    assert not undeclared, f"environment variables read but not declared in csrc/base/config_table.cpp: {undeclared}"
    # MORI-IO's overrides are read by RdmaConfig::FromMap from the table itself.
    unread = declared - set(quoted) - {e.name for e in config.entries(config.ENV) if e.overrides}
    assert not unread, f"declared in the table but read nowhere: {sorted(unread)}"


def test_nothing_reads_the_environment_around_the_table():
    table = ROOT / "csrc" / "base" / "config_table.cpp"
    offenders = []
    for f, text in _source_files():
        if f == table:
            continue
        if f.suffix in (".cpp", ".h", ".cu") and re.search(r"\b(secure_)?getenv\s*\(", text):
            offenders.append(str(f.relative_to(ROOT)))
        if f.parent.name == "mori_torch" or "mori_torch" in f.parts[len(ROOT.parts):-1]:
            if re.search(r"os\.(environ|getenv)", text):
                offenders.append(str(f.relative_to(ROOT)))
    assert not offenders, f"read the environment directly instead of through the configuration table: {offenders}"


@pytest.mark.parametrize("cls", [IOEngineConfig, TcpBackendConfig, RdmaBackendConfig, XgmiBackendConfig])
def test_python_config_classes_match_the_table(cls):
    table = {e.name: e for e in config.entries(cls.__name__)}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == set(table), f"{cls.__name__}: fields and table keys differ"
    for name, f in fields.items():
        e = table[name]
        default = f.default
        if e.kind == "choice":
            assert int(default) == e.choices.index(e.default), name
        elif e.kind == "text":
            assert (default or "") == e.default, name
        else:
            assert default == e.default and type(default) is type(e.default), name


def test_config_keys_out_of_range_name_the_key_and_range():
    e = IOEngine("cfg-range", IOEngineConfig("127.0.0.1", 0))
    try:
        with pytest.raises(Exception, match=r"TcpBackendConfig config: staging_depth=1 out of range \[2, 16\]"):
            from mori_torch.io import BackendType

            e.create_backend(BackendType.TCP, TcpBackendConfig(staging_depth=1))
    finally:
        e.shutdown()
    with pytest.raises(Exception, match=r"IOEngineConfig config: port=70000 out of range \[0, 65535\]"):
        IOEngine("cfg-port", IOEngineConfig("127.0.0.1", 70000))


@pytest.mark.parametrize("value, want", [
    ("soon", "MORI_TORCH_FRAME_TIMEOUT_MS='soon' is not an integer in [1, 3600000]"),
    ("0", "MORI_TORCH_FRAME_TIMEOUT_MS='0' is not an integer in [1, 3600000]"),
])
def test_a_bad_environment_value_is_an_error_naming_it(monkeypatch, value, want):
    monkeypatch.setenv("MORI_TORCH_FRAME_TIMEOUT_MS", value)
    with pytest.raises(Exception) as info:
        IOEngine("cfg-env", IOEngineConfig("127.0.0.1", 0))
    assert want in str(info.value)


def _nodelay_of_sockets_on(port: int):
    """TCP_NODELAY of every TCP socket of this process whose local or peer
    port is `port`: both ends of the connections to that engine."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with s:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ends = (s.getsockname()[1], s.getpeername()[1])
            except OSError:  # a listener has no peer
                continue
            if port in ends:
                out.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
    return out


@pytest.mark.parametrize("nodelay", [True, False])
def test_enable_ctrl_nodelay_sets_tcp_nodelay_on_the_backend_connections(nodelay):
    p = Pair(nbytes=1 << 16, num_data_conns=2, striping_threshold_bytes=4096, enable_ctrl_nodelay=nodelay)
    try:
        p.local.copy_(torch.arange(p.local.numel(), dtype=torch.int64).to(torch.uint8))
        uid = p.init.allocate_transfer_uid()
        wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 1 << 16, uid))  # striped: both connections
        assert torch.equal(p.remote, p.local)
        flags = _nodelay_of_sockets_on(p.target.get_engine_desc().port)
        # Each data connection appears twice (initiator and target end); the
        # engines' own control connections always use TCP_NODELAY.
        assert flags.count(False) == (0 if nodelay else 4), flags
        assert flags.count(True) >= (4 if nodelay else 0), flags
    finally:
        p.close()
