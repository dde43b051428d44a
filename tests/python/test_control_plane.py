"""Raw sockets abuse the control plane: each bad connection is closed with a
logged reason and the engine keeps serving everyone else."""
import socket
import struct
import time

import pytest

from conftest import Pair, wait_ok

MAGIC = 0x49524F4D
HELLO, MEM_LOOKUP = 1, 4


def frame(ftype, payload=b"", magic=MAGIC, version=4, length=None):
    return struct.pack("<IHHI", magic, version, ftype, len(payload) if length is None else length) + payload


def closed_by_server(sock, within=5.0):
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.fixture
def p(monkeypatch):
    monkeypatch.setenv("MORI_TORCH_FRAME_TIMEOUT_MS", "300")
    pr = Pair(nbytes=1 << 16, num_data_conns=2)
    yield pr
    pr.close()


def connect(p):
    return socket.create_connection(("127.0.0.1", p.target.get_engine_desc().port), timeout=5)


def hello_payload(p, kind=1, backend=0):
    desc = p.init.get_engine_desc().pack()
    return struct.pack("<BBI", kind, backend, len(desc)) + desc + b"\x00"  # no authentication


@pytest.mark.parametrize(
    "blob",
    [
        b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100,
        frame(HELLO, length=1 << 31),  # oversized length
        frame(99, b"abc"),  # unknown type
        frame(HELLO, b"", magic=0xDEADBEEF),
        frame(HELLO, b"", version=7),
        frame(HELLO, b"", version=1),  # the unpadded TCP wire of release 1
        frame(HELLO, b"\x01\x00\xff\xff\xff\xff"),  # descriptor length past the end
        frame(HELLO, b"\x05\x00" + b"\x00" * 4),  # unknown connection kind
    ],
    ids=["garbage", "oversized", "unknown-type", "bad-magic", "bad-version", "old-version", "bad-desc-len", "bad-kind"],
)
def test_bad_first_frame_closes_only_that_connection(p, blob, capfd):
    s = connect(p)
    s.sendall(blob)
    assert closed_by_server(s)
    s.close()
    p.local.fill_(3)
    wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 1 << 16, p.init.allocate_transfer_uid()))
    assert bool((p.remote == 3).all())
    assert "control plane" in capfd.readouterr().err


def test_stall_mid_frame_times_out(p):
    s = connect(p)
    s.sendall(frame(HELLO, hello_payload(p))[:10])  # half a header, then silence
    t0 = time.monotonic()
    assert closed_by_server(s, within=5)
    assert time.monotonic() - t0 < 3
    s.close()


def test_silent_connection_times_out(p):
    s = connect(p)
    assert closed_by_server(s, within=5)
    s.close()


def test_bad_frame_after_valid_hello(p):
    s = connect(p)
    s.sendall(frame(HELLO, hello_payload(p)))
    hdr = s.recv(12)
    assert struct.unpack("<IHHI", hdr)[2] == 2  # HelloAck
    s.recv(struct.unpack("<IHHI", hdr)[3], socket.MSG_WAITALL)
    # An unknown id gets an Error frame, the connection stays.
    incarnation = p.target.get_engine_desc().incarnation
    s.sendall(frame(MEM_LOOKUP, struct.pack("<QQ16s", 12345, incarnation, b"")))
    hdr = s.recv(12, socket.MSG_WAITALL)
    _, _, ftype, length = struct.unpack("<IHHI", hdr)
    body = s.recv(length, socket.MSG_WAITALL)
    assert ftype == 3 and b"12345" in body
    # A malformed lookup (wrong payload size) is answered with an error too.
    s.sendall(frame(MEM_LOOKUP, b"\x01"))
    _, _, ftype, length = struct.unpack("<IHHI", s.recv(12, socket.MSG_WAITALL))
    assert ftype == 3
    s.recv(length, socket.MSG_WAITALL)
    # Then garbage: closed.
    s.sendall(b"\x00" * 64)
    assert closed_by_server(s)
    s.close()


def test_many_abusive_connections_at_once(p):
    socks = []
    for i in range(50):
        s = connect(p)
        s.sendall(b"\xff" * (i + 1))
        socks.append(s)
    wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 4096, p.init.allocate_transfer_uid()))
    for s in socks:
        assert closed_by_server(s)
        s.close()


def test_data_protocol_garbage_closes_connection(p):
    """A data connection (valid Hello of kind Data) then a malformed request."""
    s = connect(p)
    s.sendall(frame(HELLO, hello_payload(p, kind=2, backend=3)))
    hdr = s.recv(12, socket.MSG_WAITALL)
    s.recv(struct.unpack("<IHHI", hdr)[3], socket.MSG_WAITALL)
    s.sendall(b"\x01" * 80)  # a request header's worth
    assert closed_by_server(s)
    s.close()
    wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 4096, p.init.allocate_transfer_uid()))
