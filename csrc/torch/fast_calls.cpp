#include "torch/fast_calls.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <new>
#include <string>
#include <vector>

#include "torch/classes.h"
#include "torch/int64_lists.h"

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

// The native descriptors of the list or tuple `seq`, held in *refs (their
// addresses in *descs stay valid while *refs lives); false with a
// TypeError naming what[i] for anything else.
bool DescsOf(PyObject* seq, const char* what, std::vector<MemoryDescRef>* refs, std::vector<const MemoryDesc*>* descs) {
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of MemoryDesc, got %s", what, Py_TYPE(seq)->tp_name);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  refs->reserve(n);
  descs->reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    MemoryDescRef r = HolderOf<MemoryDescObj>(item);
    if (!r) {
      PyErr_Format(PyExc_TypeError, "%s[%zd] must be a MemoryDesc, got %s", what, i, Py_TYPE(item)->tp_name);
      return false;
    }
    descs->push_back(&r->d);
    refs->push_back(std::move(r));
  }
  return true;
}

std::vector<Int64Span> SpansOf(const std::vector<at::Tensor>& tensors) {
  std::vector<Int64Span> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back({t.data_ptr<int64_t>(), static_cast<size_t>(t.numel())});
  return out;
}

// The batch's statuses as a Python list of torch.classes.mori.TransferStatus.
PyObject* StatusList(const std::vector<StatusPtr>& statuses) {
  pybind11::list out(statuses.size());
  for (size_t i = 0; i < statuses.size(); ++i) {
    out[i] = torch::jit::toPyObject(c10::IValue(c10::make_intrusive<TransferStatusObj>(statuses[i])));
  }
  return out.release().ptr();
}

}  // namespace

PyObject* EngineBatch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError,
                    "engine_batch(engine, is_read, local_descs, local_offsets, remote_descs, remote_offsets, sizes, "
                    "uids)");
    return nullptr;
  }
  try {
    EngineRef engine = HolderOf<EngineObj>(args[0]);
    if (!engine) {
      PyErr_Format(PyExc_TypeError, "engine_batch: expected a torch.classes.mori.Engine, got %s",
                   Py_TYPE(args[0])->tp_name);
      return nullptr;
    }
    const int is_read = PyObject_IsTrue(args[1]);
    if (is_read < 0) return nullptr;
    std::vector<MemoryDescRef> refs;
    std::vector<const MemoryDesc*> locals, remotes;
    std::vector<at::Tensor> lo, ro, sizes;
    std::vector<int64_t> uids;
    if (!DescsOf(args[2], "local_descs", &refs, &locals) || !DescsOf(args[4], "remote_descs", &refs, &remotes) ||
        !ReadInt64Lists(args[3], "local_offsets", &lo) || !ReadInt64Lists(args[5], "remote_offsets", &ro) ||
        !ReadInt64Lists(args[6], "sizes", &sizes) || !ReadInt64List(args[7], "uids", &uids)) {
      return nullptr;
    }
    std::vector<StatusPtr> statuses;
    {
      // As TorchScript's method call does: other Python threads run while
      // the pairs are checked, routed and submitted.
      pybind11::gil_scoped_release no_gil;
      statuses =
          engine->e->BatchTransfer(is_read != 0, locals, SpansOf(lo), remotes, SpansOf(ro), SpansOf(sizes), uids);
    }
    return StatusList(statuses);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const pybind11::error_already_set& e) {
    pybind11::error_already_set(e).restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "engine_batch: %s", e.what());
    return nullptr;
  }
}

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
