"""The mori.io-compatible surface: names, enum values, defaults, engine setup,
memory registration and backend management."""
import inspect
import socket

import pytest
import torch

import mori_torch.io as mio
from conftest import make_engine, unique_key
from mori_torch.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
    TransferStatus,
    XgmiBackendConfig,
)

REFERENCE_EXPORTS = [
    "IOEngine", "IOEngineSession", "IOEngineConfig", "BackendType", "MemoryLocationType", "StatusCode",
    "PollCqMode", "RdmaBackendConfig", "XgmiBackendConfig", "TcpBackendConfig", "EngineDesc", "MemoryDesc",
    "TransferStatus", "set_log_level",
]


def test_exports():
    for name in REFERENCE_EXPORTS:
        assert hasattr(mio, name), name
        assert name in mio.__all__


def test_enum_values():
    assert [(m.name, m.value) for m in BackendType] == [("Unknown", 0), ("XGMI", 1), ("RDMA", 2), ("TCP", 3),
                                                         ("FABRIC", 4)]
    assert [(m.name, m.value) for m in MemoryLocationType] == [("Unknown", 0), ("CPU", 1), ("GPU", 2)]
    assert {m.name: m.value for m in StatusCode} == {
        "SUCCESS": 0, "INIT": 1, "IN_PROGRESS": 2, "ERR_INVALID_ARGS": 11, "ERR_NOT_FOUND": 12,
        "ERR_RDMA_OP": 13, "ERR_BAD_STATE": 14, "ERR_GPU_OP": 15,
    }
    assert (PollCqMode.POLLING, PollCqMode.EVENT) == (0, 1)


def test_config_defaults_and_positional_order():
    assert IOEngineConfig() == IOEngineConfig("", 0)
    r = RdmaBackendConfig(4, 32, 2, PollCqMode.EVENT, False)  # vLLM/SGLang pass these positionally
    assert (r.qp_per_transfer, r.post_batch_size, r.num_worker_threads, r.poll_cq_mode, r.enable_notification) == (
        4, 32, 2, PollCqMode.EVENT, False)
    d = RdmaBackendConfig()
    assert (d.notif_per_qp, d.enable_transfer_chunking, d.chunk_bytes, d.max_chunks_per_transfer,
            d.num_nics_per_transfer) == (1024, False, 65536, 64, 1)
    assert XgmiBackendConfig() == XgmiBackendConfig(64, 64)
    t = TcpBackendConfig()
    assert (t.sock_sndbuf_bytes, t.sock_rcvbuf_bytes, t.op_timeout_ms, t.enable_keepalive, t.keepalive_idle_sec,
            t.keepalive_intvl_sec, t.keepalive_cnt, t.enable_ctrl_nodelay, t.num_data_conns,
            t.striping_threshold_bytes) == (32 << 20, 32 << 20, 30000, True, 30, 10, 3, True, 8, 64 << 10)


def test_method_signatures_match_reference():
    # Positional parameters as in the reference; upstream mori's other
    # spellings are extra keyword-only parameters (test_mori_alias.py).
    params = lambda f: [p.name for p in inspect.signature(f).parameters.values()  # noqa: E731
                        if p.kind is p.POSITIONAL_OR_KEYWORD][1:]
    kwonly = lambda f: [p.name for p in inspect.signature(f).parameters.values()  # noqa: E731
                        if p.kind is p.KEYWORD_ONLY]
    assert kwonly(IOEngine.read) == ["transfer_uid"] and kwonly(IOEngine.create_session) == ["local_mem", "remote_mem"]
    assert params(IOEngine.read) == ["local_dest", "local_offset", "remote_src", "remote_offset", "size", "uid"]
    assert params(IOEngine.write) == ["local_src", "local_offset", "remote_dest", "remote_offset", "size", "uid"]
    assert params(IOEngine.batch_read) == [
        "local_descs", "local_offsets", "remote_descs", "remote_offsets", "sizes", "uids"]
    assert params(IOEngine.register_memory) == ["ptr", "size", "device_id", "mem_loc"]
    assert params(IOEngine.pop_inbound_transfer_status) == ["remote_key", "uid"]
    assert inspect.signature(IOEngine.wait_all).parameters["timeout_ms"].default == -1
    assert inspect.signature(TransferStatus.WaitFor).parameters["timeout_ms"].default == -1


def test_port_zero_binds_and_reports_a_free_port():
    e = IOEngine(unique_key("p0"), IOEngineConfig("127.0.0.1", 0))
    port = e.get_engine_desc().port
    assert port > 0
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    e.shutdown()


def test_explicit_port_and_busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    e = IOEngine(unique_key("px"), IOEngineConfig("127.0.0.1", port))
    assert e.get_engine_desc().port == port
    with pytest.raises(RuntimeError, match=str(port)):
        IOEngine(unique_key("busy"), IOEngineConfig("127.0.0.1", port))
    e.shutdown()


def test_node_id_env_override(monkeypatch):
    monkeypatch.setenv("MORI_TORCH_NODE_ID", "node-under-test")
    e = IOEngine(unique_key("n"), IOEngineConfig("127.0.0.1", 0))
    assert e.get_engine_desc().node_id == "node-under-test"
    e.shutdown()


