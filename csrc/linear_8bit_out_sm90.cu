// Scaled 8-bit linear with 8-bit output on Hopper, the op fuseinfer_C::linear_8bit_out:
//
//   out[m, n] = q(act(acc[m, n] * x_scale[m] * w_scale[n] + bias[n]) / out_scale)
//
// acc = x_q (M, K) @ w_q (N, K)^T, both float8 e4m3 (the tensor cores' FP8 fast accumulation; q = e4m3 round to
// nearest even, saturating at +-448) or both int8 (exact int32; q = int8 round to nearest even, clamped to +-127);
// out is in the operands' type. out_scale one fp32 value on the device: a static per-tensor activation scale of the
// next linear's input (OPT's fc1 writing fc2's input, which then takes x_scale = out_scale for every row). The
// kernels are the sm90 scaled GEMM of w8a8_linear_sm90.cuh with its EpilogueFp8Out / EpilogueInt8Out trees (8-bit D,
// no C). This file holds the host entry point; the instantiations are fp8_linear_fp8out_sm90{,_bf16}.cu and
// w8a8_linear_int8out_sm90{,_bf16}.cu (separate files so nvcc compiles them in parallel).
// CUTLASS's device asserts are compiled out (see w8a8_linear_sm90.cu).
#ifndef NDEBUG
#define NDEBUG
#endif

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#if defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A)
#include "w8a8_linear_sm90.cuh"

namespace fuseinfer {
namespace w8a8 {
// the instantiations (fp16 / bf16 bias per output format)
size_t workspace_bytes_fp8out_f16(GemmParams const& p);
const char* run_fp8out_f16(GemmParams const& p, cudaStream_t s);
size_t workspace_bytes_fp8out_bf16(GemmParams const& p);
const char* run_fp8out_bf16(GemmParams const& p, cudaStream_t s);
size_t workspace_bytes_int8out_f16(GemmParams const& p);
const char* run_int8out_f16(GemmParams const& p, cudaStream_t s);
size_t workspace_bytes_int8out_bf16(GemmParams const& p);
const char* run_int8out_bf16(GemmParams const& p, cudaStream_t s);
// w8a8_linear_sm90.cu: the operand checks and parameters every sm90 scaled-GEMM entry shares, and the launch with
// its workspace
GemmParams checked_params(const char* op, const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& w_q,
                          const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
                          bool relu, int n_align);
void launch(const char* op, GemmParams& p, const at::Tensor& like, size_t (*workspace_bytes)(GemmParams const&),
            const char* (*run)(GemmParams const&, cudaStream_t));
}  // namespace w8a8
}  // namespace fuseinfer
#endif

namespace fuseinfer {

std::string w8a8_linear_unavailable(int64_t device);  // w8a8_linear_sm90.cu: the same build and GPU conditions

void linear_8bit_out_cuda(const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& w_q,
                          const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                          const at::Tensor& out_scale, bool relu, at::Tensor& out) {
#if !(defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A))
  (void)x_q; (void)x_scale; (void)w_q; (void)w_scale; (void)bias; (void)out_scale; (void)relu; (void)out;
  TORCH_CHECK(false, "linear_8bit_out: ", w8a8_linear_unavailable(0));
#else
  const bool fp8 = x_q.scalar_type() == at::kFloat8_e4m3fn;  // else int8
  TORCH_CHECK(fp8 || x_q.scalar_type() == at::kChar, "linear_8bit_out: x_q must be float8_e4m3fn or int8");
  TORCH_CHECK(out.scalar_type() == x_q.scalar_type(), "linear_8bit_out: out must be in x_q's dtype");
  TORCH_CHECK(out_scale.scalar_type() == at::kFloat && out_scale.numel() == 1 && out_scale.device() == x_q.device(),
              "linear_8bit_out: out_scale must be one fp32 value on x_q's device");
  const bool has_bias = bias.has_value() && bias->defined();
  const bool bf16 = has_bias && bias->scalar_type() == at::kBFloat16;
  TORCH_CHECK(!has_bias || bias->scalar_type() == at::kHalf || bf16, "linear_8bit_out: bias must be float16 or "
              "bfloat16");
  // (N % 16: the 8-bit output's rows, 16 one-byte values, for TMA)
  w8a8::GemmParams p = w8a8::checked_params("linear_8bit_out", x_q, x_scale, w_q, w_scale, bias, out, relu, 16);
  if (p.m == 0 || p.n == 0) return;

  const at::cuda::CUDAGuard guard(x_q.device());
  if (p.k == 0) {  // an empty reduction: out = q(act(bias) / out_scale); CUTLASS is not asked to handle K = 0
    at::Tensor z = at::zeros({p.m, p.n}, out.options().dtype(at::kFloat));
    if (has_bias) z.add_(bias->to(at::kFloat));
    if (relu) z.clamp_min_(0);
    z.div_(out_scale.reshape({}).to(at::kFloat));
    out.copy_(fp8 ? z.clamp_(-448.0, 448.0) : z.round_().clamp_(-127.0, 127.0));
    return;
  }
  p.out_scale = out_scale.data_ptr<float>();
  if (fp8) {
    w8a8::launch("linear_8bit_out", p, x_q,
                 bf16 ? w8a8::workspace_bytes_fp8out_bf16 : w8a8::workspace_bytes_fp8out_f16,
                 bf16 ? w8a8::run_fp8out_bf16 : w8a8::run_fp8out_f16);
  } else {
    w8a8::launch("linear_8bit_out", p, x_q,
                 bf16 ? w8a8::workspace_bytes_int8out_bf16 : w8a8::workspace_bytes_int8out_f16,
                 bf16 ? w8a8::run_int8out_bf16 : w8a8::run_int8out_f16);
  }
#endif
}

// linear_8bit_out(x_q, x_scale, w_q, w_scale, bias, out_scale, relu, out): x_q (M, K), w_q (N, K) and out (M, N) all
// float8_e4m3fn or all int8, x_scale M fp32 (or one, for every row), w_scale N fp32, bias (N,) fp16 or bf16 or None,
// out_scale one fp32 value, out preallocated; all contiguous, K % 16 == 0, N % 16 == 0. w8a8_linear_unavailable says
// whether it runs on a device.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("linear_8bit_out(Tensor x_q, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor out_scale, "
        "bool relu, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("linear_8bit_out", &linear_8bit_out_cuda); }

}  // namespace fuseinfer
