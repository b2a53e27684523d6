// Fused residual add + LayerNorm + per-token symmetric int8 quantisation, one pass over memory:
//
//   s = x + residual (rounded to x's dtype), y = LayerNorm(s) * weight + bias (rounded to x's dtype),
//   scale = max(amax_n |y| / 127, FLT_MIN)  (fp32, one per row; FLT_MIN keeps an all-zero row's q at 0),
//   q = clamp(round_half_even(y / scale), -127, 127)  (int8),
//
// which is fuseinfer.ops.quant.quantize_int8_ref applied to fuseinfer.ops.layer_norm.add_layer_norm_ref's y (the
// reference next to the op, fuseinfer/ops/layer_norm_quant.py): the int8 activations feed the W8A8 GEMM
// (w8a8_gemm_sm90.cu), whose epilogue multiplies by `scale` per token. y itself is never written: the bytes moved
// are x, residual (read), s (written when asked), q (1 byte per element) and one fp32 scale per row.
//
// Structure as csrc/layer_norm.cu (see there for the reasons): a row lives in registers (VPT 16-byte packs per
// thread, in the input dtype), one warp per row up to 32 * VPT packs, else one block per row; loads issued before
// any reduction; two-pass mean / variance in fp32; a third reduction (max) for the scale. The scalar path (vector =
// one element) serves N not a multiple of the pack or unaligned pointers. Launched with PDL (launch.h).
#include "device_utils.cuh"
#include "fuseinfer.h"
#include "launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

namespace fuseinfer {
namespace {

constexpr int kMaxN = 16384;
constexpr int kMaxElemsPerThread = 32;
constexpr int kMaxScalarPerThread = 16;
constexpr int kWarpRowsPerBlock = 4;

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// VEC int8 values stored as one instruction (8 bytes for fp16/bf16 packs, 4 for fp32 packs, 1 for scalars).
template <int VEC>
struct alignas(VEC) QPack {
  int8_t v[VEC];
};

struct Params {
  const void* x;         // (rows, n)
  const void* residual;  // (rows, n) or null
  const void* weight;    // (n,) or null
  const void* bias;      // (n,) or null
  int8_t* q;             // (rows, n)
  float* scale;          // (rows,)
  void* sum;             // (rows, n) or null
  int64_t rows;
  int n;
  float eps;
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const Pack<T, VEC>* ptr) {
  Pack<T, VEC> out;
  if constexpr (sizeof(Pack<T, VEC>) == 16) {
    *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(ptr));
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = ptr->v[j];
  }
  return out;
}

// Reductions over the blockDim.x threads of a row; each call gets its own scratch array (no second barrier).
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.f;
  return warp_sum(v);
}
__device__ __forceinline__ float row_max(float v, float* scratch) {
  v = warp_max(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.f;
  return warp_max(v);
}

template <int VEC>
constexpr int max_threads() { return VEC == 1 ? 1024 : 512; }

template <typename T, int VEC, int VPT>
__global__ void __launch_bounds__(max_threads<VEC>(), 1) layer_norm_quant_kernel(const Params p) {
  using P = Pack<T, VEC>;
  using Q = QPack<VEC>;
  __shared__ float scratch_mean[32];
  __shared__ float scratch_var[32];
  __shared__ float scratch_max[32];

  pdl_wait();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= p.rows) return;  // warp-per-row layout only
  const int tid = threadIdx.x;
  const int tpr = blockDim.x;
  const int nv = p.n / VEC;
  const int64_t base = row * nv;

  const P* __restrict__ x = reinterpret_cast<const P*>(p.x) + base;
  const P* __restrict__ r = p.residual ? reinterpret_cast<const P*>(p.residual) + base : nullptr;
  P* __restrict__ s_out = p.sum ? reinterpret_cast<P*>(p.sum) + base : nullptr;

  P a[VPT];  // the row (its part for this thread), zero past the end
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (tid + i * tpr < nv) {
      a[i] = load(x + tid + i * tpr);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) a[i].v[j] = from_float<T>(0.f);
    }
  }
  if (r) {
    P b[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) b[i] = load(r + tid + i * tpr);
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) a[i].v[j] = from_float<T>(to_float(a[i].v[j]) + to_float(b[i].v[j]));
      }
    }
  }

  float local = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (s_out && tid + i * tpr < nv) s_out[tid + i * tpr] = a[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) local += to_float(a[i].v[j]);
  }
  const float inv_n = 1.f / static_cast<float>(p.n);
  const float mean = row_sum(local, scratch_mean) * inv_n;
  local = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (tid + i * tpr < nv) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = to_float(a[i].v[j]) - mean;
        local += d * d;
      }
    }
  }
  const float rstd = rsqrtf(row_sum(local, scratch_var) * inv_n + p.eps);
  pdl_launch_dependents();

  // y = (s - mean) * rstd * w + b, rounded to T (as the reference's y), kept in a[]; amax over the row
  const P* __restrict__ w = reinterpret_cast<const P*>(p.weight);
  const P* __restrict__ bias = reinterpret_cast<const P*>(p.bias);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = tid + i * tpr;
    if (idx < nv) {
      P wv, bv;
      if (w) wv = load(w + idx);
      if (bias) bv = load(bias + idx);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float f = (to_float(a[i].v[j]) - mean) * rstd;
        if (w) f *= to_float(wv.v[j]);
        if (bias) f += to_float(bv.v[j]);
        a[i].v[j] = from_float<T>(f);
        amax = fmaxf(amax, fabsf(to_float(a[i].v[j])));
      }
    }
  }
  amax = row_max(amax, scratch_max);
  // same fp32 operations as quantize_int8_ref: scale = max(amax / 127, FLT_MIN), q = round(y / scale)
  const float scale = fmaxf(amax / 127.f, FLT_MIN);
  if (tid == 0) p.scale[row] = scale;

  Q* __restrict__ q = reinterpret_cast<Q*>(p.q) + base;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = tid + i * tpr;
    if (idx < nv) {
      Q out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float v = fminf(fmaxf(rintf(__fdiv_rn(to_float(a[i].v[j]), scale)), -127.f), 127.f);
        out.v[j] = static_cast<int8_t>(v);
      }
      q[idx] = out;
    }
  }
}

