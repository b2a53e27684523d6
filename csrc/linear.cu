// Linear layer with a fused epilogue: y = act(x @ w^T + bias + residual), one store of y.
//
// Two paths, chosen by the number of tokens M:
//   * M > 16 (prefill), or any fp32 / unaligned input: cuBLASLt. Row-major y (M, N) is the
//     column-major matrix y^T (N x M, ld N), so we ask for y^T = w . x^T: A = w as a column-major K x N matrix
//     (ld K) with transa = T, B = x as a column-major K x M matrix (ld K), C = residual and D = y as N x M
//     (ld N). The bias (length N = rows of D) and ReLU run in the BIAS / RELU_BIAS epilogues, the residual as
//     beta = 1 with C = residual (C != D). Everything accumulates in fp32 (CUBLAS_COMPUTE_32F; no TF32 for fp32
//     inputs, PyTorch's default). The algorithm is chosen once per problem (shape, dtype, epilogue, residual,
//     pointer alignments, device, workspace size) and cached: for M >= kTuneMinM the first call times the
//     heuristic's first kTuneCandidates algorithms on its own operands and keeps the fastest (its first choice
//     was 1-5% slower than another of its list at OPT-1.3b prefill shapes on the H100, docs/notes.md); otherwise, with
//     FUSEINFER_GEMM_TUNE=0, or while the stream is captured into a CUDA graph (no timing possible; not cached, so
//     a later eager call tunes), the heuristic's first choice.
//   * fp16/bf16 with M <= 16 (decode): the weight-streaming tensor-core kernel of skinny_gemv.cuh with fp16/bf16
//     weight chunks (skinny::HalfWeights). Reading w once is the whole cost.
//   * outputs of at most kTinyOutputs elements that the GEMV does not take: ATen in fp32, rounded once (see there).
// Activation "silu_mul" (the gated MLP's fused gate/up weight w (2F, K), gate rows first): y (M, F) = silu(gate) * up.
// At decode the GEMV computes it in its epilogue (one kernel, no (M, 2F) intermediate); at prefill sizes on sm_90 the
// GEMM of silu_gemm_sm90.cu can (one kernel; opt-in, FUSEINFER_SILU_GEMM=1: not faster than the pair at most sizes
// measured); elsewhere, or with FUSEINFER_GEMV_EPILOGUES=0, the linear and then the op fuseinfer_C::silu_mul
// (silu_mul.cu). All round alike (gate and up to the dtype, then as silu_mul): the GEMV and the pair agree bit for
// bit, the sm_90 GEMM sums k in another order. The GEMV, cuBLASLt and sm_90 GEMM paths allocate nothing but y (and
// an aligned copy of a misaligned bias; cuBLASLt's workspace is PyTorch's cached per-stream one), the tiny path's fp32
// temporaries come from PyTorch's caching allocator; none syncs the host, so every path can be captured in a CUDA
// graph.
#include "knobs.h"
#include "norm_ops.h"
#include "path_counts.h"
#include "skinny_gemv.cuh"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace fuseinfer {
namespace {

#define FUSEINFER_CUBLASLT_CHECK(expr)                                                                  \
  do {                                                                                                  \
    const cublasStatus_t status_ = (expr);                                                             \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "linear_epilogue: ", #expr, " failed with status ", \
                static_cast<int>(status_), " (", cublasLtGetStatusString(status_), ")");              \
  } while (0)

// ------------------------------------------------------------------------------------------------------------
// cuBLASLt path.
// ------------------------------------------------------------------------------------------------------------

struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  ~MatmulDesc() { if (desc) cublasLtMatmulDescDestroy(desc); }
};
struct Layout {
  cublasLtMatrixLayout_t desc = nullptr;
  ~Layout() { if (desc) cublasLtMatrixLayoutDestroy(desc); }
};
struct Preference {
  cublasLtMatmulPreference_t desc = nullptr;
  ~Preference() { if (desc) cublasLtMatmulPreferenceDestroy(desc); }
};

