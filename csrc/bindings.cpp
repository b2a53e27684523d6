// Python bindings of the fuseinfer CUDA extension (module fuseinfer._C).
#include "fuseinfer.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fuseinfer CUDA kernels; call through the fuseinfer::* torch.library ops, not directly";
  m.def("add_layer_norm", &fuseinfer::add_layer_norm_cuda);
  m.def("linear_epilogue", &fuseinfer::linear_epilogue_cuda);
  m.def("attention", &fuseinfer::attention_cuda);
  m.def("kv_cache_append", &fuseinfer::kv_cache_append_cuda);
}
