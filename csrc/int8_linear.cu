// W8A16 linear: y = act(x @ (q * scale)^T + bias + residual) with int8 weights q (N, K) and fp32 per-row scales.
//
// Two paths, chosen by the number of tokens M (device code in int8_kernels.cuh):
//   * fp16/bf16 with M <= 16 (decode), K % 16 == 0 and 16-byte aligned x and q: int8::skinny_kernel, the weight-
//     streaming tensor-core GEMV of linear.cu with int8 weight chunks (16 weights per 16-byte load), converted to
//     fp16/bf16 in registers (magic-number trick, exact), fp32 accumulation, scale applied in the epilogue with
//     bias / ReLU / residual, one store. Reads half the bytes of the fp16 kernel. Launched with PDL (launch.h).
//   * otherwise (prefill, fp32, odd K): q is dequantized to x's dtype into a scratch (N, K) tensor from PyTorch's
//     caching allocator (the same block serves every layer of a size class) and linear_epilogue_cuda (cuBLASLt with
//     its bias / ReLU / residual epilogues) runs on it. Extra traffic: N K (1 + 2) bytes per call.
// Nothing syncs the host: both paths can be captured in CUDA graphs.
#include "fuseinfer.h"
#include "int8_kernels.cuh"
#include "launch.h"
#include "quant.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <atomic>

namespace fuseinfer {
namespace {

std::atomic<int64_t> gemv_calls{0}, dequant_calls{0};

template <typename T, int NT, bool TAIL>
void launch_skinny(const int8::SkinnyParams& p, cudaStream_t stream) {
  constexpr int kElemsPerBlock = 64 * int8::unroll<NT>();
  const int tiles = (p.n + int8::kRows - 1) / int8::kRows;
  const int k_blocks = (p.k + kElemsPerBlock - 1) / kElemsPerBlock;
  // as linear.cu: 16 warps per block while there are fewer tiles than two per SM, else 8; never more warps than
  // k-blocks; one wave, at most one block per tile
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int warps = std::max(1, std::min(tiles < 2 * sms ? int8::kMaxWarps : 8, k_blocks));
  const auto kernel = int8::skinny_kernel<T, NT, TAIL>;
  const int resident = sms * blocks_per_sm(reinterpret_cast<const void*>(kernel), 32 * warps);
  launch_kernel(kernel, std::min(tiles, resident), 32 * warps, 0, stream, p);
}

template <typename T, int NT>
void launch_skinny(const int8::SkinnyParams& p, cudaStream_t stream) {
  if ((p.k / 16) % (4 * int8::unroll<NT>()) != 0) {
    launch_skinny<T, NT, true>(p, stream);
  } else {
    launch_skinny<T, NT, false>(p, stream);
  }
}

template <typename T>
void launch_skinny(const int8::SkinnyParams& p, cudaStream_t stream) {
  if (p.m <= 8) {
    launch_skinny<T, 1>(p, stream);
  } else {
    launch_skinny<T, 2>(p, stream);
  }
}

bool gemv_supported(const at::Tensor& x, const at::Tensor& q, int64_t m) {
  const auto dtype = x.scalar_type();
  return m <= int8::kMaxM && (dtype == at::kHalf || dtype == at::kBFloat16) && x.size(1) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 &&
         at::cuda::getCurrentDeviceProperties()->major >= 8;
}

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

at::Tensor int8_linear_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                            const std::string& activation) {
  TORCH_CHECK(activation == "none" || activation == "relu",
              "int8_linear: activation must be 'none' or 'relu', got '", activation, "'");
  const bool relu = activation == "relu";
  const at::Tensor* b = defined_or_null(bias);
  const at::Tensor* r = defined_or_null(residual);
  TORCH_CHECK(!(relu && r), "int8_linear: relu cannot be combined with a residual");
  TORCH_CHECK(x.is_cuda() && qweight.device() == x.device() && scale.device() == x.device(),
              "int8_linear: x, qweight and scale must be on one CUDA device");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1),
              "int8_linear: x must be (M, K) and qweight (N, K), got ", x.sizes(), " and ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "int8_linear: qweight must be int8");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "int8_linear: x must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(x.is_contiguous() && qweight.is_contiguous(), "int8_linear: x and qweight must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "int8_linear: scale must be a contiguous (N,) float32 tensor");
  if (b) {
    TORCH_CHECK(b->device() == x.device() && b->scalar_type() == dtype, "int8_linear: bias must match x");
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n && b->is_contiguous(), "int8_linear: bias must be (N,)");
  }
  if (r) {
    TORCH_CHECK(r->device() == x.device() && r->scalar_type() == dtype, "int8_linear: residual must match x");
    TORCH_CHECK(r->dim() == 2 && r->size(0) == m && r->size(1) == n && r->is_contiguous(),
                "int8_linear: residual must be contiguous (M, N)");
  }
  TORCH_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, "int8_linear: dimension too large");

  const at::cuda::CUDAGuard guard(x.device());
  if (m > 0 && n > 0 && k > 0 && gemv_supported(x, qweight, m)) {
    ++gemv_calls;
    at::Tensor y = at::empty({m, n}, x.options());
    int8::SkinnyParams p;
    p.x = x.data_ptr();
    p.w = qweight.data_ptr();
    p.scale = scale.data_ptr<float>();
    p.bias = b ? b->data_ptr() : nullptr;
    p.residual = r ? r->data_ptr() : nullptr;
    p.y = y.data_ptr();
    p.m = static_cast<int>(m);
    p.n = static_cast<int>(n);
    p.k = static_cast<int>(k);
    p.relu = relu;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (dtype == at::kHalf) {
      launch_skinny<__half>(p, stream);
    } else {
      launch_skinny<__nv_bfloat16>(p, stream);
    }
    return y;
  }
  ++dequant_calls;
  // (M = 0, N = 0 and K = 0 are handled by linear_epilogue_cuda, on an empty or zero-size scratch weight)
  const at::Tensor w = int8_dequantize_cuda(qweight, scale, dtype);  // (N, K) scratch
  return linear_epilogue_cuda(x, w, bias, residual, activation);
}

std::map<std::string, int64_t> int8_path_counts() {
  return {{"gemv", gemv_calls.load()}, {"dequant_gemm", dequant_calls.load()}};
}

}  // namespace fuseinfer
