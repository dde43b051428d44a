#include "torch/status_poll.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/jit/api/object.h>

#include "torch/classes.h"

namespace mori_torch {
namespace bind {

PyObject* StatusCodeOf(PyObject*, PyObject* status) {
  try {
    // A torch.ScriptObject is pybind11's wrapper of torch::jit::Object; its
    // slot holds our TransferStatusObj (toCustomClass checks the class).
    auto obj = pybind11::handle(status).cast<torch::jit::Object>();
    const StatusRef ref = c10::IValue(obj._ivalue()).toCustomClass<TransferStatusObj>();
    return PyLong_FromLong(static_cast<long>(ref->s->Code()));
  } catch (...) {
    // Not our status (pybind11's cast errors, c10's class check): nothing
    // may cross the C boundary, the caller gets a TypeError.
  }
  PyErr_Format(PyExc_TypeError, "status_code: expected a torch.classes.mori.TransferStatus, got %s",
               Py_TYPE(status)->tp_name);
  return nullptr;
}

}  // namespace bind
}  // namespace mori_torch
