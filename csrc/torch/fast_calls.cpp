#include "torch/fast_calls.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <initializer_list>
#include <new>
#include <string>
#include <vector>

#include "torch/classes.h"
#include "torch/int64_buffers.h"
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

std::vector<Int64Span> SpansOf(const std::vector<HostInt64>& values) {
  std::vector<Int64Span> out;
  out.reserve(values.size());
  for (const HostInt64& v : values) out.push_back(v.span());
  return out;
}

// A new Python reference to `status` as a torch.classes.mori.TransferStatus
// (a torch.ScriptObject). Made directly: torch::jit::toPyObject imports
// torch.jit._state on every call, for a compilation unit that custom classes
// never use (about 1 us of a failing write's 2.2 on the build machine).
PyObject* StatusObject(StatusPtr status) {
  c10::IValue v(c10::make_intrusive<TransferStatusObj>(std::move(status)));
  return pybind11::cast(torch::jit::Object(std::move(v).toObject())).release().ptr();
}

// The batch's statuses as a Python list of torch.classes.mori.TransferStatus.
PyObject* StatusList(const std::vector<StatusPtr>& statuses) {
  pybind11::list out(statuses.size());
  for (size_t i = 0; i < statuses.size(); ++i) {
    out[i] = pybind11::reinterpret_steal<pybind11::object>(StatusObject(statuses[i]));
  }
  return out.release().ptr();
}

// The frame of the METH_FASTCALL functions: nothing C++ may cross the C
// boundary, so what `body` throws becomes the Python error torch would
// raise for it (TypeError, ValueError, IndexError, NotImplementedError,
// MemoryError, pybind11's builtin errors as theirs, else RuntimeError
// naming the call).
template <class F>
PyObject* Frame(const char* call, F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const pybind11::error_already_set& e) {
    pybind11::error_already_set(e).restore();
    return nullptr;
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    return nullptr;
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    return nullptr;
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    return nullptr;
  } catch (const c10::Error& e) {
    PyErr_Format(PyExc_RuntimeError, "%s: %s", call, e.what_without_backtrace());
    return nullptr;
  } catch (const pybind11::builtin_exception& e) {
    e.set_error();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "%s: %s", call, e.what());
    return nullptr;
  } catch (...) {
    PyErr_Format(PyExc_RuntimeError, "%s: an unknown C++ exception", call);
    return nullptr;
  }
}

SessionRef SessionOf(PyObject* obj, const char* call) {
  SessionRef s = HolderOf<SessionObj>(obj);
  if (!s) {
    PyErr_Format(PyExc_TypeError, "%s: expected a torch.classes.mori.Session, got %s", call, Py_TYPE(obj)->tp_name);
  }
  return s;
}

// An argument refused for its type (set as the Python error, or thrown)
// comes after any bad entry of the lists before it, as when each list was
// read as its argument came: the lists queued so far are read first, and an
// error there is the one raised. Returns false.
bool EarlierListsFirst(Int64ListReads* reads) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  if (!reads->Read()) {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return false;
  }
  PyErr_Restore(type, value, tb);
  return false;
}

// One of session_batch's offset or size arguments: a list or tuple of ints
// (queued on `reads`, which reads it into a pooled tensor) or a 1-D int64
// tensor (checked here, used in place; OnHost later brings a device or
// strided one to the host, without the GIL: a device tensor's copy waits
// for the work queued before it).
bool Int64Values(PyObject* v, const char* what, HostInt64* out, Int64ListReads* reads) {
  if (THPVariable_Check(v)) {
    const at::Tensor& t = THPVariable_Unpack(v);
    try {
      CheckInt64Vector(t, what);
    } catch (...) {
      if (!reads->Read()) return false;  // an earlier list's bad entry comes first
      throw;
    }
    out->host = t;
    return true;
  }
  if (!PyList_Check(v) && !PyTuple_Check(v)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list, tuple or 1-D int64 tensor, got %s", what, Py_TYPE(v)->tp_name);
    return EarlierListsFirst(reads);
  }
  return reads->Add(v, what, &out->host);
}

