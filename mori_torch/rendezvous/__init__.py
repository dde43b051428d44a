"""Rendezvous directory: engines publish their EngineDesc and named
MemoryDescs under a namespace; peers look them up by key, wait for them,
register them in one call (``connect``) and learn when they leave.

Two stores:

- ``TorchStoreDirectory``: any ``torch.distributed.Store``; a TCPStore
  hosted by one process by default. Liveness by heartbeat.
- ``EtcdDirectory``: etcd v3, for deployments across machines. Entries
  live under a lease kept alive by the engine; a watch tells peers at once
  when an entry vanishes.

Example (decode side)::

    d = EtcdDirectory("llm-a", "http://etcd-host:2379", ttl_s=10)
    d.publish(engine, {"kv": engine.register_torch_tensor(kv)})
    peer = d.connect(engine, "prefill-0", timeout_s=60)
    sess = engine.create_session(local, peer.memories["kv"])
"""
from .directory import Directory, Peer
from .record import Entry, LookupTimeout, MalformedEntryError, RendezvousError
from .torch_store import TorchStoreDirectory

__all__ = ["Directory", "Peer", "Entry", "RendezvousError", "LookupTimeout", "MalformedEntryError",
           "TorchStoreDirectory", "EtcdDirectory"]


def __getattr__(name):
    # etcd3gw (and requests) load only when etcd is used.
    if name == "EtcdDirectory":
        from .etcd import EtcdDirectory

        return EtcdDirectory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
