// Fused residual add + LayerNorm + per-token symmetric int8 quantisation, one pass over memory:
//
//   s = x + residual (rounded to x's dtype), y = LayerNorm(s) * weight + bias (rounded to x's dtype),
//   scale = max(amax_n |y| / 127, FLT_MIN)  (fp32, one per row; FLT_MIN keeps an all-zero row's q at 0),
//   q = clamp(round_half_even(y / scale), -127, 127)  (int8),
//
// which is fuseinfer.ops.quant.quantize_int8_ref applied to fuseinfer.ops.layer_norm.add_layer_norm_ref's y (the
// reference next to the op, fuseinfer/ops/layer_norm_quant.py): the int8 activations feed the W8A8 GEMM
// (w8a8_linear.cu), whose epilogue multiplies by `scale` per token. y itself is never written: the bytes moved
// are x, residual (read), s (written when asked), q (1 byte per element) and one fp32 scale per row.
//
// The row machinery is layer_norm_rows.cuh's, shared with add_layer_norm (layer_norm.cu): a row lives in registers
// (VPT 16-byte packs per thread, in the input dtype), one warp per row up to 32 * VPT packs, else one block per row;
// loads issued before any reduction; two-pass mean / variance in fp32. This file adds the last pass: y rounded to
// x's dtype, a third reduction (max) for the scale, and the int8 stores. Launched with PDL (launch.h).
#include "layer_norm_rows.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cfloat>
#include <cstdint>
#include <tuple>

namespace fuseinfer {
namespace {

// VEC int8 values stored as one instruction (8 bytes for fp16/bf16 packs, 4 for fp32 packs, 1 for scalars).
template <int VEC>
struct alignas(VEC) QPack {
  int8_t v[VEC];
};

struct LayerNormQuantOp {
  static constexpr const char* kName = "add_layer_norm_quant";
  static constexpr bool kPrefetchAffine = false;
  struct Params : ln_rows::RowParams {
    int8_t* q;     // (rows, n)
    float* scale;  // (rows,)
  };
  // q's packs are VEC bytes: aligned when q's base is 16-byte aligned and n % VEC == 0
  static bool outputs_aligned(const Params& p) { return ln_rows::aligned16(p.q); }

  // y = (s - mean) * rstd * w + b, rounded to T (as the reference's y) and kept in a[]; amax over the row; then the
  // same fp32 operations as quantize_int8_ref: scale = max(amax / 127, FLT_MIN), q = round(y / scale)
  template <typename T, int VEC, int VPT, bool PREFETCHED>
  __device__ __forceinline__ static void finish(const Params& p, ln_rows::Row<T, VEC, VPT>& r) {
    __shared__ float scratch_max[32];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (r.tid + i * r.tpr < r.nv) {
        float f[VEC];
        ln_rows::normalize<PREFETCHED>(r, p, i, f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          r.a[i].v[j] = from_float<T>(f[j]);
          amax = fmaxf(amax, fabsf(to_float(r.a[i].v[j])));
        }
      }
    }
    amax = ln_rows::row_max(amax, scratch_max);
    const float scale = fmaxf(amax / 127.f, FLT_MIN);
    if (r.tid == 0) p.scale[r.index] = scale;

    QPack<VEC>* __restrict__ q = reinterpret_cast<QPack<VEC>*>(p.q) + r.base;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int idx = r.tid + i * r.tpr;
      if (idx < r.nv) {
        QPack<VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float v = fminf(fmaxf(rintf(__fdiv_rn(to_float(r.a[i].v[j]), scale)), -127.f), 127.f);
          out.v[j] = static_cast<int8_t>(v);
        }
        q[idx] = out;
      }
    }
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_quant_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, bool store_sum) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1 && x.is_contiguous(),
              "add_layer_norm_quant: x must be a contiguous CUDA tensor with at least one dimension");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "add_layer_norm_quant: dtype must be float16, bfloat16 or float32, got ", dtype);
  const int64_t n = x.size(-1);
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) {
    TORCH_CHECK(residual->device() == x.device() && residual->scalar_type() == dtype &&
                residual->sizes() == x.sizes() && residual->is_contiguous(),
                "add_layer_norm_quant: residual must be contiguous, with x's device, dtype and shape");
  }
  ln_rows::check_param("add_layer_norm_quant", weight, x, n, "weight");
  ln_rows::check_param("add_layer_norm_quant", bias, x, n, "bias");

  const at::cuda::CUDAGuard guard(x.device());
  auto scale_shape = x.sizes().vec();
  scale_shape.back() = 1;
  at::Tensor q = at::empty_like(x, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(scale_shape, x.options().dtype(at::kFloat));
  at::Tensor s = store_sum ? at::empty_like(x) : at::empty({0}, x.options());
  if (x.numel() == 0) return {q, scale, s};
  TORCH_CHECK(n <= ln_rows::kMaxN, "add_layer_norm_quant: hidden size ", n, " exceeds the supported maximum ",
              ln_rows::kMaxN);

  LayerNormQuantOp::Params p;
  ln_rows::fill_rows(p, x, residual, weight, bias, eps, store_sum ? s.data_ptr() : nullptr);
  p.q = static_cast<int8_t*>(q.data_ptr());
  p.scale = scale.data_ptr<float>();
  ln_rows::dispatch_dtype<LayerNormQuantOp>(p, dtype);
  return {q, scale, s};
}

}  // namespace

// s = x + residual (rounded to x's dtype; s = x when residual is None), y = LayerNorm(s) * weight + bias rounded to
// x's dtype, then per-token symmetric int8: scale = max(amax|y| / 127, FLT_MIN), q = clamp(rint(y / scale), ±127).
// x, residual: (..., N) contiguous fp16/bf16/fp32; weight, bias: (N,) or None. Returns (q int8 (..., N),
// scale fp32 (..., 1), s (..., N) or empty when store_sum is false).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("add_layer_norm_quant(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool store_sum) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("add_layer_norm_quant", &add_layer_norm_quant_cuda); }

}  // namespace fuseinfer
