// W8A8 linear on Hopper: out = act(x_q @ w_q^T * x_scale[m] * w_scale[n] + bias[n] + residual[m, n]), the ops
// fuseinfer_C::w8a8_linear (int8 or float8 e4m3 operands) and fuseinfer_C::w8a8_linear_unavailable.
//
// The kernels are CUTLASS sm90 warp-specialized int8 wgmma GEMMs with the dequantisation in the epilogue
// (w8a8_linear_sm90.cuh). This file holds the host entry point (checks, dispatch by output dtype) and the fp16
// instantiations; w8a8_linear_sm90_bf16.cu holds the bf16 ones (separate files so nvcc compiles them in parallel).
//
// Built only with CUTLASS's headers (setup.py defines FUSEINFER_CUTLASS when it finds them, see
// FUSEINFER_CUTLASS_DIR) and for sm_90a (FUSEINFER_SM90A); otherwise w8a8_linear_unavailable() says why and the
// Python op (fuseinfer/ops/int8_gemm.py) takes its documented fallback (torch._int_mm + rescale).
// CUTLASS's device asserts are function calls, which make ptxas serialise the wgmma pipeline (warning C7510):
// compiled out here, before any header brings in <cassert>.
#ifndef NDEBUG
#define NDEBUG
#endif
#include "knobs.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#if defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A)
#include "w8a8_linear_sm90.cuh"

namespace fuseinfer {
namespace w8a8 {
// fp16 here, bf16 in w8a8_linear_sm90_bf16.cu
size_t workspace_bytes_f16(GemmParams const& p) { return workspace_bytes<int8_t, cutlass::half_t>(p); }
const char* run_f16(GemmParams const& p, cudaStream_t s) { return run<int8_t, cutlass::half_t>(p, s); }
size_t workspace_bytes_bf16(GemmParams const& p);
const char* run_bf16(GemmParams const& p, cudaStream_t s);
// FP8 (e4m3) operands: fp8_linear_sm90.cu, fp8_linear_sm90_bf16.cu
size_t workspace_bytes_fp8_f16(GemmParams const& p);
const char* run_fp8_f16(GemmParams const& p, cudaStream_t s);
size_t workspace_bytes_fp8_bf16(GemmParams const& p);
const char* run_fp8_bf16(GemmParams const& p, cudaStream_t s);
}  // namespace w8a8
}  // namespace fuseinfer
#endif

namespace fuseinfer {

std::string w8a8_linear_unavailable(int64_t device) {
#if !defined(FUSEINFER_CUTLASS)
  (void)device;
  return "fuseinfer._C was built without CUTLASS (pip install nvidia-cutlass or set FUSEINFER_CUTLASS_DIR to a "
         "CUTLASS checkout, then rebuild: pip install --no-build-isolation -e .)";
#elif !defined(FUSEINFER_SM90A)
  (void)device;
  return "fuseinfer._C was built without sm_90a (FUSEINFER_CUDA_ARCH=9.0a), which the int8 wgmma GEMM needs";
#else
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, static_cast<int>(device)));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, static_cast<int>(device)));
  if (major != 9 || minor != 0) {
    return "the int8 wgmma GEMM needs an sm_90 GPU (H100/H200); this one is sm_" + std::to_string(major) +
           std::to_string(minor);
  }
  return "";
#endif
}

#if defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A)
namespace w8a8 {
namespace {

// the device's SM count, cached (the persistent kernels' grid)
int sm_count(int device) {
  static std::mutex mutex;
  static std::vector<int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(counts.size())) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

GemmParams checked_params(const char* op, const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& w_q,
                          const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
                          bool relu, int n_align) {
  TORCH_CHECK(x_q.is_cuda() && x_q.dim() == 2 && x_q.is_contiguous(), op,
              ": x_q must be a contiguous (M, K) CUDA tensor");
  TORCH_CHECK(w_q.scalar_type() == x_q.scalar_type() && w_q.dim() == 2 && w_q.is_contiguous() &&
              w_q.size(1) == x_q.size(1) && w_q.device() == x_q.device(),
              op, ": w_q must be a contiguous (N, K) tensor of x_q's dtype on x_q's device");
  const int64_t m = x_q.size(0), k = x_q.size(1), n = w_q.size(0);
  // (one value: a static per-tensor scale for every row)
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.is_contiguous() &&
              (x_scale.numel() == m || x_scale.numel() == 1) && x_scale.device() == x_q.device(), op,
              ": x_scale must be M (or 1) contiguous fp32 values");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == n &&
              w_scale.device() == x_q.device(), op, ": w_scale must be N contiguous fp32 values");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == m && out.size(1) == n &&
              out.device() == x_q.device(), op, ": out must be a contiguous (M, N) tensor on x_q's device");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->device() == x_q.device(), op,
                ": bias must be (N,) contiguous on x_q's device");
  }
  // TMA: 16-byte aligned base addresses and row strides (K one-byte operands; N outputs of out's element size)
  TORCH_CHECK(k % 16 == 0 && n % n_align == 0, op, ": the sm90 kernel needs K % 16 == 0 and N % ", n_align,
              " == 0, got K=", k, " N=", n);
  TORCH_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, op, ": dimensions must fit int32");
  TORCH_CHECK(aligned16(x_q.data_ptr()) && aligned16(w_q.data_ptr()) && aligned16(out.data_ptr()) &&
              aligned16(x_scale.data_ptr()) && aligned16(w_scale.data_ptr()) &&
              (!has_bias || aligned16(bias->data_ptr())), op, ": tensors must be 16-byte aligned");
  GemmParams p;
  p.a = x_q.data_ptr();
  p.b = w_q.data_ptr();
  p.a_scale = x_scale.data_ptr<float>();
  p.a_per_row = x_scale.numel() == m && m != 1;
  p.w_scale = w_scale.data_ptr<float>();
  p.bias = has_bias ? bias->data_ptr() : nullptr;
  p.residual = nullptr;
  p.out = out.data_ptr();
  p.out_scale = nullptr;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.relu = relu;
  p.sm_count = sm_count(x_q.get_device());
  // FUSEINFER_W8A8_TILE (knobs.h; 0 auto, 1 small, 2 medium, 3 large) forces that tile configuration
  // (w8a8_linear_sm90.cuh), for benchmarking; read on every call so a benchmark can switch it between calls
  p.config = knob(Knob::kW8A8Tile);
  p.workspace = nullptr;
  return p;
}

