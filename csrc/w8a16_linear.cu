// W8A16 linear: y = act(x @ (q * scale)^T + bias + residual) with int8 weights q (N, K) and fp32 per-row scales.
//
// Two paths, chosen by the number of tokens M:
//   * fp16/bf16 with M <= 16 (decode), K % 16 == 0 and 16-byte aligned x and q: the weight-streaming tensor-core
//     GEMV of skinny_gemv.cuh with int8 weight chunks (skinny::Int8Weights: 16 weights per 16-byte load), converted
//     to fp16/bf16 in registers (magic-number trick, exact), fp32 accumulation, scale applied in the epilogue with
//     bias / ReLU / residual, one store. Reads half the bytes of the fp16 kernel. Launched with PDL (launch.h).
//   * otherwise (prefill, fp32, odd K): q is dequantized to x's dtype (int8_dequantize, int8_convert.cuh) into a
//     scratch (N, K) tensor from PyTorch's caching allocator (the same block serves every layer of a size class) and
//     the op fuseinfer_C::linear_epilogue (cuBLASLt with its bias / ReLU / residual epilogues) runs on it. Extra
//     traffic: N K (1 + 2) bytes per call.
// Activation "silu_mul" (q (2F, K): the gated MLP's gate rows, then its up rows): y (M, F) = silu(gate) * up, in the
// GEMV's epilogue at decode; elsewhere, or with FUSEINFER_GEMV_EPILOGUES=0, this op with no activation and then the op
// fuseinfer_C::silu_mul, which round alike (the two agree bit for bit).
// Ops: w8a16_linear, int8_dequantize, int8_path_counts.
// Nothing syncs the host: both paths can be captured in CUDA graphs.
#include "int8_convert.cuh"
#include "knobs.h"
#include "norm_ops.h"
#include "skinny_gemv.cuh"

#include <ATen/core/Dict.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <atomic>
#include <string>

namespace fuseinfer {
namespace {

std::atomic<int64_t> gemv_calls{0}, dequant_calls{0};

template <typename T>
void launch_dequantize(const at::Tensor& q, const at::Tensor& scale, at::Tensor& out, cudaStream_t stream) {
  const int64_t rows = q.size(0), k = q.size(1);
  const bool vec = k % 16 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  const int64_t work = vec ? rows * k / 16 : rows * k;
  const int threads = 256;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 16LL * sms));
  const auto* qp = q.data_ptr<int8_t>();
  const auto* sp = scale.data_ptr<float>();
  T* op = reinterpret_cast<T*>(out.data_ptr());
  if (vec) {
    int8::dequantize_kernel<T, true><<<blocks, threads, 0, stream>>>(qp, sp, op, rows, k);
  } else {
    int8::dequantize_kernel<T, false><<<blocks, threads, 0, stream>>>(qp, sp, op, rows, k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

const at::Tensor* defined_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// The op fuseinfer_C::linear_epilogue (linear.cu), called through the dispatcher.
at::Tensor linear_epilogue(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& residual, const std::string& activation) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fuseinfer_C::linear_epilogue", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                               const c10::optional<at::Tensor>&, const std::string&)>();
  return op.call(x, w, bias, residual, activation);
}

// The op fuseinfer_C::silu_mul (silu_mul.cu), called through the dispatcher: (..., 2F) -> (..., F).
at::Tensor silu_mul_op(const at::Tensor& gate_up) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fuseinfer_C::silu_mul", "")
                             .typed<at::Tensor(const at::Tensor&)>();
  return op.call(gate_up);
}

}  // namespace

at::Tensor int8_dequantize_cuda(const at::Tensor& qweight, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(qweight.is_cuda() && scale.device() == qweight.device(), "int8_dequantize: tensors must be on one GPU");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "int8_dequantize: qweight must be a contiguous (N, K) int8 tensor");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == qweight.size(0) && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(), "int8_dequantize: scale must be (N,) float32");
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "int8_dequantize: dtype must be float16, bfloat16 or float32");
  const at::cuda::CUDAGuard guard(qweight.device());
  at::Tensor out = at::empty(qweight.sizes(), qweight.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dtype == at::kHalf) {
    launch_dequantize<__half>(qweight, scale, out, stream);
  } else if (dtype == at::kBFloat16) {
    launch_dequantize<__nv_bfloat16>(qweight, scale, out, stream);
  } else {
    launch_dequantize<float>(qweight, scale, out, stream);
  }
  return out;
}

