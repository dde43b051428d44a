"""Transfers as torch ops: ``torch.ops.mori.*`` with Python wrappers.

The ops move bytes between a session's local tensor and its remote memory and
work in eager mode, under ``torch.compile(fullgraph=True)`` and inside
captured CUDA graphs:

* every tensor argument on the CPU: a synchronous transfer; errors raise;
* any tensor argument on a GPU: the transfer is ordered on the current stream
  of that GPU. Work queued before the op on that stream finishes before any
  byte moves; work queued after it sees the bytes. GPU-peer sessions (XGMI)
  launch one copy kernel; host-driven sessions (TCP, RDMA) ring a doorbell
  that the engine's progress thread answers. GPU pages of host-driven
  sessions travel through the doorbell slot's pinned staging: a kernel on the
  stream packs them before the doorbell (writes) and unpacks them after it
  (reads), so the engine's threads never make a CUDA call while a stream
  waits on them, and any kernel may follow the op. Block lists given as GPU
  tensors are read when the stream reaches the op, so each CUDA graph replay
  uses the lists of that replay.

Errors found on the stream (a block-table entry out of range, a failed
transfer) cannot raise at the call: out-of-range entries move no byte and the
error waits in the session until :func:`check_errors` raises it.

Under CUDA graph capture every block list must be a GPU tensor (a replay
reads it); a CPU list raises ValueError naming the argument.

Sessions enter the ops as int handles (:func:`session_handle`): a plain int is
a constant to torch.compile and CUDA graphs.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from . import _C  # noqa: F401  (registers torch.ops.mori.*)
from ._int64s import int64s

__all__ = [
    "session_handle",
    "release_session_handle",
    "read",
    "write",
    "batch_read",
    "batch_write",
    "read_pages",
    "write_pages",
    "check_errors",
    "stream_flag_mechanism",
    "doorbell_slots",
]

IntList = Union[torch.Tensor, Sequence[int]]
_ops = torch.ops.mori


def session_handle(session) -> int:
    """Returns the int handle of ``session`` for the ops (the same handle for
    the same session). ``session`` is a ``mori_torch.io.IOEngineSession`` or a
    ``torch.classes.mori.Session``. Call it outside graph capture: it also
    maps remote memory and loads kernels. The handle keeps the session alive
    until :func:`release_session_handle`."""
    native = getattr(session, "_s", session)
    return _ops.session_handle(native)


def release_session_handle(handle: int) -> None:
    """Forgets ``handle``. CUDA graphs that captured ops on it keep working."""
    _ops.release_session_handle(handle)


def check_errors(handle: int) -> None:
    """Raises the first error of a stream-ordered transfer on ``handle`` since
    the last check (ValueError for out-of-range block-table entries,
    RuntimeError for failed transfers), then clears it. Synchronize the stream
    first to see errors of work still queued."""
    _ops.check_errors(handle)


def stream_flag_mechanism() -> str:
    """How doorbell flags are written and awaited on GPU streams: "memops"
    (driver stream memory operations), "spin" (kernels polling host memory;
    forced with MORI_TORCH_STREAM_FLAGS=spin) or "none" (no GPU support)."""
    return _ops.stream_flag_mechanism()


def doorbell_slots() -> dict:
    """Introspection of the doorbell that orders host-driven (TCP) ops on GPU
    streams, for tests and leak checks: ``{"watched": n, "captured": m}``,
    where ``watched`` counts the slots the progress thread watches now (eager
    ops still on a stream and ops captured into CUDA graphs) and ``captured``
    those captured into a graph that is still alive. A captured slot is freed
    (it stops being watched and drops its session) once its graph and every
    executable made from it are destroyed and their launches finished; on HIP
    builds without graph user objects (HIP 5.2) it is watched, uncounted in
    ``captured``, for the life of the process."""
    return {"watched": _ops.doorbell_slots_watched(), "captured": _ops.doorbell_slots_captured()}


def _on_device_of(what: str, values: IntList, like: torch.Tensor) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    return int64s(what, values).to(like.device)


def read(handle: int, local: torch.Tensor, local_offset: int, remote_offset: int, size: int) -> None:
    """Reads ``size`` bytes at ``remote_offset`` of the remote memory into
    ``local`` at byte ``local_offset``. ``local`` is the tensor registered for
    the session (the op mutates it)."""
    _ops.read(handle, local, local_offset, remote_offset, size)


def write(handle: int, local: torch.Tensor, local_offset: int, remote_offset: int, size: int) -> None:
    """Writes ``size`` bytes of ``local`` at byte ``local_offset`` to the
    remote memory at ``remote_offset``."""
    _ops.write(handle, local, local_offset, remote_offset, size)


def batch_read(handle: int, local: torch.Tensor, local_offsets: IntList, remote_offsets: IntList,
               sizes: IntList) -> None:
    """Reads segment i (``sizes[i]`` bytes, or ``sizes[0]`` for all when it
    holds one value) from ``remote_offsets[i]`` into ``local`` at
    ``local_offsets[i]``. Lists are int64 tensors (CPU or GPU) or sequences
    of ints (turned into tensors on ``local``'s device)."""
    _ops.batch_read(handle, local, _on_device_of("local_offsets", local_offsets, local),
                    _on_device_of("remote_offsets", remote_offsets, local), _on_device_of("sizes", sizes, local))


def batch_write(handle: int, local: torch.Tensor, local_offsets: IntList, remote_offsets: IntList,
                sizes: IntList) -> None:
    """Writes segment i of ``local`` (at ``local_offsets[i]``) to the remote
    memory at ``remote_offsets[i]``; lists as in :func:`batch_read`."""
    _ops.batch_write(handle, local, _on_device_of("local_offsets", local_offsets, local),
                     _on_device_of("remote_offsets", remote_offsets, local), _on_device_of("sizes", sizes, local))


def read_pages(handle: int, local: torch.Tensor, local_pages: IntList, remote_pages: IntList,
               page_bytes: int) -> None:
    """Block-table read: page ``remote_pages[i]`` of the remote memory (bytes
    ``[p * page_bytes, (p + 1) * page_bytes)``) into page ``local_pages[i]``
    of ``local``."""
    _ops.read_pages(handle, local, _on_device_of("local_pages", local_pages, local),
                    _on_device_of("remote_pages", remote_pages, local), page_bytes)


def write_pages(handle: int, local: torch.Tensor, local_pages: IntList, remote_pages: IntList,
                page_bytes: int) -> None:
    """Block-table write: page ``local_pages[i]`` of ``local`` to page
    ``remote_pages[i]`` of the remote memory."""
    _ops.write_pages(handle, local, _on_device_of("local_pages", local_pages, local),
                     _on_device_of("remote_pages", remote_pages, local), page_bytes)


# Fake implementations (shapes only, for torch.compile and FakeTensor): the
# ops return nothing; reads mutate `local` in place, as their schemas say.
def _register_fakes():
    def fake_single(session, local, local_offset, remote_offset, size):
        return None

    def fake_lists(session, local, a, b, c):
        return None

    for name in ("read", "write"):
        torch.library.register_fake(f"mori::{name}")(fake_single)
    for name in ("batch_read", "batch_write", "read_pages", "write_pages"):
        torch.library.register_fake(f"mori::{name}")(fake_lists)
    # Writes mutate no input and return nothing: without this, dead-code
    # elimination (FX, AOTAutograd, Inductor) would drop them.
    for name in ("write", "batch_write", "write_pages", "check_errors"):
        torch.fx.node.has_side_effect(getattr(_ops, name).default)


_register_fakes()
