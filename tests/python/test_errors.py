"""Every error code with its message; the engine keeps working afterwards."""
import re
import subprocess

import pytest
import torch

from conftest import Pair, make_engine, pattern, unique_key, wait_ok
from mori_torch.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    RdmaBackendConfig,
    StatusCode,
    XgmiBackendConfig,
)


@pytest.fixture
def p():
    pr = Pair(nbytes=1 << 16, num_data_conns=2)
    yield pr
    pr.close()


def _fails(st, code, *fragments):
    assert st.Failed() and st.Code() == code, (st.Code(), st.Message())
    for f in fragments:
        assert f in st.Message(), st.Message()


def test_out_of_range_local_and_remote(p):
    n = 1 << 16
    _fails(p.init.write(p.local_desc, n - 4, p.remote_desc, 0, 8, 1), StatusCode.ERR_INVALID_ARGS,
           "local", str(n - 4), "size 8", str(n))
    _fails(p.init.read(p.local_desc, 0, p.remote_desc, n, 1, 2), StatusCode.ERR_INVALID_ARGS, "remote", str(n))
    _fails(p.init.write(p.local_desc, -1, p.remote_desc, 0, 8, 3), StatusCode.ERR_INVALID_ARGS, "negative")
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    _fails(sess.write(0, 1 << 40, 1, 4), StatusCode.ERR_INVALID_ARGS, "remote")
    _fails(sess.batch_read([0, n], [0, 0], [8, 8], 5), StatusCode.ERR_INVALID_ARGS, "segment 1")


def test_twenty_failing_batches_then_a_good_write(p):
    n = 1 << 16
    for i in range(20):
        sts = p.init.batch_write([p.local_desc], [[0, n]], [p.remote_desc], [[0, 0]], [[8, 8]], [i])
        assert sts[0].Code() == StatusCode.ERR_INVALID_ARGS
    p.local.copy_(pattern(n, 9))
    wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, n, 100))
    assert torch.equal(p.local, p.remote)


def test_mismatched_list_lengths(p):
    sts = p.init.batch_write([p.local_desc, p.local_desc], [[0], [0]], [p.remote_desc], [[0], [0]], [[8], [8]],
                             [1, 2])
    assert len(sts) == 2
    for st in sts:
        _fails(st, StatusCode.ERR_INVALID_ARGS, "mismatched list lengths", "remote_descs 1")
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    _fails(sess.batch_write([0, 8], [0], [8, 8], 3), StatusCode.ERR_INVALID_ARGS, "remote_offsets has 1")
    (st,) = p.init.batch_read([p.local_desc], [[0, 8]], [p.remote_desc], [[0, 8]], [[8]], [4])
    _fails(st, StatusCode.ERR_INVALID_ARGS, "mismatched")


def test_every_batch_status_ends(p):
    """MORI stops at the first failing pair; here every status ends."""
    n = 1 << 16
    good = ([p.local_desc], [[0]], [p.remote_desc], [[0]], [[64]])
    sts = p.init.batch_write(
        [p.local_desc, p.local_desc, p.local_desc], [[0], [n], [64]], [p.remote_desc] * 3, [[0], [0], [64]],
        [[64], [64], [64]], [1, 2, 3])
    assert p.init.wait_all(sts, 10000) == StatusCode.ERR_INVALID_ARGS
    assert [s.WaitFor(10000) for s in sts] == [StatusCode.SUCCESS, StatusCode.ERR_INVALID_ARGS, StatusCode.SUCCESS]
    del good


def test_unregistered_and_deregistered_memory(p):
    other = make_engine("other")
    foreign = other.register_torch_tensor(torch.zeros(64, dtype=torch.uint8))
    _fails(p.init.write(foreign, 0, p.remote_desc, 0, 8, 1), StatusCode.ERR_INVALID_ARGS, "belongs to engine")
    t = torch.zeros(64, dtype=torch.uint8)
    d = p.init.register_torch_tensor(t)
    sess = p.init.create_session(d, p.remote_desc)
    p.init.deregister_memory(d)
    _fails(p.init.write(d, 0, p.remote_desc, 0, 8, 2), StatusCode.ERR_NOT_FOUND, "not registered")
    _fails(sess.write(0, 0, 8, 3), StatusCode.ERR_NOT_FOUND, "deregistered")
    assert not sess.alive()
    # Remote memory deregistered on the target: the target refuses.
    t2 = torch.zeros(64, dtype=torch.uint8)
    rd = p.target.register_torch_tensor(t2)
    p.target.deregister_memory(rd)
    st = p.init.write(p.local_desc, 0, MemoryDesc.unpack(rd.pack()), 0, 8, 4)
    assert st.WaitFor(10000) == StatusCode.ERR_NOT_FOUND
    assert "not registered" in st.Message()
    with pytest.raises(ValueError, match="not registered"):
        p.init.create_session(p.local_desc, MemoryDesc.unpack(rd.pack()))
    other.shutdown()