// Largest power of two (<= 256, cuBLASLt's default assumption) that divides the address.
uint32_t alignment_of(const void* ptr) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  uint32_t align = 256;
  while (align > 1 && addr % align != 0) align /= 2;
  return align;
}

// (m, n, k, data type, epilogue, has residual, alignment of A, B, C, D, device, workspace size)
using AlgoKey = std::array<int64_t, 12>;

constexpr int64_t kTuneMinM = 512;  // tune prefill-sized problems only: the gain is a few % of a >= 10 us GEMM
constexpr int kTuneCandidates = 8;  // the heuristic listed 7-8 at the OPT shapes swept (efb007a's sweep)

std::mutex& algo_cache_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<AlgoKey, cublasLtMatmulAlgo_t>& algo_cache() {
  static std::map<AlgoKey, cublasLtMatmulAlgo_t> cache;
  return cache;
}

// Index of the fastest of the heuristic's `found` algorithms: each is run once (warm-up), then timed over
// kTuneReps back-to-back calls, in two alternated rounds, and the best round counts. The calls write y, which the
// caller's final call overwrites (C != D, so repeated calls are idempotent). One that fails to run is skipped.
template <typename Matmul>
int tune_algorithm(const cublasLtMatmulHeuristicResult_t* results, int found, const Matmul& matmul,
                   const at::cuda::CUDAStream& stream) {
  constexpr int kTuneReps = 10, kTuneRounds = 2;
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);  // timing events, destroyed on any exit
  std::array<float, kTuneCandidates> best_ms;
  best_ms.fill(INFINITY);
  for (int i = 0; i < found; ++i) {
    if (matmul(results[i].algo) != CUBLAS_STATUS_SUCCESS) best_ms[i] = NAN;  // NaN: never chosen, never re-run
  }
  for (int round = 0; round < kTuneRounds; ++round) {
    for (int i = 0; i < found; ++i) {
      if (std::isnan(best_ms[i])) continue;
      start.record(stream);
      for (int rep = 0; rep < kTuneReps; ++rep) FUSEINFER_CUBLASLT_CHECK(matmul(results[i].algo));
      stop.record(stream);
      stop.synchronize();
      best_ms[i] = std::min(best_ms[i], start.elapsed_time(stop));
    }
  }
  int best = -1;  // ties keep the heuristic's earlier choice
  for (int i = 0; i < found; ++i) {
    if (!std::isnan(best_ms[i]) && (best < 0 || best_ms[i] < best_ms[best])) best = i;
  }
  return std::max(best, 0);  // none ran: the first, whose call then reports the error
}

