"""What every rendezvous directory does, whatever store holds the entries:
publish, look up, wait for, connect to and watch engines.

A store subclass supplies a handful of primitives (read, create-if-absent,
compare-and-swap, keep-alive, watching) and calls ``_entry_changed`` when it
sees an entry change or vanish. Everything the user sees (errors, peers,
deregistration with "peer left") is decided here, once for both stores.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Callable, Dict, Mapping, Optional

from ..io import EngineDesc, IOEngine, MemoryDesc
from .record import (
    Entry,
    LookupTimeout,
    MalformedEntryError,
    RendezvousError,
    check_key,
    check_namespace,
    decode_entry,
    make_entry,
)

log = logging.getLogger("mori_torch.rendezvous")

_POLL_S = 0.05  # how often lookups and takeovers re-read the store

# Directories still open at interpreter exit remove their entries then, so a
# process that ends without close() is not listed until its TTL runs out.
_open_directories: "weakref.WeakSet[Directory]" = weakref.WeakSet()


@atexit.register
def _close_open_directories() -> None:
    for d in list(_open_directories):
        try:
            d.close()
        except Exception as e:  # exiting anyway: report, go on with the rest
            log.warning("closing the rendezvous directory at exit: %s", e)


class Peer:
    """A remote engine found through the directory and registered with a
    local engine. The directory keeps it current: when the peer's entry
    vanishes (it shut down, crashed and its lease expired, or stopped
    heart-beating) the remote engine is deregistered, which ends transfers
    in flight to it with ERR_BAD_STATE "... peer left: ..."; when the key is
    published again by a new incarnation, that one is registered instead.
    """

    def __init__(self, key: str, entry: Entry):
        self.key = key
        self._cv = threading.Condition()
        self._set(entry)
        self.left_reason: Optional[str] = None
        self.changes = 0  # departures and arrivals seen after connect

    def _set(self, entry: Entry) -> None:
        self.engine_desc: EngineDesc = entry.engine_desc
        self.memories: Dict[str, MemoryDesc] = dict(entry.memories)
        self.incarnation: str = entry.incarnation
        self.alive = True

    def wait_left(self, timeout_s: float) -> bool:
        """Waits until the peer is seen gone; True if it is."""
        with self._cv:
            return self._cv.wait_for(lambda: not self.alive, timeout_s)

    def wait_incarnation(self, not_this: str, timeout_s: float) -> bool:
        """Waits until a live incarnation other than ``not_this`` is registered."""
        with self._cv:
            return self._cv.wait_for(lambda: self.alive and self.incarnation != not_this, timeout_s)

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"left ({self.left_reason})"
        return f"Peer({self.key!r}, incarnation={self.incarnation[:8]}, {len(self.memories)} memories, {state})"


class Directory:
    """Base of the rendezvous directories (see TorchStoreDirectory, EtcdDirectory).

    ``ttl_s``: how long an engine that stopped (crashed, lost its network)
    stays listed; peers connected to it learn that it left within this time.
    """

    store_name = "store"

    def __init__(self, namespace: str, ttl_s: float):
        self.namespace = check_namespace(namespace)
        if not isinstance(ttl_s, (int, float)) or not 0.5 <= ttl_s <= 3600:
            raise ValueError(f"ttl_s must be a number of seconds in [0.5, 3600], got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self._lock = threading.RLock()
        self._published: Optional[Entry] = None
        self._published_bytes: Optional[bytes] = None
        self._engine: Optional[IOEngine] = None  # the engine peers get registered with
        self._peers: Dict[str, Peer] = {}
        self._on_change: Dict[str, Callable[[Peer], None]] = {}
        self._closed = False
        _open_directories.add(self)

    # ---- store primitives, implemented by each store --------------------

    def _read(self, key: str) -> Optional[bytes]:
        raise NotImplementedError

    def _create(self, key: str, value: bytes) -> Optional[bytes]:
        """Writes ``value`` under ``key`` if nothing is there (attached to
        this directory's liveness: lease or heartbeat); returns None when
        written, else the bytes already there."""
        raise NotImplementedError

    def _replace(self, key: str, old: bytes, new: Optional[bytes]) -> bool:
        """Compare-and-swap (new None: remove). True if it swapped."""
        raise NotImplementedError

    def _wait_gone(self, key: str, existing: bytes, deadline: float) -> bool:
        """Waits until the entry ``existing`` is no longer under ``key`` (its
        owner is gone) or the deadline passes; True if gone."""
        while time.monotonic() < deadline:
            if self._read(key) != existing:
                return True
            time.sleep(_POLL_S)
        return False

    def _start_keep_alive(self) -> None:
        raise NotImplementedError

    def _stop_keep_alive(self) -> None:
        raise NotImplementedError

    def _watch(self, key: str) -> None:
        """Starts reporting changes of ``key`` to _entry_changed."""
        raise NotImplementedError

    def _close_store(self) -> None:
        pass

    # ---- publishing --------------------------------------------------------

    def publish(self, engine: IOEngine, memories: Mapping[str, MemoryDesc] = None, *,
                takeover_timeout_s: Optional[float] = None) -> None:
        """Publishes ``engine``'s EngineDesc and its named memories under the
        engine's key. Publishing again replaces the memories.

        If another live engine holds the key, waits up to
        ``takeover_timeout_s`` (default: ttl_s plus a margin, enough for a
        crashed predecessor's entry to expire) and then raises
        RendezvousError naming the holder; pass 0 to fail at once.
        """
        if not isinstance(engine, IOEngine):
            raise TypeError(f"publish: engine must be an IOEngine, got {type(engine).__name__}")
        self._check_open()
        key = check_key(engine.key, "engine key")
        with self._lock:
            if self._published is not None and self._published.key != key:
                raise RendezvousError(f"this directory already publishes engine {self._published.key!r}; "
                                      f"use one directory object per engine")
            incarnation = self._published.incarnation if self._published else uuid.uuid4().hex
        entry = make_entry(self.namespace, engine, memories or {}, incarnation, socket.gethostname(), os.getpid())
        data = entry.encode()
        wait_s = self.ttl_s + 2.0 if takeover_timeout_s is None else float(takeover_timeout_s)
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._lock:
            if self._published_bytes is not None:
                if not self._replace(key, self._published_bytes, data):
                    raise RendezvousError(f"publish: the entry of {key!r} in namespace {self.namespace!r} was "
                                          f"changed by someone else; this engine is no longer published")
                self._published, self._published_bytes = entry, data
                return
            while True:
                existing = self._create(key, data)
                if existing is None:
                    break
                if not self._wait_gone(key, existing, deadline):
                    raise RendezvousError(f"publish: key {key!r} in namespace {self.namespace!r} is held by "
                                          f"another live engine ({_describe(existing, self.namespace, key)}); "
                                          f"waited {wait_s:.1f}s for it to leave")
            self._published, self._published_bytes = entry, data
            self._start_keep_alive()
            engine._shutdown_hooks.append(weakref.WeakMethod(self._unpublish_on_engine_shutdown))
        log.info("published engine %r in namespace %r on %s (%d memories)", key, self.namespace, self.store_name,
                 len(entry.memories))

    def unpublish(self) -> None:
        """Removes this directory's entry (done by close() too)."""
        with self._lock:
            entry, data = self._published, self._published_bytes
            self._published = self._published_bytes = None
        if entry is None:
            return
        self._stop_keep_alive()
        try:
            self._replace(entry.key, data, None)
        except RendezvousError as e:
            log.warning("unpublish %r: %s (the entry expires by itself within %.1fs)", entry.key, e, self.ttl_s)

    def _unpublish_on_engine_shutdown(self) -> None:
        try:
            self.unpublish()
        except Exception as e:  # shutting the engine down goes on regardless
            log.warning("removing the directory entry at engine shutdown: %s", e)

    @property
    def published(self) -> bool:
        """Whether this directory's engine is listed now (False after
        unpublish, or when the store lost the entry and it could not be
        restored; see the warnings in the log)."""
        return self._published is not None

    # ---- looking up --------------------------------------------------------

    def lookup(self, key: str, timeout_s: float = 0.0) -> Entry:
        """Returns the entry of engine ``key``, waiting up to ``timeout_s``
        for it to appear. Raises LookupTimeout if it does not, and
        MalformedEntryError if what is stored there is not a valid entry of
        this namespace and key."""
        check_key(key)
        self._check_open()
        if not isinstance(timeout_s, (int, float)) or timeout_s < 0:
            raise ValueError(f"timeout_s must be a non-negative number, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        while True:
            data = self._read(key)
            if data is not None:
                return decode_entry(data, self.namespace, key)
            if time.monotonic() >= deadline:
                raise LookupTimeout(f"engine {key!r} is not published in namespace {self.namespace!r} on "
                                    f"{self.store_name} (waited {timeout_s:g}s; wrong namespace or key, or "
                                    f"the engine has not started?)")
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    # ---- connecting to peers ---------------------------------------------

    def connect(self, engine: IOEngine, key: str, timeout_s: float = 30.0,
                on_change: Optional[Callable[[Peer], None]] = None) -> Peer:
        """Looks up ``key`` (waiting up to ``timeout_s``), registers it with
        ``engine`` and keeps watching it: see Peer. ``on_change(peer)`` is
        called from the directory's thread after each departure or arrival."""
        if not isinstance(engine, IOEngine):
            raise TypeError(f"connect: engine must be an IOEngine, got {type(engine).__name__}")
        entry = self.lookup(key, timeout_s)
        with self._lock:
            if self._engine is not None and self._engine is not engine:
                raise RendezvousError("connect: this directory registers peers with another engine; "
                                      "use one directory object per engine")
            self._engine = engine
            peer = self._peers.get(key)
            if peer is None:
                peer = self._peers[key] = Peer(key, entry)
            else:
                with peer._cv:
                    peer._set(entry)
            if on_change is not None:
                self._on_change[key] = on_change
            engine.register_remote_engine(entry.engine_desc)
            self._watch(key)
        # An entry that changed between lookup and watch is caught up here.
        self._entry_changed(key, self._read(key), "its entry vanished")
        return peer

    def peers(self) -> Dict[str, Peer]:
        """The peers connected through this directory, by engine key (a copy)."""
        with self._lock:
            return dict(self._peers)

    def _entry_changed(self, key: str, data: Optional[bytes], why_gone: str) -> None:
        """Called by the store's watcher (any thread) with the bytes now
        under ``key`` (None: gone)."""
        with self._lock:
            peer = self._peers.get(key)
            engine = self._engine
            callback = self._on_change.get(key)
        if peer is None or engine is None:
            return
        entry = None
        if data is not None:
            try:
                entry = decode_entry(data, self.namespace, key)
            except MalformedEntryError as e:
                log.warning("%s; treating engine %r as gone", e, key)
        with peer._cv:
            changed = False
            if peer.alive and (entry is None or entry.incarnation != peer.incarnation):
                why = why_gone if entry is None else f"restarted as incarnation {entry.incarnation[:8]}"
                try:
                    engine.deregister_remote_engine(peer.engine_desc, reason=f"peer left: {why}")
                except (RuntimeError, ValueError) as e:  # already deregistered by the user
                    log.debug("deregistering %r: %s", key, e)
                peer.alive, peer.left_reason, changed = False, why, True
                log.warning("engine %r left namespace %r: %s", key, self.namespace, why)
            if entry is not None and not peer.alive:
                try:
                    engine.register_remote_engine(entry.engine_desc)
                except (RuntimeError, ValueError) as e:
                    log.warning("registering the new incarnation of %r failed: %s", key, e)
                else:
                    peer._set(entry)
                    peer.left_reason, changed = None, True
                    log.info("engine %r (re)joined namespace %r as incarnation %s", key, self.namespace,
                             entry.incarnation[:8])
            if changed:
                peer.changes += 1
                peer._cv.notify_all()
        if changed and callback is not None:
            try:
                callback(peer)
            except Exception:  # a user callback never stops the watcher
                log.exception("on_change callback for %r raised", key)

    # ---- life cycle ---------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RendezvousError("the directory is closed")

    def close(self) -> None:
        """Unpublishes, stops watching (connected peers stay registered with
        their engine) and releases the store connection."""
        if self._closed:
            return
        self.unpublish()
        self._closed = True
        self._close_store()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _describe(data: bytes, namespace: str, key: str) -> str:
    try:
        e = decode_entry(data, namespace, key)
    except MalformedEntryError as err:
        return f"unreadable entry: {err}"
    return f"pid {e.pid} on {e.hostname!r}, incarnation {e.incarnation[:8]}"
