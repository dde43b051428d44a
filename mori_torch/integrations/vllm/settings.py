"""``kv_connector_extra_config`` of MoriTorchConnector, parsed and checked
once (a bad value is an error naming the key and the value).

Keys (all optional but ``rendezvous``):

``rendezvous``
    Where engines find each other: ``"tcpstore://HOST:PORT"`` (a
    torch.distributed TCPStore) or ``"etcd://HOST:PORT"`` /
    ``"http(s)://HOST:PORT"`` (etcd v3).
``rendezvous_serve``
    true: this worker hosts the TCPStore (exactly one process of the
    deployment; the others connect). Default false.
``namespace``
    Directory namespace shared by the prefill and decode instances
    (default ``"vllm"``).
``backend``
    ``"tcp"``, ``"xgmi"``, ``"rdma"`` or ``"auto"`` (default): auto creates
    XGMI for GPU caches, RDMA where an RDMA device is active, and TCP always;
    the engine picks per peer (XGMI for GPU pairs of one node).
``host``
    Address this worker's engine and side channel listen on, and that
    peers use to reach them (default: vLLM's ``get_ip()``).
``side_channel_port``
    Base port of the prefill workers' side channel (layout queries and
    "blocks read" notices); TP rank r listens on base + r. Default: the
    KVTransferConfig's ``kv_port``.
``kv_lease_s``
    How long a prefill keeps a finished request's blocks for a decode that
    never reads them (default 120).
``connect_timeout_s``
    How long a decode waits for a prefill engine to be listed and to answer
    (default 30).
``ttl_s``
    Rendezvous entry lifetime after a crash (default 10).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Tuple

BACKENDS = ("auto", "tcp", "xgmi", "rdma")
_KNOWN = {"rendezvous", "rendezvous_serve", "namespace", "backend", "host", "side_channel_port", "kv_lease_s",
          "connect_timeout_s", "ttl_s"}


@dataclasses.dataclass(frozen=True)
class Settings:
    store_kind: str  # "tcpstore" or "etcd"
    store_host: str
    store_port: int
    etcd_endpoint: Optional[str]
    rendezvous_serve: bool
    namespace: str
    backend: str
    host: Optional[str]
    side_channel_port: int
    kv_lease_s: float
    connect_timeout_s: float
    ttl_s: float


def _number(extra: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _port(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a port in [1, 65535], got {v!r}")
    return v


def parse_rendezvous(url: Any) -> Tuple[str, str, int, Optional[str]]:
    """``(kind, host, port, etcd_endpoint)`` of a rendezvous URL."""
    if not isinstance(url, str):
        raise ValueError(f"kv_connector_extra_config['rendezvous'] must be a string like "
                         f"'tcpstore://10.0.0.1:29600' or 'etcd://10.0.0.1:2379', got {url!r}")
    m = re.fullmatch(r"(tcpstore|etcd|https?)://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-_]+):(\d{1,5})/?", url)
    if not m:
        raise ValueError(f"kv_connector_extra_config['rendezvous'] = {url!r} is not 'tcpstore://HOST:PORT', "
                         f"'etcd://HOST:PORT' or 'http(s)://HOST:PORT'")
    scheme, host, port = m.group(1), m.group(2), _port("rendezvous", int(m.group(3)))
    if scheme == "tcpstore":
        return "tcpstore", host.strip("[]"), port, None
    endpoint = f"{'http' if scheme == 'etcd' else scheme}://{host}:{port}"
    return "etcd", host, port, endpoint


def parse_settings(extra: Optional[Mapping[str, Any]], kv_port: int) -> Settings:
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KNOWN)
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown keys {unknown} (known: {sorted(_KNOWN)})")
    if "rendezvous" not in extra:
        raise ValueError("kv_connector_extra_config needs 'rendezvous' ('tcpstore://HOST:PORT' or "
                         "'etcd://HOST:PORT'): where prefill and decode engines find each other")
    kind, shost, sport, endpoint = parse_rendezvous(extra["rendezvous"])
    serve = extra.get("rendezvous_serve", False)
    if not isinstance(serve, bool):
        raise ValueError(f"kv_connector_extra_config['rendezvous_serve'] must be true or false, got {serve!r}")
    if serve and kind != "tcpstore":
        raise ValueError("kv_connector_extra_config['rendezvous_serve'] hosts a TCPStore; with etcd, run etcd")
    ns = extra.get("namespace", "vllm")
    if not isinstance(ns, str) or not re.fullmatch(r"[A-Za-z0-9._\-]{1,64}", ns):
        raise ValueError(f"kv_connector_extra_config['namespace'] must be 1-64 of [A-Za-z0-9._-], got {ns!r}")
    backend = extra.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"kv_connector_extra_config['backend'] must be one of {BACKENDS}, got {backend!r}")
    host = extra.get("host")
    if host is not None and (not isinstance(host, str) or not host):
        raise ValueError(f"kv_connector_extra_config['host'] must be a non-empty string, got {host!r}")
    side = _port("side_channel_port", extra.get("side_channel_port", kv_port))
    return Settings(kind, shost, sport, endpoint, serve, ns, backend, host, side,
                    _number(extra, "kv_lease_s", 120.0, 1.0, 86400.0),
                    _number(extra, "connect_timeout_s", 30.0, 0.1, 3600.0),
                    _number(extra, "ttl_s", 10.0, 0.5, 3600.0))


def engine_key(engine_id: str, tp_rank: int) -> str:
    """Directory key of the engine of one TP rank of a vLLM instance."""
    return f"{engine_id}.tp{tp_rank}"