void cublaslt_linear(const at::Tensor& x, const at::Tensor& w, const void* bias, const at::Tensor* residual,
                     bool relu, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const auto dtype = x.scalar_type();
  const cudaDataType_t data_type =
      dtype == at::kHalf ? CUDA_R_16F : dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute_type = CUBLAS_COMPUTE_32F;
  const cublasLtEpilogue_t epilogue =
      bias ? (relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
           : (relu ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT);
  const void* c_ptr = residual ? residual->data_ptr() : y.data_ptr();
  const float alpha = 1.f;
  const float beta = residual ? 1.f : 0.f;

  MatmulDesc op;
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&op.desc, compute_type, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  FUSEINFER_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  FUSEINFER_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  FUSEINFER_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (bias) {
    FUSEINFER_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }

  // Column-major views: A = w (K x N, ld K), B = x (K x M, ld K), C = residual and D = y (N x M, ld N).
  Layout a, b, c, d;
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&a.desc, data_type, k, n, k));
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&b.desc, data_type, k, m, k));
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&c.desc, data_type, n, m, n));
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&d.desc, data_type, n, m, n));

  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  const uint32_t align_a = alignment_of(w.data_ptr()), align_b = alignment_of(x.data_ptr()),
                 align_c = alignment_of(c_ptr), align_d = alignment_of(y.data_ptr());

  const AlgoKey key = {m, n, k, static_cast<int64_t>(data_type), static_cast<int64_t>(epilogue),
                       residual != nullptr, align_a, align_b, align_c, align_d, x.get_device(),
                       static_cast<int64_t>(workspace_size)};
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    const std::lock_guard<std::mutex> lock(algo_cache_mutex());
    const auto it = algo_cache().find(key);
    if (it != algo_cache().end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (cached) count_path(Path::kLinearLtCached);
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  auto matmul = [&](const cublasLtMatmulAlgo_t& al) {
    return cublasLtMatmul(handle, op.desc, &alpha, w.data_ptr(), a.desc, x.data_ptr(), b.desc, &beta, c_ptr, c.desc,
                          y.data_ptr(), d.desc, &al, workspace, workspace_size, stream);
  };
  if (!cached) {
    Preference pref;
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref.desc));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_size, sizeof(workspace_size)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));
    // No split-K algorithm that reduces its partial sums in the output type: with fp16 output the product was
    // rounded to fp16 before the bias epilogue, and a bias that cancels the product left that rounding error in a
    // small result (1x9 @ 9x1 fp16: 0.0420 against 0.0417). Only split-K reductions in the compute type (fp32) stay:
    // in-place ones add the parts up in the output buffer, in its type.
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;  // (in-place reduces in the output buffer)
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions, sizeof(reductions)));
    std::array<cublasLtMatmulHeuristicResult_t, kTuneCandidates> results = {};
    int found = 0;
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, op.desc, a.desc, b.desc, c.desc, d.desc,
                                                            pref.desc, kTuneCandidates, results.data(), &found));
    TORCH_CHECK(found > 0, "linear_epilogue: cuBLASLt has no algorithm for M=", m, " N=", n, " K=", k,
                " dtype ", dtype);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    algo = results[0].algo;
    const bool tune = !capturing && found > 1 && m >= kTuneMinM && knob(Knob::kGemmTune) != 0;
    if (tune) algo = results[tune_algorithm(results.data(), found, matmul, stream)].algo;
    count_path(capturing ? Path::kLinearLtCaptured : tune ? Path::kLinearLtTuned : Path::kLinearLtHeuristic);
    if (!capturing) {
      const std::lock_guard<std::mutex> lock(algo_cache_mutex());
      algo_cache().emplace(key, algo);
    }
  }

  FUSEINFER_CUBLASLT_CHECK(matmul(algo));
}

}  // namespace

// silu_gemm_sm90.cu: y (M, F) = silu(x @ w[:F]^T) * (x @ w[F:]^T); false (nothing launched) where it does not apply
bool silu_gemm_sm90(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);

constexpr int64_t kTinyOutputs = 64;  // outputs (M N) up to which linear_epilogue computes in fp32 with ATen (below)

namespace {

const at::Tensor* defined_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// The op fuseinfer_C::silu_mul (silu_mul.cu), called through the dispatcher: (..., 2F) -> (..., F).
at::Tensor silu_mul_op(const at::Tensor& gate_up) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fuseinfer_C::silu_mul", "")
                             .typed<at::Tensor(const at::Tensor&)>();
  return op.call(gate_up);
}

// linear_epilogue, or with `norm` (which rms_norm_linear_cuda / layer_norm_linear_cuda have checked the decode GEMV
// takes) the GEMV with the norm prologue over x's un-normalised rows.
at::Tensor linear_epilogue_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& residual, const std::string& activation,
                                const norm_ops::Norm* norm);

// The w8a16_linear op (w8a16_linear.cu) through the dispatcher.
at::Tensor w8a16_linear_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                           const std::string& activation) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fuseinfer_C::w8a16_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                               const std::string&)>();
  return op.call(x, qweight, scale, bias, residual, activation);
}

}  // namespace

at::Tensor linear_epilogue_cuda(
    const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, const std::string& activation) {
  return linear_epilogue_impl(x, w, bias, residual, activation, nullptr);
}

