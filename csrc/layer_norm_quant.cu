// Fused residual add + LayerNorm + per-token symmetric quantisation to int8 or float8 e4m3, one pass over memory:
//
//   s = x + residual (rounded to x's dtype), y = LayerNorm(s) * weight + bias (rounded to x's dtype),
//   int8:  scale = max(amax_n |y| / 127, FLT_MIN), q = clamp(round_half_even(y / scale), -127, 127),
//   e4m3:  scale = max(amax_n |y| / 448, FLT_MIN), q = e4m3(y / scale) (nearest even, saturated to +-448),
//   (scale fp32, one per row; FLT_MIN keeps an all-zero row's q at 0)
//
// which is fuseinfer.ops.quant.quantize_int8_ref (fuseinfer.ops.fp8_linear.quantize_fp8_ref) applied to
// fuseinfer.ops.layer_norm.add_layer_norm_ref's y (the references next to the ops, fuseinfer/ops/layer_norm_quant.py):
// the 8-bit activations feed the W8A8 / FP8 GEMM, whose epilogue multiplies by `scale` per token. y itself is never
// written: the bytes moved are x, residual (read), s (written when asked), q (1 byte per element) and one fp32 scale
// per row.
//
// The row machinery is layer_norm_rows.cuh's, shared with add_layer_norm (layer_norm.cu): a row lives in registers
// (VPT 16-byte packs per thread, in the input dtype), one warp per row up to 32 * VPT packs, else one block per row;
// loads issued before any reduction; two-pass mean / variance in fp32. This file adds the last pass: y rounded to
// x's dtype (kept in fp32 registers), a third reduction (max) for the scale, and the 8-bit stores.
//
// The kernel is bound by instructions per element, not bytes, so the quantisation is written for few of them, with
// the same bits as the straightforward code (rintf, fminf / fmaxf, int cast, __fdiv_rn per element):
//   * y / scale: IEEE division's own fast path (the FFMA sequence nvcc emits for __fdiv_rn) with its reciprocal
//     refinement hoisted out of the row, 3 FFMA per element instead of the MUFU.RCP, FCHK and branch of each
//     division; the fast path is exact for normal operands whose quotient is far from the overflow and underflow
//     ranges, which holds for every element that can round to a nonzero q when 2^-64 <= scale <= 2^64; rows outside
//     that range (an inf in y, an fp32 / bf16 row of subnormals) take __fdiv_rn per element;
//   * int8 rounding: adding 1.5 * 2^23 rounds a value in [-127, 127] to the nearest even integer in the fp32 adder,
//     whose low byte is then the int8 (no FRND, no F2I, both quarter-rate);
//   * e4m3: one cvt.rn.satfinite.e4m3x2.f32 per pair, which saturates exactly as the reference's clamp to +-448.
// Launched with PDL (launch.h).
#include "layer_norm_rows.cuh"
#include "quant_rows.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <cfloat>
#include <cstdint>
#include <tuple>

namespace fuseinfer {
namespace {

using quant8::Divider;
using quant8::QPack;
using quant8::fast_divide;
using quant8::quantize;


template <bool kFp8>
struct LayerNormQuantOp {
  static constexpr const char* kName = kFp8 ? "add_layer_norm_quant_fp8" : "add_layer_norm_quant";
  static constexpr bool kPrefetchAffine = false;
  static constexpr bool kRowInFp32 = true;  // layer_norm_rows.cuh: fewer conversions, the kernel's bottleneck
  static constexpr float kQmax = kFp8 ? 448.f : 127.f;  // largest int8 / finite e4m3 magnitude
  static constexpr int kMinBlocks16 = 2;  // layer_norm_rows.cuh: a 64-register cap (a single wave at 2040 x 2048)
  struct Params : ln_rows::RowParams {
    uint8_t* q;    // (rows, n) int8 or float8_e4m3fn bytes
    float* scale;  // (rows,)
  };
  // q's packs are VEC bytes: aligned when q's base is 16-byte aligned and n % VEC == 0
  static bool outputs_aligned(const Params& p) { return ln_rows::aligned16(p.q); }