// Every entry of the list or tuple `seqs` (one per memory pair of an
// engine-level batch) as Int64Values reads it; errors name what[i], or
// what[i][j] inside a list.
bool Int64ValuesEach(PyObject* seqs, const char* what, std::vector<HostInt64>* out, Int64ListReads* reads) {
  out->clear();
  if (!CheckListOrTuple(seqs, what)) return EarlierListsFirst(reads);
  out->reserve(PySequence_Fast_GET_SIZE(seqs));  // reads points into it
  return ReadEach(seqs, what, [&](Py_ssize_t, PyObject* entry, const char* name) {
    out->emplace_back();
    return Int64Values(entry, name, &out->back(), reads);
  });
}

// The direction and the four ints of a single transfer.
struct OneTransfer {
  bool is_read = false;
  int64_t lo = 0, ro = 0, size = 0, uid = 0;
};
bool ReadOneTransfer(PyObject* is_read, PyObject* lo, PyObject* ro, PyObject* size, PyObject* uid, OneTransfer* t) {
  const int r = PyObject_IsTrue(is_read);
  if (r < 0 || !ReadInt64(lo, "local_offset", &t->lo) || !ReadInt64(ro, "remote_offset", &t->ro) ||
      !ReadInt64(size, "size", &t->size) || !ReadInt64(uid, "uid", &t->uid)) {
    return false;
  }
  t->is_read = r != 0;
  return true;
}

// Runs `submit` (returning the transfer's status) without the GIL, as
// TorchScript's method call did: other Python threads run while the
// transfer is checked, routed and submitted. The status as a Python object.
template <class F>
PyObject* SubmitWithoutGil(F&& submit) {
  StatusPtr status;
  {
    pybind11::gil_scoped_release no_gil;
    status = submit();
  }
  return StatusObject(std::move(status));
}

}  // namespace

PyObject* SessionTransfer(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* kCall = "session_transfer";
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "session_transfer(session, is_read, local_offset, remote_offset, size, uid)");
    return nullptr;
  }
  return Frame(kCall, [&]() -> PyObject* {
    SessionRef session = SessionOf(args[0], kCall);
    OneTransfer t;
    if (!session || !ReadOneTransfer(args[1], args[2], args[3], args[4], args[5], &t)) return nullptr;
    return SubmitWithoutGil([&] {
      const auto u = static_cast<TransferUid>(t.uid);
      return t.is_read ? session->s->Read(t.lo, t.ro, t.size, u) : session->s->Write(t.lo, t.ro, t.size, u);
    });
  });
}

PyObject* SessionBatch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* kCall = "session_batch";
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "session_batch(session, is_read, local_offsets, remote_offsets, sizes, uid)");
    return nullptr;
  }
  return Frame(kCall, [&]() -> PyObject* {
    SessionRef session = SessionOf(args[0], kCall);
    if (!session) return nullptr;
    const int is_read = PyObject_IsTrue(args[1]);
    HostInt64 lo, ro, sizes;
    Int64ListReads reads;
    int64_t uid = 0;
    if (is_read < 0 || !Int64Values(args[2], "local_offsets", &lo, &reads) ||
        !Int64Values(args[3], "remote_offsets", &ro, &reads) || !Int64Values(args[4], "sizes", &sizes, &reads) ||
        !reads.Read() || !ReadInt64(args[5], "uid", &uid)) {
      return nullptr;
    }
    return SubmitWithoutGil([&] {
      for (HostInt64* v : {&lo, &ro, &sizes}) *v = OnHost(v->host);
      const auto u = static_cast<TransferUid>(uid);
      return is_read ? session->s->BatchRead(lo.span(), ro.span(), sizes.span(), u)
                     : session->s->BatchWrite(lo.span(), ro.span(), sizes.span(), u);
    });
  });
}

