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
// Long: 8,192 entries or more over one call's lists. How many threads:
// MORI_TORCH_LIST_READERS (by default several only where cores are many).
// A free-threaded CPython has no GIL to keep the lists still: one thread.
//
// The calling thread never waits for a helper that has not started (the pool
// may be busy, or its threads gone in a forked child): chunks are claimed
// from a shared counter, the calling thread claims too, and it waits only for
// chunks a helper has claimed and is reading, a few us of work each.
#include "torch/int64_lists.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pthread.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/config_table.h"
#include "base/usable_cpus.h"
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

// A list (or tuple) to read, and where its values go.
struct ListToRead {
  PyObject* const* items;
  Py_ssize_t n;
  int64_t* out;
};

// Lists read by the calling thread and helpers, in chunks of at most kChunk
// entries of one list. Shared with the helpers' tasks, which may run after
// the call has returned (and then find no chunk left).
struct ParallelRead {
  struct Chunk {
    size_t list;
    Py_ssize_t begin, end;
  };
  std::vector<ListToRead> lists;
  std::vector<Chunk> chunks;
  std::unique_ptr<std::atomic<Py_ssize_t>[]> first_stop;  // per list: lowest index a reader stopped at
  std::atomic<size_t> next{0};                            // the next unclaimed chunk
  std::atomic<int> readers_inside{0};                     // helpers that may hold a chunk

