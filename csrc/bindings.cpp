// Python bindings of the fuseinfer CUDA extension (module fuseinfer._C).
#include "fuseinfer.h"
#include "quant.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fuseinfer CUDA kernels; call through the fuseinfer::* torch.library ops, not directly";
  m.def("add_layer_norm", &fuseinfer::add_layer_norm_cuda);
  m.def("linear_epilogue", &fuseinfer::linear_epilogue_cuda);
  m.def("attention", &fuseinfer::attention_cuda);
  m.def("attention_prefill_kernel", &fuseinfer::attention_prefill_kernel);
  m.def("kv_cache_append", &fuseinfer::kv_cache_append_cuda);
  m.def("decode_step", &fuseinfer::decode_step_cuda);
  m.def("decode_step_workspace_bytes", &fuseinfer::decode_step_workspace_bytes);
  m.def("decode_step_fits", &fuseinfer::decode_step_fits);
  m.def("decode_step_trace", &fuseinfer::decode_step_trace);
  m.def("emit_tokens", &fuseinfer::emit_tokens_cuda);
  m.def("emit_tokens_scratch_ints", &fuseinfer::emit_tokens_scratch_ints);
  m.def("kernels_run_on", &fuseinfer::kernels_run_on);
  m.def("path_counts", &fuseinfer::path_counts);
  m.def("set_knobs", &fuseinfer::set_knobs);
  m.def("int8_linear", &fuseinfer::int8_linear_cuda);
  m.def("int8_dequantize", &fuseinfer::int8_dequantize_cuda);
  m.def("quantize_int8_rows", &fuseinfer::quantize_int8_rows_cuda);
  m.def("int8_path_counts", &fuseinfer::int8_path_counts);
  m.def("add_layer_norm_quant", &fuseinfer::add_layer_norm_quant_cuda);
  m.def("w8a8_linear", &fuseinfer::w8a8_linear_cuda);
  m.def("w8a8_gemm_unavailable", &fuseinfer::w8a8_gemm_unavailable);
  // a CUDA stream of its own for one CUDA graph's capture (fuseinfer/runtime/graphs.py says why); never destroyed:
  // graphs.py keeps it in a free list for the next capture
  m.def("new_stream", [](int64_t device) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaStream_t stream;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return reinterpret_cast<int64_t>(stream);
  });
}
