// The fused q/k/v projection with the rotary embedding and the k / v cache write in its epilogue (the op
// fuseinfer_C::linear_rope_append): q = qkv_rope_append(linear(x, w, bias), cos, sin, heads, kv_heads, k_cache,
// v_cache, slots), for fp16/bf16 weights (w in x's dtype) and int8 weights (w int8 with fp32 per-row scales).
//
// At decode (B S <= 16 tokens, fp16/bf16, head dim a multiple of 16, the GEMV's alignment) one kernel: the
// weight-streaming GEMV of skinny_gemv.cuh with its ROPE epilogue (a tile pairs dims d and d + D/2 of a head, which
// rotate_half mixes), so neither the (B, S, (H + 2 Hkv) D) projection nor a second pass over it exists. It rounds the
// projection to the dtype first and rotates as rope.cu does, so it matches the two-kernel path bit for bit.
// At prefill sizes on sm_90 (fp16 / bf16 weights, head dims 16-256 dividing 256), opt-in (FUSEINFER_QKV_GEMM=1: not
// faster than the pair measured), one kernel as well: the GEMM of qkv_rope_gemm_sm90.cu with the same rounding in
// its epilogue.
// Elsewhere, or with FUSEINFER_GEMV_EPILOGUES=0 at decode: the linear op (linear_epilogue or w8a16_linear), then
// qkv_rope_append (or, without cos / sin, kv_cache_append of the k / v views), through the dispatcher.
#include "knobs.h"
#include "norm_ops.h"
#include "skinny_gemv.cuh"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace fuseinfer {

// qkv_rope_gemm_sm90.cu: the q/k/v GEMM with the rotary, the split and the cache write in its epilogue; false
// (nothing launched) where it does not apply
bool qkv_rope_gemm_sm90(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, const at::Tensor* cos,
                        const at::Tensor* sin, int64_t seq, int64_t heads, int64_t kv_heads, at::Tensor& q,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots);

namespace {

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& bias) {
  if (w.scalar_type() == at::kChar) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fuseinfer_C::w8a16_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                                 const std::string&)>();
    return op.call(x, w, *scale, bias, c10::nullopt, "none");
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fuseinfer_C::linear_epilogue", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                               const c10::optional<at::Tensor>&, const std::string&)>();
  return op.call(x, w, bias, c10::nullopt, "none");
}

void kv_append_op(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slots) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fuseinfer_C::kv_cache_append", "")
                             .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&)>();
  op.call(k_cache, v_cache, k, v, slots);
}

at::Tensor rope_append_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                          int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fuseinfer_C::qkv_rope_append", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                               int64_t, at::Tensor&, at::Tensor&, const at::Tensor&)>();
  return op.call(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slots);
}

