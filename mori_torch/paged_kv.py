"""Page tables for paged KV caches: which bytes of a registered memory hold
block ``b`` of a layer, and per-layer pulls of a step's blocks with
``torch.ops.mori`` (stream-ordered on GPU caches, synchronous on CPU ones).

No serving framework is imported here: a vLLM (or SGLang) connector
describes its caches with these helpers, and the same code runs on machines
without vLLM.

Layouts understood (one tensor per layer, views into the registered memory):

* vLLM 0.33's per-layer view ``[num_blocks, heads, block_size, 2*head_size]``
  (K and V side by side in the last dim). Its strides depend on the KV cache
  layout (LBNHC, LBHNC, BLNHC, ...), but a block of one layer is always one
  dense run of bytes; consecutive blocks are ``stride(0)`` apart (the other
  layers' pages sit in between for block-outermost layouts).
* The classic ``[2, num_blocks, block_size, heads, head_dim]`` (K at index 0,
  V at 1): a block is two dense runs, K's and V's.

A layer's block is thus one or two *segments* of ``seg_bytes`` each, at
``offset + seg_offsets[s] + b * block_stride`` bytes into the registered
memory. When every such offset (both sides) is a multiple of ``seg_bytes``,
a layer's table is a list of page indices for ``read_pages``; otherwise it is
a list of byte offsets for ``batch_read``. Both are stream-ordered ops.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import ops

__all__ = [
    "LayerPages",
    "KVLayout",
    "LayerTable",
    "PageTables",
    "StaticPageTables",
    "PullsAhead",
    "layer_pages",
    "pull_layer",
]

# A peer sends its layout; these bound what it can make us allocate.
MAX_LAYERS = 4096
MAX_SEGMENTS = 2

BlockIds = Union[torch.Tensor, Sequence[int]]


def _block_shape(t: torch.Tensor, dims: Sequence[int], names: str) -> str:
    """Sizes of ``dims`` (size-1 dims left out) in memory order, and dtype."""
    order = sorted((d for d in dims if t.shape[d] > 1), key=lambda d: -t.stride(d))
    parts = [f"{names[dims.index(d)]}{t.shape[d]}" for d in order]
    return ".".join(parts + [str(t.dtype).replace("torch.", "")])


def _dense_bytes(t: torch.Tensor, dims: Sequence[int]) -> Optional[int]:
    """Bytes of the sub-tensor spanned by ``dims`` if it is one dense run
    (any order of strides), else None."""
    sizes = [t.shape[d] for d in dims]
    strides = [t.stride(d) for d in dims]
    expect = 1
    for size, stride in sorted(zip(sizes, strides), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expect:
            return None
        expect *= size
    n = 1
    for s in sizes:
        n *= s
    return n * t.element_size()


@dataclasses.dataclass(frozen=True)
class LayerPages:
    """Where one layer's blocks are in a registered memory (all in bytes):
    block ``b`` is the segments ``[offset + s + b * block_stride, ... +
    seg_bytes)`` for ``s`` in ``seg_offsets``."""

    offset: int
    block_stride: int
    seg_bytes: int
    seg_offsets: Tuple[int, ...]
    num_blocks: int
    # Arrangement of a segment's bytes, outermost dim first, e.g.
    # "N16.H8.C256.bfloat16": pulls need it equal on both sides.
    block_shape: str = ""

    def __post_init__(self):
        for name in ("offset", "block_stride", "seg_bytes", "num_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"LayerPages.{name} must be a non-negative int, got {v!r}")
        if self.seg_bytes == 0 or self.num_blocks == 0:
            raise ValueError(f"LayerPages: seg_bytes and num_blocks must be positive, got {self.seg_bytes} "
                             f"and {self.num_blocks}")
        segs = self.seg_offsets
        if (not isinstance(segs, tuple) or not 1 <= len(segs) <= MAX_SEGMENTS
                or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in segs)):
            raise ValueError(f"LayerPages.seg_offsets must be 1 to {MAX_SEGMENTS} non-negative ints, got {segs!r}")
        if not isinstance(self.block_shape, str) or len(self.block_shape) > 128:
            raise ValueError(f"LayerPages.block_shape must be a string of at most 128 characters, "
                             f"got {str(self.block_shape)[:140]!r}")

    @property
    def page_aligned(self) -> bool:
        """Whether every segment starts at a multiple of ``seg_bytes`` (the
        layer's blocks are pages of the memory for ``read_pages``)."""
        starts = [self.offset + s for s in self.seg_offsets] + [self.block_stride]
        return all(x % self.seg_bytes == 0 for x in starts)

    @property
    def end(self) -> int:
        """One past the last byte of the layer's last block."""
        return self.offset + max(self.seg_offsets) + (self.num_blocks - 1) * self.block_stride + self.seg_bytes

    def byte_offsets(self, block_ids: torch.Tensor) -> torch.Tensor:
        """int64 byte offsets of the segments of ``block_ids`` (CPU int64),
        block-major: ``[b0 seg0, b0 seg1, b1 seg0, ...]``."""
        segs = torch.tensor(self.seg_offsets, dtype=torch.int64)
        return (self.offset + block_ids.unsqueeze(1) * self.block_stride + segs.unsqueeze(0)).reshape(-1)

    def to_dict(self) -> dict:
        """A JSON-able dict of this layer's page geometry (from_dict reads it back)."""
        return {"offset": self.offset, "block_stride": self.block_stride, "seg_bytes": self.seg_bytes,
                "seg_offsets": list(self.seg_offsets), "num_blocks": self.num_blocks,
                "block_shape": self.block_shape}

    @staticmethod
    def from_dict(d: Mapping) -> "LayerPages":
        """The LayerPages of a dict made by to_dict; ValueError naming what is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a layer's pages must be a mapping, got {type(d).__name__}")
        try:
            segs = d["seg_offsets"]
            if not isinstance(segs, (list, tuple)) or len(segs) > MAX_SEGMENTS:
                raise ValueError(f"seg_offsets must be a list of at most {MAX_SEGMENTS} ints, got {segs!r}")
            return LayerPages(d["offset"], d["block_stride"], d["seg_bytes"], tuple(segs), d["num_blocks"],
                              d.get("block_shape", ""))
        except KeyError as e:
            raise ValueError(f"a layer's pages lack the field {e.args[0]!r}") from None


def layer_pages(cache: torch.Tensor, memory: torch.Tensor, kind: str = "auto") -> LayerPages:
    """Describes layer cache ``cache`` (a view into ``memory``, the tensor
    registered with the engine) as LayerPages.

    ``kind``: ``"vllm"`` for ``[num_blocks, heads, block_size, 2*head_size]``
    views (vLLM 0.33), ``"classic"`` for ``[2, num_blocks, block_size, heads,
    head_dim]``, ``"auto"`` to pick by shape (5 dims with a leading 2:
    classic; 4 dims: vllm)."""
    if not isinstance(cache, torch.Tensor) or not isinstance(memory, torch.Tensor):
        raise TypeError("layer_pages: cache and memory must be tensors")
    if kind == "auto":
        kind = "classic" if cache.dim() == 5 and cache.shape[0] == 2 else "vllm" if cache.dim() == 4 else None
        if kind is None:
            raise ValueError(f"layer_pages: cannot tell the layout of a cache of shape {tuple(cache.shape)}; "
                             f"expected [num_blocks, heads, block_size, 2*head_size] or "
                             f"[2, num_blocks, block_size, heads, head_dim]")
    if cache.device != memory.device:
        raise ValueError(f"layer_pages: the cache is on {cache.device} but the memory on {memory.device}")
    esz = cache.element_size()
    offset = cache.data_ptr() - memory.data_ptr()
    mem_bytes = memory.numel() * memory.element_size()
    if kind == "vllm":
        if cache.dim() != 4:
            raise ValueError(f"layer_pages(kind='vllm'): expected 4 dims, got shape {tuple(cache.shape)}")
        seg = _dense_bytes(cache, (1, 2, 3))
        block_dim, segs, shape = 0, (0,), _block_shape(cache, (1, 2, 3), "HNC")
    elif kind == "classic":
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(f"layer_pages(kind='classic'): expected [2, num_blocks, block_size, heads, head_dim], "
                             f"got shape {tuple(cache.shape)}")
        seg = _dense_bytes(cache, (2, 3, 4))
        block_dim, segs, shape = 1, (0, cache.stride(0) * esz), _block_shape(cache, (2, 3, 4), "NHD")
    else:
        raise ValueError(f"layer_pages: kind must be 'auto', 'vllm' or 'classic', got {kind!r}")
    if seg is None:
        raise ValueError(f"layer_pages: a block of the cache (shape {tuple(cache.shape)}, strides "
                         f"{cache.stride()}) is not one dense run of bytes")
    outside = f"layer_pages: the cache starts {offset} bytes from the memory's start"
    if offset < 0:
        raise ValueError(f"{outside}, before it; is it a view into that memory?")
    pages = LayerPages(offset, cache.stride(block_dim) * esz, seg, segs, cache.shape[block_dim], shape)
    if pages.end > mem_bytes:
        raise ValueError(f"layer_pages: the cache spans bytes [{offset}, {pages.end}) of the memory, which has "
                         f"{mem_bytes}; is it a view into that memory?")
    return pages


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """All layers of a KV cache in one registered memory of ``memory_bytes``."""

    layers: Dict[str, LayerPages]
    memory_bytes: int

    def __post_init__(self):
        if not 1 <= len(self.layers) <= MAX_LAYERS:
            raise ValueError(f"KVLayout: 1 to {MAX_LAYERS} layers, got {len(self.layers)}")
        for name, p in self.layers.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"KVLayout: layer names must be non-empty strings, got {name!r}")
            if p.end > self.memory_bytes:
                raise ValueError(f"KVLayout: layer {name!r} ends at byte {p.end}, past the memory's "
                                 f"{self.memory_bytes}")

    @staticmethod
    def from_caches(caches: Mapping[str, torch.Tensor], memory: torch.Tensor, kind: str = "auto") -> "KVLayout":
        """Layout of per-layer caches ``caches`` (name -> view into ``memory``)."""
        layers = {name: layer_pages(t, memory, kind) for name, t in caches.items()}
        return KVLayout(layers, memory.numel() * memory.element_size())

    def to_dict(self) -> dict:
        """A JSON-able dict of the whole layout (from_dict reads it back)."""
        return {"memory_bytes": self.memory_bytes, "layers": {n: p.to_dict() for n, p in self.layers.items()}}

    @staticmethod
    def from_dict(d: Mapping) -> "KVLayout":
        """Parses a layout a peer sent; malformed input raises ValueError."""
        if not isinstance(d, Mapping) or not isinstance(d.get("layers"), Mapping):
            raise ValueError("a KV layout must be a mapping with a 'layers' mapping")
        if len(d["layers"]) > MAX_LAYERS:
            raise ValueError(f"a KV layout has at most {MAX_LAYERS} layers, got {len(d['layers'])}")
        mem = d.get("memory_bytes")
        if not isinstance(mem, int) or isinstance(mem, bool) or mem <= 0:
            raise ValueError(f"KV layout memory_bytes must be a positive int, got {mem!r}")
        return KVLayout({str(n): LayerPages.from_dict(p) for n, p in d["layers"].items()}, mem)

    def check_pullable_from(self, remote: "KVLayout") -> None:
        """Raises ValueError unless every local layer has a remote layer of
        the same name with segments of the same size and number."""
        for name, p in self.layers.items():
            r = remote.layers.get(name)
            if r is None:
                raise ValueError(f"the remote KV cache has no layer {name!r} (it has {len(remote.layers)} layers, "
                                 f"e.g. {next(iter(remote.layers))!r}); is it the same model?")
            if (r.seg_bytes, len(r.seg_offsets), r.block_shape) != (p.seg_bytes, len(p.seg_offsets), p.block_shape):
                raise ValueError(f"layer {name!r}: remote blocks are {len(r.seg_offsets)} x {r.seg_bytes} bytes "
                                 f"({r.block_shape or '?'}), local ones {len(p.seg_offsets)} x {p.seg_bytes} bytes "
                                 f"({p.block_shape or '?'}); block size, heads, head size, dtype and the "
                                 f"arrangement inside a block (KV cache layout) must match")


@dataclasses.dataclass
class LayerTable:
    """One layer's pull: ``read_pages`` of page indices (``page_bytes`` set)
    or ``batch_read`` of byte offsets (``sizes`` a one-element tensor)."""

    local: torch.Tensor
    remote: torch.Tensor
    page_bytes: int = 0
    sizes: Optional[torch.Tensor] = None

    @property
    def num_entries(self) -> int:
        """How many (local, remote) page pairs the table holds."""
        return int(self.local.numel())


def pull_layer(handle: int, memory: torch.Tensor, table: LayerTable) -> None:
    """Enqueues one layer's pull on the current stream (GPU memory) or runs
    it (CPU memory). ``memory`` is the local registered tensor."""
    if table.page_bytes:
        ops.read_pages(handle, memory, table.local, table.remote, table.page_bytes)
    else:
        ops.batch_read(handle, memory, table.local, table.remote, table.sizes)


class PullsAhead:
    """A step's per-layer pulls, enqueued all at once on side streams so that
    later layers' pulls overlap earlier layers' compute (GPU memory).

    ``start`` forks ``lanes`` side streams from the current stream (so the
    pulls see everything enqueued before) and enqueues the layers' pulls on
    them round robin, in the given order, recording one event per layer;
    ``wait(layer)`` makes the current stream wait for that layer's pages only;
    ``finish`` joins whatever was not waited for. Several lanes keep several
    layers' pulls in flight at once: over TCP or RDMA a pull is a network
    round trip, and one lane would serialize them. All three are capturable:
    inside a CUDA graph capture the side streams fork from and join the
    capturing stream. The tables must stay alive (and unchanged) until the
    pulls ran."""

    def __init__(self, device: Union[str, torch.device, None] = None, lanes: int = 4):
        if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
            raise ValueError(f"PullsAhead: lanes must be an int >= 1, got {lanes!r}")
        self.streams = [torch.cuda.Stream(device) for _ in range(lanes)]
        self.stream = self.streams[0]
        self._events: Dict[str, torch.cuda.Event] = {}
        self._lasts: Dict[int, torch.cuda.Event] = {}  # lane -> its last event not yet joined

    def start(self, pulls: Sequence[Tuple[int, torch.Tensor, Mapping[str, LayerTable]]],
              layers: Sequence[str]) -> None:
        """``pulls``: (session handle, local memory, layer -> LayerTable)
        per remote engine; ``layers``: the order the forward pass uses them."""
        self.finish()
        current = torch.cuda.current_stream(self.stream.device)
        for i, name in enumerate(layers):
            lane = i % len(self.streams)
            stream = self.streams[lane]
            if i < len(self.streams):
                stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for handle, memory, tables in pulls:
                    if name in tables:
                        pull_layer(handle, memory, tables[name])
                ev = torch.cuda.Event()
                ev.record(stream)
            self._events[name] = self._lasts[lane] = ev

    def wait(self, layer: str) -> bool:
        """The current stream waits for ``layer``'s pull; False if it was not started."""
        ev = self._events.pop(layer, None)
        if ev is None:
            return False
        torch.cuda.current_stream(self.stream.device).wait_event(ev)
        if not self._events:  # every layer waited for: every lane is joined
            self._lasts.clear()
        return True

    def finish(self) -> None:
        """Joins the side streams' pulls that no layer waited for."""
        current = torch.cuda.current_stream(self.stream.device)
        for ev in self._lasts.values():
            current.wait_event(ev)
        self._events.clear()
        self._lasts.clear()


def _as_ids(name: str, ids: BlockIds, limit: int) -> torch.Tensor:
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.int64)
    t = t.to(device="cpu", dtype=torch.int64).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= limit):
        bad = t[(t < 0) | (t >= limit)][0].item()
        raise ValueError(f"{name}: block id {bad} is out of range [0, {limit})")
    return t


