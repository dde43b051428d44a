#include "torch/status_poll.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/jit/api/object.h>

#include "torch/classes.h"

namespace mori_torch {
namespace bind {

PyObject* StatusCodeOf(PyObject*, PyObject* status) {
  StatusRef ref;
  try {
    // A torch.ScriptObject is pybind11's wrapper of torch::jit::Object; its
    // slot holds our TransferStatusObj (toCustomClass checks the class).
    auto obj = pybind11::handle(status).cast<torch::jit::Object>();
    ref = c10::IValue(obj._ivalue()).toCustomClass<TransferStatusObj>();
  } catch (...) {
    // Nothing may cross the C boundary: not our status is a TypeError.
    PyErr_Format(PyExc_TypeError, "status_code: expected a torch.classes.mori.TransferStatus, got %s",
                 Py_TYPE(status)->tp_name);
    return nullptr;
  }
  StatusCode code = ref->s->PeekCode();
  if (!IsTerminal(code)) {
    // A running status may poll its backend (an XGMI event query): without
    // the GIL, as TorchScript's call did.
    bool failed = false;
    Py_BEGIN_ALLOW_THREADS;
    try {
      code = ref->s->Code();
    } catch (...) {
      failed = true;
    }
    Py_END_ALLOW_THREADS;
    if (failed) {
      PyErr_SetString(PyExc_RuntimeError, "status_code: polling the transfer's backend failed");
      return nullptr;
    }
  }
  return PyLong_FromLong(static_cast<long>(code));
}

}  // namespace bind
}  // namespace mori_torch
