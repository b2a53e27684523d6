// FP8 linear with e4m3 output on Hopper, the op fuseinfer_C::fp8_linear_fp8out:
//
//   out[m, n] = e4m3_satfinite(act(acc[m, n] * x_scale[m] * w_scale[n] + bias[n]) / out_scale)
//
// acc = x_q (M, K) e4m3 @ w_q (N, K)^T e4m3 (the tensor cores' FP8 fast accumulation), out_scale one fp32 value on
// the device: a static per-tensor activation scale of the next linear's input (OPT's fc1 writing fc2's input, which
// then takes x_scale = out_scale for every row). The kernels are the sm90 scaled GEMM of w8a8_linear_sm90.cuh with
// its EpilogueFp8Out tree (e4m3 D, no C). This file holds the host entry point and the fp16-bias instantiations;
// fp8_linear_fp8out_sm90_bf16.cu the bf16-bias ones (separate files so nvcc compiles them in parallel).
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
// fp16 bias here, bf16 in fp8_linear_fp8out_sm90_bf16.cu
size_t workspace_bytes_fp8out_f16(GemmParams const& p) {
  return workspace_bytes<cutlass::float_e4m3_t, cutlass::half_t, EpilogueFp8Out>(p);
}
const char* run_fp8out_f16(GemmParams const& p, cudaStream_t s) {
  return run<cutlass::float_e4m3_t, cutlass::half_t, EpilogueFp8Out>(p, s);
}
size_t workspace_bytes_fp8out_bf16(GemmParams const& p);
const char* run_fp8out_bf16(GemmParams const& p, cudaStream_t s);
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

void fp8_linear_fp8out_cuda(const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& w_q,
                            const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                            const at::Tensor& out_scale, bool relu, at::Tensor& out) {
#if !(defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A))
  (void)x_q; (void)x_scale; (void)w_q; (void)w_scale; (void)bias; (void)out_scale; (void)relu; (void)out;
  TORCH_CHECK(false, "fp8_linear_fp8out: ", w8a8_linear_unavailable(0));
#else
  TORCH_CHECK(x_q.scalar_type() == at::kFloat8_e4m3fn, "fp8_linear_fp8out: x_q must be float8_e4m3fn");
  TORCH_CHECK(out.scalar_type() == at::kFloat8_e4m3fn, "fp8_linear_fp8out: out must be float8_e4m3fn");
  TORCH_CHECK(out_scale.scalar_type() == at::kFloat && out_scale.numel() == 1 && out_scale.device() == x_q.device(),
              "fp8_linear_fp8out: out_scale must be one fp32 value on x_q's device");
  const bool has_bias = bias.has_value() && bias->defined();
  const bool bf16 = has_bias && bias->scalar_type() == at::kBFloat16;
  TORCH_CHECK(!has_bias || bias->scalar_type() == at::kHalf || bf16, "fp8_linear_fp8out: bias must be float16 or "
              "bfloat16");
  // (N % 16: the e4m3 output's rows, 16 one-byte values, for TMA)
  w8a8::GemmParams p = w8a8::checked_params("fp8_linear_fp8out", x_q, x_scale, w_q, w_scale, bias, out, relu, 16);
  if (p.m == 0 || p.n == 0) return;

  const at::cuda::CUDAGuard guard(x_q.device());
  if (p.k == 0) {  // an empty reduction: out = e4m3(act(bias) / out_scale); CUTLASS is not asked to handle K = 0
    at::Tensor z = at::zeros({p.m, p.n}, out.options().dtype(at::kFloat));
    if (has_bias) z.add_(bias->to(at::kFloat));
    if (relu) z.clamp_min_(0);
    out.copy_(z.div_(out_scale.reshape({}).to(at::kFloat)).clamp_(-448.0, 448.0));
    return;
  }
  p.out_scale = out_scale.data_ptr<float>();
  w8a8::launch("fp8_linear_fp8out", p, x_q, bf16 ? w8a8::workspace_bytes_fp8out_bf16 : w8a8::workspace_bytes_fp8out_f16,
               bf16 ? w8a8::run_fp8out_bf16 : w8a8::run_fp8out_f16);
#endif
}

// fp8_linear_fp8out(x_q, x_scale, w_q, w_scale, bias, out_scale, relu, out): x_q (M, K), w_q (N, K) float8_e4m3fn,
// x_scale M fp32, w_scale N fp32, bias (N,) fp16 or bf16 or None, out_scale one fp32 value, out (M, N)
// float8_e4m3fn preallocated; all contiguous, K % 16 == 0, N % 16 == 0. w8a8_linear_unavailable says whether it
// runs on a device.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("fp8_linear_fp8out(Tensor x_q, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor out_scale, "
        "bool relu, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("fp8_linear_fp8out", &fp8_linear_fp8out_cuda); }

}  // namespace fuseinfer