  // y = (s - mean) * rstd * w + b, rounded to T (as the reference's y) and kept in fp32; amax over the row; then the
  // same fp32 values as the reference: scale = max(amax / qmax, FLT_MIN), q = quantised y / scale
  template <typename T, int VEC, int VPT, bool PREFETCHED>
  __device__ __forceinline__ static void finish(const Params& p, ln_rows::Row<T, VEC, VPT>& r) {
    __shared__ float scratch_max[32];
    float y[VPT][VEC];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (r.tid + i * r.tpr < r.nv) {
        float f[VEC];
        ln_rows::normalize<PREFETCHED, T, VEC, VPT, kRowInFp32>(r, p, i, f);
        ln_rows::widen(ln_rows::narrow<T, VEC>(f), y[i]);  // round to T (pairwise), back to fp32 (exact)
#pragma unroll
        for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(y[i][j]));
      }
    }
    amax = ln_rows::row_max(amax, scratch_max);
    const float scale = fmaxf(amax / kQmax, FLT_MIN);
    if (r.tid == 0) p.scale[r.index] = scale;
    if (fast_divide(scale)) {
      store<VEC, VPT>(p, r, y, Divider<false>(scale));
    } else {
      store<VEC, VPT>(p, r, y, Divider<true>(scale));
    }
  }

  template <int VEC, int VPT, typename T, class Div>
  __device__ __forceinline__ static void store(const Params& p, const ln_rows::Row<T, VEC, VPT>& r,
                                               const float (&y)[VPT][VEC], const Div& div) {
    QPack<VEC>* __restrict__ q = reinterpret_cast<QPack<VEC>*>(p.q) + r.base;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int idx = r.tid + i * r.tpr;
      if (idx < r.nv) q[idx] = quantize<kFp8, VEC>(y[i], div);
    }
  }
};

template <bool kFp8>
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_quant_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, bool store_sum) {
  using Op = LayerNormQuantOp<kFp8>;
  ln_rows::check_rows(Op::kName, x, residual);
  const int64_t n = x.size(-1);
  ln_rows::check_param(Op::kName, weight, x, n, "weight");
  ln_rows::check_param(Op::kName, bias, x, n, "bias");

  const at::cuda::CUDAGuard guard(x.device());
  auto scale_shape = x.sizes().vec();
  scale_shape.back() = 1;
  at::Tensor q = at::empty_like(x, x.options().dtype(kFp8 ? at::kFloat8_e4m3fn : at::kChar));
  at::Tensor scale = at::empty(scale_shape, x.options().dtype(at::kFloat));
  at::Tensor s = store_sum ? at::empty_like(x) : at::empty({0}, x.options());
  if (x.numel() == 0) return {q, scale, s};
  TORCH_CHECK(n <= ln_rows::kMaxN, Op::kName, ": hidden size ", n, " exceeds the supported maximum ", ln_rows::kMaxN);

  typename Op::Params p;
  ln_rows::fill_rows(p, x, residual, weight, bias, eps, store_sum ? s.data_ptr() : nullptr);
  p.q = static_cast<uint8_t*>(q.data_ptr());
  p.scale = scale.data_ptr<float>();
  ln_rows::dispatch_dtype<Op>(p, x.scalar_type());
  return {q, scale, s};
}

}  // namespace

// s = x + residual (rounded to x's dtype; s = x when residual is None), y = LayerNorm(s) * weight + bias rounded to
// x's dtype, then per-token symmetric 8-bit:
//   add_layer_norm_quant: int8, scale = max(amax|y| / 127, FLT_MIN), q = clamp(rint(y / scale), +-127);
//   add_layer_norm_quant_fp8: float8_e4m3fn, scale = max(amax|y| / 448, FLT_MIN), q = e4m3(clamp(y / scale, +-448)).
// x, residual: (..., N) contiguous fp16/bf16/fp32; weight, bias: (N,) or None. Returns (q (..., N), scale fp32
// (..., 1), s (..., N) or empty when store_sum is false).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("add_layer_norm_quant(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool store_sum) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("add_layer_norm_quant_fp8(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
        "bool store_sum) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("add_layer_norm_quant", &add_layer_norm_quant_cuda<false>);
  m.impl("add_layer_norm_quant_fp8", &add_layer_norm_quant_cuda<true>);
}

}  // namespace fuseinfer