// w8a16_linear, or with `norm` (which layer_norm_linear, linear.cu, has checked the int8 GEMV and its norm
// prologue take) the GEMV with the norm prologue over x's un-normalised rows.
at::Tensor w8a16_linear_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                             const std::string& activation, const norm_ops::Norm* norm) {
  TORCH_CHECK(activation == "none" || activation == "relu" || activation == "silu_mul",
              "w8a16_linear: activation must be 'none', 'relu' or 'silu_mul', got '", activation, "'");
  const bool relu = activation == "relu";
  const bool silu = activation == "silu_mul";
  const at::Tensor* b = defined_or_null(bias);
  const at::Tensor* r = defined_or_null(residual);
  TORCH_CHECK(!((relu || silu) && r), "w8a16_linear: an activation cannot be combined with a residual");
  TORCH_CHECK(x.is_cuda() && qweight.device() == x.device() && scale.device() == x.device(),
              "w8a16_linear: x, qweight and scale must be on one CUDA device");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1),
              "w8a16_linear: x must be (M, K) and qweight (N, K), got ", x.sizes(), " and ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "w8a16_linear: qweight must be int8");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "w8a16_linear: x must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(x.is_contiguous() && qweight.is_contiguous(), "w8a16_linear: x and qweight must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "w8a16_linear: scale must be a contiguous (N,) float32 tensor");
  if (b) {
    TORCH_CHECK(b->device() == x.device() && b->scalar_type() == dtype, "w8a16_linear: bias must match x");
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n && b->is_contiguous(), "w8a16_linear: bias must be (N,)");
  }
  if (r) {
    TORCH_CHECK(r->device() == x.device() && r->scalar_type() == dtype, "w8a16_linear: residual must match x");
    TORCH_CHECK(r->dim() == 2 && r->size(0) == m && r->size(1) == n && r->is_contiguous(),
                "w8a16_linear: residual must be contiguous (M, N)");
  }
  TORCH_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, "w8a16_linear: dimension too large");
  TORCH_CHECK(!silu || n % 2 == 0, "w8a16_linear: silu_mul needs an even number of weight rows (gate, up), got ", n);

  const at::cuda::CUDAGuard guard(x.device());
  const bool gemv = m > 0 && n > 0 && k > 0 && skinny::supported<skinny::Int8Weights>(x, qweight, m);
  if (silu && !(gemv && knob(Knob::kGemvEpilogues) != 0)) {  // the linear, then silu_mul: (M, 2F) -> (M, F)
    TORCH_CHECK(norm == nullptr, "w8a16_linear: the norm prologue without the decode GEMV");
    return silu_mul_op(w8a16_linear_impl(x, qweight, scale, bias, residual, "none", nullptr));
  }
  if (gemv) {
    ++gemv_calls;
    at::Tensor y = at::empty({m, silu ? n / 2 : n}, x.options());
    const skinny::NormParams np = norm ? norm->params() : skinny::NormParams{};
    skinny::run<skinny::Int8Weights>(x, qweight, scale.data_ptr<float>(), b, r, relu, y, silu, norm ? &np : nullptr,
                                     norm ? norm->kind : skinny::kRmsNorm);
    return y;
  }
  TORCH_CHECK(norm == nullptr, "w8a16_linear: the norm prologue without the decode GEMV");
  ++dequant_calls;
  // (M = 0, N = 0 and K = 0 are handled by linear_epilogue, on an empty or zero-size scratch weight)
  const at::Tensor w = int8_dequantize_cuda(qweight, scale, dtype);  // (N, K) scratch
  return linear_epilogue(x, w, bias, residual, activation);
}

at::Tensor w8a16_linear_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                             const std::string& activation) {
  return w8a16_linear_impl(x, qweight, scale, bias, residual, activation, nullptr);
}

at::Tensor w8a16_linear_folded(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                               const std::string& activation, const norm_ops::Norm& norm) {
  return w8a16_linear_impl(x, qweight, scale, bias, residual, activation, &norm);
}

// Calls of w8a16_linear per path since the process started: "gemv" (M <= 16 kernel), "dequant_gemm".
c10::Dict<std::string, int64_t> int8_path_counts() {
  c10::Dict<std::string, int64_t> out;
  out.insert("gemv", gemv_calls.load());
  out.insert("dequant_gemm", dequant_calls.load());
  return out;
}

// w8a16_linear: y = act(x @ (qweight * scale[:, None])^T + bias + residual). x: (M, K) fp16/bf16/fp32 contiguous;
// qweight: (N, K) int8 contiguous; scale: (N,) fp32; bias: (N,) and residual: (M, N) in x's dtype; activation
// 'none', 'relu' or 'silu_mul' (then y is (M, N / 2): silu(y[:, :N/2]) * y[:, N/2:], without a residual).
// int8_dequantize: (N, K) int8 * scale (N,) fp32 -> (N, K) in dtype (fp16, bf16 or fp32), rounded once.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("w8a16_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias, Tensor? residual, str activation) "
        "-> Tensor");
  m.def("int8_dequantize(Tensor qweight, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("int8_path_counts() -> Dict(str, int)", &int8_path_counts);
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("w8a16_linear", &w8a16_linear_cuda);
  m.impl("int8_dequantize", &int8_dequantize_cuda);
}

}  // namespace fuseinfer
