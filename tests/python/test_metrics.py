"""Prometheus exposition of IOEngine.stats() (mori_torch.metrics), scraped for
real: a collector on a registry of the test's own, and the HTTP endpoint an
engine serves with IOEngineConfig(metrics_port=...)."""
import urllib.request

import prometheus_client  # scripts/setup.sh installs it
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import Pair, make_engine, unique_key, wait_ok
from mori_torch.io import BackendType, IOEngine, IOEngineConfig


def _samples(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sample(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_collector_exposes_the_counters():
    from mori_torch.metrics import EngineCollector

    p = Pair(nbytes=1 << 16)
    try:
        for i in range(3):
            wait_ok(p.init.write(p.local_desc, 0, p.remote_desc, 0, 1000, i))
        wait_ok(p.init.read(p.local_desc, 0, p.remote_desc, 0, 500, 9))
        p.init.write(p.local_desc, 0, p.remote_desc, 1 << 16, 1, 10).WaitFor(5000)  # refused
        registry = prometheus_client.CollectorRegistry()
        registry.register(EngineCollector(p.init))
        s = _samples(prometheus_client.generate_latest(registry).decode())
        lab = dict(engine=p.init.key, backend="TCP", peer=p.target.key)
        assert _sample(s, "mori_torch_transfers_total", op="write", **lab) == 3
        assert _sample(s, "mori_torch_transfers_total", op="read", **lab) == 1
        assert _sample(s, "mori_torch_transfer_bytes_total", op="write", **lab) == 3000
        assert _sample(s, "mori_torch_transfer_bytes_total", op="read", **lab) == 500
        assert _sample(s, "mori_torch_transfers_in_flight", **lab) == 0
        assert _sample(s, "mori_torch_transfer_latency_seconds_count", **lab) == 4
        assert _sample(s, "mori_torch_transfer_latency_seconds_bucket", le="+Inf", **lab) == 4
        assert _sample(s, "mori_torch_transfer_latency_seconds_sum", **lab) > 0
        refused = dict(engine=p.init.key, backend="none", peer="")
        assert _sample(s, "mori_torch_transfer_errors_total", code="ERR_INVALID_ARGS", **refused) == 1
        # Cumulative buckets never decrease.
        buckets = sorted(
            (float(dict(k[1])["le"]), v) for k, v in s.items()
            if k[0] == "mori_torch_transfer_latency_seconds_bucket" and dict(k[1])["peer"] == p.target.key
        )
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        # per_peer=False: one series per backend.
        registry2 = prometheus_client.CollectorRegistry()
        registry2.register(EngineCollector(p.init, per_peer=False))
        s2 = _samples(prometheus_client.generate_latest(registry2).decode())
        assert _sample(s2, "mori_torch_transfers_total", op="write", engine=p.init.key, backend="TCP", peer="") == 3
    finally:
        p.close()


def test_metrics_port_serves_prometheus_text():
    target = make_engine("target")
    init = IOEngine(unique_key("init"), IOEngineConfig("127.0.0.1", 0, metrics_port=0))
    try:
        init.create_backend(BackendType.TCP)
        init.register_remote_engine(target.get_engine_desc())
        local = init.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8))
        remote = target.register_torch_tensor(torch.zeros(4096, dtype=torch.uint8))
        wait_ok(init.write(local, 0, remote, 0, 4096, 1))
        port = init.metrics_port
        assert isinstance(port, int) and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        s = _samples(text)
        lab = dict(engine=init.key, backend="TCP", peer=target.key)
        assert _sample(s, "mori_torch_transfer_bytes_total", op="write", **lab) == 4096
        assert _sample(s, "mori_torch_transfers_total", op="write", **lab) == 1
    finally:
        init.shutdown()
        target.shutdown()
    with pytest.raises(OSError):  # the endpoint went with the engine
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_metrics_port_bad_values():
    with pytest.raises(ValueError, match=r"metrics_port must be in \[-1, 65535\]"):
        IOEngine(unique_key("e"), IOEngineConfig(metrics_port=70000))
    with pytest.raises(TypeError):
        IOEngine(unique_key("e"), IOEngineConfig(metrics_port="9400"))
