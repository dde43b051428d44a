"""Prometheus exposition of :meth:`mori_torch.io.IOEngine.stats`.

As vLLM does, through ``prometheus_client`` (``pip install prometheus_client``;
imported only here, so ``mori_torch`` imports without it). Either register a
collector with your registry::

    from prometheus_client import REGISTRY
    from mori_torch.metrics import EngineCollector
    REGISTRY.register(EngineCollector(engine))

or let the engine serve its own ``/metrics``::

    IOEngine("prefill-0", IOEngineConfig(metrics_port=9400))

Series (labels ``engine``, ``backend``, ``peer``; ``peer`` is "" with
``per_peer=False``, and transfers refused before a backend was chosen carry
``backend="none"``):

- ``mori_torch_transfers_total{op}``: transfers submitted (``op``: read, write)
- ``mori_torch_transfer_bytes_total{op}``: bytes of transfers that succeeded
- ``mori_torch_transfer_errors_total{code}``: transfers that failed, by status code
- ``mori_torch_transfers_in_flight``: transfers submitted and not yet ended
- ``mori_torch_transfer_latency_seconds``: histogram, submit to end
- ``mori_torch_log_lines_dropped_total``: native log lines lost (no labels)
"""
from __future__ import annotations

import weakref
from typing import Iterable, List, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["EngineCollector", "serve"]

_LABELS = ["engine", "backend", "peer"]


class EngineCollector(Collector):
    """A ``prometheus_client`` collector of one or more engines' counters.

    Engines are held weakly: one that is garbage collected drops out; one that
    is shut down reports what it counted until then. ``per_peer=False`` sums
    each backend's peers into one series (fewer series on large clusters)."""

    def __init__(self, *engines, per_peer: bool = True):
        self._engines: List[weakref.ref] = []
        self._per_peer = bool(per_peer)
        for e in engines:
            self.add(e)

    def add(self, engine) -> None:
        """Starts collecting ``engine``'s counters (an ``IOEngine``)."""
        if not callable(getattr(engine, "stats", None)):
            raise TypeError(f"EngineCollector: expected an IOEngine, got {type(engine).__name__}")
        self._engines.append(weakref.ref(engine))

    def remove(self, engine) -> None:
        self._engines = [r for r in self._engines if r() is not None and r() is not engine]

    def _snapshots(self) -> List[dict]:
        out = []
        for ref in list(self._engines):
            e = ref()
            if e is not None:
                out.append(e.stats())
        return out

    def _series(self, stats: dict) -> Iterable[Tuple[Tuple[str, str, str], dict]]:
        engine = stats["engine"]
        if stats["unrouted"]["transfers"]:
            yield (engine, "none", ""), stats["unrouted"]
        if self._per_peer:
            for peer, backends in stats["peers"].items():
                for backend, c in backends.items():
                    yield (engine, backend, peer), c
        else:
            for backend, c in stats["backends"].items():
                yield (engine, backend, ""), c

    def collect(self):
        from mori_torch import log

        transfers = CounterMetricFamily("mori_torch_transfers", "Transfers submitted", labels=_LABELS + ["op"])
        nbytes = CounterMetricFamily(
            "mori_torch_transfer_bytes", "Bytes of transfers that succeeded", labels=_LABELS + ["op"]
        )
        errors = CounterMetricFamily(
            "mori_torch_transfer_errors", "Transfers that ended with an error", labels=_LABELS + ["code"]
        )
        in_flight = GaugeMetricFamily("mori_torch_transfers_in_flight", "Transfers not yet ended", labels=_LABELS)
        latency = HistogramMetricFamily(
            "mori_torch_transfer_latency_seconds", "Transfer latency, submit to end", labels=_LABELS
        )
        for stats in self._snapshots():
            bounds = [b * 1e-6 for b in stats["latency_bounds_us"]]
            for labels, c in self._series(stats):
                lv = list(labels)
                transfers.add_metric(lv + ["read"], c["reads"])
                transfers.add_metric(lv + ["write"], c["writes"])
                nbytes.add_metric(lv + ["read"], c["bytes_read"])
                nbytes.add_metric(lv + ["write"], c["bytes_written"])
                for code, n in c["errors"].items():
                    errors.add_metric(lv + [code], n)
                in_flight.add_metric(lv, c["in_flight"])
                latency.add_metric(lv, _cumulative(bounds, c["latency"]["buckets"]), c["latency"]["sum_ns"] * 1e-9)
        dropped = CounterMetricFamily("mori_torch_log_lines_dropped",
                                      "Native log lines lost (queue full or rate limit)")
        dropped.add_metric([], log.lines_dropped())
        return [transfers, nbytes, errors, in_flight, latency, dropped]


def _cumulative(bounds: List[float], counts: List[int]) -> List[Tuple[str, float]]:
    """Per-bucket counts (the last one unbounded) -> Prometheus's cumulative buckets."""
    out, total = [], 0
    for bound, n in zip(bounds + [float("inf")], counts):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return out


def serve(engine, port: int, host: str = "127.0.0.1"):
    """Serves ``engine``'s counters at ``http://host:port/metrics`` from a daemon
    thread, on a registry of its own. Returns the server (``server.server_port``
    is the port, useful with ``port=0``; ``server.shutdown()`` stops it)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
