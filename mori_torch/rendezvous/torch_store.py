"""A rendezvous directory on any ``torch.distributed.Store`` (TCPStore by
default: one process hosts it, the others connect).

A Store has no leases, so liveness is a heartbeat: the publisher bumps a
counter (``Store.add``) every ttl/3; a watcher that sees a counter stand
still for ttl_s removes the entry (compare-and-swap, so a newer entry is
never touched) and reports the engine gone. Entries are "removed" by
emptying them: a Store read of a deleted key would block until its timeout.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from .directory import Directory, log
from .record import RendezvousError, decode_entry


class TorchStoreDirectory(Directory):
    """Directory on a torch.distributed Store.

    Either pass a ``store`` (TCPStore, FileStore, a PrefixStore of your
    process group's store, ...), or ``host``/``port`` to make a TCPStore:
    ``is_server=True`` in exactly one process (port 0 picks a free port; read
    it back from ``.port``).
    """

    store_name = "torch.distributed store"

    def __init__(self, namespace: str, store: Optional[dist.Store] = None, *, host: str = "127.0.0.1",
                 port: int = 0, is_server: bool = False, ttl_s: float = 10.0, timeout_s: float = 30.0):
        super().__init__(namespace, ttl_s)
        if store is None:
            if not isinstance(host, str) or not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError(f"TCPStore address {host!r}:{port!r} is not a host string and a port in [0, 65535]")
            if port == 0 and not is_server:
                raise ValueError("port 0 only makes sense with is_server=True (the server picks a free port)")
            try:
                store = dist.TCPStore(host, port, is_master=is_server, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
            except (RuntimeError, ValueError) as e:
                raise RendezvousError(f"cannot {'host' if is_server else 'reach'} the TCPStore at {host}:{port} "
                                      f"within {timeout_s:g}s: {e}") from None
        elif not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        self.store = store
        self._prefix = f"mori_torch/rendezvous/{self.namespace}/"
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None
        self._watcher: Optional[threading.Thread] = None
        self._watched: Dict[str, Tuple[Optional[bytes], int, float]] = {}  # key -> (entry, count, last change)

    @property
    def port(self) -> int:
        """The TCPStore's port (the one to give the other processes)."""
        return self.store.port

    def _entry_key(self, key: str) -> str:
        return self._prefix + "entry/" + key

    def _beat_key(self, key: str, incarnation: str) -> str:
        return self._prefix + "alive/" + key + "/" + incarnation

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, ValueError) as e:  # c10d raises DistStoreError (a RuntimeError) when unreachable
            raise RendezvousError(f"{what} on the torch.distributed store failed: {e}") from None

    # ---- primitives ------------------------------------------------------------

    def _read(self, key: str) -> Optional[bytes]:
        k = self._entry_key(key)
        if not self._call("check", self.store.check, [k]):
            return None
        v = self._call("get", self.store.get, k)
        return v or None

    def _create(self, key: str, value: bytes) -> Optional[bytes]:
        # compare_set with expected b"" writes when the key is absent or empty.
        now = self._call("compare_set", self.store.compare_set, self._entry_key(key), b"", value)
        return None if now == value else now

    def _replace(self, key: str, old: bytes, new: Optional[bytes]) -> bool:
        now = self._call("compare_set", self.store.compare_set, self._entry_key(key), old, new or b"")
        return now == (new or b"")

    def _heartbeat_count(self, key: str, data: bytes) -> int:
        try:  # the incarnation names the counter
            inc = decode_entry(data, self.namespace, key).incarnation
        except ValueError:
            return -1
        return int(self._call("add", self.store.add, self._beat_key(key, inc), 0))

    def _wait_gone(self, key: str, existing: bytes, deadline: float) -> bool:
        # Gone when the entry changes, or when its heartbeat stands still for
        # ttl_s: then the holder is dead and we empty its entry ourselves.
        count, since = self._heartbeat_count(key, existing), time.monotonic()
        while time.monotonic() < deadline:
            if self._read(key) != existing:
                return True
            c = self._heartbeat_count(key, existing)
            if c != count:
                count, since = c, time.monotonic()
            elif time.monotonic() - since >= self.ttl_s:
                self._replace(key, existing, None)
                return True
            time.sleep(min(0.05, self.ttl_s / 10))
        return False

    # ---- liveness ----------------------------------------------------------------

    def _start_keep_alive(self) -> None:
        if self._beat is None or not self._beat.is_alive():
            self._beat = threading.Thread(target=self._beat_loop, name="mori-rdv-heartbeat", daemon=True)
            self._beat.start()

    def _stop_keep_alive(self) -> None:
        pass  # the loop stops beating as soon as nothing is published

    def _beat_loop(self) -> None:
        failing = False
        while not self._stop.wait(self.ttl_s / 3):
            entry = self._published
            if entry is None:
                return
            try:
                self._call("add", self.store.add, self._beat_key(entry.key, entry.incarnation), 1)
                if failing:
                    log.warning("heartbeat of %r reaches the store again", entry.key)
                failing = False
            except RendezvousError as e:
                if not failing:
                    log.warning("heartbeat of %r failed (%s); peers will see it gone after %.1fs", entry.key, e,
                                self.ttl_s)
                failing = True

    def _watch(self, key: str) -> None:
        with self._lock:
            if key not in self._watched:
                data = self._read(key)
                self._watched[key] = (data, self._heartbeat_count(key, data) if data else -1, time.monotonic())
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, name="mori-rdv-watch", daemon=True)
                self._watcher.start()

    def _watch_loop(self) -> None:
        interval = min(0.25, self.ttl_s / 8)
        failing = False  # log a store outage once, not every interval
        while not self._stop.wait(interval):
            with self._lock:
                items = list(self._watched.items())
            for key, (last, count, since) in items:
                try:
                    data = self._read(key)
                    if data is not None and data == last:
                        c = self._heartbeat_count(key, data)
                        if c != count:
                            count, since = c, time.monotonic()
                        elif time.monotonic() - since >= self.ttl_s:
                            # Dead: take its entry out, as an etcd lease would.
                            self._replace(key, data, None)
                            data = None
                            self._entry_changed(key, None, f"no heartbeat for {self.ttl_s:g}s (TTL)")
                    elif data != last:
                        count = self._heartbeat_count(key, data) if data else -1
                        since = time.monotonic()
                        self._entry_changed(key, data, "its entry was removed (it shut down)")
                except RendezvousError as e:
                    # The store is down: nobody can be judged gone meanwhile.
                    if not failing:
                        log.warning("watching %r: %s; peers are not judged until the store answers again", key, e)
                    failing = True
                    with self._lock:  # an outage does not count against the peer's heartbeat
                        self._watched[key] = (last, count, time.monotonic())
                    continue
                if failing:
                    log.warning("the torch.distributed store answers again")
                    failing = False
                with self._lock:
                    self._watched[key] = (data, count, since)

    def _close_store(self) -> None:
        self._stop.set()
        for t in (self._beat, self._watcher):
            if t is not None and t is not threading.current_thread():
                t.join(5)
