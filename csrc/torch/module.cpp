// Makes the extension importable as mori_torch._C; importing it runs the
// TORCH_LIBRARY registrations of the other files in this library: the
// custom classes (classes.cpp) and the ops torch.ops.mori.* (ops_*.cpp).
// Its Python functions: log_route/log_drain hand native log lines to
// Python's logging (mori_torch/log.py); int64_tensor turns the offset lists
// that serving engines pass into int64 tensors in C (a few ns per entry:
// torch/int64_lists.h), since the
// TorchScript boundary converts a List[int] at about 20 ns per entry;
// the per-transfer calls (a session's read, write and batch, a status's
// poll and wait, a uid, the engine-level batch) skip TorchScript's method
// call (torch/fast_calls.h); config_table hands the settings table to
// mori_torch.config.
// The module also carries the build's facts (TORCH_VERSION, WITH_GPU), so
// that nothing is generated into the source tree at build time.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "core/logging.h"

#include "base/config_table.h"
#include "torch/fast_calls.h"
#include "torch/int64_lists.h"

namespace {

// log_route(on): while on, native log lines wait for log_drain instead of
// going to stderr (mori_torch/log.py routes them into Python's logging).
PyObject* LogRoute(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  mori_torch::RouteLogToReader(on != 0);
  Py_RETURN_NONE;
}

// log_drain(max_lines, timeout_ms) -> [(level, subsystem, thread, file,
// line, time_ms, message)], waiting up to timeout_ms (GIL released) for the
// first line. Levels: 0 trace .. 5 critical.
PyObject* LogDrain(PyObject*, PyObject* args) {
  long long max_lines = 0, timeout_ms = 0;
  if (!PyArg_ParseTuple(args, "LL", &max_lines, &timeout_ms)) return nullptr;
  if (max_lines <= 0 || timeout_ms < 0) {
    PyErr_Format(PyExc_ValueError, "log_drain: max_lines must be > 0 and timeout_ms >= 0, got %lld and %lld", max_lines,
                 timeout_ms);
    return nullptr;
  }
  std::vector<mori_torch::LogRecord> recs;
  Py_BEGIN_ALLOW_THREADS;
  recs = mori_torch::DrainLog(static_cast<size_t>(max_lines), static_cast<int>(timeout_ms));
  Py_END_ALLOW_THREADS;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(recs.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < recs.size(); ++i) {
    const auto& r = recs[i];
    // Bytes a peer sent may reach a message: never fail on them.
    PyObject* msg = PyUnicode_DecodeUTF8(r.msg.data(), static_cast<Py_ssize_t>(r.msg.size()), "replace");
    PyObject* thread = PyUnicode_DecodeUTF8(r.thread.data(), static_cast<Py_ssize_t>(r.thread.size()), "replace");
    if (msg == nullptr || thread == nullptr) {
      Py_XDECREF(msg);
      Py_XDECREF(thread);
      Py_DECREF(out);
      return nullptr;
    }
    // "N" hands msg and thread over, also when building fails.
    PyObject* t = Py_BuildValue("(isNsiLN)", static_cast<int>(r.level), mori_torch::LogSubsystemName(r.subsystem),
                                thread, r.file ? r.file : "", r.line, static_cast<long long>(r.time_ms), msg);
    if (t == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), t);
  }
  return out;
}

// config_table() -> [(scope, name, kind, default, min, max, text_default,
// choices, doc, overrides)], the rows of base/config_table.cpp in order.
PyObject* ConfigTable(PyObject*, PyObject*) {
  using mori_torch::config::Kind;
  const auto& rows = mori_torch::config::Table();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(rows.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& e = rows[i];
    static const char* kKinds[] = {"int", "bool", "choice", "text"};
    PyObject* row = Py_BuildValue("(sssLLLssss)", e.scope, e.name, kKinds[static_cast<int>(e.kind)],
                                  static_cast<long long>(e.def), static_cast<long long>(e.min),
                                  static_cast<long long>(e.max), e.text_def, e.choices, e.doc, e.overrides);
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), row);
  }
  return out;
}

PyMethodDef kMethods[] = {
    {"log_route", LogRoute, METH_O,
     "log_route(on): hold native log lines for log_drain (True) or write them to stderr."},
    {"log_drain", LogDrain, METH_VARARGS,
     "log_drain(max_lines, timeout_ms) -> [(level, subsystem, thread, file, line, time_ms, message)]."},
    {"int64_tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mori_torch::bind::Int64TensorFromList)),
     METH_FASTCALL,
     "int64_tensor(values, what) -> a CPU int64 tensor of the list or tuple of ints `values`; errors name `what`."},
    {"int64_tensors",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mori_torch::bind::Int64TensorsFromLists)),
     METH_FASTCALL,
     "int64_tensors(lists, what) -> int64 tensors of every list or tuple of ints in `lists`; errors name what[i][j]."},
    {"engine_batch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mori_torch::bind::EngineBatch)),
     METH_FASTCALL,
     "engine_batch(engine, is_read, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids) -> "
     "the statuses of an engine-level batch; each pair's offsets and sizes a list or tuple of ints or a 1-D int64 "
     "tensor."},
    {"session_transfer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mori_torch::bind::SessionTransfer)),
     METH_FASTCALL,
     "session_transfer(session, is_read, local_offset, remote_offset, size, uid) -> a session's read or write."},
    {"session_batch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mori_torch::bind::SessionBatch)),
     METH_FASTCALL,
     "session_batch(session, is_read, local_offsets, remote_offsets, sizes, uid) -> a session's batch read or "
     "write; offsets and sizes lists or tuples of ints or 1-D int64 tensors."},
    {"engine_transfer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mori_torch::bind::EngineTransfer)),
     METH_FASTCALL,
     "engine_transfer(engine, is_read, local_desc, local_offset, remote_desc, remote_offset, size, uid) -> an "
     "engine-level read or write."},
    {"status_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mori_torch::bind::StatusWait)),
     METH_FASTCALL, "status_wait(status, timeout_ms) -> int: waits without the GIL, returns the code seen."},
    {"transfer_uid", mori_torch::bind::TransferUidOf, METH_O,
     "transfer_uid(session_or_engine) -> the next transfer uid of a torch.classes.mori.Session or Engine."},
    {"status_code", mori_torch::bind::StatusCodeOf, METH_O,
     "status_code(status) -> int: a native TransferStatus's code, without TorchScript's method call"},
    {"config_table", ConfigTable, METH_NOARGS,
     "config_table() -> the settings table (environment variables and config keys); see mori_torch.config."},
    {nullptr, nullptr, 0, nullptr}};

// setup.py passes the torch version as bare tokens (see there for why).
#define MORI_STRINGIZE_TOKENS(x) #x
#define MORI_STRINGIZE(x) MORI_STRINGIZE_TOKENS(x)
#ifdef MORI_TORCH_BUILT_AGAINST
constexpr const char* kBuiltAgainstTorch = MORI_STRINGIZE(MORI_TORCH_BUILT_AGAINST);
#else
constexpr const char* kBuiltAgainstTorch = "unknown";
#endif

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT,
                            "mori_torch._C",
                            "mori_torch native library",
                            -1,
                            kMethods,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
  // TORCH_VERSION: the torch this extension was compiled against (mori_torch
  // refuses to import under another); WITH_GPU: compiled with CUDA/HIP.
  PyObject* with_gpu = PyBool_FromLong(MORI_WITH_GPU);
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", kBuiltAgainstTorch) < 0 ||
      PyModule_AddObject(m, "WITH_GPU", with_gpu) < 0) {  // steals with_gpu only on success
    Py_XDECREF(with_gpu);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