PyObject* EngineTransfer(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* kCall = "engine_transfer";
  if (nargs != 8) {
    PyErr_SetString(
        PyExc_TypeError,
        "engine_transfer(engine, is_read, local_desc, local_offset, remote_desc, remote_offset, size, uid)");
    return nullptr;
  }
  return Frame(kCall, [&]() -> PyObject* {
    EngineRef engine = HolderOf<EngineObj>(args[0]);
    MemoryDescRef local = HolderOf<MemoryDescObj>(args[2]), remote = HolderOf<MemoryDescObj>(args[4]);
    if (!engine || !local || !remote) {
      PyErr_Format(PyExc_TypeError, "%s: expected an Engine and two MemoryDesc (torch.classes.mori), got %s, %s, %s",
                   kCall, Py_TYPE(args[0])->tp_name, Py_TYPE(args[2])->tp_name, Py_TYPE(args[4])->tp_name);
      return nullptr;
    }
    OneTransfer t;
    if (!ReadOneTransfer(args[1], args[3], args[5], args[6], args[7], &t)) return nullptr;
    return SubmitWithoutGil([&] {
      const auto u = static_cast<TransferUid>(t.uid);
      return t.is_read ? engine->e->Read(local->d, t.lo, remote->d, t.ro, t.size, u)
                       : engine->e->Write(local->d, t.lo, remote->d, t.ro, t.size, u);
    });
  });
}

PyObject* StatusWait(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "status_wait(status, timeout_ms)");
    return nullptr;
  }
  return Frame("status_wait", [&]() -> PyObject* {
    StatusRef ref = HolderOf<TransferStatusObj>(args[0]);
    if (!ref) {
      PyErr_Format(PyExc_TypeError, "status_wait: expected a torch.classes.mori.TransferStatus, got %s",
                   Py_TYPE(args[0])->tp_name);
      return nullptr;
    }
    int64_t timeout_ms = 0;
    if (!ReadInt64(args[1], "timeout_ms", &timeout_ms)) return nullptr;
    StatusCode code = ref->s->PeekCode();
    if (!IsTerminal(code)) {
      pybind11::gil_scoped_release no_gil;
      code = ref->s->WaitFor(timeout_ms);
    }
    return PyLong_FromLong(static_cast<long>(code));
  });
}

PyObject* EngineBatch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError,
                    "engine_batch(engine, is_read, local_descs, local_offsets, remote_descs, remote_offsets, sizes, "
                    "uids)");
    return nullptr;
  }
  return Frame("engine_batch", [&]() -> PyObject* {
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
    std::vector<HostInt64> lo, ro, sizes;
    std::vector<int64_t> uids;
    Int64ListReads reads;
    if (!DescsOf(args[2], "local_descs", &refs, &locals) || !DescsOf(args[4], "remote_descs", &refs, &remotes) ||
        !Int64ValuesEach(args[3], "local_offsets", &lo, &reads) ||
        !Int64ValuesEach(args[5], "remote_offsets", &ro, &reads) ||
        !Int64ValuesEach(args[6], "sizes", &sizes, &reads) || !reads.Read() || !ReadInt64List(args[7], "uids", &uids)) {
      return nullptr;
    }
    std::vector<StatusPtr> statuses;
    {
      // As TorchScript's method call does: other Python threads run while
      // the pairs are checked, routed and submitted.
      pybind11::gil_scoped_release no_gil;
      for (std::vector<HostInt64>* each : {&lo, &ro, &sizes}) {
        for (HostInt64& v : *each) v = OnHost(v.host);
      }
      statuses =
          engine->e->BatchTransfer(is_read != 0, locals, SpansOf(lo), remotes, SpansOf(ro), SpansOf(sizes), uids);
    }
    return StatusList(statuses);
  });
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
