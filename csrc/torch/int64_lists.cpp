// Reading a list of ints costs a few ns per entry, most of it the memory
// access to each int object. Exact ints of up to two 30-bit digits (every
// byte offset below 2^60; KV caches of tens of GiB have offsets past 2^30)
// are read from their digits inline, one-digit ones four at a time;
// anything else (a numpy int, a larger int, a bad entry) the general way,
// from the first such entry on, so that errors name the first bad entry.
//
// Long lists (a batch's three lists of 16,384 entries) are read in chunks
// on the WorkCrew (core/work_crew.h), the submitting thread and helpers
// together, the fast path only: the helpers touch no Python API and no
// reference count while the submitting thread holds the GIL.
#include "torch/int64_lists.h"

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "core/work_crew.h"
#include "torch/int64_buffers.h"

namespace mori_torch {
namespace bind {
namespace {

static_assert(sizeof(long) == sizeof(int64_t), "an LP64 platform");
static_assert(PyLong_SHIFT == 30, "CPython's 30-bit digits");

// The value of an exact int of at most two digits (|v| < 2^60, every byte
// offset there is), read from its digits: no call. False for anything else.
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

// Four entries at once when all four are exact ints of one digit (|v| <
// 2^30: page offsets of the first GiB, sizes): the checks of the four are
// combined into one branch per step, so the reads of the objects overlap
// (one entry per step: 1.3-1.8 ns on the build machine). False, with
// nothing stored, when any of the four is anything else.
inline bool FourSmallInts(PyObject* const* items, int64_t* out) {
  PyObject* const a = items[0];
  PyObject* const b = items[1];
  PyObject* const c = items[2];
  PyObject* const d = items[3];
  if (!((Py_TYPE(a) == &PyLong_Type) & (Py_TYPE(b) == &PyLong_Type) & (Py_TYPE(c) == &PyLong_Type) &
        (Py_TYPE(d) == &PyLong_Type))) {
    return false;
  }
#if PY_VERSION_HEX >= 0x030C0000
  const auto* const la = reinterpret_cast<PyLongObject*>(a);
  const auto* const lb = reinterpret_cast<PyLongObject*>(b);
  const auto* const lc = reinterpret_cast<PyLongObject*>(c);
  const auto* const ld = reinterpret_cast<PyLongObject*>(d);
  if (!(PyUnstable_Long_IsCompact(la) & PyUnstable_Long_IsCompact(lb) & PyUnstable_Long_IsCompact(lc) &
        PyUnstable_Long_IsCompact(ld))) {
    return false;
  }
  out[0] = PyUnstable_Long_CompactValue(la);
  out[1] = PyUnstable_Long_CompactValue(lb);
  out[2] = PyUnstable_Long_CompactValue(lc);
  out[3] = PyUnstable_Long_CompactValue(ld);
#else
  const Py_ssize_t sa = Py_SIZE(a), sb = Py_SIZE(b), sc = Py_SIZE(c), sd = Py_SIZE(d);
  // One digit or zero: size in [-1, 1]. A zero has no digit to read.
  auto fits = [](Py_ssize_t size) { return static_cast<size_t>(size + 1) <= 2; };
  if (!(fits(sa) & fits(sb) & fits(sc) & fits(sd))) return false;
  auto value = [](PyObject* o, Py_ssize_t size) {
    return size == 0 ? int64_t{0} : size * static_cast<int64_t>(reinterpret_cast<PyLongObject*>(o)->ob_digit[0]);
  };
  out[0] = value(a, sa);
  out[1] = value(b, sb);
  out[2] = value(c, sc);
  out[3] = value(d, sd);
#endif
  return true;
}

// Errors name entry what[i] of a list, or the lone argument `what` (i < 0).
void NotAnInt(const char* what, Py_ssize_t i, PyObject* item) {
  if (i < 0) {
    PyErr_Format(PyExc_TypeError, "%s must be an int, got %s", what, Py_TYPE(item)->tp_name);
  } else {
    PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int, got %s", what, i, Py_TYPE(item)->tp_name);
  }
}

// Any int object's value, raising OverflowError beyond int64.
bool IntToInt64(PyObject* item, const char* what, Py_ssize_t i, int64_t* out) {
  if (SmallExactInt(item, out)) return true;
  int overflow = 0;
  const long v = PyLong_AsLongAndOverflow(item, &overflow);
  if (overflow != 0) {
    if (i < 0) {
      PyErr_Format(PyExc_OverflowError, "%s does not fit in int64", what);
    } else {
      PyErr_Format(PyExc_OverflowError, "%s[%zd] does not fit in int64", what, i);
    }
    return false;
  }
  if (v == -1 && PyErr_Occurred()) return false;
  *out = v;
  return true;
}

// The value of an int or of anything with __index__ (numpy ints), not a
// float; __index__ may run Python code, which may even change a list.
bool IndexToInt64(PyObject* item, const char* what, Py_ssize_t i, int64_t* out) {
  if (PyLong_CheckExact(item)) return IntToInt64(item, what, i, out);
  if (!PyIndex_Check(item) || PyFloat_Check(item)) {
    NotAnInt(what, i, item);
    return false;
  }
  PyObject* idx = PyNumber_Index(item);
  if (idx == nullptr) return false;
  const bool ok = IntToInt64(idx, what, i, out);
  Py_DECREF(idx);
  return ok;
}

// Reads entries from the start of `items` into out while they are exact
// ints of at most two digits; returns how many it read (n when all). No
// Python call and no reference count is touched: the WorkCrew's helpers run
// it while the submitting thread holds the GIL.
Py_ssize_t ReadFast(PyObject* const* items, Py_ssize_t n, int64_t* out) {
  Py_ssize_t i = 0;
  // Four at a time while all four have one digit; a step holding anything
  // else goes one by one (two-digit ints still inline) and the next step is
  // tried four at a time again.
  while (i < n) {
    if (i + 4 <= n && FourSmallInts(items + i, out + i)) {
      i += 4;
      continue;
    }
    const Py_ssize_t stop = std::min<Py_ssize_t>(n, i + 4);
    while (i < stop && SmallExactInt(items[i], &out[i])) ++i;
    if (i < stop) break;
  }
  return i;
}

// Entries [from, n) of `seq` into out the general way (numpy ints, ints past
// 2^60, errors naming the entry). A list that is no longer n long (an
// entry's __index__ may change any list) is refused: out holds n entries.
bool ReadRest(PyObject* seq, Py_ssize_t n, Py_ssize_t from, int64_t* out, const char* what) {
  for (Py_ssize_t i = from; i < n; ++i) {
    if (!IndexToInt64(PySequence_Fast_GET_ITEM(seq, i), what, i, &out[i])) return false;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
      PyErr_Format(PyExc_RuntimeError, "%s changed size while it was read", what);
      return false;
    }
  }
  return true;
}

// All n entries of `seq` into out: small exact ints in a tight loop, the
// rest one by one the general way, from the first such entry on.
bool ReadAll(PyObject* seq, Py_ssize_t n, int64_t* out, const char* what) {
  if (PySequence_Fast_GET_SIZE(seq) != n) {
    PyErr_Format(PyExc_RuntimeError, "%s changed size while it was read", what);
    return false;
  }
  return ReadRest(seq, n, ReadFast(PySequence_Fast_ITEMS(seq), n, out), out, what);
}

bool IsListOrTuple(PyObject* v) { return PyList_Check(v) || PyTuple_Check(v); }

// The length of the list or tuple of ints `seq`; -1 with a TypeError for
// anything else.
Py_ssize_t IntListLength(PyObject* seq, const char* what) {
  if (!IsListOrTuple(seq)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of ints, got %s", what, Py_TYPE(seq)->tp_name);
    return -1;
  }
  return PySequence_Fast_GET_SIZE(seq);
}

// The frame of both functions: checks their arguments (sequence, what: str)
// and runs `body(sequence, what)`. Nothing C++ may cross the C boundary, so
// what the body throws becomes a Python error (out of memory: MemoryError).
template <class F>
PyObject* ListCall(PyObject* const* args, Py_ssize_t nargs, const char* usage, const char* of, F&& body) {
  if (nargs != 2 || !PyUnicode_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  const char* what = PyUnicode_AsUTF8(args[1]);
  if (what == nullptr) return nullptr;
  if (!IsListOrTuple(args[0])) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple%s, got %s", what, of, Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  try {
    return body(args[0], what);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

}  // namespace

PyObject* Int64TensorFromList(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return ListCall(args, nargs, "int64_tensor(values, what: str)", " of ints",
                  [](PyObject* seq, const char* what) -> PyObject* {
                    at::Tensor t;
                    if (!ReadInt64Tensor(seq, what, &t)) return nullptr;
                    return THPVariable_Wrap(std::move(t));
                  });
}

bool ReadInt64(PyObject* v, const char* what, int64_t* out) { return IndexToInt64(v, what, -1, out); }

bool ReadInt64Tensor(PyObject* seq, const char* what, at::Tensor* out) {
  Int64ListReads reads;
  return reads.Add(seq, what, out) && reads.Read();
}

bool Int64ListReads::Add(PyObject* seq, const char* what, at::Tensor* out) {
  const Py_ssize_t n = IntListLength(seq, what);
  if (n < 0) return false;
  *out = PooledInt64Tensor(static_cast<int64_t>(n));
  lists_.push_back({pybind11::reinterpret_borrow<pybind11::object>(seq), what, n, out, out->data_ptr<int64_t>()});
  return true;
}

bool Int64ListReads::Read() {
  Py_ssize_t total = 0;
  for (const List& l : lists_) total += l.n;
  // Below this the helpers' wake-up costs more than they read.
  constexpr Py_ssize_t kCrewFrom = 6144, kChunk = 2048;
  size_t first_slow = 0;  // lists before it were read in full by the fast path
  auto unchanged = [&] {  // no Python code ran since Add, but be sure
    for (const List& l : lists_) {
      if (PySequence_Fast_GET_SIZE(l.seq.ptr()) != l.n) return false;
    }
    return true;
  };
  if (total >= kCrewFrom && WorkCrew::Shared().helpers() > 0 && unchanged()) {
    // Chunks of the lists, in order: where each one's fast read stopped.
    struct Chunk {
      size_t list;
      Py_ssize_t begin, end, stopped;
    };
    std::vector<Chunk> chunks;
    for (size_t j = 0; j < lists_.size(); ++j) {
      for (Py_ssize_t b = 0; b < lists_[j].n; b += kChunk)
        chunks.push_back({j, b, std::min(lists_[j].n, b + kChunk), 0});
    }
    WorkCrew::Shared().Run(chunks.size(), [&](size_t c) {
      Chunk& k = chunks[c];
      const List& l = lists_[k.list];
      k.stopped = k.begin + ReadFast(PySequence_Fast_ITEMS(l.seq.ptr()) + k.begin, k.end - k.begin, l.out + k.begin);
    });
    // The first list with an entry the fast path left goes on the general
    // way from that entry; its entries' __index__ may run Python code that
    // changes any list, so every later list is read again after it.
    first_slow = lists_.size();
    for (const Chunk& k : chunks) {
      if (k.stopped == k.end) continue;
      List& l = lists_[k.list];
      if (!ReadRest(l.seq.ptr(), l.n, k.stopped, l.out, l.what.c_str())) return false;
      first_slow = k.list + 1;
      break;
    }
  }
  for (size_t j = first_slow; j < lists_.size(); ++j) {
    List& l = lists_[j];
    // Read as it is now: an earlier list's __index__ may have resized it.
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(l.seq.ptr());
    if (n != l.n) {
      *l.tensor = PooledInt64Tensor(static_cast<int64_t>(n));
      l.n = n;
      l.out = l.tensor->data_ptr<int64_t>();
    }
    if (!ReadAll(l.seq.ptr(), l.n, l.out, l.what.c_str())) return false;
  }
  lists_.clear();  // read: a second Read has nothing to do
  return true;
}

bool ReadInt64List(PyObject* seq, const char* what, std::vector<int64_t>* out) {
  const Py_ssize_t n = IntListLength(seq, what);
  if (n < 0) return false;
  out->resize(static_cast<size_t>(n));
  return ReadAll(seq, n, out->data(), what);
}

bool CheckListOrTuple(PyObject* seqs, const char* what) {
  if (IsListOrTuple(seqs)) return true;
  PyErr_Format(PyExc_TypeError, "%s must be a list or tuple, got %s", what, Py_TYPE(seqs)->tp_name);
  return false;
}

bool ReadEach(PyObject* seqs, const char* what,
              const std::function<bool(Py_ssize_t i, PyObject* entry, const char* name)>& read) {
  if (!CheckListOrTuple(seqs, what)) return false;
  const Py_ssize_t m = PySequence_Fast_GET_SIZE(seqs);
  // References to the entries themselves: an entry's __index__ may change
  // the outer list while a later entry waits to be read.
  std::vector<pybind11::object> held;
  held.reserve(m);
  for (Py_ssize_t i = 0; i < m; ++i) {
    held.push_back(pybind11::reinterpret_borrow<pybind11::object>(PySequence_Fast_GET_ITEM(seqs, i)));
  }
  for (Py_ssize_t i = 0; i < m; ++i) {
    const std::string name = std::string(what) + "[" + std::to_string(i) + "]";
    if (!read(i, held[i].ptr(), name.c_str())) return false;
  }
  return true;
}

bool ReadInt64Lists(PyObject* seqs, const char* what, std::vector<at::Tensor>* out) {
  out->clear();
  if (IsListOrTuple(seqs)) out->reserve(PySequence_Fast_GET_SIZE(seqs));  // Add keeps pointers into it
  Int64ListReads reads;
  return ReadEach(seqs, what,
                  [&](Py_ssize_t, PyObject* entry, const char* name) {
                    out->emplace_back();
                    return reads.Add(entry, name, &out->back());
                  }) &&
         reads.Read();
}

PyObject* Int64TensorsFromLists(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return ListCall(args, nargs, "int64_tensors(lists, what: str)", "",
                  [](PyObject* seqs, const char* what) -> PyObject* {
                    // The result list is made only once every list is read: an entry's
                    // __index__ may run any Python code, which must never find a list of
                    // ours with empty slots (gc.get_objects() would hand it out).
                    std::vector<at::Tensor> tensors;
                    if (!ReadInt64Lists(seqs, what, &tensors)) return nullptr;
                    const auto m = static_cast<Py_ssize_t>(tensors.size());
                    pybind11::list out(m);
                    for (Py_ssize_t i = 0; i < m; ++i) {
                      PyObject* t = THPVariable_Wrap(std::move(tensors[i]));
                      if (t == nullptr) return nullptr;
                      PyList_SET_ITEM(out.ptr(), i, t);
                    }
                    return out.release().ptr();
                  });
}

}  // namespace bind
}  // namespace mori_torch
