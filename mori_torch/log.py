"""The native log, and routing it into Python's ``logging``.

Native lines carry a subsystem (``core``, ``engine``, ``ctrl``, ``loop``,
``tcp``, ``rdma``, ``xgmi``, ``stream``, ``gpu``, ``torch``), the name of the
thread that wrote them and the source file:line. Which lines are written is
set per subsystem, natively (Python's logger levels only filter further)::

    MORI_TORCH_LOG=info,tcp=debug python serve.py
    mori_torch.log.set_level("info,tcp=debug")

They go to stderr unless routed::

    import logging, mori_torch.log
    mori_torch.log.route_to_python()   # into logging.getLogger("mori_torch")

Routed, each line becomes a ``logging.LogRecord`` of logger
``mori_torch.<subsystem>`` with ``pathname``/``lineno``/``threadName`` set to
the native ones. A daemon thread moves them; the native queue stays bounded,
so a slow handler loses lines (counted by :func:`lines_dropped`), never
blocks a transfer.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Optional

import torch

from . import _C

__all__ = ["route_to_python", "unroute", "set_level", "level_spec", "lines_dropped", "flush"]

TRACE = 5  # below logging.DEBUG
logging.addLevelName(TRACE, "TRACE")
_LEVELS = (TRACE, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)

_lock = threading.Lock()
_router: Optional["_Router"] = None


class _Router(threading.Thread):
    def __init__(self, logger: logging.Logger):
        super().__init__(name="mori-log-python", daemon=True)
        self.logger = logger
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for rec in _C.log_drain(256, 100):
                try:
                    self.emit(*rec)
                except Exception:  # a failing handler must not stop the routing
                    logging.getLogger(__name__).debug("mori_torch log routing: emit failed", exc_info=True)

    def emit(self, level, subsystem, thread, file, line, time_ms, msg) -> None:
        pylevel = _LEVELS[min(max(level, 0), len(_LEVELS) - 1)]
        logger = self.logger.getChild(subsystem)
        if not logger.isEnabledFor(pylevel):
            return
        record = logger.makeRecord(logger.name, pylevel, file, line, msg, None, None, func=None)
        record.created = time_ms / 1000.0
        record.msecs = time_ms % 1000
        record.threadName = thread
        record.thread = None
        record.filename = os.path.basename(file)
        record.module = os.path.splitext(record.filename)[0]
        record.mori_subsystem = subsystem
        logger.handle(record)


def route_to_python(logger: Optional[logging.Logger] = None) -> None:
    """Sends native log lines to ``logger`` (default ``logging.getLogger("mori_torch")``)
    instead of stderr; each goes to its child logger ``<logger>.<subsystem>``.
    Calling it again switches to the new logger."""
    global _router
    if logger is None:
        logger = logging.getLogger("mori_torch")
    if not isinstance(logger, logging.Logger):
        raise TypeError(f"route_to_python: logger must be a logging.Logger, got {type(logger).__name__}")
    with _lock:
        if _router is not None:
            _router.logger = logger
            return
        _router = _Router(logger)
        _C.log_route(True)
        _router.start()


def unroute() -> None:
    """Sends native log lines to stderr again (lines not yet taken go there too)."""
    global _router
    with _lock:
        router, _router = _router, None
        if router is None:
            return
        router.stop.set()
        _C.log_route(False)  # wakes the router's drain
        router.join(timeout=2.0)


# At exit the router thread stops before native code stops logging: lines
# written after that go to stderr instead of waiting for a reader.
atexit.register(unroute)


def set_level(spec: str) -> None:
    """Native levels: a level for every subsystem and/or ``subsystem=level``
    pairs, comma-separated ("info", "info,tcp=debug", "rdma=trace").
    ValueError names a bad level or subsystem."""
    if not isinstance(spec, str):
        raise TypeError(f"set_level: spec must be a str, got {type(spec).__name__}")
    torch.classes.mori.Engine.set_log_level(spec)


def level_spec() -> str:
    """The native levels now, in set_level's form ("warning,tcp=debug")."""
    return torch.classes.mori.Engine.log_level_spec()


def lines_dropped() -> int:
    """Native log lines lost since the process started: the bounded queue was
    full (a slow reader), or a call site's rate limit suppressed them."""
    e = torch.classes.mori.Engine
    return int(e.log_lines_dropped()) + int(e.log_lines_suppressed())


def flush(timeout_ms: int = 1000) -> bool:
    """Waits up to ``timeout_ms`` for queued native lines to be written (or,
    routed, taken by the router); True if they were."""
    return bool(torch.classes.mori.Engine.flush_log(int(timeout_ms)))
