"""mori_torch's wire format written out independently in Python, for tests
that play a peer from raw sockets: control frames, the Hello, the
HMAC-SHA256 handshake (Python's hmac module, a second implementation that
must agree with the engine's), MemLookup references and TCP data requests."""
import hashlib
import hmac
import os
import socket
import struct

MAGIC = 0x49524F4D
PROTOCOL_VERSION = 4
HELLO, HELLO_ACK, ERROR, MEM_LOOKUP, MEM_LOOKUP_REPLY = 1, 2, 3, 4, 5
MEM_WATCH, MEM_REVOKE, MEM_REVOKE_ACK, AUTH_CHALLENGE, AUTH_PROOF = 10, 11, 12, 13, 14
CONTROL, DATA = 1, 2
TCP_BACKEND = 3
AUTH_VERSION = 1

REQUEST_MAGIC, RESPONSE_MAGIC = 0x5152544D, 0x5352544D
OP_WRITE, OP_READ, OP_NOTICE = 1, 2, 3
FLAG_NOTIFY = 1
# magic, op, flags, reserved, req_id, uid, mem_id, total_bytes, num_segs,
# parts_total, incarnation, token, reserved2 (tcp_protocol.h)
REQUEST = struct.Struct("<IBBHQQQQIIQ16sQ")
RESPONSE = struct.Struct("<IHHQQ")
assert REQUEST.size == 80 and RESPONSE.size == 24


def pad64(n):
    return (64 - n % 64) % 64


def frame(ftype, payload=b"", magic=MAGIC, version=PROTOCOL_VERSION, length=None):
    return struct.pack("<IHHI", magic, version, ftype, len(payload) if length is None else length) + payload


def read_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_frame(sock):
    _, _, ftype, length = struct.unpack("<IHHI", read_exact(sock, 12))
    return ftype, read_exact(sock, length)


def error_message(payload):
    (n,) = struct.unpack_from("<I", payload, 4)
    return payload[8:8 + n].decode(errors="replace")


def hello(engine_desc_bytes, kind=CONTROL, backend=0, nonce=None):
    auth = b"\x00" if nonce is None else bytes([AUTH_VERSION]) + nonce
    return struct.pack("<BBI", kind, backend, len(engine_desc_bytes)) + engine_desc_bytes + auth


def fake_engine_desc(key, incarnation=1):
    """An EngineDesc (format 2) for a made-up engine."""
    def s(x):
        x = x.encode()
        return struct.pack("<I", len(x)) + x
    return (struct.pack("<IH", 0x4445544D, 2) + s(key) + s("node") + s("host") + s("127.0.0.1") +
            struct.pack("<iiQ", 1, os.getpid(), incarnation))


def _prove(secret, label, transcript):
    return hmac.new(secret.encode(), label + b"\x00" + transcript, hashlib.sha256).digest()


def connect(port, key, secret=None, kind=CONTROL, backend=0, server_key=""):
    """Opens a connection as engine `key`; with `secret`, runs the handshake.
    Returns (socket, type and payload of the last frame received, whether the
    server proved `secret`)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    nonce = os.urandom(32) if secret is not None else None
    h = hello(fake_engine_desc(key), kind, backend, nonce)
    s.sendall(frame(HELLO, h))
    ftype, payload = read_frame(s)
    if secret is None or ftype != AUTH_CHALLENGE:
        return s, ftype, payload, False
    server_nonce, server_proof = payload[1:33], payload[33:65]
    transcript = (struct.pack("<I", len(h)) + h + server_nonce + struct.pack("<I", len(server_key)) +
                  server_key.encode())
    server_proof_ok = hmac.compare_digest(server_proof, _prove(secret, b"mori-torch auth v1: server proof",
                                                                 transcript))
    s.sendall(frame(AUTH_PROOF, bytes([AUTH_VERSION]) + _prove(secret, b"mori-torch auth v1: client proof",
                                                               transcript)))
    ftype, payload = read_frame(s)
    return s, ftype, payload, server_proof_ok


def mem_ref(mem_id, incarnation, token=bytes(16)):
    return struct.pack("<QQ16s", mem_id, incarnation, token)


def memory_desc_fields(packed):
    """(id, incarnation, token) of a packed MemoryDesc (format 2)."""
    (klen,) = struct.unpack_from("<I", packed, 6)
    (mem_id,) = struct.unpack_from("<Q", packed, 10 + klen)
    incarnation, token = struct.unpack_from("<Q16s", packed, len(packed) - 24)
    return mem_id, incarnation, token


def data_request(op, req_id, mem_id, incarnation, token, segs, payload=b"", uid=None, parts_total=1,
                 flags=FLAG_NOTIFY):
    total = sum(size for _, size in segs)
    hdr = REQUEST.pack(REQUEST_MAGIC, op, flags, 0, req_id, req_id if uid is None else uid, mem_id, total,
                       len(segs), parts_total, incarnation, token, 0)
    table = b"".join(struct.pack("<QQ", off, size) for off, size in segs)
    msg = hdr + table
    msg += b"\x00" * pad64(len(msg))
    if op == OP_WRITE:
        msg += payload + b"\x00" * pad64(len(payload))
    return msg


def read_response(sock):
    magic, code, msg_len, req_id, payload_bytes = RESPONSE.unpack(read_exact(sock, 24))
    assert magic == RESPONSE_MAGIC
    rest = read_exact(sock, 24 + msg_len + pad64(24 + msg_len) - 24)
    return code, rest[:msg_len].decode(errors="replace"), req_id, payload_bytes
