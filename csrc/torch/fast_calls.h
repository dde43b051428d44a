// Plain CPython calls for the calls that Python makes per transfer.
// TorchScript's method call costs 1.4-5 us from Python (schema matching, a
// stack), as much as a poll loop's whole iteration or more than a small
// transfer's own host work, and converts every list argument and result
// entry by entry; mori_torch.io calls these instead.
#pragma once

#include <Python.h>

namespace mori_torch {
namespace bind {

// status_code(status) -> int: the code of a torch.classes.mori.TransferStatus.
PyObject* StatusCodeOf(PyObject* module, PyObject* status);

// transfer_uid(owner) -> int: the next transfer uid of a
// torch.classes.mori.Session or Engine (the same counter their
// allocate_transfer_uid methods take from).
PyObject* TransferUidOf(PyObject* module, PyObject* owner);

// session_transfer(session, is_read, local_offset, remote_offset, size,
// uid) -> TransferStatus: a torch.classes.mori.Session's read or write of
// one segment. Ints may be any int or have __index__ (TypeError naming the
// argument otherwise, OverflowError beyond int64). A METH_FASTCALL function.
PyObject* SessionTransfer(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// session_batch(session, is_read, local_offsets, remote_offsets, sizes, uid)
// -> TransferStatus: a session's batch read or write, each of the three
// arguments a list or tuple of ints (read here; errors name what[j]) or a
// 1-D int64 tensor (read in place; a device tensor is copied to the host).
// A METH_FASTCALL function.
PyObject* SessionBatch(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// engine_transfer(engine, is_read, local_desc, local_offset, remote_desc,
// remote_offset, size, uid) -> TransferStatus: an engine-level read or
// write of one segment (descriptors as torch.classes.mori.MemoryDesc).
// A METH_FASTCALL function.
PyObject* EngineTransfer(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// status_wait(status, timeout_ms) -> int: waits up to timeout_ms for a
// torch.classes.mori.TransferStatus to end (0: poll once, < 0: forever),
// without the GIL; returns the code seen. A METH_FASTCALL function.
PyObject* StatusWait(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// engine_batch(engine, is_read, local_descs, local_offsets, remote_descs,
// remote_offsets, sizes, uids) -> [TransferStatus]: the engine-level batch
// (one transfer per memory pair) from native descriptors, each pair's
// offsets and sizes a list or tuple of ints (read here) or a 1-D int64
// tensor (read in place), as torch.classes.mori.Engine's
// batch_transfer_tensors does from tensors without its conversion of every
// argument and result (about 2 us per pair). Errors name what[i], or
// what[i][j] inside a list. A METH_FASTCALL function.
PyObject* EngineBatch(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

}  // namespace bind
}  // namespace mori_torch