struct Config {
  int vpt;
  int threads_per_row;
  int rows_per_block;
};

Config pick_config(int nv, int max_vpt) {
  const int wpr = (nv + 32 * max_vpt - 1) / (32 * max_vpt);
  const int vpt = (nv + 32 * wpr - 1) / (32 * wpr);
  return {vpt, 32 * wpr, wpr == 1 ? kWarpRowsPerBlock : 1};
}

using Kernel = void (*)(Params);

template <int VEC>
void launch(Kernel kernel, const Params& p, const Config& c, cudaStream_t stream) {
  const int64_t blocks = (p.rows + c.rows_per_block - 1) / c.rows_per_block;
  TORCH_CHECK(blocks <= INT32_MAX, "add_layer_norm_quant: too many rows (", p.rows, ")");
  TORCH_CHECK(c.threads_per_row <= max_threads<VEC>(), "add_layer_norm_quant: row of ", p.n, " elements too long");
  launch_kernel(kernel, static_cast<unsigned>(blocks), dim3(c.threads_per_row, c.rows_per_block), 0, stream, p);
}

template <typename T, int VEC, int MAX_VPT>
Kernel kernel_for(int vpt) {
  if constexpr (MAX_VPT >= 1) {
    if (vpt == MAX_VPT) return layer_norm_quant_kernel<T, VEC, MAX_VPT>;
    return kernel_for<T, VEC, MAX_VPT - 1>(vpt);
  } else {
    TORCH_CHECK(false, "add_layer_norm_quant: no kernel for ", vpt, " vectors per thread");
    return nullptr;
  }
}