def _tables_cpu(local: KVLayout, remote: KVLayout, local_ids: BlockIds, remote_ids: BlockIds
                ) -> Tuple[List[str], torch.Tensor, torch.Tensor, List[int]]:
    """Per-layer rows of local and remote entries (CPU int64 [layers, n]),
    and per layer the page size (0: the row holds byte offsets)."""
    local.check_pullable_from(remote)
    names = list(local.layers)
    lmin = min(p.num_blocks for p in local.layers.values())
    rmin = min(remote.layers[n].num_blocks for n in names)
    lid = _as_ids("local block ids", local_ids, lmin)
    rid = _as_ids("remote block ids", remote_ids, rmin)
    if lid.numel() != rid.numel():
        raise ValueError(f"{lid.numel()} local block ids but {rid.numel()} remote ones")
    rows_l, rows_r, units = [], [], []
    for n in names:
        lp, rp = local.layers[n], remote.layers[n]
        lo, ro = lp.byte_offsets(lid), rp.byte_offsets(rid)
        page = lp.seg_bytes
        aligned = lp.page_aligned and rp.page_aligned
        if aligned:
            lo, ro = lo // page, ro // page
        rows_l.append(lo)
        rows_r.append(ro)
        units.append(page if aligned else 0)
    n_entries = lid.numel() * len(next(iter(local.layers.values())).seg_offsets)
    empty = torch.empty(len(names), 0, dtype=torch.int64)
    L = torch.stack(rows_l) if n_entries else empty
    R = torch.stack(rows_r) if n_entries else empty
    return names, L, R, units


