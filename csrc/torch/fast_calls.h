// Plain CPython calls for the small calls that Python makes per transfer.
// TorchScript's method call costs 1.4-5 us from Python (schema matching, a
// stack), as much as a poll loop's whole iteration or more than a small
// transfer's own host work; mori_torch.io calls these instead.
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

}  // namespace bind
}  // namespace mori_torch
