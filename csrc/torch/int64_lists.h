// Python lists and tuples of ints (the offsets and sizes serving engines
// pass) into int64 tensors, for mori_torch._C.int64_tensor.
#pragma once

#include <ATen/ATen.h>
#include <Python.h>

#include <pybind11/pybind11.h>

#include <functional>
#include <string>
#include <vector>

namespace mori_torch {
namespace bind {

// int64_tensor(values, what) -> a CPU int64 tensor holding the list or tuple
// `values`; entries may be any int or have __index__ (numpy ints). Errors
// name `what` and the entry: TypeError for a non-int, OverflowError for an
// int beyond int64. A METH_FASTCALL function.
PyObject* Int64TensorFromList(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// int64_tensors(lists, what) -> [int64_tensor(l, f"{what}[{i}]") for i, l in
// enumerate(lists)], every entry a list or tuple of ints, in one call: the
// engine-level batch's lists, one per memory pair.
PyObject* Int64TensorsFromLists(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// For the native calls that take lists themselves (fast_calls.h); with the
// GIL held. False with a Python error set (naming what[j], or what[i][j]).
// One int (or an object with __index__, not a float) into *out: TypeError
// "what must be an int", OverflowError beyond int64.
bool ReadInt64(PyObject* v, const char* what, int64_t* out);
// One list or tuple of ints into *out.
bool ReadInt64List(PyObject* seq, const char* what, std::vector<int64_t>* out);
// One list or tuple of ints into a pooled int64 tensor (int64_buffers.h).
bool ReadInt64Tensor(PyObject* seq, const char* what, at::Tensor* out);
// True for a list or tuple; else false with a TypeError naming `what`.
bool CheckListOrTuple(PyObject* seqs, const char* what);
// Calls read(i, entry, "what[i]") for every entry of the list or tuple
// `seqs`, in order, holding a reference to every entry first (an entry's
// __index__ may change the outer list while a later entry waits); stops at
// the first false.
bool ReadEach(PyObject* seqs, const char* what,
              const std::function<bool(Py_ssize_t i, PyObject* entry, const char* name)>& read);
// Lists or tuples of ints read together (a batch's offsets and sizes): Add
// each, then Read once. Long ones are read on the WorkCrew. With the GIL
// held.
class Int64ListReads {
 public:
  // Queues `seq` to be read into a pooled int64 tensor, put into *out now
  // (its values are there once Read returns true; *out must stay where it
  // is until then). False with a TypeError naming `what` when `seq` is no
  // list or tuple.
  bool Add(PyObject* seq, const char* what, at::Tensor* out);
  // Reads every list queued since the last Read; false with a Python error
  // naming the first bad entry of the first list (in the order added) that
  // has one.
  bool Read();

 private:
  struct List {
    pybind11::object seq;  // held: an entry's __index__ may drop it elsewhere
    std::string what;
    Py_ssize_t n;
    at::Tensor* tensor;
    int64_t* out;  // tensor's data
  };
  std::vector<List> lists_;
};

// Every list or tuple of ints in the list or tuple `seqs` into a pooled
// int64 tensor of its own, in order.
bool ReadInt64Lists(PyObject* seqs, const char* what, std::vector<at::Tensor>* out);

}  // namespace bind
}  // namespace mori_torch
