// Makes the extension importable as mori_torch._C; importing it runs the
// TORCH_LIBRARY registrations of the other files in this library: the
// custom classes (classes.cpp) and the ops torch.ops.mori.* (ops.cpp).
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "mori_torch._C", "mori_torch native library", -1, nullptr,
                            nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