// linear_epilogue(RMSNorm(x) with norm_weight and eps, w, bias, residual, activation): at decode (the skinny GEMV's
// sizes, fp16 / bf16, FUSEINFER_GEMV_EPILOGUES on, the staged rows fitting shared memory) one kernel, the GEMV with
// the RMSNorm prologue, which rounds as add_rms_norm does; elsewhere add_rms_norm, then linear_epilogue.
at::Tensor rms_norm_linear_cuda(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& w,
                                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                                const std::string& activation) {
  TORCH_CHECK(x.dim() == 2 && norm_weight.dim() == 1 && norm_weight.size(0) == x.size(1),
              "rms_norm_linear: x must be (M, K) and norm_weight (K,), got ", x.sizes(), " and ", norm_weight.sizes());
  TORCH_CHECK(norm_weight.device() == x.device() && norm_weight.scalar_type() == x.scalar_type(),
              "rms_norm_linear: norm_weight must match x");
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), k = x.size(1);
  const at::cuda::CUDAGuard guard(x.device());
  const norm_ops::Norm norm{skinny::kRmsNorm, &norm_weight, nullptr, eps};
  const bool fold = (dtype == at::kHalf || dtype == at::kBFloat16) && x.is_cuda() && w.device() == x.device() &&
                    w.dim() == 2 && w.size(1) == k && w.scalar_type() == dtype && x.is_contiguous() &&
                    w.is_contiguous() && norm.prologue_reads(x) && m > 0 && k > 0 &&
                    w.size(0) > 0 && w.size(0) <= INT32_MAX && k <= INT32_MAX && knob(Knob::kGemvEpilogues) != 0 &&
                    skinny::norm_fits(m, k) && skinny::supported<skinny::HalfWeights>(x, w, m);
  if (!fold) {
    const at::Tensor nw = norm_weight.contiguous();
    return linear_epilogue_cuda(norm_ops::apply(x.contiguous(), {skinny::kRmsNorm, &nw, nullptr, eps}), w, bias,
                                residual, activation);
  }
  return linear_epilogue_impl(x, w, bias, residual, activation, &norm);
}

// linear_epilogue (w in x's dtype) or w8a16_linear (w int8 with fp32 per-row scales) of LayerNorm(x) with ln_weight,
// ln_bias and eps: at decode (the skinny GEMV's sizes, fp16 / bf16, FUSEINFER_GEMV_EPILOGUES on, the staged rows
// fitting shared memory, activation "none" or "relu") one kernel, the GEMV with the LayerNorm prologue, which
// rounds as add_layer_norm does; elsewhere add_layer_norm, then the linear op.
at::Tensor layer_norm_linear_cuda(const at::Tensor& x, const at::Tensor& ln_weight, const at::Tensor& ln_bias,
                                  double eps, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                                  const std::string& activation) {
  TORCH_CHECK(x.dim() == 2 && ln_weight.dim() == 1 && ln_weight.size(0) == x.size(1) &&
                  ln_bias.sizes() == ln_weight.sizes(),
              "layer_norm_linear: x must be (M, K) and ln_weight, ln_bias (K,), got ", x.sizes(), ", ",
              ln_weight.sizes(), " and ", ln_bias.sizes());
  TORCH_CHECK(ln_weight.device() == x.device() && ln_weight.scalar_type() == x.scalar_type() &&
                  ln_bias.device() == x.device() && ln_bias.scalar_type() == x.scalar_type(),
              "layer_norm_linear: ln_weight and ln_bias must match x");
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(!int8 || defined_or_null(scale) != nullptr, "layer_norm_linear: int8 weights need their scales");
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), k = x.size(1);
  const at::cuda::CUDAGuard guard(x.device());
  const norm_ops::Norm norm{skinny::kLayerNorm, &ln_weight, &ln_bias, eps};
  const bool fold = (dtype == at::kHalf || dtype == at::kBFloat16) && x.is_cuda() && w.device() == x.device() &&
                    w.dim() == 2 && w.size(1) == k && (int8 || w.scalar_type() == dtype) && x.is_contiguous() &&
                    w.is_contiguous() && norm.prologue_reads(x) && activation != "silu_mul" && m > 0 && k > 0 &&
                    w.size(0) > 0 && w.size(0) <= INT32_MAX && k <= INT32_MAX && knob(Knob::kGemvEpilogues) != 0 &&
                    skinny::norm_fits(m, k, skinny::kLayerNorm) &&
                    (int8 ? skinny::supported<skinny::Int8Weights>(x, w, m)
                          : skinny::supported<skinny::HalfWeights>(x, w, m));
  if (!fold) {
    const at::Tensor nw = ln_weight.contiguous(), nb = ln_bias.contiguous();
    const at::Tensor y = norm_ops::apply(x.contiguous(), {skinny::kLayerNorm, &nw, &nb, eps});
    return int8 ? w8a16_linear_op(y, w, *scale, bias, residual, activation)
                : linear_epilogue_cuda(y, w, bias, residual, activation);
  }
  if (int8) return w8a16_linear_folded(x, w, *scale, bias, residual, activation, norm);
  return linear_epilogue_impl(x, w, bias, residual, activation, &norm);
}