  // Claims and reads chunks until none is left.
  void Work() {
    for (;;) {
      const size_t c = next.fetch_add(1);
      if (c >= chunks.size()) return;
      const Chunk& k = chunks[c];
      const ListToRead& l = lists[k.list];
      const Py_ssize_t stop = ReadSmallInts(l.items, k.begin, k.end, l.out);
      if (stop == k.end) continue;
      std::atomic<Py_ssize_t>& first = first_stop[k.list];
      Py_ssize_t seen = first.load();
      while (stop < seen && !first.compare_exchange_weak(seen, stop)) {
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

// MORI_TORCH_LIST_READERS, -1 resolved by the CPUs this process may use: on
// a few busy cores a helper that is preempted mid-chunk keeps the calling
// thread waiting (measured slower than one thread on the 2-vCPU build VM).
// 0 with a Python error set for a bad value.
int ListReaders() {
  static std::atomic<int> cached{0};
  int v = cached.load(std::memory_order_relaxed);
  if (v > 0) return v;
  try {
    const int64_t set = config::EnvInt("MORI_TORCH_LIST_READERS");
    constexpr int kManyReaders = 8;
    v = set > 0 ? static_cast<int>(set) : (UsableCpus() >= kManyCpus ? kManyReaders : 1);
#ifdef Py_GIL_DISABLED
    v = 1;
#endif
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return 0;
  }
  cached.store(v, std::memory_order_relaxed);
  return v;
}

int HelpersFor(size_t chunks, int readers) {
  if (g_forked.load(std::memory_order_relaxed) || chunks < 2 || readers < 2) return 0;
  const size_t threads = static_cast<size_t>(at::get_num_interop_threads());
  const int want = static_cast<int>(std::min<size_t>({chunks - 1, threads, static_cast<size_t>(readers - 1)}));
  const int room = kMaxUnstarted - g_unstarted.load(std::memory_order_relaxed);
  return std::max(0, std::min(want, room));
}

// Reads what it can of every list as small exact ints, on several threads
// when they hold kParallelMin entries or more together. Returns per list the
// first index it could not read (its n if none).
std::vector<Py_ssize_t> ReadSmallIntsParallel(std::vector<ListToRead> lists, int readers) {
  std::vector<Py_ssize_t> stops(lists.size());
  Py_ssize_t total = 0;
  for (const ListToRead& l : lists) total += l.n;
  auto job = std::make_shared<ParallelRead>();
  if (total >= kParallelMin) {
    for (size_t i = 0; i < lists.size(); ++i) {
      for (Py_ssize_t b = 0; b < lists[i].n; b += kChunk) {
        job->chunks.push_back({i, b, std::min(lists[i].n, b + kChunk)});
      }
    }
  }
  const int helpers = HelpersFor(job->chunks.size(), readers);
  if (helpers == 0) {
    for (size_t i = 0; i < lists.size(); ++i) stops[i] = ReadSmallInts(lists[i].items, 0, lists[i].n, lists[i].out);
    return stops;
  }
  job->first_stop.reset(new std::atomic<Py_ssize_t>[lists.size()]);
  for (size_t i = 0; i < lists.size(); ++i) job->first_stop[i].store(lists[i].n);
  job->lists = std::move(lists);
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
  for (size_t i = 0; i < stops.size(); ++i) stops[i] = job->first_stop[i].load();
  return stops;
}

void NotAnInt(const char* what, Py_ssize_t i, PyObject* item) {
  PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int, got %s", what, i, Py_TYPE(item)->tp_name);
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

// Entries [from, n) of `seq`, one by one, the general way (numpy ints, ints
// past 2^60, errors naming the entry). `out` holds n entries: a list that
// is no longer n long (an entry's __index__ may change any list) is refused.
bool ReadRest(PyObject* seq, Py_ssize_t n, Py_ssize_t from, int64_t* out, const char* what) {
  if (PySequence_Fast_GET_SIZE(seq) != n) {
    PyErr_Format(PyExc_RuntimeError, "%s changed size while it was read", what);
    return false;
  }
  for (Py_ssize_t i = from; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    if (PyLong_CheckExact(item)) {
      if (!IntToInt64(item, what, i, &out[i])) return false;
      continue;
    }
    if (!PyIndex_Check(item) || PyFloat_Check(item)) {
      NotAnInt(what, i, item);
      return false;
    }
    // __index__ may run Python code, which may even shrink the list.
    PyObject* idx = PyNumber_Index(item);
    if (idx == nullptr) return false;
    const bool ok = IntToInt64(idx, what, i, &out[i]);
    Py_DECREF(idx);
    if (!ok) return false;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
      PyErr_Format(PyExc_RuntimeError, "%s changed size while it was read", what);
      return false;
    }
  }
  return true;
}

bool IsListOrTuple(PyObject* v) { return PyList_Check(v) || PyTuple_Check(v); }

// The arguments (sequence, what: str) of both functions: the sequence, with
// `what` and the readers to use, or nullptr with a Python error set.
PyObject* SequenceAndName(PyObject* const* args, Py_ssize_t nargs, const char* usage, const char* of, const char** what,
                          int* readers) {
  if (nargs != 2 || !PyUnicode_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  *what = PyUnicode_AsUTF8(args[1]);
  if (*what == nullptr) return nullptr;
  if (!IsListOrTuple(args[0])) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple%s, got %s", *what, of, Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  *readers = ListReaders();
  return *readers == 0 ? nullptr : args[0];
}

}  // namespace

PyObject* Int64TensorFromList(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const char* what = nullptr;
  int readers = 0;
  PyObject* seq = SequenceAndName(args, nargs, "int64_tensor(values, what: str)", " of ints", &what, &readers);
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  at::Tensor t = PooledInt64Tensor(static_cast<int64_t>(n));
  int64_t* out = t.data_ptr<int64_t>();
  // The common case in one (possibly parallel) pass; the rest one by one.
  const Py_ssize_t stop = ReadSmallIntsParallel({{PySequence_Fast_ITEMS(seq), n, out}}, readers)[0];
  if (!ReadRest(seq, n, stop, out, what)) return nullptr;
  return THPVariable_Wrap(std::move(t));
}

PyObject* Int64TensorsFromLists(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const char* what = nullptr;
  int readers = 0;
  PyObject* seqs = SequenceAndName(args, nargs, "int64_tensors(lists, what: str)", "", &what, &readers);
  if (seqs == nullptr) return nullptr;
  const Py_ssize_t m = PySequence_Fast_GET_SIZE(seqs);
  // References to the lists themselves: an entry's __index__ may change the
  // outer list, and the lists must outlive the call.
  std::vector<pybind11::object> held;
  std::vector<at::Tensor> tensors;
  std::vector<ListToRead> lists;
  held.reserve(m);
  tensors.reserve(m);
  lists.reserve(m);
  for (Py_ssize_t i = 0; i < m; ++i) {
    PyObject* seq = PySequence_Fast_GET_ITEM(seqs, i);
    if (!IsListOrTuple(seq)) {
      PyErr_Format(PyExc_TypeError, "%s[%zd] must be a list or tuple of ints, got %s", what, i, Py_TYPE(seq)->tp_name);
      return nullptr;
    }
    held.push_back(pybind11::reinterpret_borrow<pybind11::object>(seq));
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    tensors.push_back(PooledInt64Tensor(static_cast<int64_t>(n)));
    lists.push_back({PySequence_Fast_ITEMS(seq), n, tensors.back().data_ptr<int64_t>()});
  }
  std::vector<Py_ssize_t> sizes(m);
  for (Py_ssize_t i = 0; i < m; ++i) sizes[i] = lists[i].n;
  const std::vector<Py_ssize_t> stops = ReadSmallIntsParallel(std::move(lists), readers);
  pybind11::list out(m);
  for (Py_ssize_t i = 0; i < m; ++i) {
    const std::string name = std::string(what) + "[" + std::to_string(i) + "]";
    if (!ReadRest(held[i].ptr(), sizes[i], stops[i], tensors[i].data_ptr<int64_t>(), name.c_str())) return nullptr;
  }
  for (Py_ssize_t i = 0; i < m; ++i) PyList_SET_ITEM(out.ptr(), i, THPVariable_Wrap(std::move(tensors[i])));
  return out.release().ptr();
}

}  // namespace bind
}  // namespace mori_torch
