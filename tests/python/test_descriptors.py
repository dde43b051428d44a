"""EngineDesc / MemoryDesc: fields, pack/unpack round trips, malformed bytes."""
import struct

import pytest
import torch

from conftest import make_engine
from mori_torch.io import EngineDesc, MemoryDesc, MemoryLocationType


@pytest.fixture
def engine():
    e = make_engine("desc")
    yield e
    e.shutdown()


def test_engine_desc_round_trip(engine):
    d = engine.get_engine_desc()
    assert d.key == engine.key
    assert d.host == "127.0.0.1"
    assert 0 < d.port < 65536
    assert d.pid > 0 and d.hostname and d.node_id
    b = d.pack()
    assert isinstance(b, bytes)
    assert EngineDesc.unpack(b) == d
    assert EngineDesc.unpack(bytearray(b)) == d


def test_memory_desc_round_trip_and_fields(engine):
    t = torch.arange(4096, dtype=torch.int32)
    m = engine.register_torch_tensor(t)
    assert m.engine_key == engine.key
    assert m.loc == MemoryLocationType.CPU
    assert m.device_id == -1
    assert m.device_bus_id == ""
    assert m.data == t.data_ptr()
    assert m.size == t.numel() * 4
    assert m.ipc_handle == bytes(64)
    assert m.ipc_offset == 0
    assert isinstance(m.numa_node, int)
    u = MemoryDesc.unpack(m.pack())
    assert u == m
    assert u.size == m.size and u.data == m.data and u.id == m.id


def test_descriptor_kinds_are_not_interchangeable(engine):
    m = engine.register_torch_tensor(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="magic"):
        EngineDesc.unpack(m.pack())
    with pytest.raises(ValueError, match="magic"):
        MemoryDesc.unpack(engine.get_engine_desc().pack())


@pytest.mark.parametrize("cls_name", ["engine", "memory"])
def test_malformed_bytes_rejected(engine, cls_name):
    if cls_name == "engine":
        cls, good = EngineDesc, engine.get_engine_desc().pack()
    else:
        cls, good = MemoryDesc, engine.register_torch_tensor(torch.zeros(8, dtype=torch.uint8)).pack()
    for cut in range(1, len(good)):
        with pytest.raises(ValueError, match="truncated"):
            cls.unpack(good[:cut])
    with pytest.raises(ValueError, match="trailing|oversized"):
        cls.unpack(good + b"\x00")
    wrong_version = good[:4] + struct.pack("<H", 99) + good[6:]
    with pytest.raises(ValueError, match="version 99"):
        cls.unpack(wrong_version)
    with pytest.raises(ValueError, match="empty"):
        cls.unpack(b"")
    with pytest.raises(TypeError):
        cls.unpack("not bytes")


def test_unpacked_remote_desc_equality_is_field_wise(engine):
    a = engine.register_torch_tensor(torch.zeros(8, dtype=torch.uint8))
    b = engine.register_torch_tensor(torch.zeros(8, dtype=torch.uint8))
    assert a != b
    assert a == MemoryDesc.unpack(a.pack())
    assert (a == "x") is False