namespace {

at::Tensor linear_epilogue_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& residual, const std::string& activation,
                                const norm_ops::Norm* norm) {
  TORCH_CHECK(activation == "none" || activation == "relu" || activation == "silu_mul",
              "linear_epilogue: activation must be 'none', 'relu' or 'silu_mul', got '", activation, "'");
  const bool relu = activation == "relu";
  const bool silu = activation == "silu_mul";
  const at::Tensor* b = defined_or_null(bias);
  const at::Tensor* r = defined_or_null(residual);
  TORCH_CHECK(!((relu || silu) && r), "linear_epilogue: an activation cannot be combined with a residual");
  TORCH_CHECK(x.is_cuda() && w.device() == x.device(), "linear_epilogue: x and w must be on one CUDA device");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_epilogue: x must be (M, K) and w (N, K), got ", x.sizes(), " and ", w.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "linear_epilogue: dtype must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(w.scalar_type() == dtype, "linear_epilogue: w must have x's dtype");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_epilogue: x and w must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  if (b) {
    TORCH_CHECK(b->device() == x.device() && b->scalar_type() == dtype, "linear_epilogue: bias must match x");
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n && b->is_contiguous(), "linear_epilogue: bias must be (N,)");
  }
  if (r) {
    TORCH_CHECK(r->device() == x.device() && r->scalar_type() == dtype, "linear_epilogue: residual must match x");
    TORCH_CHECK(r->dim() == 2 && r->size(0) == m && r->size(1) == n && r->is_contiguous(),
                "linear_epilogue: residual must be contiguous (M, N)");
  }

  TORCH_CHECK(!silu || n % 2 == 0, "linear_epilogue: silu_mul needs an even number of weight rows (gate, up), got ",
              n);

  const at::cuda::CUDAGuard guard(x.device());
  if (silu) {
    if (m > 0 && n > 0 && k > 0 && m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX &&
        knob(Knob::kGemvEpilogues) != 0 && skinny::supported<skinny::HalfWeights>(x, w, m)) {
      count_path(Path::kLinearSkinny);
      at::Tensor y = at::empty({m, n / 2}, x.options());
      const skinny::NormParams np = norm ? norm->params() : skinny::NormParams{};
      skinny::run<skinny::HalfWeights>(x, w, nullptr, b, nullptr, false, y, /*silu=*/true, norm ? &np : nullptr,
                                       norm ? norm->kind : skinny::kRmsNorm);
      return y;
    }
    TORCH_CHECK(norm == nullptr, "linear_epilogue: the norm prologue without the decode GEMV");
    // prefill sizes on sm_90: one GEMM with silu(gate) * up in its epilogue (decode sizes: the GEMV, or with
    // FUSEINFER_GEMV_EPILOGUES=0 the GEMV and then silu_mul)
    // (the knob first: off by default, the output is not allocated for nothing)
    if (knob(Knob::kSiluGemm) != 0 && b == nullptr && m > 0 && n > 0 && k > 0 &&
        !skinny::supported<skinny::HalfWeights>(x, w, m)) {
      at::Tensor y = at::empty({m, n / 2}, x.options());
      if (silu_gemm_sm90(x, w, y)) return y;
    }
    return silu_mul_op(linear_epilogue_cuda(x, w, bias, residual, "none"));  // (M, 2F) -> (M, F)
  }
  TORCH_CHECK(norm == nullptr || (m > 0 && n > 0 && k > 0), "linear_epilogue: the norm prologue on empty operands");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) {  // empty product: only the epilogue remains
    y.zero_();
    if (b) y.add_(*b);
    if (r) y.add_(*r);
    return relu ? y.relu_() : y;
  }
  TORCH_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, "linear_epilogue: dimension too large");

  if (skinny::supported<skinny::HalfWeights>(x, w, m)) {
    count_path(Path::kLinearSkinny);
    const skinny::NormParams np = norm ? norm->params() : skinny::NormParams{};
    skinny::run<skinny::HalfWeights>(x, w, nullptr, b, r, relu, y, /*silu=*/false, norm ? &np : nullptr,
                                     norm ? norm->kind : skinny::kRmsNorm);
    return y;
  }
  TORCH_CHECK(norm == nullptr, "linear_epilogue: the norm prologue without the decode GEMV");

  // Outputs of a few elements (a row times a column or two, where the GEMV does not apply: K % 8 != 0, a misaligned
  // row, fp32; K < 16 does not get here, the Python op computes it in fp32 itself): cuBLASLt's heuristic picks
  // reduction kernels there, some of which round the product to the output type before the bias epilogue (x 1 x 17 @
  // w 1 x 17 fp16 with a bias came out one unit in the last place off, far from a tie, in one draw of ten; the
  // split-K preference below does not exclude them). ATen in fp32 instead, rounded once.
  if (m * n <= kTinyOutputs) {
    at::Tensor acc = at::matmul(x.to(at::kFloat), w.to(at::kFloat).t());  // (M, N)
    if (b) acc.add_(b->to(at::kFloat));
    if (r) acc.add_(r->to(at::kFloat));
    if (relu) acc.relu_();
    y.copy_(acc);
    count_path(Path::kLinearTiny);
    return y;
  }
  // cuBLASLt's alignment preferences cover A, B, C and D but not the bias, whose kernels may assume 16 bytes:
  // a bias sliced out of a larger buffer gets an aligned copy (N elements, negligible).
  at::Tensor bias_aligned;
  if (b) bias_aligned = reinterpret_cast<uintptr_t>(b->data_ptr()) % 16 == 0 ? *b : b->clone();
  cublaslt_linear(x, w, b ? bias_aligned.data_ptr() : nullptr, r, relu, y);
  return y;
}

}  // namespace