// linear_rope_append of x, or with `norm` of norm(x): the GEMV's norm prologue where the decode GEMV serves the call
// (RMSNorm: fp16 / bf16 weights; LayerNorm: those and int8; the staged rows fitting shared memory), the norm op
// first elsewhere.
at::Tensor linear_rope_append_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& cos_in,
                                   const c10::optional<at::Tensor>& sin_in, int64_t heads, int64_t kv_heads,
                                   at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                                   const norm_ops::Norm* norm) {
  TORCH_CHECK(x.is_cuda() && w.device() == x.device(), "linear_rope_append: x and w must be on one CUDA device");
  TORCH_CHECK(x.dim() == 3 && w.dim() == 2 && x.size(2) == w.size(1),
              "linear_rope_append: x must be (B, S, K) and w (N, K), got ", x.sizes(), " and ", w.sizes());
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(!int8 || (scale.has_value() && scale->defined()), "linear_rope_append: int8 weights need scales");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && w.size(0) % (heads + 2 * kv_heads) == 0,
              "linear_rope_append: w's rows must be (H + 2 Hkv) D");
  const bool rotate = cos_in.has_value() && cos_in->defined();
  TORCH_CHECK(rotate == (sin_in.has_value() && sin_in->defined()), "linear_rope_append: give both cos and sin, or "
              "neither (no rotation)");
  const int64_t B = x.size(0), S = x.size(1), K = x.size(2), N = w.size(0), D = N / (heads + 2 * kv_heads);
  const at::Tensor x2 = x.reshape({B * S, K}).contiguous();  // (M, K)
  const at::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
  const at::cuda::CUDAGuard guard(x.device());
  const auto dtype = x.scalar_type();
  const auto dev = x.device();
  const bool rope_operands =
      !rotate || (cos_in->device() == dev && sin_in->device() == dev && cos_in->scalar_type() == dtype &&
                  sin_in->scalar_type() == dtype && cos_in->dim() == 3 && cos_in->size(0) == B &&
                  cos_in->size(1) == S && cos_in->size(2) == D && sin_in->sizes() == cos_in->sizes() &&
                  cos_in->is_contiguous() && sin_in->is_contiguous());
  const bool operands = (dtype == at::kHalf || dtype == at::kBFloat16) && (int8 || w.scalar_type() == dtype) &&
                        rope_operands && k_cache.device() == dev &&
                        v_cache.device() == dev && slots.device() == dev && (!b || b->device() == dev) &&
                        (!int8 || scale->device() == dev) &&
                        w.is_contiguous() && D % 16 == 0 && B * S > 0 && K > 0 && N <= INT32_MAX &&
                        k_cache.dim() == 4 &&
                        k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B && k_cache.size(1) == kv_heads &&
                        k_cache.size(3) == D && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype &&
                        k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) <= INT32_MAX &&
                        slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == S &&
                        (!b || (b->scalar_type() == dtype && b->is_contiguous() && b->numel() == N)) &&
                        (!int8 || (scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                                   scale->numel() == N));
  const bool gemv = operands && knob(Knob::kGemvEpilogues) != 0 &&
                    (int8 ? skinny::supported<skinny::Int8Weights>(x2, w, B * S)
                          : skinny::supported<skinny::HalfWeights>(x2, w, B * S));
  // the norm prologue: RMSNorm for fp16 / bf16 weights, LayerNorm also for int8 ones (the prologues built), rows
  // that fit
  const bool fold = norm != nullptr && gemv && (!int8 || norm->kind == skinny::kLayerNorm) &&
                    skinny::norm_fits(B * S, K, norm->kind) && norm->prologue_reads(x);
  if (norm != nullptr && !fold) {  // the norm first, then the call without it
    return linear_rope_append_impl(norm_ops::apply(x.contiguous(), *norm), w, scale, bias, cos_in, sin_in, heads,
                                   kv_heads, k_cache, v_cache, slots, nullptr);
  }
  // prefill sizes: the sm_90 GEMM with all of it in its epilogue (the knob first: off by default, q is not
  // allocated for nothing)
  if (knob(Knob::kQkvGemm) != 0 && !gemv && operands && !int8 && B * S > 16) {
    at::Tensor q = at::empty({B, heads, S, D}, x.options());
    if (qkv_rope_gemm_sm90(x2, w, b, rotate ? &*cos_in : nullptr, rotate ? &*sin_in : nullptr, S, heads, kv_heads, q,
                           k_cache, v_cache, slots))
      return q;
  }
  if (!gemv) {  // the linear, then the rotary pass (which checks the rest), or the split and the cache write
    const at::Tensor qkv = linear_op(x2, w, scale, bias).view({B, S, N});
    if (rotate) return rope_append_op(qkv, *cos_in, *sin_in, heads, kv_heads, k_cache, v_cache, slots);
    const at::Tensor k = qkv.narrow(2, heads * D, kv_heads * D).view({B, S, kv_heads, D}).transpose(1, 2);
    const at::Tensor v = qkv.narrow(2, (heads + kv_heads) * D, kv_heads * D).view({B, S, kv_heads, D}).transpose(1, 2);
    kv_append_op(k_cache, v_cache, k, v, slots);
    return qkv.narrow(2, 0, heads * D).view({B, S, heads, D}).transpose(1, 2).contiguous();  // (B, H, S, D)
  }
  const at::Tensor* cos = rotate ? &*cos_in : nullptr;
  const at::Tensor* sin = rotate ? &*sin_in : nullptr;
  at::Tensor q = at::empty({B, heads, S, D}, x.options());
  const skinny::NormParams np = fold ? norm->params() : skinny::NormParams{};
  const skinny::Norm kind = fold ? norm->kind : skinny::kRmsNorm;
  if (int8) {
    skinny::run_rope<skinny::Int8Weights>(x2, w, scale->data_ptr<float>(), b, cos, sin, S, heads, kv_heads, q,
                                          k_cache, v_cache, slots, fold ? &np : nullptr, kind);
  } else {
    skinny::run_rope<skinny::HalfWeights>(x2, w, nullptr, b, cos, sin, S, heads, kv_heads, q, k_cache, v_cache,
                                          slots, fold ? &np : nullptr, kind);
  }
  return q;
}

}  // namespace

