// Row-wise symmetric quantization over the last dim: int8 (fuseinfer::quantize_int8: per token of activations
// (M, K) and per output channel of weights (N, K)), the op fuseinfer_C::quantize_int8_rows, device code
// int8::quantize_rows_kernel (int8_convert.cuh); and float8 e4m3 per token (fuseinfer::quantize_fp8_per_token,
// the FP8 linears' inputs that no LayerNorm quantizes: out_proj's and fc2's), the op fuseinfer_C::quantize_fp8_rows,
// device code quant8::quantize_fp8_rows_kernel (quant_rows.cuh, launched with PDL).
#include "int8_convert.cuh"
#include "launch.h"
#include "quant_rows.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace fuseinfer {
namespace {

// Block size for rows of k values: about four 16-byte loads per thread and row, 32 .. 512 threads.
int row_threads(int64_t loads) {
  return static_cast<int>(std::min<int64_t>(512, std::max<int64_t>(32, (loads / 4 + 31) / 32 * 32)));
}

template <typename T>
void launch_quantize(const at::Tensor& x, at::Tensor& q, at::Tensor& scale, cudaStream_t stream) {
  const int64_t rows = x.size(0), k = x.size(1);
  constexpr int V = 16 / sizeof(T);
  const bool vec = k % V == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const int threads = row_threads(vec ? k / V : k);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, 32LL * sms));
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  if (vec) {
    int8::quantize_rows_kernel<T, true><<<blocks, threads, 0, stream>>>(xp, q.data_ptr<int8_t>(),
                                                                          scale.data_ptr<float>(), rows, k);
  } else {
    int8::quantize_rows_kernel<T, false><<<blocks, threads, 0, stream>>>(xp, q.data_ptr<int8_t>(),
                                                                           scale.data_ptr<float>(), rows, k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_quantize_fp8(const at::Tensor& x, at::Tensor& q, at::Tensor& scale, cudaStream_t stream) {
  const int64_t rows = x.size(0), k = x.size(1);
  constexpr int V = 16 / sizeof(T);
  const bool vec = k % V == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const int threads = row_threads(vec ? k / V : k);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, 32LL * sms));
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
  float* sp = scale.data_ptr<float>();
  if (vec) {
    launch_kernel(quant8::quantize_fp8_rows_kernel<T, true>, dim3(blocks), dim3(threads), 0, stream, xp, qp, sp, rows,
                  k);
  } else {
    launch_kernel(quant8::quantize_fp8_rows_kernel<T, false>, dim3(blocks), dim3(threads), 0, stream, xp, qp, sp,
                  rows, k);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_int8_rows_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "quantize_int8_rows: x must be a contiguous (R, K) "
              "CUDA tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "quantize_int8_rows: x must be float16, bfloat16 or float32, got ", dtype);
  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return {q, scale};
  TORCH_CHECK(x.size(1) > 0, "quantize_int8_rows: rows must not be empty (the reference handles K = 0)");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dtype == at::kHalf) {
    launch_quantize<__half>(x, q, scale, stream);
  } else if (dtype == at::kBFloat16) {
    launch_quantize<__nv_bfloat16>(x, q, scale, stream);
  } else {
    launch_quantize<float>(x, q, scale, stream);
  }
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_rows_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "quantize_fp8_rows: x must be a contiguous (R, K) "
              "CUDA tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "quantize_fp8_rows: x must be float16, bfloat16 or float32, got ", dtype);
  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return {q, scale};
  TORCH_CHECK(x.size(1) > 0, "quantize_fp8_rows: rows must not be empty (the reference handles K = 0)");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dtype == at::kHalf) {
    launch_quantize_fp8<__half>(x, q, scale, stream);
  } else if (dtype == at::kBFloat16) {
    launch_quantize_fp8<__nv_bfloat16>(x, q, scale, stream);
  } else {
    launch_quantize_fp8<float>(x, q, scale, stream);
  }
  return {q, scale};
}

// quantize_int8_rows(x): x (R, K) contiguous fp16/bf16/fp32 -> (q (R, K) int8, scale (R,) fp32): symmetric, per row,
// round half to even.
// quantize_fp8_rows(x): x (R, K) contiguous fp16/bf16/fp32 -> (q (R, K) float8_e4m3fn, scale (R,) fp32): scale =
// max(amax / 448, FLT_MIN), q = e4m3(clamp(x / scale, +-448)) rounded to nearest even (quantize_fp8_ref's bits).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("quantize_int8_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("quantize_fp8_rows(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("quantize_int8_rows", &quantize_int8_rows_cuda);
  m.impl("quantize_fp8_rows", &quantize_fp8_rows_cuda);
}

}  // namespace fuseinfer
