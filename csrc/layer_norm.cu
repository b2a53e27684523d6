// Fused residual add + LayerNorm: s = x + residual (rounded to x's dtype), y = LayerNorm(s) * weight + bias, one
// pass over memory (the op fuseinfer_C::add_layer_norm). The row machinery (loads, residual add, two-pass fp32
// statistics, layouts, PDL) is layer_norm_rows.cuh's; this file adds the last pass, which writes y, and prefetches
// weight and bias before the reductions on the vector paths.
#include "layer_norm_rows.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

namespace fuseinfer {
namespace {

struct LayerNormOp {
  static constexpr const char* kName = "add_layer_norm";
  static constexpr bool kPrefetchAffine = true;
  struct Params : ln_rows::RowParams {
    void* y;  // (rows, n)
  };
  static bool outputs_aligned(const Params& p) { return ln_rows::aligned16(p.y); }

  // y = (s - mean) * rstd * w + b, rounded to T
  template <typename T, int VEC, int VPT, bool PREFETCHED>
  __device__ __forceinline__ static void finish(const Params& p, const ln_rows::Row<T, VEC, VPT>& r) {
    using P = ln_rows::Pack<T, VEC>;
    P* __restrict__ y = reinterpret_cast<P*>(p.y) + r.base;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int idx = r.tid + i * r.tpr;
      if (idx < r.nv) {
        float f[VEC];
        ln_rows::normalize<PREFETCHED>(r, p, i, f);
        y[idx] = ln_rows::narrow<T, VEC>(f);
      }
    }
  }
};

std::tuple<at::Tensor, at::Tensor> add_layer_norm_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, bool store_sum) {
  ln_rows::check_rows("add_layer_norm", x, residual);
  const int64_t n = x.size(-1);
  ln_rows::check_param("add_layer_norm", weight, x, n, "weight");
  ln_rows::check_param("add_layer_norm", bias, x, n, "bias");

  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  at::Tensor s = store_sum ? at::empty_like(x) : at::empty({0}, x.options());
  if (x.numel() == 0) return {y, s};
  TORCH_CHECK(n <= ln_rows::kMaxN, "add_layer_norm: hidden size ", n, " exceeds the supported maximum ",
              ln_rows::kMaxN);

  LayerNormOp::Params p;
  ln_rows::fill_rows(p, x, residual, weight, bias, eps, store_sum ? s.data_ptr() : nullptr);
  p.y = y.data_ptr();
  ln_rows::dispatch_dtype<LayerNormOp>(p, x.scalar_type());
  return {y, s};
}

}  // namespace

// y = LayerNorm(s) * weight + bias, where s = x + residual rounded to x's dtype (s = x when residual is None).
// Statistics in fp32. x, residual: (..., N) contiguous, same dtype (fp16/bf16/fp32); weight, bias: (N,) or None.
// Returns (y, s); s is an empty tensor when store_sum is false.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool store_sum) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("add_layer_norm", &add_layer_norm_cuda); }

}  // namespace fuseinfer