class PageTables:
    """The per-layer tables of one step's pull: ``local_ids[i]`` of the
    local cache receives ``remote_ids[i]`` of the remote one, in every
    layer. Built on the CPU and copied to ``device`` in one transfer."""

    def __init__(self, local: KVLayout, remote: KVLayout, local_ids: BlockIds, remote_ids: BlockIds,
                 device: Union[str, torch.device] = "cpu"):
        names, L, R, units = _tables_cpu(local, remote, local_ids, remote_ids)
        both = torch.stack([L, R]).to(device, non_blocking=True)
        self.device = torch.device(device)
        self.num_blocks = 0 if L.shape[0] == 0 else L.shape[1] // len(next(iter(local.layers.values())).seg_offsets)
        self.num_bytes = sum(local.layers[n].seg_bytes for n in names) * L.shape[1]
        self._tables: Dict[str, LayerTable] = {}
        for i, (n, unit) in enumerate(zip(names, units)):
            sizes = None if unit else torch.tensor([local.layers[n].seg_bytes], dtype=torch.int64, device=device)
            self._tables[n] = LayerTable(both[0, i], both[1, i], unit, sizes)

    def __getitem__(self, layer: str) -> LayerTable:
        return self._tables[layer]

    def __contains__(self, layer: str) -> bool:
        return layer in self._tables

    def layers(self) -> Iterable[str]:
        """The names of the layers that have a table."""
        return self._tables.keys()


