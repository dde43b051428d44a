"""One engine's directory entry: its EngineDesc and named MemoryDescs, as
bytes that are checked field by field when read back.

A single entry per engine makes publishing atomic (a peer never sees the
engine without its memories) and a lookup one read. The entry carries no
secret: descriptors are addresses, never credentials.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
from typing import Dict, Mapping

from ..io import EngineDesc, MemoryDesc

FORMAT = "mori_torch.rendezvous"
VERSION = 1
# Bounds what a malformed or hostile entry can make us parse: 64 memories of
# a few hundred bytes each fit many times over.
MAX_ENTRY_BYTES = 4 << 20
MAX_MEMORIES = 4096
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class RendezvousError(RuntimeError):
    """A directory operation failed (store unreachable, key taken, ...)."""


class MalformedEntryError(ValueError):
    """Bytes in the directory are not a valid entry of this namespace and key."""


class LookupTimeout(TimeoutError):
    """A key did not appear in the directory before the timeout."""


def check_namespace(namespace) -> str:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    if not _NAMESPACE_RE.match(namespace):
        raise ValueError(f"namespace {namespace!r} is not 1-128 characters of letters, digits, '_', '.', '-'")
    return namespace


def check_key(key, what: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"{what} must be a str, got {type(key).__name__}")
    if not 0 < len(key) <= 256 or not key.isprintable():
        raise ValueError(f"{what} {key!r} must be 1-256 printable characters")
    return key


@dataclasses.dataclass
class Entry:
    """What an engine publishes: decoded, validated."""

    namespace: str
    key: str
    incarnation: str  # random per publish of a process: tells a restarted engine from the old one
    engine_desc: EngineDesc
    memories: Dict[str, MemoryDesc]
    hostname: str = ""
    pid: int = 0

    def encode(self) -> bytes:
        """The entry as the bytes stored in the directory (decode_entry reads them)."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "namespace": self.namespace,
            "key": self.key,
            "incarnation": self.incarnation,
            "hostname": self.hostname,
            "pid": self.pid,
            "engine": base64.b64encode(self.engine_desc.pack()).decode("ascii"),
            "memories": {n: base64.b64encode(m.pack()).decode("ascii") for n, m in self.memories.items()},
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8")


def make_entry(namespace: str, engine, memories: Mapping[str, MemoryDesc], incarnation: str, hostname: str,
               pid: int) -> Entry:
    desc = engine.get_engine_desc()
    if not isinstance(memories, Mapping):
        raise TypeError(f"memories must be a mapping of name -> MemoryDesc, got {type(memories).__name__}")
    if len(memories) > MAX_MEMORIES:
        raise ValueError(f"{len(memories)} memories exceed the limit of {MAX_MEMORIES} per engine")
    out = {}
    for name, m in memories.items():
        check_key(name, "memory name")
        if not isinstance(m, MemoryDesc):
            raise TypeError(f"memories[{name!r}] must be a MemoryDesc, got {type(m).__name__}")
        if m.engine_key != desc.key:
            raise ValueError(f"memories[{name!r}] belongs to engine {m.engine_key!r}, not {desc.key!r}")
        out[name] = m
    return Entry(namespace, desc.key, incarnation, desc, out, hostname, pid)


def decode_entry(data, namespace: str, key: str) -> Entry:
    """Parses and checks an entry read under (namespace, key); raises
    MalformedEntryError naming the key and what is wrong."""

    def bad(why: str):
        return MalformedEntryError(f"directory entry for key {key!r} in namespace {namespace!r} is malformed: {why}")

    if not isinstance(data, (bytes, bytearray)):
        raise bad(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_ENTRY_BYTES:
        raise bad(f"{len(data)} bytes exceed the limit of {MAX_ENTRY_BYTES}")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise bad(f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise bad(f"format {doc.get('format')!r} is not {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise bad(f"version {doc.get('version')!r} is not {VERSION} (written by another mori_torch release?)")
    if doc.get("namespace") != namespace:
        raise bad(f"it was written for namespace {doc.get('namespace')!r}")
    if doc.get("key") != key:
        raise bad(f"it names key {doc.get('key')!r}")
    for field, typ in (("incarnation", str), ("hostname", str), ("pid", int), ("engine", str), ("memories", dict)):
        if not isinstance(doc.get(field), typ):
            raise bad(f"field {field!r} is {doc.get(field)!r}, expected {typ.__name__}")
    if len(doc["memories"]) > MAX_MEMORIES:
        raise bad(f"{len(doc['memories'])} memories exceed the limit of {MAX_MEMORIES}")

    def b64(what: str, s) -> bytes:
        if not isinstance(s, str):
            raise bad(f"{what} is {type(s).__name__}, expected base64 text")
        try:
            return base64.b64decode(s, validate=True)
        except (binascii.Error, ValueError) as e:
            raise bad(f"{what} is not base64 ({e})") from None

    try:
        engine_desc = EngineDesc.unpack(b64("engine", doc["engine"]))
        memories = {str(n): MemoryDesc.unpack(b64(f"memories[{n!r}]", v)) for n, v in doc["memories"].items()}
    except (ValueError, TypeError, RuntimeError) as e:
        if isinstance(e, MalformedEntryError):
            raise
        raise bad(f"descriptor does not unpack ({e})") from None
    if engine_desc.key != key:
        raise bad(f"its EngineDesc names engine {engine_desc.key!r}")
    for n, m in memories.items():
        if m.engine_key != key:
            raise bad(f"memory {n!r} belongs to engine {m.engine_key!r}")
    return Entry(namespace, key, doc["incarnation"], engine_desc, memories, doc["hostname"], doc["pid"])
