"""Worker side of MoriTorchConnector.

Prefill (producer): registers the KV cache with a mori_torch engine,
publishes it in the rendezvous directory, serves its layout on the side
channel, and keeps each finished request's blocks until a decode says it
has read them (or the lease ends).

Decode (consumer): ``start_load_kv`` turns the step's pulls into per-layer
page tables (int64 tensors on the cache's device, built once per step);
``wait_for_layer_load(layer)`` is called by vLLM just before that layer's
attention. On GPU caches, its first call in a step enqueues every layer's
``torch.ops.mori.read_pages`` on a side stream forked from the forward
stream (``paged_kv.PullsAhead``, capturable), and each call makes the
forward stream wait for that layer's pages only: later layers' pulls
overlap earlier layers' compute. On CPU caches each layer's read runs at
once. At the end of the step the connector learns which pulls failed
(``check_errors`` after the step's work completed), reports their blocks
through vLLM's load-error path and tells each prefill which requests it
has read.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from typing import Dict, List, Mapping, Optional, Set, Tuple

import torch

from ... import ops
from ...io import BackendType, IOEngine, IOEngineConfig, IOEngineSession, MemoryDesc
from ...paged_kv import KVLayout, PageTables, PullsAhead, pull_layer
from ...rendezvous import Directory, Peer, RendezvousError, TorchStoreDirectory
from .metadata import MoriTorchConnectorMetadata, PullSpec
from .settings import Settings, engine_key
from .side_channel import SideChannelClient, SideChannelServer
from .stats import MoriTorchKVConnectorStats

log = logging.getLogger(__name__)

MAX_PENDING_NOTICES = 100_000  # read notices for requests this prefill does not know (yet)


def backing_memory(kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The one allocation all layers' caches are views of, as a flat uint8
    tensor (what the engine registers). vLLM >= 0.33 allocates the KV cache
    so; anything else is refused with the reason."""
    if not kv_caches:
        raise ValueError("register_kv_caches: no KV caches")
    storages = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
    if len(storages) != 1:
        raise ValueError(f"MoriTorchConnector needs every layer's KV cache in one allocation (vLLM 0.33's "
                         f"allocate_kv_cache); these {len(kv_caches)} layers use {len(storages)} allocations")
    first = next(iter(kv_caches.values()))
    storage = first.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (storage.nbytes(),))


def open_directory(settings: Settings, tp_rank: int) -> Directory:
    if settings.store_kind == "tcpstore":
        # With rendezvous_serve, TP rank 0 hosts the TCPStore; the other ranks connect to it.
        return TorchStoreDirectory(settings.namespace, host=settings.store_host, port=settings.store_port,
                                   is_server=settings.rendezvous_serve and tp_rank == 0, ttl_s=settings.ttl_s,
                                   timeout_s=settings.connect_timeout_s)
    from ...rendezvous import EtcdDirectory

    return EtcdDirectory(settings.namespace, settings.etcd_endpoint, ttl_s=settings.ttl_s)


@dataclasses.dataclass
class _RemoteEngine:
    key: str
    peer: Peer
    incarnation: str
    session: IOEngineSession
    handle: int
    layout: KVLayout


@dataclasses.dataclass
class _Pull:
    """One step's pull from one prefill engine (all its requests)."""

    remote: Optional[_RemoteEngine]
    specs: Dict[str, PullSpec]
    tables: Optional[PageTables]
    pending: Set[str]
    error: Optional[str] = None

    @property
    def local_blocks(self) -> List[int]:
        return [b for s in self.specs.values() for b in s.local_block_ids]


@dataclasses.dataclass
class _Step:
    pulls: List[_Pull]
    notices: Dict[Tuple[str, int], List[str]]
    started: Optional[float] = None
    start_event: Optional[object] = None
    end_event: Optional[object] = None  # recorded after the step's last pull (GPU)
    ahead: bool = False  # GPU: every layer's pull was enqueued on the side stream


