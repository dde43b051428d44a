"""Worker side of MoriTorchConnector: a prefill and a decode vLLM instance
in two processes (real Scheduler, connector built by vLLM's factory, CPU KV
caches from vLLM's allocator: 4 layers, K and V), meeting in a TCPStore
directory hosted by the test and pulling over TCP. After the decode's step
its cache holds the prefill's bytes for the request's tokens; the prefill
frees its blocks when told, or when the lease ends; a prefill killed
mid-request becomes vLLM load errors without anything hanging."""
import datetime
import multiprocessing as mp
import os
import signal
import socket
import time
import uuid

import pytest
import torch.distributed as dist

import pd_node
from vllm_helpers import BLOCK, HEAD, KV_HEADS, LAYERS, prompt

PAGE = KV_HEADS * BLOCK * 2 * HEAD * 2  # bytes of one block of one layer (bf16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30), use_libuv=True)
    yield s


def extra(store, **over):
    e = {"rendezvous": f"tcpstore://127.0.0.1:{store.port}", "host": "127.0.0.1", "backend": "tcp",
         "side_channel_port": free_port(), "namespace": f"t{uuid.uuid4().hex[:8]}", "ttl_s": 2,
         "connect_timeout_s": 5}
    e.update(over)
    return e


class Node:
    def __init__(self, model, role, extra, *, num_blocks=64, layout="LBNHC", policy="fail", salt=1):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.engine_id = f"{role}-{uuid.uuid4().hex[:6]}"
        self.proc = ctx.Process(target=pd_node.node_main, daemon=True,
                                args=(child, model, role, extra, self.engine_id, num_blocks, layout, policy, salt))
        self.proc.start()
        status, val = self._recv(180)
        assert status == "ready", val
        self.pid = val

    def _recv(self, timeout):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the node did not answer within {timeout}s")
        return self.conn.recv()

    def call(self, *cmd, timeout=60):
        self.conn.send(cmd)
        status, val = self._recv(timeout)
        assert status == "ok", val
        return val

    def step_until(self, pred, steps=20, pause=0.0):
        for _ in range(steps):
            r = self.call("step")
            if pred(r):
                return r
            time.sleep(pause)
        raise AssertionError(f"condition not reached in {steps} steps; last step: {r}")

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20)
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


@pytest.fixture
def nodes():
    made = []

    def make(*a, **kw):
        made.append(Node(*a, **kw))
        return made[-1]

    yield make
    for n in made:
        n.close()


def prefill(p, reqs):
    """Runs prompts through the prefill instance; returns their kv_transfer_params."""
    for rid, toks in reqs.items():
        p.call("add", rid, toks, 1, {"do_remote_decode": True})
    params = {}
    p.step_until(lambda r: params.update(r["finished"]) or len(params) == len(reqs))
    return params


@pytest.mark.parametrize("layouts", [("LBNHC", "BLNHC"), ("LBHNC", "LBHNC")], ids=lambda pair: "-".join(pair))
def test_decode_holds_the_prefills_bytes_after_its_step(model, store, nodes, layouts):
    e = extra(store)
    p = nodes(model, "kv_producer", e, num_blocks=64, layout=layouts[0], salt=1)
    d = nodes(model, "kv_consumer", e, num_blocks=48, layout=layouts[1], salt=2)
    prompts = {"a": prompt(80, 21), "b": prompt(40, 22)}
    free_at_start = p.call("step")["free_blocks"]
    params = prefill(p, prompts)
    assert all(v["remote_engine_id"] == p.engine_id for v in params.values())
    want = {rid: p.call("kv", rid, len(toks) - 1) for rid, toks in prompts.items()}
    assert all(len(b) == (len(prompts[r]) - 1) * KV_HEADS * 2 * HEAD * 2 and b.count(0) < len(b) // 100
               for r, layers in want.items() for b in layers.values())  # random bytes, not an empty cache

    for rid, toks in prompts.items():
        d.call("add", "d" + rid, toks, 3, params[rid])
    r = d.call("step")
    assert r["invalid"] == []
    assert set(r["pulls"]) == {"da", "db"}  # both requests pulled in one step
    assert [len(r["pulls"][x][0]) for x in ("da", "db")] == [5, 3]
    assert r["scheduled"] == {"da": 1, "db": 1}
    for rid, toks in prompts.items():
        got = d.call("kv", "d" + rid, len(toks) - 1)
        for layer in got:  # every token slot of every layer: K and V, byte for byte
            assert got[layer] == want[rid][layer], (rid, layer)
    st = r["stats"]
    assert (st["pulled_requests"], st["pulled_blocks"], st["failed_requests"]) == (2, 8, 0)
    assert st["pulled_bytes"] == 8 * LAYERS * PAGE and len(st["step_s"]) == 1

    # The prefill frees both requests' blocks once told they were read.
    done = set()
    last = p.step_until(lambda r: done.update(r["finished_sending"]) or done == {"a", "b"}, steps=100, pause=0.05)
    assert "a" not in last["live"] and "b" not in last["live"]
    assert last["free_blocks"] == free_at_start
    # The decode goes on decoding from the pulled KV.
    d.step_until(lambda r: {"da", "db"} <= set(r["finished"]))