void launch(const char* op, GemmParams& p, const at::Tensor& like, size_t (*workspace_bytes)(GemmParams const&),
            const char* (*run)(GemmParams const&, cudaStream_t)) {
  const size_t bytes = workspace_bytes(p);
  at::Tensor workspace;
  if (bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }
  const char* error = run(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error[0] == '\0', op, ": ", error, " (M=", p.m, " N=", p.n, " K=", p.k, ")");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace w8a8
#endif

void w8a8_linear_cuda(const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& w_q,
                      const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                      const c10::optional<at::Tensor>& residual, bool relu, at::Tensor& out) {
#if !(defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A))
  (void)x_q; (void)x_scale; (void)w_q; (void)w_scale; (void)bias; (void)residual; (void)relu; (void)out;
  TORCH_CHECK(false, "w8a8_linear: ", w8a8_linear_unavailable(0));
#else
  const bool fp8 = x_q.scalar_type() == at::kFloat8_e4m3fn;  // else int8
  TORCH_CHECK(x_q.scalar_type() == at::kChar || fp8, "w8a8_linear: x_q must be int8 or float8_e4m3fn");
  const auto dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "w8a8_linear: output must be float16 or bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  const bool has_residual = residual.has_value() && residual->defined();
  TORCH_CHECK(!has_bias || bias->scalar_type() == dtype, "w8a8_linear: bias must be in the output dtype");
  w8a8::GemmParams p = w8a8::checked_params("w8a8_linear", x_q, x_scale, w_q, w_scale, bias, out, relu, 8);
  const int64_t m = p.m, n = p.n;
  if (has_residual) {
    TORCH_CHECK(residual->scalar_type() == dtype && residual->is_contiguous() && residual->size(0) == m &&
                residual->size(1) == n && residual->device() == x_q.device() &&
                reinterpret_cast<uintptr_t>(residual->data_ptr()) % 16 == 0,
                "w8a8_linear: residual must be (M, N) contiguous in the output dtype, 16-byte aligned");
    p.residual = residual->data_ptr();
  }
  if (m == 0 || n == 0) return;

  const at::cuda::CUDAGuard guard(x_q.device());
  if (p.k == 0) {  // an empty reduction: out = act(bias + residual); CUTLASS is not asked to handle K = 0
    at::Tensor z = at::zeros({m, n}, out.options().dtype(at::kFloat));
    if (has_bias) z.add_(bias->to(at::kFloat));
    if (has_residual) z.add_(residual->to(at::kFloat));
    if (relu) z.clamp_min_(0);
    out.copy_(z);
    return;
  }
  const bool f16 = dtype == at::kHalf;
  if (fp8) {
    w8a8::launch("w8a8_linear", p, x_q, f16 ? w8a8::workspace_bytes_fp8_f16 : w8a8::workspace_bytes_fp8_bf16,
                 f16 ? w8a8::run_fp8_f16 : w8a8::run_fp8_bf16);
  } else {
    w8a8::launch("w8a8_linear", p, x_q, f16 ? w8a8::workspace_bytes_f16 : w8a8::workspace_bytes_bf16,
                 f16 ? w8a8::run_f16 : w8a8::run_bf16);
  }
#endif
}

// w8a8_linear(x_q, x_scale, w_q, w_scale, bias, residual, relu, out): x_q (M, K) and w_q (N, K) both int8 or both
// float8_e4m3fn (FP8: fp32 accumulation), x_scale M fp32 (or one, for every row), w_scale N fp32, bias (N,), residual
// (M, N), out (M, N) preallocated, fp16 or bf16 (bias and residual in out's dtype); all contiguous, K % 16 == 0, N % 8
// == 0; act = ReLU when relu. w8a8_linear_unavailable(device): "" when w8a8_linear runs on CUDA device `device`, else
// why not (built without CUTLASS or sm_90a, not sm_90).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("w8a8_linear(Tensor x_q, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor? residual, "
        "bool relu, Tensor(a!) out) -> ()");
  m.def("w8a8_linear_unavailable(int device) -> str", &w8a8_linear_unavailable);
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("w8a8_linear", &w8a8_linear_cuda); }

}  // namespace fuseinfer
