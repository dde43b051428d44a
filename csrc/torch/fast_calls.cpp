#include "torch/fast_calls.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/jit/api/object.h>

#include "torch/classes.h"

namespace mori_torch {
namespace bind {

namespace {

// The holder of class T inside `obj`, a torch.ScriptObject (pybind11's
// wrapper of torch::jit::Object); null for anything else. Nothing may cross
// the C boundary.
template <class T>
c10::intrusive_ptr<T> HolderOf(PyObject* obj) noexcept {
  try {
    auto o = pybind11::handle(obj).cast<torch::jit::Object>();
    // The class compared first: a mismatch thrown by toCustomClass costs
    // microseconds, and the uid call tries a session before an engine.
    if (o.type().get() != c10::getCustomClassType<c10::intrusive_ptr<T>>().get()) return {};
    return c10::IValue(o._ivalue()).toCustomClass<T>();
  } catch (...) {
    return {};
  }
}

}  // namespace

PyObject* StatusCodeOf(PyObject*, PyObject* status) {
  StatusRef ref = HolderOf<TransferStatusObj>(status);
  if (!ref) {
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

PyObject* TransferUidOf(PyObject*, PyObject* owner) {
  // A session first: the per-transfer calls go through sessions.
  if (SessionRef s = HolderOf<SessionObj>(owner)) {
    return PyLong_FromLongLong(static_cast<int64_t>(s->s->AllocateTransferUid()));
  }
  if (EngineRef e = HolderOf<EngineObj>(owner)) {
    return PyLong_FromLongLong(static_cast<int64_t>(e->e->AllocateTransferUid()));
  }
  PyErr_Format(PyExc_TypeError, "transfer_uid: expected a torch.classes.mori.Session or Engine, got %s",
               Py_TYPE(owner)->tp_name);
  return nullptr;
}

}  // namespace bind
}  // namespace mori_torch
