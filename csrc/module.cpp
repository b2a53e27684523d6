// The Python module fuseinfer._C, whose only job is to be importable: importing it loads this shared library, and
// the library's static initialisers register every kernel's ops (torch.ops.fuseinfer_C.*), each from its own .cu
// file (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL). The module itself exports nothing; fuseinfer/_ext.py calls the
// ops through torch.ops.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "fuseinfer's CUDA kernels, registered as torch.ops.fuseinfer_C on import", -1,
                               nullptr};
  return PyModule_Create(&module);
}
