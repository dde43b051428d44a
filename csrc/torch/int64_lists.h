// Python lists and tuples of ints (the offsets and sizes serving engines
// pass) into int64 tensors, for mori_torch._C.int64_tensor.
#pragma once

#include <ATen/ATen.h>
#include <Python.h>

#include <functional>
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
// Calls read(i, entry, "what[i]") for every entry of the list or tuple
// `seqs`, in order, holding a reference to every entry first (an entry's
// __index__ may change the outer list while a later entry waits); stops at
// the first false.
bool ReadEach(PyObject* seqs, const char* what,
              const std::function<bool(Py_ssize_t i, PyObject* entry, const char* name)>& read);
// Every list or tuple of ints in the list or tuple `seqs` into a pooled
// int64 tensor of its own, in order.
bool ReadInt64Lists(PyObject* seqs, const char* what, std::vector<at::Tensor>* out);

}  // namespace bind
}  // namespace mori_torch
