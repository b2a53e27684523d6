// FP8 weight GEMV: y = act(x @ (w * scale)^T + bias + residual) for M <= 16 tokens (decode), with float8 e4m3
// weights w (N, K), fp32 per-output-channel scales and fp16/bf16 activations: the weight-streaming tensor-core GEMV
// of skinny_gemv.cuh with e4m3 weight chunks (skinny::Fp8Weights: 16 weights per 16-byte load, converted to fp16 /
// bf16 in registers, exact), fp32 accumulation, the scale applied in the epilogue with bias / ReLU / residual, one
// store. Reads the int8 GEMV's bytes. Other shapes are the caller's (fuseinfer/ops/fp8_gemv.py: the reference).
// Launched with PDL (launch.h); nothing syncs the host.
#include "skinny_gemv.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>

namespace fuseinfer {

at::Tensor fp8_weight_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                                  const std::string& activation) {
  TORCH_CHECK(activation == "none" || activation == "relu",
              "fp8_weight_linear: activation must be 'none' or 'relu', got '", activation, "'");
  const bool relu = activation == "relu";
  const at::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
  const at::Tensor* r = residual.has_value() && residual->defined() ? &*residual : nullptr;
  TORCH_CHECK(!(relu && r), "fp8_weight_linear: relu cannot be combined with a residual");
  TORCH_CHECK(x.is_cuda() && weight.device() == x.device() && scale.device() == x.device(),
              "fp8_weight_linear: x, weight and scale must be on one CUDA device");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "fp8_weight_linear: x must be (M, K) and weight (N, K), got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "fp8_weight_linear: weight must be float8_e4m3fn");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "fp8_weight_linear: x must be float16 or bfloat16");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "fp8_weight_linear: x and weight must be contiguous");
  const int64_t m = x.size(0), n = weight.size(0);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "fp8_weight_linear: scale must be a contiguous (N,) float32 tensor");
  if (b) {
    TORCH_CHECK(b->device() == x.device() && b->scalar_type() == dtype && b->dim() == 1 && b->size(0) == n &&
                    b->is_contiguous(), "fp8_weight_linear: bias must be a contiguous (N,) tensor in x's dtype");
  }
  if (r) {
    TORCH_CHECK(r->device() == x.device() && r->scalar_type() == dtype && r->dim() == 2 && r->size(0) == m &&
                    r->size(1) == n && r->is_contiguous(),
                "fp8_weight_linear: residual must be a contiguous (M, N) tensor in x's dtype");
  }
  TORCH_CHECK(m > 0 && n > 0 && n <= INT32_MAX && skinny::supported<skinny::Fp8Weights>(x, weight, m),
              "fp8_weight_linear: the GEMV takes 1 to 16 rows, K a multiple of 16, 16-byte aligned x and weight "
              "(sm_80+)");
  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({m, n}, x.options());
  skinny::run<skinny::Fp8Weights>(x, weight, scale.data_ptr<float>(), b, r, relu, y);
  return y;
}

// fp8_weight_linear: y = act(x @ (weight * scale[:, None])^T + bias + residual). x: (M <= 16, K) fp16/bf16
// contiguous; weight: (N, K) float8_e4m3fn contiguous; scale: (N,) fp32; bias: (N,), residual: (M, N) in x's dtype.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("fp8_weight_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias, Tensor? residual, str activation) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("fp8_weight_linear", &fp8_weight_linear_cuda); }

}  // namespace fuseinfer
