// Reading a list of ints costs a few ns per entry, most of it the memory
// access to each int object; three 16,384-entry lists per batch are then
// more host time than the engine's own work on the batch. So long lists are
// read by several threads: the calling thread and helpers from torch's
// inter-op pool (at::launch), each taking chunks of 2,048 entries.
//
// Why helpers may read Python objects without the GIL: the calling thread
// holds the GIL for the whole call, so no Python code runs that could change
// the list or its ints, and the helpers only read (an exact int's type and
// digits; no reference counts, no calls). Anything else (a numpy int, an int
// of more than two digits, a bad entry) stops a helper's chunk, and the
// calling thread reads on from the first such entry the general way, so
// errors name the first bad entry, as a single pass would.
//
// The calling thread never waits for a helper that has not started (the pool
// may be busy, or its threads gone in a forked child): chunks are claimed
// from a shared counter, the calling thread claims too, and it waits only for
// chunks a helper has claimed and is reading, a few us of work each.
#include "torch/int64_lists.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pthread.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include "torch/int64_buffers.h"

namespace mori_torch {
namespace bind {
namespace {

static_assert(sizeof(long) == sizeof(int64_t), "an LP64 platform");
static_assert(PyLong_SHIFT == 30, "CPython's 30-bit digits");

// Lists shorter than this are read by the calling thread alone (waking a
// helper costs more than it saves).
constexpr Py_ssize_t kParallelMin = 8192;
constexpr Py_ssize_t kChunk = 2048;
constexpr int kMaxHelpers = 7;

// The value of an exact int of at most two digits (|v| < 2^60, every byte
// offset there is), read from its digits: no call, no error state, so a
// helper thread may use it. False for anything else.
inline bool SmallExactInt(PyObject* item, int64_t* out) {
  if (!PyLong_CheckExact(item)) return false;
#if PY_VERSION_HEX >= 0x030C0000
  const auto* v = reinterpret_cast<PyLongObject*>(item);
  if (PyUnstable_Long_IsCompact(v)) {
    *out = PyUnstable_Long_CompactValue(v);
    return true;
  }
  const uintptr_t tag = v->long_value.lv_tag;
  if ((tag >> _PyLong_NON_SIZE_BITS) != 2) return false;
  const int64_t sign = 1 - static_cast<int64_t>(tag & _PyLong_SIGN_MASK);
  const digit* d = v->long_value.ob_digit;
#else
  const Py_ssize_t size = Py_SIZE(item);  // signed digit count
  const digit* d = reinterpret_cast<PyLongObject*>(item)->ob_digit;
  if (size >= -1 && size <= 1) {
    *out = size == 0 ? 0 : size * static_cast<int64_t>(d[0]);
    return true;
  }
  if (size != 2 && size != -2) return false;
  const int64_t sign = size < 0 ? -1 : 1;
#endif
  *out = sign * static_cast<int64_t>(static_cast<uint64_t>(d[0]) | (static_cast<uint64_t>(d[1]) << PyLong_SHIFT));
  return true;
}

// Reads items [begin, end) while they are small exact ints; returns the
// index of the first that is not (end if none).
Py_ssize_t ReadSmallInts(PyObject* const* items, Py_ssize_t begin, Py_ssize_t end, int64_t* out) {
  for (Py_ssize_t i = begin; i < end; ++i) {
    if (!SmallExactInt(items[i], &out[i])) return i;
  }
  return end;
}

// One long list read by the calling thread and helpers. Shared with the
// helpers' tasks, which may run after the call has returned (and then find
// no chunk left).
struct ParallelRead {
  PyObject* const* items;
  int64_t* out;
  Py_ssize_t n;
  std::atomic<Py_ssize_t> next{0};     // start of the next unclaimed chunk
  std::atomic<Py_ssize_t> first_stop;  // lowest index a reader stopped at
  std::atomic<int> readers_inside{0};  // helpers that may hold a chunk

