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

// engine_batch(engine, is_read, local_descs, local_offsets, remote_descs,
// remote_offsets, sizes, uids) -> [TransferStatus]: the engine-level batch
// (one transfer per memory pair) from native descriptors and lists or
// tuples of lists of ints, as torch.classes.mori.Engine's
// batch_transfer_tensors does from tensors: the lists are read here, and
// the TorchScript call's conversion of every argument and result (about
// 2 us per pair) is skipped. Errors in the lists name what[i][j].
// A METH_FASTCALL function.
PyObject* EngineBatch(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

}  // namespace bind
}  // namespace mori_torch
