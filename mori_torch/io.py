"""Drop-in replacement for AMD's ``mori.io``.

Same class, enum, method and argument names, defaults and semantics as
MORI-IO (see docs/MORI_IO_API.md), over the TorchScript classes
``torch.classes.mori.*``. Code written for MORI-IO runs after changing only
the import::

    from mori_torch.io import IOEngine, IOEngineConfig, BackendType, ...
"""
from __future__ import annotations

import builtins
import dataclasses
import enum
import functools
import inspect
import json
import operator
from typing import Dict, List, Optional, Sequence

import torch

from . import _C  # noqa: F401  (registers torch.classes.mori)
from ._int64s import int64s as _int64s
from ._int64s import int64s_each as _int64s_each

__all__ = [
    "IOEngine",
    "IOEngineSession",
    "IOEngineConfig",
    "BackendType",
    "MemoryLocationType",
    "StatusCode",
    "PollCqMode",
    "RdmaBackendConfig",
    "XgmiBackendConfig",
    "TcpBackendConfig",
    "FabricBackendConfig",
    "EngineDesc",
    "MemoryDesc",
    "TransferStatus",
    "set_log_level",
]

_native = torch.classes.mori


class BackendType(enum.IntEnum):
    """The transfer backends (values as in MORI-IO)."""

    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4  # upstream's UALink scale-up backend: exists for compatibility, create_backend refuses it


class MemoryLocationType(enum.IntEnum):
    """Where registered memory lives (values as in MORI-IO)."""

    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.IntEnum):
    """A transfer's state or error (values as in MORI-IO): INIT and IN_PROGRESS
    until it ends, then SUCCESS or one of the ERR_* codes."""

    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


# The per-transfer calls are plain CPython calls (csrc/torch/fast_calls.h):
# 0.1-0.2 us of call overhead against TorchScript's method call, 1.4-5 us.
try:
    _status_code = _C.status_code
    _status_wait = _C.status_wait
    _transfer_uid = _C.transfer_uid
    _session_transfer = _C.session_transfer
    _session_batch = _C.session_batch
    _engine_transfer = _C.engine_transfer
except AttributeError:  # an extension built from an older tree
    raise ImportError("mori_torch._C is older than this mori_torch (no session_transfer or status_wait): rebuild "
                      "it (scripts/setup.sh, or pip install --no-build-isolation .)") from None
_SUCCESS, _INIT, _IN_PROGRESS = int(StatusCode.SUCCESS), int(StatusCode.INIT), int(StatusCode.IN_PROGRESS)
_LAST_NON_ERROR = 10  # codes above are errors (base/error.h: IsError)


class PollCqMode(enum.IntEnum):
    """How RDMA completion threads wait: POLLING (spin, backing off) or EVENT
    (block on completion channels)."""

    POLLING = 0
    EVENT = 1


@dataclasses.dataclass
class IOEngineConfig:
    """Where an engine listens: ``host`` ("": 127.0.0.1 only) and ``port``
    (0: a free port). Keyword-only extension: ``secret``, a shared secret every
    peer must prove before anything is served (None: ``MORI_TORCH_SECRET``)."""

    host: str = ""
    port: int = 0
    # mori_torch extension (keyword-only, so mori.io's positional signature
    # holds): a secret every peer must prove before anything is served; None
    # takes MORI_TORCH_SECRET, and without either the engine serves anyone.
    # Never printed, never part of a descriptor.
    secret: Optional[str] = dataclasses.field(default=None, kw_only=True, repr=False)
    # mori_torch extension: serve this engine's counters (IOEngine.stats) for
    # Prometheus at http://<host>:<metrics_port>/metrics (needs
    # prometheus_client; 0 picks a free port, see IOEngine.metrics_port).
    # mori_torch.metrics.EngineCollector registers them with
    # a registry of your own instead. -1: no endpoint.
    metrics_port: int = dataclasses.field(default=-1, kw_only=True)
    # mori_torch extension: NVTX / roctx ranges around transfers and ops, for
    # Nsight Systems or rocprof. Process-wide (so is MORI_TORCH_NVTX=1);
    # True turns them on, False leaves them as they are.
    nvtx: bool = dataclasses.field(default=False, kw_only=True)
    # mori_torch extensions (keyword-only): a transfer whose path breaks
    # (connection reset, QP in error, IPC open refused) is retried over a
    # fresh connection, up to retry_attempts attempts within retry_budget_ms
    # (never past the backend's op timeout), and a failed backend hands the
    # peer's transfers to the next capable one until it is healthy again
    # (docs/FAILOVER.md). failover=False: a broken path fails its transfers.
    failover: bool = dataclasses.field(default=True, kw_only=True)
    retry_attempts: int = dataclasses.field(default=4, kw_only=True)
    retry_budget_ms: int = dataclasses.field(default=30000, kw_only=True)


