// status_code(status) -> int: the code of a torch.classes.mori.TransferStatus
// through a plain CPython call. TorchScript's method call costs about 1.4 us
// from Python (schema matching, a stack), as much as a poll loop's whole
// iteration; mori_torch.io's TransferStatus polls through this instead.
#pragma once

#include <Python.h>

namespace mori_torch {
namespace bind {

PyObject* StatusCodeOf(PyObject* module, PyObject* status);

}  // namespace bind
}  // namespace mori_torch