// rms_norm_linear(x, norm_weight, eps, w, bias, residual, activation) = linear_epilogue(y, w, bias, residual,
// activation) with y = add_rms_norm(x, None, norm_weight, eps) (rms_norm.cu): x (M, K), norm_weight (K,) in x's dtype.
// layer_norm_linear(x, ln_weight, ln_bias, eps, w, scale, bias, residual, activation) = linear_epilogue(y, w, bias,
// residual, activation) (w in x's dtype, scale None) or w8a16_linear(y, w, scale, bias, residual, activation) (w int8,
// scale (N,) fp32) with y = add_layer_norm(x, None, ln_weight, ln_bias, eps) (layer_norm.cu): x (M, K), ln_weight and
// ln_bias (K,) in x's dtype.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("linear_epilogue(Tensor x, Tensor w, Tensor? bias, Tensor? residual, str activation) -> Tensor");
  m.def("rms_norm_linear(Tensor x, Tensor norm_weight, float eps, Tensor w, Tensor? bias, Tensor? residual, "
        "str activation) -> Tensor");
  m.def("layer_norm_linear(Tensor x, Tensor ln_weight, Tensor ln_bias, float eps, Tensor w, Tensor? scale, "
        "Tensor? bias, Tensor? residual, str activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("linear_epilogue", &linear_epilogue_cuda);
  m.impl("rms_norm_linear", &rms_norm_linear_cuda);
  m.impl("layer_norm_linear", &layer_norm_linear_cuda);
}

}  // namespace fuseinfer
