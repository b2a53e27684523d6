// Fused residual add + RMSNorm, the Llama family's norm: s = x + residual (rounded to x's dtype),
// y = round(w * round(s * rsqrt(mean(s^2) + eps))), one pass over memory (the op fuseinfer_C::add_rms_norm). The
// two roundings to x's dtype are transformers' LlamaRMSNorm's (`weight * hidden.to(input_dtype)`), so the kernel
// gives the unpatched model's bits wherever the fp32 statistics agree. The row machinery (loads, residual add,
// fp32 statistics, layouts, PDL) is layer_norm_rows.cuh's, asked for RMS statistics (Stats::kRms); this file adds
// the last pass, which writes y, and prefetches the weight before the reduction on the vector paths.
#include "layer_norm_rows.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

namespace fuseinfer {
namespace {

struct RmsNormOp {
  static constexpr const char* kName = "add_rms_norm";
  static constexpr bool kPrefetchAffine = true;
  static constexpr ln_rows::Stats kStats = ln_rows::Stats::kRms;
  struct Params : ln_rows::RowParams {
    void* y;  // (rows, n)
  };
  static bool outputs_aligned(const Params& p) { return ln_rows::aligned16(p.y); }

  // y = round_T(w * round_T(s * rstd)): the normalised value rounded to T first, then multiplied by the weight in
  // fp32 and rounded again (eager `weight * n` for T operands); without a weight y is the first rounding.
  template <typename T, int VEC, int VPT, bool PREFETCHED>
  __device__ __forceinline__ static void finish(const Params& p, const ln_rows::Row<T, VEC, VPT>& r) {
    using P = ln_rows::Pack<T, VEC>;
    const P* __restrict__ w = reinterpret_cast<const P*>(p.weight);
    P* __restrict__ y = reinterpret_cast<P*>(p.y) + r.base;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int idx = r.tid + i * r.tpr;
      if (idx < r.nv) {
        float f[VEC];
        ln_rows::widen(r.a[i], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] *= r.rstd;
        P n = ln_rows::narrow<T, VEC>(f);
        if (w) {
          float fw[VEC];
          ln_rows::widen(n, f);
          ln_rows::widen(PREFETCHED ? r.wv[i] : ln_rows::load(w + idx), fw);
#pragma unroll
          for (int j = 0; j < VEC; ++j) f[j] *= fw[j];
          n = ln_rows::narrow<T, VEC>(f);
        }
        y[idx] = n;
      }
    }
  }
};

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                     const c10::optional<at::Tensor>& weight, double eps,
                                                     bool store_sum) {
  ln_rows::check_rows("add_rms_norm", x, residual);
  const int64_t n = x.size(-1);
  ln_rows::check_param("add_rms_norm", weight, x, n, "weight");

  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor s = store_sum ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::empty({0}, x.options());
  if (x.numel() == 0) return {y, s};
  TORCH_CHECK(n <= ln_rows::kMaxN, "add_rms_norm: hidden size ", n, " exceeds the supported maximum ",
              ln_rows::kMaxN);

  RmsNormOp::Params p;
  ln_rows::fill_rows(p, x, residual, weight, c10::nullopt, eps, store_sum ? s.data_ptr() : nullptr);
  p.y = y.data_ptr();
  ln_rows::dispatch_dtype<RmsNormOp>(p, x.scalar_type());
  return {y, s};
}

}  // namespace

// y = RMSNorm(s) = round(weight * round(s * rsqrt(mean(s^2) + eps))), where s = x + residual rounded to x's dtype
// (s = x when residual is None); statistics in fp32. x, residual: (..., N) contiguous, same dtype (fp16/bf16/fp32);
// weight: (N,) of x's dtype or None. Returns (y, s); s is an empty tensor when store_sum is false.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor? weight, float eps, bool store_sum) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("add_rms_norm", &add_rms_norm_cuda); }

}  // namespace fuseinfer
