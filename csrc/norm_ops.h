// The norm ops through the dispatcher, for the paths of the folded-norm ops (rms_norm_linear, layer_norm_linear,
// rms_norm_linear_rope_append, layer_norm_linear_append: linear.cu, linear_rope.cu) where the decode GEMV's norm
// prologue does not serve the call: there the norm runs first, as its own op, and the linear after it.
#pragma once
#include "skinny_gemv.cuh"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace fuseinfer {
namespace norm_ops {

// A folded norm's operands: RMSNorm (weight; add_rms_norm, rms_norm.cu) or LayerNorm (weight and bias;
// add_layer_norm, layer_norm.cu), over the rows of x.
struct Norm {
  skinny::Norm kind;
  const at::Tensor* weight;  // (K,) x's dtype
  const at::Tensor* bias;    // (K,) x's dtype, LayerNorm; null for RMSNorm
  double eps;

  // The GEMV prologue's operands.
  skinny::NormParams params() const {
    skinny::NormParams np;
    np.weight = weight->data_ptr();
    np.eps = static_cast<float>(eps);
    np.bias = bias != nullptr ? bias->data_ptr() : nullptr;
    return np;
  }
  // Whether the prologue can read the operands (16-byte vectors, x's dtype; the entry points check the shapes).
  bool prologue_reads(const at::Tensor& x) const {
    auto ok = [&](const at::Tensor* t) {
      return t->is_contiguous() && t->device() == x.device() && t->scalar_type() == x.scalar_type() &&
             reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
    };
    return ok(weight) && (kind == skinny::kRmsNorm || (bias != nullptr && ok(bias)));
  }
};

// y = add_rms_norm(x, None, weight, eps) (rms_norm.cu) or add_layer_norm(x, None, weight, bias, eps) (layer_norm.cu),
// the two ops' first output, through the dispatcher.
inline at::Tensor apply(const at::Tensor& x, const Norm& norm) {
  if (norm.kind == skinny::kLayerNorm) {
    using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const c10::optional<at::Tensor>&,
                                                   const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                                   double, bool);
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fuseinfer_C::add_layer_norm", "").typed<Sig>();
    return std::get<0>(op.call(x, c10::nullopt, *norm.weight, *norm.bias, norm.eps, false));
  }
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const c10::optional<at::Tensor>&,
                                                 const c10::optional<at::Tensor>&, double, bool);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fuseinfer_C::add_rms_norm", "").typed<Sig>();
  return std::get<0>(op.call(x, c10::nullopt, *norm.weight, norm.eps, false));
}

}  // namespace norm_ops

// w8a16_linear (w8a16_linear.cu) of norm(x) with the decode GEMV's norm prologue, for operands that the caller
// (layer_norm_linear, linear.cu) has checked the int8 GEMV and the prologue take.
at::Tensor w8a16_linear_folded(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                               const std::string& activation, const norm_ops::Norm& norm);

}  // namespace fuseinfer
