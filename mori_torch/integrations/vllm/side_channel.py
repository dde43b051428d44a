"""The prefill worker's side channel (ZeroMQ, which vLLM already depends
on): a decode worker asks it for the KV layout once per prefill engine, and
tells it which requests' blocks it has read so the prefill can free them.

Messages are one JSON object per frame. A peer cannot make us allocate or
log without bound: frames over MAX_MSG_BYTES are dropped by ZeroMQ, lists are
capped, and malformed messages are answered with an error and logged at most
LOG_LIMIT times.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable, Dict, List, Optional

import zmq

log = logging.getLogger(__name__)

MAX_MSG_BYTES = 1 << 20
MAX_IDS = 4096
MAX_ID_LEN = 512
LOG_LIMIT = 10


def _addr(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.setsockopt(zmq.RCVHWM, 1000)
    s.setsockopt(zmq.IPV6, 1)  # IPv6 and IPv4 hosts alike
    return s


def parse_read_notice(msg: dict) -> List[str]:
    ids = msg.get("req_ids")
    if not isinstance(ids, list) or len(ids) > MAX_IDS:
        raise ValueError(f"'req_ids' must be a list of at most {MAX_IDS} request ids")
    if any(not isinstance(r, str) or not 0 < len(r) <= MAX_ID_LEN for r in ids):
        raise ValueError(f"request ids must be strings of 1-{MAX_ID_LEN} characters")
    return ids


class SideChannelServer:
    """Serves ``{"op": "layout"}`` with ``layout_reply`` and passes the ids of
    ``{"op": "read", "req_ids": [...]}`` to ``on_read`` (from its thread)."""

    def __init__(self, host: str, port: int, layout_reply: dict, on_read: Callable[[List[str]], None]):
        self._ctx = zmq.Context.instance()
        self._sock = _socket(self._ctx, zmq.ROUTER)
        try:
            self._sock.bind(_addr(host, port))
        except zmq.ZMQError as e:
            self._sock.close()
            raise RuntimeError(f"MoriTorchConnector: cannot listen on {host}:{port} for the side channel: {e} "
                               f"(set kv_connector_extra_config 'side_channel_port' or kv_port)") from None
        self._reply = json.dumps({"ok": True, **layout_reply}).encode()
        self._on_read = on_read
        self._stop = threading.Event()
        self._bad = 0
        self._thread = threading.Thread(target=self._run, name="mori-vllm-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 2:
                self._complain(f"a message of {len(frames)} frames")
                continue
            ident, body = frames
            reply = self._handle(body)
            if reply is not None:
                try:
                    self._sock.send_multipart([ident, reply], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the asker is gone or not reading: drop the answer
        self._sock.close()

    def _handle(self, body: bytes) -> Optional[bytes]:
        try:
            msg = json.loads(body)
            if not isinstance(msg, dict):
                raise ValueError("not a JSON object")
            op = msg.get("op")
            if op == "layout":
                return self._reply
            if op == "read":
                self._on_read(parse_read_notice(msg))
                return None  # notices are fire-and-forget
            raise ValueError(f"unknown op {str(op)[:40]!r}")
        except (ValueError, UnicodeDecodeError) as e:
            self._complain(str(e)[:200])
            return json.dumps({"ok": False, "error": str(e)[:200]}).encode()

    def _complain(self, what: str) -> None:
        self._bad += 1
        if self._bad <= LOG_LIMIT:
            log.warning("MoriTorchConnector side channel: malformed message (%s)%s", what,
                        "; further ones are not logged" if self._bad == LOG_LIMIT else "")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class SideChannelClient:
    """The decode worker's end: one DEALER socket per prefill worker."""

    def __init__(self):
        self._ctx = zmq.Context.instance()
        self._socks: Dict[str, zmq.Socket] = {}

    def _sock(self, addr: str) -> zmq.Socket:
        s = self._socks.get(addr)
        if s is None:
            s = self._socks[addr] = _socket(self._ctx, zmq.DEALER)
            s.connect(addr)
        return s

    def _drop(self, addr: str) -> None:
        s = self._socks.pop(addr, None)
        if s is not None:
            s.close()

    def query_layout(self, host: str, port: int, timeout_s: float) -> dict:
        """The prefill worker's layout reply; TimeoutError if it does not
        answer within ``timeout_s``, ValueError if the answer is malformed."""
        addr = _addr(host, port)
        self._drop(addr)  # a fresh socket: no stale answers queued
        s = self._sock(addr)
        s.send(json.dumps({"op": "layout"}).encode())
        if not s.poll(int(timeout_s * 1000), zmq.POLLIN):
            self._drop(addr)
            raise TimeoutError(f"the prefill worker's side channel at {host}:{port} did not answer in {timeout_s:g}s")
        try:
            reply = json.loads(s.recv())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed side channel answer from {host}:{port}: {e}") from None
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            raise ValueError(f"the side channel at {host}:{port} answered {str(reply)[:200]}")
        return reply

    def notify_read(self, host: str, port: int, req_ids: List[str]) -> bool:
        """Tells the prefill worker that ``req_ids`` were read (fire and
        forget: never blocks). False if the notice could not be queued."""
        addr = _addr(host, port)
        ok = True
        for i in range(0, len(req_ids), MAX_IDS):
            try:
                self._sock(addr).send(json.dumps({"op": "read", "req_ids": req_ids[i:i + MAX_IDS]}).encode(),
                                      zmq.NOBLOCK)
            except zmq.ZMQError:
                ok = False
        return ok

    def close(self) -> None:
        for addr in list(self._socks):
            self._drop(addr)