@dataclasses.dataclass
class RdmaBackendConfig:
    """Settings of the RDMA backend: MORI-IO's fields and defaults, plus the
    mori_torch extensions gid_index, sq_depth, sq_full_timeout_ms,
    connect_timeout_ms and inactivity_timeout_ms (README "Backends")."""

    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = -1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True
    notif_per_qp: int = 1024
    enable_transfer_chunking: bool = False
    chunk_bytes: int = 65536
    max_chunks_per_transfer: int = 64
    num_nics_per_transfer: int = 1
    # mori_torch extensions
    gid_index: int = -1  # -1: the port's IPv4-mapped RoCE v2 GID (env MORI_RDMA_GID_INDEX overrides)
    sq_depth: int = 512  # send work requests per QP
    sq_full_timeout_ms: int = 10000  # a transfer waits this long for send-queue room, then fails "SQ full"
    connect_timeout_ms: int = 5000
    # a QP with work in flight that completes nothing this long drops its
    # connection: the transfers retry over a fresh one (failover on) or fail
    inactivity_timeout_ms: int = 30000


@dataclasses.dataclass
class XgmiBackendConfig:
    """Settings of the GPU-peer backend: MORI-IO's stream and event pools, plus
    when a batch goes to the copy kernel instead of the copy engines."""

    num_streams: int = 64
    num_events: int = 64
    # Extensions (not in MORI-IO): a transfer whose merged segments number at
    # least kernel_min_segments and average under kernel_max_avg_bytes goes
    # to the copy kernel, others to the copy engines (docs/BENCHMARK.md).
    kernel_min_segments: int = 8
    kernel_max_avg_bytes: int = 8 << 20


@dataclasses.dataclass
class FabricBackendConfig:
    """Upstream MORI-IO's UALink fabric backend config, for code that names it.
    mori-torch has no fabric backend: create_backend(BackendType.FABRIC) raises."""

    num_streams: int = 64
    num_events: int = 64


@dataclasses.dataclass
class TcpBackendConfig:
    """Settings of the TCP backend: the fields and defaults of MORI's TCP
    branch, plus the mori_torch extensions below (README "Backends")."""

    sock_sndbuf_bytes: int = 32 * 1024 * 1024
    sock_rcvbuf_bytes: int = 32 * 1024 * 1024
    op_timeout_ms: int = 30000
    enable_keepalive: bool = True
    keepalive_idle_sec: int = 30
    keepalive_intvl_sec: int = 10
    keepalive_cnt: int = 3
    enable_ctrl_nodelay: bool = True
    num_data_conns: int = 8
    striping_threshold_bytes: int = 64 * 1024
    # mori_torch extensions
    connect_timeout_ms: int = 5000
    enable_notification: bool = True
    # GPU memory goes through pinned staging buffers: per connection and
    # direction, staging_depth chunks of staging_chunk_bytes in flight.
    staging_chunk_bytes: int = 512 * 1024
    staging_depth: int = 4
    # A transfer whose connection moves no byte for this long fails (and the
    # connection with it), long before op_timeout_ms (the whole operation).
    # A slow but live link keeps moving bytes and is not cut off.
    inactivity_timeout_ms: int = 10000
    # Threads serving inbound requests (and, each, sending and receiving for
    # outbound ones), whatever the number of connections; 0: from the cores.
    serve_threads: int = 0
    # Host-memory requests up to this size are sent by the submitting thread
    # and received and served by the event loop when all their bytes are
    # there, with no hand-off to a worker thread (0: always hand off).
    inline_max_bytes: int = 64 * 1024
    # Where the event loop sleeps between events (MORI_TORCH_LOOP_SPIN_US 0,
    # the default below 16 CPUs), a thread polling a small host-memory
    # transfer's status reads its response itself once it is all there,
    # saving the loop thread's wake-up.
    poller_receives: bool = True
    # A read's completion notice to the target waits up to this long to ride
    # on the next request to that peer, in the same system call, instead of
    # costing a send and a target event of its own (0: sent at once; -1: 1000
    # where the event loop spins, MORI_TORCH_LOOP_SPIN_US, else 0).
    notice_delay_us: int = -1


_CONFIG_TYPES = {
    BackendType.TCP: TcpBackendConfig,
    BackendType.RDMA: RdmaBackendConfig,
    BackendType.XGMI: XgmiBackendConfig,
}


_UNSUPPORTED_BACKENDS = {
    BackendType.FABRIC: "the FABRIC (UALink scale-up) backend is not supported by mori-torch; "
                        "use BackendType.XGMI inside a node, RDMA or TCP between nodes",
}


def _both_names(where: str, own: str, up: str) -> TypeError:
    return TypeError(f"{where}: got both {own}= and its upstream name {up}=")