def test_bad_engine_arguments():
    with pytest.raises(TypeError):
        IOEngine(123, IOEngineConfig())
    with pytest.raises(TypeError):
        IOEngine("k", ("127.0.0.1", 0))
    with pytest.raises(ValueError, match="key must not be empty"):
        IOEngine("", IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match="70000"):
        IOEngine("k", IOEngineConfig("127.0.0.1", 70000))


def test_register_tensor_ids_and_fields():
    e = make_engine("reg")
    tensors = [torch.zeros(n, dtype=torch.float16) for n in (1, 100, 4096)]
    descs = [e.register_torch_tensor(t) for t in tensors]
    assert [d.id for d in descs] == [0, 1, 2]
    for t, d in zip(tensors, descs):
        assert d.data == t.data_ptr() and d.size == t.nbytes
    view = torch.zeros(1000, dtype=torch.uint8)[100:200]
    d = e.register_torch_tensor(view)
    assert d.data == view.data_ptr() and d.size == 100
    e.shutdown()


def test_register_rejects_bad_tensors():
    e = make_engine("regbad")
    with pytest.raises(ValueError, match="contiguous"):
        e.register_torch_tensor(torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="no bytes"):
        e.register_torch_tensor(torch.zeros(0))
    with pytest.raises(TypeError):
        e.register_torch_tensor([1, 2, 3])
    e.shutdown()


def test_register_memory_raw_pointer_and_bad_values():
    e = make_engine("raw")
    t = torch.zeros(8192, dtype=torch.uint8)
    d = e.register_memory(t.data_ptr(), t.nbytes, -1, MemoryLocationType.CPU)
    assert d.data == t.data_ptr() and d.size == 8192 and d.loc == MemoryLocationType.CPU
    with pytest.raises(ValueError, match="ptr is 0"):
        e.register_memory(0, 10, -1, MemoryLocationType.CPU)
    with pytest.raises(ValueError, match="size must be positive, got -5"):
        e.register_memory(t.data_ptr(), -5, -1, MemoryLocationType.CPU)
    with pytest.raises(ValueError, match="not mapped"):
        e.register_memory(8, 4096, -1, MemoryLocationType.CPU)
    with pytest.raises(ValueError):
        e.register_memory(t.data_ptr(), 16, -1, 7)
    with pytest.raises(TypeError):
        e.register_memory("0x10", 16, -1, MemoryLocationType.CPU)
    e.shutdown()


def test_deregister_memory_errors():
    a, b = make_engine("dera"), make_engine("derb")
    d = a.register_torch_tensor(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="belongs to engine"):
        b.deregister_memory(d)
    a.deregister_memory(d)
    with pytest.raises(ValueError, match="not registered"):
        a.deregister_memory(d)
    a.shutdown()
    b.shutdown()


def test_duplicate_backend_is_a_warning(capfd):
    e = make_engine("dup")
    e.create_backend(BackendType.TCP)
    torch.classes.mori.Engine.flush_log(2000)  # lines reach stderr from the log writer thread
    assert "already exists" in capfd.readouterr().err
    e.shutdown()


def test_backend_config_validation():
    e = IOEngine(unique_key("cfg"), IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match="num_data_conns=0"):
        e.create_backend(BackendType.TCP, TcpBackendConfig(num_data_conns=0))
    with pytest.raises(TypeError, match="TcpBackendConfig"):
        e.create_backend(BackendType.TCP, XgmiBackendConfig())
    with pytest.raises(TypeError, match="num_data_conns"):
        e.create_backend(BackendType.TCP, TcpBackendConfig(num_data_conns="8"))
    with pytest.raises(ValueError):
        e.create_backend(42)
    e.create_backend(BackendType.TCP, TcpBackendConfig(num_data_conns=2))
    e.remove_backend(BackendType.TCP)
    e.remove_backend(BackendType.TCP)  # removing twice is harmless
    e.shutdown()


def test_set_log_level():
    mio.set_log_level("error")
    mio.set_log_level("INFO")
    mio.set_log_level("warning")
    with pytest.raises(ValueError, match="loud"):
        mio.set_log_level("loud")
    with pytest.raises(TypeError):
        mio.set_log_level(3)


def test_allocate_transfer_uid_increases_and_sessions_share_it():
    e = make_engine("uid")
    uids = [e.allocate_transfer_uid() for _ in range(5)]
    assert uids == sorted(uids) and len(set(uids)) == 5
    t = torch.zeros(64, dtype=torch.uint8)
    d = e.register_torch_tensor(t)
    s = e.create_session(d, d)  # an engine may target its own memory
    assert s is not None
    u = s.allocate_transfer_uid()
    assert u > uids[-1] and e.allocate_transfer_uid() > u
    # The io layer's calls go through _C.transfer_uid; the native methods
    # take from the same counter.
    mixed = [s.allocate_transfer_uid(), s._s.allocate_transfer_uid(), e.allocate_transfer_uid(),
             e._e.allocate_transfer_uid(), s.allocate_transfer_uid()]
    assert mixed == sorted(mixed) and len(set(mixed)) == 5
    from mori_torch import _C

    for bad in (None, 7, "engine", torch.zeros(1), d._d, TransferStatus()._s):
        with pytest.raises(TypeError, match="expected a torch.classes.mori.Session or Engine"):
            _C.transfer_uid(bad)
    e.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        e.allocate_transfer_uid()
    with pytest.raises(RuntimeError, match="shut down"):
        s.allocate_transfer_uid()