class StaticPageTables:
    """Page tables at fixed addresses for CUDA graphs: capture the per-layer
    pulls once with :meth:`__getitem__`'s tables, then :meth:`set` new block
    lists before each replay (an in-place copy; a replay reads the lists the
    stream finds there).

    A graph's lists have a fixed length: ``capacity`` blocks per layer.
    Unused entries pull ``pad_remote_block`` into ``pad_local_block``
    (vLLM's null block 0 on both sides is never read by attention)."""

    def __init__(self, local: KVLayout, remote: KVLayout, capacity: int, device: Union[str, torch.device],
                 pad_local_block: int = 0, pad_remote_block: int = 0):
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"StaticPageTables: capacity must be a positive int, got {capacity!r}")
        self.local, self.remote, self.capacity = local, remote, capacity
        self._pad = (pad_local_block, pad_remote_block)
        names, L, R, units = _tables_cpu(local, remote, [pad_local_block] * capacity, [pad_remote_block] * capacity)
        self._names, self._units = names, units
        self._buf = torch.stack([L, R]).to(device)
        self._tables = {}
        for i, (n, unit) in enumerate(zip(names, units)):
            sizes = None if unit else torch.tensor([local.layers[n].seg_bytes], dtype=torch.int64, device=device)
            self._tables[n] = LayerTable(self._buf[0, i], self._buf[1, i], unit, sizes)
        self.num_blocks = 0

    def __getitem__(self, layer: str) -> LayerTable:
        return self._tables[layer]

    def __contains__(self, layer: str) -> bool:
        return layer in self._tables

    def set(self, local_ids: BlockIds, remote_ids: BlockIds) -> None:
        """Fills the tables with this step's blocks (the rest padded).
        Ordered on the current stream like any copy into device memory."""
        lid = list(local_ids.tolist() if isinstance(local_ids, torch.Tensor) else local_ids)
        rid = list(remote_ids.tolist() if isinstance(remote_ids, torch.Tensor) else remote_ids)
        if len(lid) > self.capacity:
            raise ValueError(f"StaticPageTables.set: {len(lid)} blocks exceed the capacity of {self.capacity}")
        pad = self.capacity - len(lid)
        _, L, R, _ = _tables_cpu(self.local, self.remote, lid + [self._pad[0]] * pad,
                                         rid + [self._pad[1]] * pad)
        self._buf.copy_(torch.stack([L, R]), non_blocking=True)
        self.num_blocks = len(lid)