class _NoUid:
    """The default of a per-transfer call's ``uid``: distinct from None, so an
    explicit ``uid=None`` still fails as a wrong type ("uid must be an int")."""

    def __repr__(self) -> str:
        return "<required>"


_NO_UID = _NoUid()


def _uid_or_upstream(uid, transfer_uid, where: str):
    """The per-transfer calls take upstream's ``transfer_uid=`` themselves
    rather than through _upstream_keywords, whose extra frame costs about
    0.15 us a call; this is that wrapper's rule for them (called when uid is
    missing or transfer_uid is given)."""
    if transfer_uid is None:
        raise TypeError(f"{where}() missing its uid (or upstream's transfer_uid=)")
    if uid is not _NO_UID:
        raise _both_names(where, "uid", "transfer_uid")
    return transfer_uid


def _upstream_keywords(**aliases: str):
    """Accepts upstream mori.io's keyword names beside ours (``engine_desc=``
    for ``desc=``, ``transfer_uid=`` for ``uid=``, ...).

    Upstream and mori-torch disagree on a few parameter names; code written
    for either must run unchanged. Passing both spellings is a TypeError. The
    wrapper's signature lists the upstream names as keyword-only parameters,
    so ``inspect.signature`` (and the compatibility test) sees both. Calls
    without keywords (the hot path) go straight through.
    """

    def wrap(fn):
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        # Ours stay positional-or-keyword; a caller using the upstream name
        # leaves ours unset, so the advertised signature gives them a default.
        params = [q.replace(default=None) if q.name in aliases.values() and q.default is q.empty else q
                  for q in params]
        extra = [inspect.Parameter(up, inspect.Parameter.KEYWORD_ONLY, default=None) for up in aliases]
        call_sig = sig.replace(parameters=sorted(params + extra, key=lambda q: q.kind))

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if kwargs:
                for up, own in aliases.items():
                    if up in kwargs:
                        if own in kwargs:
                            raise _both_names(fn.__qualname__, own, up)
                        kwargs[own] = kwargs.pop(up)
            return fn(*args, **kwargs)

        call.__signature__ = call_sig
        return call

    return wrap


def _config_dict(config) -> Dict[str, int]:
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        try:
            out[f.name] = operator.index(v)
        except TypeError:
            raise TypeError(f"{type(config).__name__}.{f.name} must be an int or bool, got {v!r}") from None
    return out


def _raise_if_type_error(e: RuntimeError) -> None:
    """Argument-type mismatches rejected by the TorchScript boundary become TypeError.

    Used as ``except RuntimeError as e: _raise_if_type_error(e); raise``: a
    plain try costs nothing on the hot path, a context manager about a
    microsecond per call.
    """
    # torch's own wording is all there is to go on: the TorchScript boundary
    # raises a plain RuntimeError with no code (mori_torch's errors never
    # take this path: they carry a StatusCode).
    msg = str(e)
    if "Expected a value of type" in msg or "Expected at most" in msg or "incompatible function arguments" in msg:
        raise TypeError(msg.splitlines()[0]) from None


def _index(name: str, v) -> int:
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None


def set_log_level(level) -> None:
    """Sets the native log level: trace, debug, info, warning, error, critical or off,
    for every subsystem; a mori_torch extension also takes per-subsystem levels,
    "info,tcp=debug" (mori_torch.log.set_level; docs/OBSERVABILITY.md)."""
    if not isinstance(level, str):
        raise TypeError(f"set_log_level: level must be a str, got {type(level).__name__}")
    _native.Engine.set_log_level(level)


class TransferStatus:
    """Status of one transfer; CamelCase methods as in MORI-IO."""

    # The polls read the code through _C.status_code, a plain CPython call:
    # TorchScript's method call costs about 1.4 us, a poll loop's whole budget.
    __slots__ = ("_s",)

    def __init__(self, _native_status=None):
        self._s = _native_status if _native_status is not None else _native.TransferStatus()

    def Code(self) -> StatusCode:
        """The current code: INIT, IN_PROGRESS, SUCCESS or an error."""
        return StatusCode(_status_code(self._s))

    def Message(self) -> str:
        """The error message (empty while none)."""
        return self._s.Message()

    def Init(self) -> bool:
        """True before the transfer started."""
        return _status_code(self._s) == _INIT

    def InProgress(self) -> bool:
        """True while the transfer runs."""
        return _status_code(self._s) == _IN_PROGRESS

    def Succeeded(self) -> bool:
        """True once the transfer ended without error."""
        return _status_code(self._s) == _SUCCESS

    def Failed(self) -> bool:
        """True once the transfer ended with an error."""
        return _status_code(self._s) > _LAST_NON_ERROR

    def Update(self, code, message: str = "") -> None:
        """Sets code and message (for statuses a caller makes itself, as in MORI-IO)."""
        self._s.Update(int(StatusCode(code)), message)

    def SetCode(self, code) -> None:
        """Sets the code (as in MORI-IO)."""
        self._s.SetCode(int(StatusCode(code)))

    def SetMessage(self, message: str) -> None:
        """Sets the message (as in MORI-IO)."""
        self._s.SetMessage(message)

    def Wait(self) -> None:
        """Blocks until the transfer ends; releases the GIL meanwhile."""
        _status_wait(self._s, -1)

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:
        """Waits up to timeout_ms (0: poll once, <0: forever); returns the code seen."""
        return StatusCode(_status_wait(self._s, timeout_ms))

    def WaitBusy(self, timeout_ms: int = -1) -> StatusCode:
        """Upstream's spinning wait; here the same as WaitFor (which also
        releases the GIL), kept so code calling it runs unchanged."""
        return self.WaitFor(timeout_ms)

    def __repr__(self) -> str:
        code = self.Code()
        msg = self.Message()
        return f"TransferStatus({code.name}{', ' + repr(msg) if msg else ''})"


