"""A rendezvous directory on etcd v3, for deployments across machines.

Talks to etcd's v3 JSON gateway (served by every etcd >= 3.4 on its client
port) through etcd3gw, OpenStack's maintained client for it, over requests
(see README "Rendezvous" for why this client). Entries live under a lease
that a thread keeps alive, so a crashed engine's entry vanishes within the
lease TTL; a watch on the namespace tells every connected peer at once.

etcd3gw's own Watcher ends silently when the stream breaks (an etcd
restart) and cannot resume, so the watch stream is read here over the
client's HTTP layer: after any break the directory re-reads the watched
keys (catching up on what it missed) and watches again from there.
"""
from __future__ import annotations

import base64
import json
import math
import socket
import threading
import time
import urllib.parse
from typing import Optional, Set

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_exceptions

from .directory import Directory, log
from .record import RendezvousError

_RETRY_S = 0.5  # keep-alive and watch retry interval while etcd is unreachable


def _b64(data) -> str:
    return base64.b64encode(data.encode("utf-8") if isinstance(data, str) else data).decode("ascii")


def _prefix_end(prefix: str) -> str:
    b = bytearray(prefix.encode("utf-8"))
    b[-1] += 1  # prefixes here end in "/", never 0xff
    return bytes(b).decode("utf-8")