class ConnectorWorker:
    def __init__(self, engine_id: str, settings: Settings, host: str, tp_rank: int, is_producer: bool,
                 is_consumer: bool):
        self.engine_id, self.settings, self.host, self.tp_rank = engine_id, settings, host, tp_rank
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.key = engine_key(engine_id, tp_rank)
        self.stats = MoriTorchKVConnectorStats()
        self.engine: Optional[IOEngine] = None
        self.directory: Optional[Directory] = None
        self.memory: Optional[torch.Tensor] = None
        self.mem_desc: Optional[MemoryDesc] = None
        self.layout: Optional[KVLayout] = None
        self._ahead: Optional[PullsAhead] = None
        self._remotes: Dict[str, _RemoteEngine] = {}
        self._client: Optional[SideChannelClient] = None
        self._server: Optional[SideChannelServer] = None
        self._step: Optional[_Step] = None
        self._invalid: Set[int] = set()
        self._sending: Dict[str, float] = {}  # request id -> deadline (time.time())
        self._notices: Dict[str, float] = {}  # request id -> when its read notice came
        self._lock = threading.Lock()

    # ---- set-up ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        memory = backing_memory(kv_caches)
        layout = KVLayout.from_caches(kv_caches, memory)
        engine = IOEngine(self.key, IOEngineConfig(host=self.host, port=0))
        try:
            self._create_backends(engine, memory.device)
            self.mem_desc = engine.register_torch_tensor(memory)
            self.directory = open_directory(self.settings, self.tp_rank)
            if self.is_producer:
                self.directory.publish(engine, {"kv": self.mem_desc})
                self._server = SideChannelServer(self.host, self.settings.side_channel_port + self.tp_rank,
                                                 {"layout": layout.to_dict(), "engine_key": self.key},
                                                 self._on_read)
        except BaseException:
            if self.directory is not None:
                self.directory.close()
            engine.shutdown()
            raise
        self.engine, self.memory, self.layout = engine, memory, layout
        # GPU caches: the side stream the step's pulls go ahead on.
        self._ahead = PullsAhead(memory.device) if memory.is_cuda else None
        if self.is_consumer:
            self._client = SideChannelClient()
        log.info("MoriTorchConnector %s: %d layers, %d bytes of KV cache on %s registered", self.key,
                 len(layout.layers), layout.memory_bytes, memory.device)

    def _create_backends(self, engine: IOEngine, device: torch.device) -> None:
        wanted = self.settings.backend
        names = ["xgmi", "rdma", "tcp"] if wanted == "auto" else [wanted]
        made = []
        for name in names:
            if name == "xgmi" and device.type == "cpu":
                if wanted == "xgmi":
                    raise ValueError("kv_connector_extra_config backend 'xgmi' moves GPU memory; this KV cache "
                                     "is on the CPU (use 'tcp' or 'auto')")
                continue
            try:
                engine.create_backend(BackendType[name.upper()])
                made.append(name)
            except (RuntimeError, NotImplementedError) as e:
                if wanted != "auto":
                    raise
                log.info("MoriTorchConnector: no %s backend here (%s)", name, e)
        log.info("MoriTorchConnector %s: backends %s", self.key, made)

    # ---- decode side ---------------------------------------------------------------

    def _connect(self, spec: PullSpec) -> _RemoteEngine:
        key = engine_key(spec.remote_engine_id, self.tp_rank)
        known = self._remotes.get(key)
        if known is not None and known.peer.alive and known.peer.incarnation == known.incarnation:
            return known
        timeout = self.settings.connect_timeout_s
        peer = self.directory.connect(self.engine, key, timeout_s=timeout)
        mem = peer.memories.get("kv")
        if mem is None:
            raise ValueError(f"engine {key!r} publishes no 'kv' memory; is it a MoriTorchConnector prefill?")
        reply = self._client.query_layout(spec.remote_host, spec.remote_port + self.tp_rank, timeout)
        if reply.get("engine_key") != key:
            raise ValueError(f"the side channel at {spec.remote_host}:{spec.remote_port + self.tp_rank} belongs to "
                             f"engine {str(reply.get('engine_key'))[:100]!r}, not {key!r}")
        layout = KVLayout.from_dict(reply.get("layout"))
        self.layout.check_pullable_from(layout)
        session = self.engine.create_session(self.mem_desc, mem)
        if session is None:
            raise RuntimeError(f"no backend of this engine reaches engine {key!r} for this memory pair")
        handle = ops.session_handle(session)  # may fail (mapping the remote memory); the old one stays valid until then
        if known is not None:
            self._remotes.pop(key, None)
            ops.release_session_handle(known.handle)
        remote = _RemoteEngine(key, peer, peer.incarnation, session, handle, layout)
        self._remotes[key] = remote
        return remote

    def start_load_kv(self, meta: MoriTorchConnectorMetadata) -> None:
        if self.is_producer and meta.reqs_to_send:
            with self._lock:
                self._sending.update(meta.reqs_to_send)
        if self._step is not None:  # a step whose results were never collected
            self._finish_step()
        if not meta.reqs_to_pull:
            return
        step = _Step([], defaultdict(list))
        by_engine: Dict[str, Dict[str, PullSpec]] = defaultdict(dict)
        for req_id, spec in meta.reqs_to_pull.items():
            step.notices[(spec.remote_host, spec.remote_port + self.tp_rank)].append(spec.remote_request_id)
            if spec.local_block_ids:
                by_engine[spec.remote_engine_id][req_id] = spec
        for specs in by_engine.values():
            pull = _Pull(None, specs, None, set())
            try:
                first = next(iter(specs.values()))
                pull.remote = self._connect(first)
                local = [b for s in specs.values() for b in s.local_block_ids]
                remote = [b for s in specs.values() for b in s.remote_block_ids]
                pull.tables = PageTables(self.layout, pull.remote.layout, local, remote, self.memory.device)
                pull.pending = set(pull.tables.layers())
            except (RendezvousError, TimeoutError, ValueError, RuntimeError) as e:
                pull.error = f"connecting to engine {first.remote_engine_id!r}: {e}"
                self.stats.add("failed_connects", 1)
            step.pulls.append(pull)
        self._step = step

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step is None:
            return
        if self.memory.is_cuda:
            self._wait_for_layer_pulled_ahead(step, layer_name)
            return
        for pull in step.pulls:
            if pull.error is not None or layer_name not in pull.pending:
                continue
            pull.pending.discard(layer_name)
            t0 = time.perf_counter()
            if step.started is None:
                step.started = t0
                if self.memory.is_cuda:
                    step.start_event = torch.cuda.Event(enable_timing=True)
                    step.start_event.record()
            try:
                pull_layer(pull.remote.handle, self.memory, pull.tables[layer_name])
            except (RuntimeError, ValueError) as e:  # CPU caches: the transfer ran and failed
                pull.error = f"pulling layer {layer_name!r}: {e}"
            self.stats.add("enqueue_s", time.perf_counter() - t0)
        if (step.start_event is not None and step.end_event is None
                and all(p.error is not None or not p.pending for p in step.pulls)):
            # The end of the step's pulls on the stream: the end of the step
            # waits for this, not for the rest of the forward pass.
            step.end_event = torch.cuda.Event(enable_timing=True)
            step.end_event.record()

    def _wait_for_layer_pulled_ahead(self, step: "_Step", layer_name: str) -> None:
        """GPU caches: the step's first call enqueues every layer's pull on
        the side stream (this layer first, then the layout's order); each
        call makes the forward stream wait for its layer's pages only."""
        live = [p for p in step.pulls if p.error is None]
        if not step.ahead:
            step.ahead = True
            t0 = time.perf_counter()
            step.started = t0
            step.start_event = torch.cuda.Event(enable_timing=True)
            step.start_event.record()
            order = [layer_name] + [n for n in self.layout.layers if n != layer_name]
            try:
                self._ahead.start([(p.remote.handle, self.memory, p.tables) for p in live], order)
            except (RuntimeError, ValueError) as e:
                for p in live:
                    p.error = f"enqueueing the step's pulls: {e}"
            self.stats.add("enqueue_s", time.perf_counter() - t0)
        for p in live:
            p.pending.discard(layer_name)
        self._ahead.wait(layer_name)
        if step.end_event is None and all(p.error is not None or not p.pending for p in step.pulls):
            self._ahead.finish()
            step.end_event = torch.cuda.Event(enable_timing=True)
            step.end_event.record()

    def _finish_step(self) -> None:
        """Ends this step's pulls: waits for the step's stream work (GPU),
        collects errors, reports failed blocks and tells the prefills."""
        step, self._step = self._step, None
        if step is None:
            return
        step_s = None
        if step.start_event is not None:
            end = step.end_event
            if end is None:  # some layers were never waited for: join the side stream
                self._ahead.finish()
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            end.synchronize()
            step_s = step.start_event.elapsed_time(end) / 1e3
        elif step.started is not None:
            step_s = time.perf_counter() - step.started
        for pull in step.pulls:
            if pull.error is None and pull.pending and not step.ahead:
                # The forward never reached these layers' attention: their
                # blocks were used (or will be) without the pulled KV.
                pull.error = f"layers {sorted(pull.pending)[:3]}... were not pulled during the forward pass"
            if pull.error is None and self.memory.is_cuda:
                try:
                    ops.check_errors(pull.remote.handle)
                except (RuntimeError, ValueError) as e:
                    pull.error = str(e)
            n_blocks = len(pull.local_blocks)
            if pull.error is None:
                self.stats.add("pulled_requests", len(pull.specs))
                self.stats.add("pulled_blocks", n_blocks)
                self.stats.add("pulled_bytes", pull.tables.num_bytes)
            else:
                log.warning("MoriTorchConnector: %d requests (%d blocks) failed to load, vLLM's load-failure "
                            "policy applies: %s", len(pull.specs), n_blocks, pull.error)
                self._invalid.update(pull.local_blocks)
                self.stats.add("failed_requests", len(pull.specs))
                self.stats.add("failed_blocks", n_blocks)
        if step_s is not None:
            self.stats.data["step_s"].append(step_s)
        for (host, port), req_ids in step.notices.items():
            if not self._client.notify_read(host, port, req_ids):
                log.warning("MoriTorchConnector: could not tell %s:%d that %d requests were read; it frees "
                            "them when their lease ends", host, port, len(req_ids))

    def get_block_ids_with_load_errors(self) -> Set[int]:
        self._finish_step()
        out, self._invalid = self._invalid, set()
        return out

    # ---- prefill side ------------------------------------------------------------

    def _on_read(self, req_ids: List[str]) -> None:
        now = time.time()
        with self._lock:
            for r in req_ids:
                if r in self._notices or len(self._notices) < MAX_PENDING_NOTICES:
                    self._notices[r] = now

    def get_finished(self) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        self._finish_step()
        if not self.is_producer:
            return None, None
        now = time.time()
        with self._lock:
            read = {r for r in self._sending if r in self._notices}
            expired = {r for r, d in self._sending.items() if d <= now and r not in read}
            for r in read | expired:
                del self._sending[r]
                self._notices.pop(r, None)
            # Notices for requests never handed to this worker age out.
            stale = now - self.settings.kv_lease_s
            for r in [r for r, t in self._notices.items() if t < stale and r not in self._sending]:
                del self._notices[r]
        if expired:
            log.warning("MoriTorchConnector: no decode read %d finished requests within kv_lease_s=%gs; their "
                        "blocks are freed: %s", len(expired), self.settings.kv_lease_s, sorted(expired)[:5])
        self.stats.add("sent_requests", len(read))
        self.stats.add("expired_requests", len(expired))
        return (read | expired) or None, None

    # ---- both ------------------------------------------------------------------------

    def get_stats(self) -> Optional[MoriTorchKVConnectorStats]:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._client is not None:
            self._client.close()
        for r in self._remotes.values():
            ops.release_session_handle(r.handle)
        self._remotes.clear()
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