def _bytes_tensor(data, what: str) -> torch.Tensor:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{what}: empty input")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class EngineDesc:
    """How to reach an engine. Exchange it as bytes with pack()/unpack()."""

    __slots__ = ("_d",)

    def __init__(self, _native_desc):
        self._d = _native_desc

    key = property(lambda self: self._d.key(), doc="The engine's key.")
    node_id = property(lambda self: self._d.node_id(),
                       doc="The node the engine runs on (MORI_TORCH_NODE_ID or MORI_IO_NODE_ID, else the boot id).")
    hostname = property(lambda self: self._d.hostname(), doc="The host name of the engine's machine.")
    host = property(lambda self: self._d.host(), doc='The address the engine listens on.')
    port = property(lambda self: self._d.port(), doc="The engine's control-plane port.")
    pid = property(lambda self: self._d.pid(), doc="The engine's process id.")
    # mori_torch extension: random per engine process (a restart changes it)
    incarnation = property(lambda self: self._d.incarnation() & 0xFFFFFFFFFFFFFFFF,
                           doc='Random per engine process, so a restarted engine has a new one (mori_torch extension).')

    def pack(self) -> bytes:
        """The descriptor as bytes, for unpack() on a peer."""
        return bytes(self._d.pack().tolist())

    @staticmethod
    def unpack(data) -> "EngineDesc":
        """The EngineDesc packed in ``data`` (bytes); ValueError if malformed or of another format version."""
        return EngineDesc(_native.EngineDesc.unpack(_bytes_tensor(data, "EngineDesc.unpack")))

    def __eq__(self, other) -> bool:
        if not isinstance(other, EngineDesc):
            return False
        with _no_torch_function():
            return self._d.equals(other._d)

    __hash__ = None

    def __repr__(self) -> str:
        return f"EngineDesc(key={self.key!r}, host={self.host!r}, port={self.port}, node_id={self.node_id!r})"


class MemoryDesc:
    """A registered memory range. Exchange it as bytes with pack()/unpack()."""

    __slots__ = ("_d",)

    def __init__(self, _native_desc):
        self._d = _native_desc

    engine_key = property(lambda self: self._d.engine_key(), doc='The key of the engine that owns the memory.')
    id = property(lambda self: self._d.id(), doc="The registration's id in its engine.")
    device_id = property(lambda self: self._d.device_id(), doc='The GPU index (-1 for host memory).')
    device_bus_id = property(lambda self: self._d.device_bus_id(),
                             doc="The GPU's PCI bus id (empty for host memory).")
    data = property(lambda self: self._d.data(), doc="The memory's address in its owner's process.")
    size = property(lambda self: self._d.size(), doc="The memory's size in bytes.")
    loc = property(lambda self: MemoryLocationType(self._d.loc()),
                   doc='Host (CPU) or GPU memory (MemoryLocationType).')
    ipc_offset = property(lambda self: self._d.ipc_offset(),
                          doc='Offset of the registered range inside its IPC allocation.')
    numa_node = property(lambda self: self._d.numa_node(),
                         doc='The NUMA node of host memory (-1 for GPU memory or unknown).')

    @property
    def ipc_handle(self) -> bytes:
        """The GPU IPC handle of the allocation holding this memory (empty for host memory)."""
        return bytes(self._d.ipc_handle().tolist())

    def pack(self) -> bytes:
        """The descriptor as bytes, for unpack() on a peer."""
        return bytes(self._d.pack().tolist())

    @staticmethod
    def unpack(data) -> "MemoryDesc":
        """The MemoryDesc packed in ``data`` (bytes); ValueError if malformed or of another format version."""
        return MemoryDesc(_native.MemoryDesc.unpack(_bytes_tensor(data, "MemoryDesc.unpack")))

    def __eq__(self, other) -> bool:
        if not isinstance(other, MemoryDesc):
            return False
        with _no_torch_function():
            return self._d.equals(other._d)

    __hash__ = None

    def __repr__(self) -> str:
        return (
            f"MemoryDesc(engine_key={self.engine_key!r}, id={self.id}, loc={self.loc.name}, "
            f"device_id={self.device_id}, data=0x{self.data:x}, size={self.size})"
        )