// As layer_norm.cu's vector_config: rows spread over a block get more threads (fewer packs each) while every row
// still has a block in the first wave.
template <typename T, int VEC, int MAX_VPT>
Config vector_config(int nv, int64_t rows) {
  const Config narrow = pick_config(nv, MAX_VPT);
  if (narrow.rows_per_block != 1) return narrow;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for (int vpt = 1; vpt < MAX_VPT; ++vpt) {
    const Config wide = pick_config(nv, vpt);
    if (wide.vpt != vpt || wide.threads_per_row > max_threads<VEC>()) continue;
    const void* kernel = reinterpret_cast<const void*>(kernel_for<T, VEC, MAX_VPT>(vpt));
    if (static_cast<int64_t>(sms) * blocks_per_sm(kernel, wide.threads_per_row) >= rows) return wide;
  }
  return narrow;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T>
void dispatch(const Params& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  // q's packs are kVec bytes: aligned when q's base is 16-byte aligned and n % kVec == 0
  const bool vectorized = p.n % kVec == 0 && aligned16(p.x) && aligned16(p.q) &&
                          (!p.residual || aligned16(p.residual)) && (!p.sum || aligned16(p.sum)) &&
                          (!p.weight || aligned16(p.weight)) && (!p.bias || aligned16(p.bias));
  if (vectorized) {
    constexpr int kMaxVpt = kMaxElemsPerThread / kVec;
    const Config c = vector_config<T, kVec, kMaxVpt>(p.n / kVec, p.rows);
    launch<kVec>(kernel_for<T, kVec, kMaxVpt>(c.vpt), p, c, stream);
    return;
  }
  Config c = pick_config(p.n, kMaxScalarPerThread);
  int vpt = 1;
  while (vpt < c.vpt) vpt *= 2;
  c.vpt = vpt;
  switch (c.vpt) {
    case 1: return launch<1>(layer_norm_quant_kernel<T, 1, 1>, p, c, stream);
    case 2: return launch<1>(layer_norm_quant_kernel<T, 1, 2>, p, c, stream);
    case 4: return launch<1>(layer_norm_quant_kernel<T, 1, 4>, p, c, stream);
    case 8: return launch<1>(layer_norm_quant_kernel<T, 1, 8>, p, c, stream);
    case 16: return launch<1>(layer_norm_quant_kernel<T, 1, 16>, p, c, stream);
    default: TORCH_CHECK(false, "add_layer_norm_quant: no scalar kernel for ", c.vpt, " elements per thread");
  }
}

void check_param(const c10::optional<at::Tensor>& t, const at::Tensor& x, int64_t n, const char* name) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->device() == x.device(), "add_layer_norm_quant: ", name, " must be on x's device");
  TORCH_CHECK(t->scalar_type() == x.scalar_type(), "add_layer_norm_quant: ", name, " must have x's dtype");
  TORCH_CHECK(t->is_contiguous() && t->numel() == n, "add_layer_norm_quant: ", name, " must be contiguous (N,)");
}

const void* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_quant_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, bool store_sum) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1 && x.is_contiguous(),
              "add_layer_norm_quant: x must be a contiguous CUDA tensor with at least one dimension");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "add_layer_norm_quant: dtype must be float16, bfloat16 or float32, got ", dtype);
  const int64_t n = x.size(-1);
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) {
    TORCH_CHECK(residual->device() == x.device() && residual->scalar_type() == dtype &&
                residual->sizes() == x.sizes() && residual->is_contiguous(),
                "add_layer_norm_quant: residual must be contiguous, with x's device, dtype and shape");
  }
  check_param(weight, x, n, "weight");
  check_param(bias, x, n, "bias");

  const at::cuda::CUDAGuard guard(x.device());
  auto scale_shape = x.sizes().vec();
  scale_shape.back() = 1;
  at::Tensor q = at::empty_like(x, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(scale_shape, x.options().dtype(at::kFloat));
  at::Tensor s = store_sum ? at::empty_like(x) : at::empty({0}, x.options());
  if (x.numel() == 0) return {q, scale, s};
  TORCH_CHECK(n <= kMaxN, "add_layer_norm_quant: hidden size ", n, " exceeds the supported maximum ", kMaxN);

  Params p;
  p.x = x.data_ptr();
  p.residual = has_residual ? residual->data_ptr() : nullptr;
  p.weight = data_or_null(weight);
  p.bias = data_or_null(bias);
  p.q = static_cast<int8_t*>(q.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.sum = store_sum ? s.data_ptr() : nullptr;
  p.rows = x.numel() / n;
  p.n = static_cast<int>(n);
  p.eps = static_cast<float>(eps);

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (dtype) {
    case at::kHalf: dispatch<__half>(p, stream); break;
    case at::kBFloat16: dispatch<__nv_bfloat16>(p, stream); break;
    default: dispatch<float>(p, stream); break;
  }
  return {q, scale, s};
}

}  // namespace fuseinfer