def test_target_bounds_checks_forged_descriptor(p):
    """A descriptor claiming more memory than was registered passes the
    initiator's check; the target must refuse and leave its memory alone."""
    guard = torch.full((4096,), 0xEE, dtype=torch.uint8)
    inner = guard[1024:2048]
    d = p.target.register_torch_tensor(inner)
    raw = bytearray(d.pack())
    # The size field follows engine_key, id, device_id, bus id and data; find it by value.
    size_bytes = (1024).to_bytes(8, "little")
    at = raw.rfind(size_bytes)
    raw[at:at + 8] = (4096).to_bytes(8, "little")
    forged = MemoryDesc.unpack(bytes(raw))
    assert forged.size == 4096
    p.local.fill_(1)
    st = p.init.write(p.local_desc, 0, forged, 0, 2048, 7)
    assert st.WaitFor(10000) == StatusCode.ERR_INVALID_ARGS
    assert "rejected by target" in st.Message()
    assert bool((guard == 0xEE).all())
    st = p.init.read(p.local_desc, 0, forged, 1024, 1024, 8)
    assert st.WaitFor(10000) == StatusCode.ERR_INVALID_ARGS
    wait_ok(p.init.write(p.local_desc, 0, forged, 0, 1024, 9))  # in range: fine
    assert bool((inner == 1).all()) and bool((guard[:1024] == 0xEE).all())


def test_unknown_engine(p):
    stranger = make_engine("stranger")
    sd = stranger.register_torch_tensor(torch.zeros(64, dtype=torch.uint8))
    _fails(p.init.write(p.local_desc, 0, sd, 0, 8, 1), StatusCode.ERR_NOT_FOUND, stranger.key,
           "register_remote_engine")
    with pytest.raises(ValueError, match="not registered"):
        p.init.deregister_remote_engine(stranger.get_engine_desc())
    stranger.shutdown()


def test_no_backend():
    a = IOEngine(unique_key("nb-a"), IOEngineConfig("127.0.0.1", 0))
    b = IOEngine(unique_key("nb-b"), IOEngineConfig("127.0.0.1", 0))
    a.register_remote_engine(b.get_engine_desc())
    la = a.register_torch_tensor(torch.zeros(64, dtype=torch.uint8))
    rb = b.register_torch_tensor(torch.zeros(64, dtype=torch.uint8))
    _fails(a.write(la, 0, rb, 0, 8, 1), StatusCode.ERR_BAD_STATE, "No available backend found, create backend first")
    _fails(a.read(la, 0, rb, 0, 8, 2), StatusCode.ERR_BAD_STATE, "No available backend")
    assert a.create_session(la, rb) is None
    # Backend only on the initiator: the target refuses the data connection.
    a.create_backend(BackendType.TCP)
    st = a.write(la, 0, rb, 0, 8, 3)
    assert st.WaitFor(10000) == StatusCode.ERR_BAD_STATE
    assert "has no TCP backend" in st.Message()
    a.shutdown()
    b.shutdown()


def test_unavailable_backends_raise_clearly():
    e = IOEngine(unique_key("unavail"), IOEngineConfig("127.0.0.1", 0))
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no GPU"):
            e.create_backend(BackendType.XGMI)
    # This machine has no RDMA device (CI's kernel has no RDMA at all).
    with pytest.raises(RuntimeError, match="no active RDMA device/port found"):
        e.create_backend(BackendType.RDMA)
    e.create_backend(BackendType.TCP)  # the engine is unharmed
    e.shutdown()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(notif_per_qp=0), "Invalid RDMA config: notifPerQp must be >= 1 when notification is enabled"),
        (dict(max_chunks_per_transfer=0), "Invalid RDMA config: maxChunksPerTransfer must be >= 1"),
        (dict(num_nics_per_transfer=0), "Invalid RDMA config: numNicsPerTransfer must be >= 1"),
        (dict(enable_transfer_chunking=True, chunk_bytes=1024),
         "Invalid RDMA config: chunkBytes must be >= 4096 when chunking is enabled"),
    ],
)
def test_rdma_config_validation_matches_mori_io(kwargs, message):
    e = IOEngine(unique_key("rdmacfg"), IOEngineConfig("127.0.0.1", 0))
    # Checked at create_backend, before any device is looked at (as MORI-IO).
    with pytest.raises(RuntimeError, match=re.escape(message)):
        e.create_backend(BackendType.RDMA, RdmaBackendConfig(**kwargs))
    with pytest.raises(TypeError):
        e.create_backend(BackendType.RDMA, XgmiBackendConfig())
    e.shutdown()


def test_extension_does_not_link_libibverbs():
    # libibverbs is dlopen'ed: the extension must import where rdma-core is absent.
    import mori_torch._C as ext

    out = subprocess.run(["nm", "-D", "--undefined-only", ext.__file__], capture_output=True, text=True, check=True)
    assert not [ln for ln in out.stdout.splitlines() if " ibv_" in ln or ln.strip().startswith("U ibv_")]
    ldd = subprocess.run(["ldd", ext.__file__], capture_output=True, text=True)
    assert "libibverbs" not in ldd.stdout


def test_wrong_argument_types(p):
    with pytest.raises(TypeError):
        p.init.write(p.local_desc, "0", p.remote_desc, 0, 8, 1)
    with pytest.raises(TypeError):
        p.init.write(p.local_desc.pack(), 0, p.remote_desc, 0, 8, 1)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    with pytest.raises(TypeError):
        sess.batch_write([0.5], [0], [8], 1)
    with pytest.raises(TypeError):
        p.init.wait_all([object()])