def _check_desc(name: str, d, cls):
    if not isinstance(d, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(d).__name__}")
    return d._d


class _ShutDownEngine:
    """Stands in for the native engine after IOEngine.shutdown(): every call raises."""

    __slots__ = ("_key", "_native")

    def __init__(self, key: str, native=None):
        self._key = key
        self._native = native  # read only for stats() after shutdown

    def __getattr__(self, name):
        self.refuse(name)

    def refuse(self, name: str):
        raise RuntimeError(f"IOEngine '{self._key}' is shut down ({name} called after shutdown())")


def _native_call(fn):
    """Wraps an IOEngine method: TorchScript argument-type errors become TypeError."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            _raise_if_type_error(e)
            raise

    return wrapper


# TorchScript's Python entry probes every argument that is not a tensor for
# __torch_function__; on one of our ScriptObjects (descriptors, statuses) the
# probe throws and catches a C++ exception: 10-20 us per object, so an
# engine-level read paid it twice and an 8-pair batch 16 times. Our methods
# are not torch functions: calls that pass our objects run with it off.
_no_torch_function = torch._C.DisableTorchFunction


def _native_form(what: str, v, is_native, convert):
    """``v`` as it is where the native call reads it itself, else converted."""
    return v if is_native(v) else convert(what, v)


def _native_each(v) -> bool:
    """A list or tuple whose entries the native engine batch reads itself: lists, tuples, tensors."""
    return (type(v) is list or type(v) is tuple) and all(_native_int64s(x) for x in v)


def _native_int64s(v) -> bool:
    """A form the native batch calls read themselves: a list, tuple or tensor."""
    return type(v) is list or type(v) is tuple or isinstance(v, torch.Tensor)


def _wrap_all(natives) -> List[TransferStatus]:
    return [TransferStatus(s) for s in natives]


class IOEngineSession:
    """Pins one (local, remote) memory pair to its backend; see IOEngine.create_session."""

    __slots__ = ("_s", "_engine")

    def __init__(self, _native_session, _engine=None):
        self._s = _native_session
        self._engine = _engine

    def _check_open(self):
        if self._engine is not None and isinstance(self._engine._e, _ShutDownEngine):
            raise RuntimeError(f"IOEngine '{self._engine.key}' of this session is shut down")

    def allocate_transfer_uid(self) -> int:
        """A transfer uid not used before by this engine."""
        self._check_open()
        return _transfer_uid(self._s)

    def read(self, local_offset: int, remote_offset: int, size: int, uid: int = _NO_UID, *,
             transfer_uid: int = None) -> TransferStatus:
        """Reads ``size`` bytes at ``remote_offset`` of the remote memory into ``local_offset`` of the
        local one; returns at once with the transfer's status."""
        if uid is _NO_UID or transfer_uid is not None:
            uid = _uid_or_upstream(uid, transfer_uid, "IOEngineSession.read")
        self._check_open()
        return TransferStatus(_session_transfer(self._s, True, local_offset, remote_offset, size, uid))

    def write(self, local_offset: int, remote_offset: int, size: int, uid: int = _NO_UID, *,
              transfer_uid: int = None) -> TransferStatus:
        """Writes ``size`` bytes at ``local_offset`` of the local memory to ``remote_offset`` of the
        remote one; returns at once with the transfer's status."""
        if uid is _NO_UID or transfer_uid is not None:
            uid = _uid_or_upstream(uid, transfer_uid, "IOEngineSession.write")
        self._check_open()
        return TransferStatus(_session_transfer(self._s, False, local_offset, remote_offset, size, uid))

    @_upstream_keywords(transfer_uid="uid")
    def batch_read(self, local_offsets, remote_offsets, sizes, uid: int) -> TransferStatus:
        """Lists or tuples of ints, 1-D int64 tensors or numpy integer arrays."""
        return self._batch(True, local_offsets, remote_offsets, sizes, uid)

    @_upstream_keywords(transfer_uid="uid")
    def batch_write(self, local_offsets, remote_offsets, sizes, uid: int) -> TransferStatus:
        """Lists or tuples of ints, 1-D int64 tensors or numpy integer arrays."""
        return self._batch(False, local_offsets, remote_offsets, sizes, uid)

    def _batch(self, is_read, local_offsets, remote_offsets, sizes, uid):
        self._check_open()
        # Lists, tuples and tensors go to the native call as they are (it
        # reads lists itself); numpy arrays and other iterables become
        # tensors first.
        lo = _native_form("local_offsets", local_offsets, _native_int64s, _int64s)
        ro = _native_form("remote_offsets", remote_offsets, _native_int64s, _int64s)
        sz = _native_form("sizes", sizes, _native_int64s, _int64s)
        return TransferStatus(_session_batch(self._s, is_read, lo, ro, sz, uid))

    def alive(self) -> bool:
        """False once the session's backend or either memory is gone."""
        self._check_open()
        return self._s.alive()

    @property
    def backend_type(self) -> BackendType:
        """The backend this session's transfers go through."""
        return BackendType(self._s.backend_type())