def test_prefill_and_decode_meet_in_etcd(model, nodes):
    from mori_torch.rendezvous.local_etcd import LocalEtcd

    with LocalEtcd() as etcd:
        e = {"rendezvous": etcd.endpoint.replace("http://", "etcd://"), "host": "127.0.0.1", "backend": "auto",
             "side_channel_port": free_port(), "namespace": f"t{uuid.uuid4().hex[:8]}", "ttl_s": 2}
        p = nodes(model, "kv_producer", e, salt=7)
        d = nodes(model, "kv_consumer", e, num_blocks=40, salt=8)
        toks = prompt(60, 60)
        params = prefill(p, {"e": toks})
        want = p.call("kv", "e", 59)
        d.call("add", "de", toks, 3, params["e"])
        r = d.call("step")
        assert r["invalid"] == [] and len(r["pulls"]["de"][0]) == 4
        assert d.call("kv", "de", 59) == want
        p.step_until(lambda r: r["finished_sending"] == ["e"], steps=100, pause=0.05)
        p.close()
        d.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_killed_mid_request_is_a_load_error_and_nothing_hangs(model, store, nodes, policy):
    e = extra(store)
    p = nodes(model, "kv_producer", e, salt=3)
    d = nodes(model, "kv_consumer", e, num_blocks=48, policy=policy, salt=4)
    warm = prefill(p, {"w": prompt(40, 30)})
    d.call("add", "dw", prompt(40, 30), 1, warm["w"])
    assert d.call("step")["invalid"] == []  # connected, pulling works

    toks = prompt(70, 31)
    params = prefill(p, {"x": toks})
    p.kill()
    d.call("add", "dx", toks, 2, params["x"])
    t0 = time.monotonic()
    r = d.call("step", timeout=60)
    assert time.monotonic() - t0 < 30
    local = r["pulls"]["dx"][0]
    assert len(local) == 5 and r["invalid"] == sorted(local)
    assert r["stats"]["failed_requests"] == 1 and r["stats"]["failed_blocks"] == 5
    if policy == "recompute":
        # vLLM truncated the request to its first failed block and computes the prompt here.
        assert r["computed"]["dx"] == 0 and "dx" not in r["finished"]
        r = d.step_until(lambda r: "dx" in r["finished"])
        assert r["reasons"]["dx"] == "length"
    else:
        assert r["reasons"]["dx"] == "error"


def test_a_decode_that_never_comes_lets_the_lease_end(model, store, nodes):
    p = nodes(model, "kv_producer", extra(store, kv_lease_s=1.5), salt=5)
    free = p.call("step")["free_blocks"]
    prefill(p, {"y": prompt(50, 40)})
    t0 = time.monotonic()
    r = p.step_until(lambda r: r["finished_sending"] == ["y"], steps=200, pause=0.05)
    assert 1.0 < time.monotonic() - t0 < 10
    assert r["stats"]["expired_requests"] == 1 and r["free_blocks"] == free and "y" not in r["live"]


def test_an_unknown_prefill_engine_is_a_load_error(model, store, nodes):
    d = nodes(model, "kv_consumer", extra(store, connect_timeout_s=1), salt=6)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "nobody",
              "remote_request_id": "r", "remote_block_ids": [1, 2, 3], "remote_num_tokens": 40,
              "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_tp_size": 1}
    d.call("add", "dz", prompt(40, 50), 1, params)
    t0 = time.monotonic()
    r = d.call("step")
    assert time.monotonic() - t0 < 10
    assert r["invalid"] == sorted(r["pulls"]["dz"][0]) and len(r["invalid"]) == 3
    assert r["stats"]["failed_connects"] == 1


def test_a_layer_whose_hook_never_ran_is_a_load_error(model, store, nodes):
    e = extra(store)
    p = nodes(model, "kv_producer", e, salt=9)
    d = nodes(model, "kv_consumer", e, num_blocks=40, policy="recompute", salt=10)
    params = prefill(p, {"s": prompt(50, 70)})
    d.call("add", "ds", prompt(50, 70), 2, params["s"])
    r = d.call("step", [2])  # layer 2's attention ran without wait_for_layer_load
    local = r["pulls"]["ds"][0]
    assert r["invalid"] == sorted(local) and len(local) == 4
    assert r["computed"]["ds"] == 0  # vLLM recomputes the prompt rather than use layer 2's missing KV
    assert r["stats"]["failed_requests"] == 1
    p.step_until(lambda r: r["finished_sending"] == ["s"], steps=100, pause=0.05)  # the prefill is freed anyway