  // Claims and reads chunks until none is left.
  void Work() {
    for (;;) {
      const Py_ssize_t b = next.fetch_add(kChunk);
      if (b >= n) return;
      const Py_ssize_t e = std::min(n, b + kChunk);
      const Py_ssize_t stop = ReadSmallInts(items, b, e, out);
      if (stop < e) {
        Py_ssize_t seen = first_stop.load();
        while (stop < seen && !first_stop.compare_exchange_weak(seen, stop)) {
        }
      }
    }
  }
};

// No helpers in a process forked from one that had loaded this library:
// the child inherits torch's inter-op pool object but not its threads (and
// maybe a lock one of them held). Where the pool's threads are gone anyway
// (a child forked before this library was loaded), helper tasks queue and
// never start; at most kMaxUnstarted of them may wait, so that costs a few
// hundred bytes once, not per call: the calling thread reads alone then.
std::atomic<bool> g_forked{false};
std::atomic<int> g_unstarted{0};
constexpr int kMaxUnstarted = 64;
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, [] { g_forked.store(true); });

int HelpersFor(Py_ssize_t n) {
  if (g_forked.load(std::memory_order_relaxed)) return 0;
  const Py_ssize_t chunks = (n + kChunk - 1) / kChunk;
  const int threads = at::get_num_interop_threads();
  const int want = static_cast<int>(std::min<Py_ssize_t>({chunks - 1, threads, kMaxHelpers}));
  const int room = kMaxUnstarted - g_unstarted.load(std::memory_order_relaxed);
  return std::max(0, std::min(want, room));
}

// Reads what it can of items [0, n) as small exact ints, on several threads
// for long lists; returns the first index it could not read (n if none).
Py_ssize_t ReadSmallIntsParallel(PyObject* const* items, Py_ssize_t n, int64_t* out) {
  const int helpers = n >= kParallelMin ? HelpersFor(n) : 0;
  if (helpers <= 0) return ReadSmallInts(items, 0, n, out);
  auto job = std::make_shared<ParallelRead>();
  job->items = items;
  job->out = out;
  job->n = n;
  job->first_stop.store(n);
  g_unstarted.fetch_add(helpers);
  for (int h = 0; h < helpers; ++h) {
    at::launch([job] {
      g_unstarted.fetch_sub(1);
      job->readers_inside.fetch_add(1);
      job->Work();
      job->readers_inside.fetch_sub(1);
    });
  }
  job->Work();
  // Every chunk is claimed; wait for the ones helpers are still reading
  // (a helper that enters from now on finds nothing to claim).
  while (job->readers_inside.load() != 0) std::this_thread::yield();
  return job->first_stop.load();
}

PyObject* NotAnInt(const char* what, Py_ssize_t i, PyObject* item) {
  PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int, got %s", what, i, Py_TYPE(item)->tp_name);
  return nullptr;
}

// Any int object's value, raising OverflowError beyond int64.
bool IntToInt64(PyObject* item, const char* what, Py_ssize_t i, int64_t* out) {
  if (SmallExactInt(item, out)) return true;
  int overflow = 0;
  const long v = PyLong_AsLongAndOverflow(item, &overflow);
  if (overflow != 0) {
    PyErr_Format(PyExc_OverflowError, "%s[%zd] does not fit in int64", what, i);
    return false;
  }
  if (v == -1 && PyErr_Occurred()) return false;
  *out = v;
  return true;
}

}  // namespace

PyObject* Int64TensorFromList(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyUnicode_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "int64_tensor(values, what: str)");
    return nullptr;
  }
  PyObject* seq = args[0];
  const char* what = PyUnicode_AsUTF8(args[1]);
  if (what == nullptr) return nullptr;
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of ints, got %s", what, Py_TYPE(seq)->tp_name);
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  at::Tensor t = PooledInt64Tensor(static_cast<int64_t>(n));
  int64_t* out = t.data_ptr<int64_t>();
  // The common case in one (possibly parallel) pass; the rest one by one.
  for (Py_ssize_t i = ReadSmallIntsParallel(PySequence_Fast_ITEMS(seq), n, out); i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    if (PyLong_CheckExact(item)) {
      if (!IntToInt64(item, what, i, &out[i])) return nullptr;
      continue;
    }
    if (!PyIndex_Check(item) || PyFloat_Check(item)) return NotAnInt(what, i, item);
    // __index__ may run Python code, which may even shrink the list.
    PyObject* idx = PyNumber_Index(item);
    if (idx == nullptr) return nullptr;
    const bool ok = IntToInt64(idx, what, i, &out[i]);
    Py_DECREF(idx);
    if (!ok) return nullptr;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
      PyErr_Format(PyExc_RuntimeError, "%s changed size while it was read", what);
      return nullptr;
    }
  }
  return THPVariable_Wrap(std::move(t));
}

}  // namespace bind
}  // namespace mori_torch