class IOEngine:
    """A transfer engine: registers memory and moves bytes to and from remote engines."""

    def __init__(self, key: str, config: IOEngineConfig):
        if not isinstance(key, str):
            raise TypeError(f"IOEngine: key must be a str, got {type(key).__name__}")
        if not isinstance(config, IOEngineConfig):
            raise TypeError(f"IOEngine: config must be an IOEngineConfig, got {type(config).__name__}")
        if not isinstance(config.host, str):
            raise TypeError("IOEngineConfig.host must be a str")
        if config.secret is not None and not isinstance(config.secret, str):
            raise TypeError(f"IOEngineConfig.secret must be a str or None, got {type(config.secret).__name__}")
        metrics_port = _index("IOEngineConfig.metrics_port", config.metrics_port)
        if not -1 <= metrics_port <= 65535:
            raise ValueError(f"IOEngineConfig.metrics_port must be in [-1, 65535] (-1: none), got {metrics_port}")
        if not isinstance(config.nvtx, bool):
            raise TypeError(f"IOEngineConfig.nvtx must be a bool, got {type(config.nvtx).__name__}")
        if config.nvtx:
            _native.Engine.set_trace_ranges(True)
        if not isinstance(config.failover, bool):
            raise TypeError(f"IOEngineConfig.failover must be a bool, got {type(config.failover).__name__}")
        self._e = _native.Engine(key, config.host, _index("IOEngineConfig.port", config.port), config.secret or "",
                                 config.failover, _index("IOEngineConfig.retry_attempts", config.retry_attempts),
                                 _index("IOEngineConfig.retry_budget_ms", config.retry_budget_ms))
        self._key = key
        self._metrics_server = None
        if metrics_port >= 0:
            try:
                from . import metrics

                self._metrics_server = metrics.serve(self, metrics_port, config.host or "127.0.0.1")
            except BaseException:
                self._e.shutdown()
                raise
        # Registered tensors stay alive until deregistered: the engine may
        # touch their memory at any time.
        self._tensors: Dict[int, torch.Tensor] = {}
        # Called first thing in shutdown(): rendezvous directories take the
        # engine's entry out, so peers never look up an engine that is gone.
        self._shutdown_hooks: List = []

    @property
    def key(self) -> str:
        """The engine's key, unique among the engines that talk to each other."""
        return self._key

    @_native_call
    def get_engine_desc(self) -> EngineDesc:
        """This engine's descriptor: give it (packed) to peers so they can reach it."""
        return EngineDesc(self._e.get_engine_desc())

    @_native_call
    def create_backend(self, type, config=None) -> None:
        """Adds a backend of ``type`` (BackendType) with ``config`` (its config class; None: the defaults).

        ValueError or TypeError for a wrong type or config; RuntimeError if the
        backend cannot start here (e.g. RDMA without an active device)."""
        btype = BackendType(type)
        if btype in _UNSUPPORTED_BACKENDS:
            raise NotImplementedError(f"create_backend({btype.name}): {_UNSUPPORTED_BACKENDS[btype]}")
        cls = _CONFIG_TYPES.get(btype)
        if cls is None:
            raise ValueError(f"create_backend: unsupported backend type {btype!r}")
        if config is None:
            config = cls()
        elif not isinstance(config, cls):
            raise TypeError(
                f"create_backend({btype.name}): config must be a {cls.__name__}, "
                f"got {builtins.type(config).__name__}"
            )
        self._e.create_backend(int(btype), _config_dict(config))

    @_native_call
    def remove_backend(self, type) -> None:
        """Removes the backend of ``type``; its in-flight transfers end with an error status."""
        self._e.remove_backend(int(BackendType(type)))

    @_native_call
    @_upstream_keywords(engine_desc="desc")
    def register_remote_engine(self, desc: EngineDesc) -> None:
        """Makes the engine of ``desc`` known, so memory it owns can be used in transfers."""
        d = _check_desc("desc", desc, EngineDesc)
        with _no_torch_function():
            self._e.register_remote_engine(d)

    @_native_call
    @_upstream_keywords(engine_desc="desc")
    def deregister_remote_engine(self, desc: EngineDesc, *, reason: str = "") -> None:
        """Forgets a remote engine; its in-flight transfers end with
        ERR_BAD_STATE. ``reason`` (a mori_torch extension) goes into their
        messages, e.g. "peer left: ..." from a rendezvous directory."""
        d = _check_desc("desc", desc, EngineDesc)
        if not isinstance(reason, str):
            raise TypeError(f"deregister_remote_engine: reason must be a str, got {type(reason).__name__}")
        with _no_torch_function():
            if reason:
                self._e.deregister_remote_engine_because(d, reason)
            else:
                self._e.deregister_remote_engine(d)

    @_native_call
    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc) -> MemoryDesc:
        """Registers ``size`` bytes at address ``ptr`` (host memory, or GPU memory of
        ``device_id``, as ``mem_loc`` says); returns its descriptor. The caller
        keeps the memory alive until deregister_memory."""
        loc = MemoryLocationType(mem_loc)
        return MemoryDesc(
            self._e.register_memory(_index("ptr", ptr), _index("size", size), _index("device_id", device_id), int(loc))
        )

    @_native_call
    def register_torch_tensor(self, tensor: torch.Tensor) -> MemoryDesc:
        """Registers a contiguous tensor's bytes (CPU or GPU); returns its
        descriptor. The engine keeps the tensor alive until deregister_memory."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_torch_tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        desc = MemoryDesc(self._e.register_tensor(tensor))
        self._tensors[desc.id] = tensor
        return desc

    @_native_call
    @_upstream_keywords(mem_desc="desc")
    def deregister_memory(self, desc: MemoryDesc) -> None:
        """Deregisters local memory: in-flight transfers on it end with an error, and
        peers that mapped it (XGMI) have stopped using it when this returns."""
        d = _check_desc("desc", desc, MemoryDesc)
        with _no_torch_function():
            self._e.deregister_memory(d)
        self._tensors.pop(desc.id, None)

    def allocate_transfer_uid(self) -> int:
        """A transfer uid not used before by this engine."""
        e = self._e
        if isinstance(e, _ShutDownEngine):
            return e.allocate_transfer_uid()  # raises: shut down
        return _transfer_uid(e)

    def read(self, local_dest, local_offset, remote_src, remote_offset, size, uid=_NO_UID, *,
             transfer_uid=None) -> TransferStatus:
        """Reads ``size`` bytes at ``remote_offset`` of ``remote_src`` into ``local_offset`` of
        ``local_dest``; returns at once with the transfer's status."""
        if uid is _NO_UID or transfer_uid is not None:
            uid = _uid_or_upstream(uid, transfer_uid, "IOEngine.read")
        local = _check_desc("local_dest", local_dest, MemoryDesc)
        remote = _check_desc("remote_src", remote_src, MemoryDesc)
        if type(self._e) is _ShutDownEngine:
            self._e.refuse("read")
        return TransferStatus(_engine_transfer(self._e, True, local, local_offset, remote, remote_offset, size, uid))

    def write(self, local_src, local_offset, remote_dest, remote_offset, size, uid=_NO_UID, *,
              transfer_uid=None) -> TransferStatus:
        """Writes ``size`` bytes at ``local_offset`` of ``local_src`` to ``remote_offset`` of
        ``remote_dest``; returns at once with the transfer's status."""
        if uid is _NO_UID or transfer_uid is not None:
            uid = _uid_or_upstream(uid, transfer_uid, "IOEngine.write")
        local = _check_desc("local_src", local_src, MemoryDesc)
        remote = _check_desc("remote_dest", remote_dest, MemoryDesc)
        if type(self._e) is _ShutDownEngine:
            self._e.refuse("write")
        return TransferStatus(_engine_transfer(self._e, False, local, local_offset, remote, remote_offset, size, uid))

    def _batch(self, is_read, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids):
        locals_ = [_check_desc("local_descs[]", d, MemoryDesc) for d in local_descs]
        remotes = [_check_desc("remote_descs[]", d, MemoryDesc) for d in remote_descs]
        # One native call, without TorchScript's conversion of every argument
        # and result: it reads lists itself and takes tensors in place; other
        # entries (numpy arrays, ranges) become tensors first.
        if type(self._e) is _ShutDownEngine:
            self._e.refuse("batch_read/batch_write")
        lo = _native_form("local_offsets", local_offsets, _native_each, _int64s_each)
        ro = _native_form("remote_offsets", remote_offsets, _native_each, _int64s_each)
        sz = _native_form("sizes", sizes, _native_each, _int64s_each)
        natives = _C.engine_batch(self._e, is_read, locals_, lo, remotes, ro, sz,
                                  uids if type(uids) is list else list(uids))
        return _wrap_all(natives)

    @_upstream_keywords(transfer_uid="uids")
    def batch_read(self, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids) -> List[TransferStatus]:
        """One transfer per memory pair: entry i reads sizes[i] at local_offsets[i] of local_descs[i] from
        remote_offsets[i] of remote_descs[i] under uids[i]. Offsets and sizes as in IOEngineSession.batch_read."""
        return self._batch(True, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids)

    @_upstream_keywords(transfer_uid="uids")
    def batch_write(self, local_descs, local_offsets, remote_descs, remote_offsets, sizes,
                    uids) -> List[TransferStatus]:
        """As batch_read, in the other direction."""
        return self._batch(False, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids)

    @_native_call
    @_upstream_keywords(local_mem="local", remote_mem="remote")
    def create_session(self, local: MemoryDesc, remote: MemoryDesc) -> Optional[IOEngineSession]:
        """A session pinning the pair (``local``, ``remote``) to the backend that
        serves it, for repeated transfers without per-call lookups; None if no
        backend can serve the pair."""
        pair = _check_desc("local", local, MemoryDesc), _check_desc("remote", remote, MemoryDesc)
        with _no_torch_function():
            s = self._e.create_session(*pair)
        return None if s is None else IOEngineSession(s, self)

    @_native_call
    @_upstream_keywords(transfer_uid="uid")
    def pop_inbound_transfer_status(self, remote_key: str, uid: int) -> Optional[TransferStatus]:
        """The status of the inbound transfer ``uid`` of engine ``remote_key`` once
        its data is in place, or None; each status is returned once."""
        s = self._e.pop_inbound_transfer_status(remote_key, _index("uid", uid))
        return None if s is None else TransferStatus(s)

    @_native_call
    def wait_all(self, statuses: Sequence[Optional[TransferStatus]], timeout_ms: int = -1) -> StatusCode:
        """Waits until every status ends (None entries skipped), at most
        ``timeout_ms`` (<0: forever); returns SUCCESS or the first error code."""
        natives = []
        for s in statuses:
            if s is None:
                continue
            if not isinstance(s, TransferStatus):
                raise TypeError(f"wait_all: expected TransferStatus entries, got {type(s).__name__}")
            natives.append(s._s)
        timeout_ms = _index("timeout_ms", timeout_ms)
        with _no_torch_function():
            return StatusCode(self._e.wait_all(natives, timeout_ms))

    def stats(self) -> dict:
        """This engine's transfer counters (a mori_torch extension), as a plain dict::

            {"engine": key, "total": C, "backends": {"TCP": C, ...},
             "peers": {remote_key: {"TCP": C, ...}}, "unrouted": C,
             "latency_bounds_us": [1, 2, 4, ...]}

        where each ``C`` holds ``reads``, ``writes``, ``transfers`` (submitted,
        refused ones included), ``bytes_read``, ``bytes_written``, ``bytes``
        (of transfers that succeeded), ``succeeded``, ``errors`` (by status
        code name), ``in_flight`` and ``latency``: ``buckets`` (counts per
        bound of ``latency_bounds_us``, the last one unbounded), ``count`` and
        ``sum_ns``. ``unrouted`` counts transfers refused before a backend was
        chosen (bad arguments, unknown engine); backends and peers with no
        transfers are left out. Counters keep counting from the engine's
        start and stay readable after shutdown()."""
        return json.loads(self._stats_json())

    def _stats_json(self) -> str:
        native = self._e._native if isinstance(self._e, _ShutDownEngine) else self._e
        return native.stats_json()

    @property
    def metrics_port(self) -> Optional[int]:
        """The port of this engine's Prometheus endpoint (IOEngineConfig.metrics_port), None without one."""
        return None if self._metrics_server is None else self._metrics_server.server_port

    @_native_call
    def failover_stats(self) -> Dict[str, int]:
        """What retry and failover did so far: retries (attempts after a
        transfer's first), recovered (transfers that succeeded after a retry),
        exhausted (transfers that failed after every attempt), failovers
        (switches away from a failed backend), returns (switches back),
        probes (transfers let through to a failed backend) and paths_down
        (peer, backend) paths failed now."""
        return dict(self._e.failover_stats())

    @_native_call
    def mapped_remote_memories(self) -> int:
        """How many peers' memories this engine holds mapped (XGMI IPC
        mappings); a mapping closes when its owner deregisters the memory,
        when the peer is deregistered, or at shutdown. For tests and leak checks."""
        return int(self._e.mapped_remote_memories())

    def shutdown(self) -> None:
        """Ends in-flight transfers with an error and stops the engine's threads.

        Every later call on this engine (and its sessions) raises RuntimeError;
        calling shutdown() again does nothing."""
        if isinstance(self._e, _ShutDownEngine):
            return
        hooks, self._shutdown_hooks = self._shutdown_hooks, []
        for hook in hooks:
            fn = hook()  # weak references: a hook never keeps its owner alive
            if fn is not None:
                fn()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self._e.shutdown()
        self._e = _ShutDownEngine(self._key, self._e)
        self._tensors.clear()
