"""The prefill's side channel under malformed and oversized messages, and
the connector stats through vLLM's own logging path (KVConnectorLogging)."""
import json
import logging
import socket
import threading
import time

import pytest
import zmq
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

from mori_torch.integrations.vllm import MoriTorchConnector, MoriTorchKVConnectorStats
from mori_torch.integrations.vllm.side_channel import (
    LOG_LIMIT,
    MAX_IDS,
    MAX_MSG_BYTES,
    SideChannelClient,
    SideChannelServer,
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    got = []
    lock = threading.Lock()

    def on_read(ids):
        with lock:
            got.extend(ids)

    port = free_port()
    srv = SideChannelServer("127.0.0.1", port, {"layout": {"x": 1}, "engine_key": "e.tp0"}, on_read)
    yield port, got
    srv.close()


def raw(port):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def answer(s, timeout_ms=3000):
    assert s.poll(timeout_ms), "no answer"
    return json.loads(s.recv())


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


def test_layout_query_and_read_notices(server):
    port, got = server
    c = SideChannelClient()
    assert c.query_layout("127.0.0.1", port, 5) == {"ok": True, "layout": {"x": 1}, "engine_key": "e.tp0"}
    ids = [f"r{i}" for i in range(MAX_IDS + 10)]  # split into two notices
    assert c.notify_read("127.0.0.1", port, ids)
    assert wait_for(lambda: len(got) == len(ids)) and got == ids
    c.close()


def test_malformed_messages_get_an_error_and_the_server_goes_on(server, caplog):
    port, got = server
    s = raw(port)
    caplog.set_level(logging.WARNING)
    bad = [b"not json", b"[1, 2]", json.dumps({"op": "drop tables"}).encode(),
           json.dumps({"op": "read", "req_ids": "r1"}).encode(),
           json.dumps({"op": "read", "req_ids": ["x" * 600]}).encode(),
           json.dumps({"op": "read", "req_ids": [f"r{i}" for i in range(MAX_IDS + 1)]}).encode(),
           b"\xff\xfe"]
    for body in bad:
        s.send(body)
        a = answer(s)
        assert a["ok"] is False and a["error"], body[:40]
    for _ in range(LOG_LIMIT + 5):  # logging stops at LOG_LIMIT
        s.send(b"junk")
        answer(s)
    assert caplog.text.count("malformed message") == LOG_LIMIT
    assert got == []
    s.send(json.dumps({"op": "layout"}).encode())
    assert answer(s)["engine_key"] == "e.tp0"


def test_an_oversized_message_is_dropped_and_others_still_served(server):
    port, got = server
    s = raw(port)
    s.send(b"x" * (MAX_MSG_BYTES + 1))  # ZeroMQ drops the peer's connection without reading it
    time.sleep(0.2)
    c = SideChannelClient()
    assert c.query_layout("127.0.0.1", port, 5)["ok"] is True
    c.close()


def test_a_silent_side_channel_times_out():
    port = free_port()
    c = SideChannelClient()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port} did not answer in 0.5s"):
        c.query_layout("127.0.0.1", port, 0.5)
    assert time.monotonic() - t0 < 3
    assert c.notify_read("127.0.0.1", port, ["r"])  # queued, never blocks
    c.close()


def test_stats_aggregate_and_reduce_through_vllms_logging(caplog):
    a = MoriTorchKVConnectorStats()
    assert a.is_empty()
    a.add("pulled_requests", 2)
    a.add("pulled_blocks", 8)
    a.add("pulled_bytes", 8 << 20)
    a.data["step_s"].append(0.004)
    b = MoriTorchKVConnectorStats()
    b.add("failed_requests", 1)
    b.data["step_s"].append(0.002)
    assert MoriTorchConnector.build_kv_connector_stats(a.data).data == a.data
    kv_logging = KVConnectorLogging(KVTransferConfig(kv_connector="MoriTorchConnector",
                                                     kv_connector_module_path="mori_torch.integrations.vllm",
                                                     kv_role="kv_consumer"))
    kv_logging.observe(a.clone_and_reset().data)
    kv_logging.observe(b.data)
    assert a.is_empty()
    lines = []
    kv_logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    for part in ("pulled_requests=2", "pulled_blocks=8", "failed_requests=1", "avg_step_ms=3.0",
                 "pull_GBps=1.398"):
        assert part in lines[0], lines[0]