at::Tensor linear_rope_append_cuda(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& cos,
                                   const c10::optional<at::Tensor>& sin, int64_t heads, int64_t kv_heads,
                                   at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  return linear_rope_append_impl(x, w, scale, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots, nullptr);
}

at::Tensor rms_norm_linear_rope_append_cuda(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                            const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                                            const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                                            int64_t heads, int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache,
                                            const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && norm_weight.dim() == 1 && norm_weight.size(0) == x.size(2),
              "rms_norm_linear_rope_append: x must be (B, S, K) and norm_weight (K,), got ", x.sizes(), " and ",
              norm_weight.sizes());
  TORCH_CHECK(norm_weight.device() == x.device() && norm_weight.scalar_type() == x.scalar_type() &&
                  norm_weight.is_contiguous(),
              "rms_norm_linear_rope_append: norm_weight must be contiguous, on x's device, in x's dtype");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm_linear_rope_append: w must have x's dtype");
  const norm_ops::Norm norm{skinny::kRmsNorm, &norm_weight, nullptr, eps};
  return linear_rope_append_impl(x, w, c10::nullopt, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots, &norm);
}

at::Tensor layer_norm_linear_append_cuda(const at::Tensor& x, const at::Tensor& ln_weight, const at::Tensor& ln_bias,
                                         double eps, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                                         const c10::optional<at::Tensor>& bias, int64_t heads, int64_t kv_heads,
                                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && ln_weight.dim() == 1 && ln_weight.size(0) == x.size(2) &&
                  ln_bias.sizes() == ln_weight.sizes(),
              "layer_norm_linear_append: x must be (B, S, K) and ln_weight, ln_bias (K,), got ", x.sizes(), ", ",
              ln_weight.sizes(), " and ", ln_bias.sizes());
  TORCH_CHECK(ln_weight.device() == x.device() && ln_weight.scalar_type() == x.scalar_type() &&
                  ln_bias.device() == x.device() && ln_bias.scalar_type() == x.scalar_type(),
              "layer_norm_linear_append: ln_weight and ln_bias must be on x's device, in x's dtype");
  const at::Tensor nw = ln_weight.contiguous(), nb = ln_bias.contiguous();
  const norm_ops::Norm norm{skinny::kLayerNorm, &nw, &nb, eps};
  return linear_rope_append_impl(x, w, scale, bias, c10::nullopt, c10::nullopt, heads, kv_heads, k_cache, v_cache,
                                 slots, &norm);
}

// linear_rope_append(x, w, scale, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots) -> q:
// qkv_rope_append(x @ w'^T + bias, ...) with w' = w (x's dtype) or w * scale[:, None] (w int8, scale (N,) fp32).
// x (B, S, K); w ((H + 2 Hkv) D, K); cos, sin (B, S, D), or both None: no rotation (the split and the cache write
// alone, OPT's decode q/k/v); caches (B, Hkv, T, D); slots (S,) int64. q (B, H, S, D).
// rms_norm_linear_rope_append(x, norm_weight, eps, w, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots) -> q:
// linear_rope_append of add_rms_norm(x, None, norm_weight, eps) (rms_norm.cu), w in x's dtype (no scale); at decode
// one kernel (the GEMV's RMSNorm prologue, rounding as add_rms_norm).
// layer_norm_linear_append(x, ln_weight, ln_bias, eps, w, scale, bias, heads, kv_heads, k_cache, v_cache, slots) -> q:
// linear_rope_append of add_layer_norm(x, None, ln_weight, ln_bias, eps) (layer_norm.cu) without rotation (OPT's
// q/k/v: the split and the cache write), w in x's dtype or int8 with its scales; at decode one kernel (the GEMV's
// LayerNorm prologue, rounding as add_layer_norm).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("linear_rope_append(Tensor x, Tensor w, Tensor? scale, Tensor? bias, Tensor? cos, Tensor? sin, int heads, "
        "int kv_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
  m.def("rms_norm_linear_rope_append(Tensor x, Tensor norm_weight, float eps, Tensor w, Tensor? bias, Tensor? cos, "
        "Tensor? sin, int heads, int kv_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
  m.def("layer_norm_linear_append(Tensor x, Tensor ln_weight, Tensor ln_bias, float eps, Tensor w, Tensor? scale, "
        "Tensor? bias, int heads, int kv_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("linear_rope_append", &linear_rope_append_cuda);
  m.impl("rms_norm_linear_rope_append", &rms_norm_linear_rope_append_cuda);
  m.impl("layer_norm_linear_append", &layer_norm_linear_append_cuda);
}

}  // namespace fuseinfer