class EtcdDirectory(Directory):
    """Directory on etcd v3.

    ``endpoint``: ``http://host:port`` (or https) of an etcd member's client
    URL. ``ttl_s``: the lease TTL (whole seconds, at least 1); a crashed
    engine is gone from the directory, and its peers told, within it.
    ``timeout_s``: per request to etcd.
    """

    store_name = "etcd"

    def __init__(self, namespace: str, endpoint: str = "http://127.0.0.1:2379", *, ttl_s: float = 10.0,
                 timeout_s: float = 5.0):
        super().__init__(namespace, ttl_s)
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str like 'http://127.0.0.1:2379', got {type(endpoint).__name__}")
        url = urllib.parse.urlparse(endpoint)
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            raise ValueError(f"etcd endpoint {endpoint!r} is not of the form http(s)://host:port")
        self.endpoint = endpoint
        self._lease_ttl = max(1, math.ceil(self.ttl_s))
        self._timeout_s = float(timeout_s)
        # /v3/ is the gateway path of every etcd >= 3.4; fixing it skips a discovery request.
        self._conn = dict(host=url.hostname, port=port, protocol=url.scheme, timeout=self._timeout_s,
                          api_path="/v3/")
        self._client = etcd3gw.client(**self._conn)  # the caller's thread
        self._keeper_client = etcd3gw.client(**self._conn)  # the keep-alive thread's own session
        self._prefix = f"/mori_torch/rendezvous/{self.namespace}/entry/"
        self._call("status", self._client.status)  # unreachable at start: fail now, clearly
        self._lease: Optional[int] = None
        self._stop = threading.Event()
        self._keeper: Optional[threading.Thread] = None
        self._watcher: Optional[threading.Thread] = None
        self._watched: Set[str] = set()
        self._watch_resp: Optional[requests.Response] = None
        self.unreachable_since: Optional[float] = None  # monotonic time keep-alive first failed, None if fine
        self.republished = 0  # times the entry was restored after etcd lost the lease

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (etcd_exceptions.Etcd3Exception, requests.RequestException, ValueError, KeyError) as e:
            raise RendezvousError(f"etcd {what} at {self.endpoint} failed: {type(e).__name__}: {e}") from None

    # ---- primitives ------------------------------------------------------------

    def _read(self, key: str) -> Optional[bytes]:
        values = self._call("get", self._client.get, self._k(key))
        return bytes(values[0]) if values else None

    def _grant(self, client) -> int:
        r = self._call("lease grant", client.post, client.get_url("/lease/grant"), json={"TTL": self._lease_ttl})
        return int(r["ID"])

    def _txn(self, client, compare, success, failure=()):
        return self._call("txn", client.transaction,
                          {"compare": list(compare), "success": list(success), "failure": list(failure)})

    def _create_with(self, client, key: str, value: bytes) -> Optional[bytes]:
        if self._lease is None:
            self._lease = self._grant(client)
        k = _b64(self._k(key))
        # One transaction: put if absent, else read what is there (atomic, so
        # the read finds the entry that made the compare fail).
        r = self._txn(client, [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
                      [{"request_put": {"key": k, "value": _b64(value), "lease": self._lease}}],
                      [{"request_range": {"key": k}}])
        if r.get("succeeded"):
            return None
        kvs = r["responses"][0]["response_range"].get("kvs", [])
        if not kvs:
            raise RendezvousError(f"etcd txn at {self.endpoint}: create of {key!r} failed but nothing is there")
        return base64.b64decode(kvs[0].get("value", ""))

    def _create(self, key: str, value: bytes) -> Optional[bytes]:
        return self._create_with(self._client, key, value)

    def _replace(self, key: str, old: bytes, new: Optional[bytes]) -> bool:
        k = _b64(self._k(key))
        op = ({"request_put": {"key": k, "value": _b64(new), "lease": self._lease or 0}} if new is not None
              else {"request_delete_range": {"key": k}})
        r = self._txn(self._client, [{"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(old)}], [op])
        return bool(r.get("succeeded"))

    # ---- keep-alive ------------------------------------------------------------

    def _start_keep_alive(self) -> None:
        if self._keeper is None or not self._keeper.is_alive():
            self._keeper = threading.Thread(target=self._keep_alive_loop, name="mori-rdv-keepalive", daemon=True)
            self._keeper.start()

    def _stop_keep_alive(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            try:  # takes the entry with it at once
                self._call("lease revoke", self._client.post, self._client.get_url("/kv/lease/revoke"),
                           json={"ID": lease})
            except RendezvousError as e:
                log.warning("revoking lease %x: %s (it expires within %ds)", lease, e, self._lease_ttl)

    def _keep_alive_loop(self) -> None:
        c = self._keeper_client
        while not self._stop.wait(self._lease_ttl / 3 if self.unreachable_since is None else _RETRY_S):
            with self._lock:
                entry, data, lease = self._published, self._published_bytes, self._lease
            if entry is None:
                return
            try:
                r = self._call("lease keep-alive", c.post, c.get_url("/lease/keepalive"), json={"ID": lease})
                ttl = int(r.get("result", {}).get("TTL", -1))
                if self.unreachable_since is not None:
                    log.warning("etcd at %s reachable again after %.1fs; lease of %r %s", self.endpoint,
                                time.monotonic() - self.unreachable_since, entry.key,
                                "kept" if ttl > 0 else "lost")
                    self.unreachable_since = None
                if ttl <= 0:
                    self._restore(c, entry, data)
            except RendezvousError as e:
                if self.unreachable_since is None:
                    self.unreachable_since = time.monotonic()
                    log.warning("%s; engine %r stays published only if etcd comes back within its %ds lease",
                                e, entry.key, self._lease_ttl)

    def _restore(self, client, entry, data: bytes) -> None:
        """etcd lost our lease (it expired while etcd was unreachable, or
        etcd came back without its data): publish the same entry again."""
        with self._lock:
            if self._published is not entry:
                return
            self._lease = None
            try:
                existing = self._create_with(client, entry.key, data)
            except RendezvousError as e:
                log.warning("restoring the entry of %r: %s; will retry", entry.key, e)
                return
            if existing is not None and existing != data:
                self._published = self._published_bytes = None
                log.error("engine %r is UNPUBLISHED: its lease expired and key %r in namespace %r is now held by "
                          "another engine", entry.key, entry.key, self.namespace)
                return
            self.republished += 1
        log.warning("etcd lost the lease of %r; entry published again under a new lease", entry.key)

    # ---- watching ----------------------------------------------------------------

    def _watch(self, key: str) -> None:
        with self._lock:
            self._watched.add(key)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, name="mori-rdv-watch", daemon=True)
                self._watcher.start()

    def _sync(self, client) -> int:
        """Reports the current state of every watched key; returns the
        revision to watch from."""
        r = self._call("range", client.post, client.get_url("/kv/range"),
                       json={"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix))})
        now = {base64.b64decode(kv["key"]).decode("utf-8")[len(self._prefix):]: base64.b64decode(kv.get("value", ""))
               for kv in r.get("kvs", [])}
        with self._lock:
            watched = list(self._watched)
        for key in watched:
            self._entry_changed(key, now.get(key), f"its entry is gone from etcd (it shut down, or its "
                                                   f"{self._lease_ttl}s lease expired)")
        return int(r["header"]["revision"]) + 1

    def _watch_loop(self) -> None:
        client = etcd3gw.client(**self._conn)
        while not self._stop.is_set():
            try:
                revision = self._sync(client)
                self._stream(client, revision)
            except (RendezvousError, requests.RequestException, ValueError, KeyError) as e:
                if not self._stop.is_set():
                    log.debug("etcd watch: %s; re-syncing", e)
            self._stop.wait(_RETRY_S)

    def _stream(self, client, revision: int) -> None:
        req = {"create_request": {"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix)),
                                  "start_revision": revision}}
        resp = client.session.post(client.get_url("/watch"), json=req, stream=True,
                                   timeout=(self._timeout_s, None))
        self._watch_resp = resp
        try:
            if self._stop.is_set():
                return
            for line in resp.iter_lines(chunk_size=None):
                if not line.strip():
                    continue
                msg = json.loads(line)
                if "error" in msg:
                    raise ValueError(f"watch error: {msg['error']}")
                result = msg.get("result", {})
                if result.get("canceled") or "compact_revision" in result:
                    raise ValueError(f"watch canceled: {result.get('cancel_reason') or 'compacted'}")
                for ev in result.get("events", []):
                    kv = ev["kv"]
                    key = base64.b64decode(kv["key"]).decode("utf-8")[len(self._prefix):]
                    with self._lock:
                        if key not in self._watched:
                            continue
                    if ev.get("type") == "DELETE":
                        self._entry_changed(key, None, f"its entry was removed from etcd (it shut down, or its "
                                                       f"{self._lease_ttl}s lease expired)")
                    else:
                        self._entry_changed(key, base64.b64decode(kv.get("value", "")), "")
        finally:
            self._watch_resp = None
            resp.close()

    def _close_store(self) -> None:
        self._stop.set()
        resp = self._watch_resp
        if resp is not None:
            # A blocked stream read only returns when its socket is shut down.
            try:
                dup = socket.fromfd(resp.raw.fileno(), socket.AF_INET, socket.SOCK_STREAM)
                dup.shutdown(socket.SHUT_RDWR)
                dup.close()
            except (OSError, ValueError, AttributeError):
                pass
        for t in (self._keeper, self._watcher):
            if t is not None and t is not threading.current_thread():
                t.join(5)
