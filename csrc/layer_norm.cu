// Fused residual add + LayerNorm: s = x + residual (rounded to x's dtype), y = LayerNorm(s) * weight + bias.
//
// One pass over memory: every row is loaded once into registers (x and residual read, s optionally written),
// its mean and biased variance are reduced in fp32 from those registers (two-pass: mean first, then the sum of
// squared deviations, so no E[x^2] - E[x]^2 cancellation), and y is written from the same registers.
//
// Work split (chosen on the host from the row length and the row count, see pick_config and vector_config):
//   * a row of at most 32 * VPT vectors: one warp per row, 4 rows per 128-thread block, shuffle reductions;
//   * a longer row: one block of 32 * WPR threads per row, shuffle + shared-memory reductions; spread over
//     more threads (fewer vectors each) when the rows fit in one wave anyway.
// VPT (vectors per thread) is a template parameter so the row lives in a fixed-size register array (kept in
// the input dtype, widened to fp32 on the fly in each pass). All loads of a row (x, residual, and on the vector
// paths with at most 64 bytes of row per thread also weight and bias) are issued before the first store or
// reduction, so each thread has them in flight at once; otherwise weight and bias are loaded in the last pass.
// A "vector" is 16 bytes (8 fp16/bf16 or 4 fp32) when N is a multiple of that and every pointer is 16-byte
// aligned; otherwise the scalar instantiation (vector = 1 element) serves any N and any alignment.
// Thread t of a row holds vectors t, t + T, t + 2T, ... (T = threads per row), so each load instruction of a
// warp touches 32 consecutive vectors (coalesced). Launched with PDL (launch.h).
#include "device_utils.cuh"
#include "fuseinfer.h"
#include "launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fuseinfer {
namespace {

constexpr int kMaxN = 16384;             // largest supported hidden size
constexpr int kMaxElemsPerThread = 32;   // row elements per thread on the vector paths (4 x 8 or 8 x 4)
constexpr int kMaxScalarPerThread = 16;  // same for the scalar path: 1024 threads * 16 = kMaxN
constexpr int kWarpRowsPerBlock = 4;     // rows per block in the warp-per-row layout

// VEC elements of T moved as one load/store (16 bytes for the vector paths, one element for the scalar path).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// fp32 <-> T for a pair (one instruction for two 16-bit values; single elements: device_utils.cuh).
__device__ __forceinline__ float2 to_float2(const float* v) { return make_float2(v[0], v[1]); }
__device__ __forceinline__ float2 to_float2(const __half* v) {
  return __half22float2(*reinterpret_cast<const __half2*>(v));
}
// bf16 -> fp32 is exact: a bf16 is the top half of an fp32, so a pair widens with one shift and one mask.
__device__ __forceinline__ float2 to_float2(const __nv_bfloat16* v) {
  const unsigned u = *reinterpret_cast<const unsigned*>(v);
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}

__device__ __forceinline__ void from_float2(float* out, float lo, float hi) { out[0] = lo; out[1] = hi; }
__device__ __forceinline__ void from_float2(__half* out, float lo, float hi) {
  *reinterpret_cast<__half2*>(out) = __floats2half2_rn(lo, hi);
}
__device__ __forceinline__ void from_float2(__nv_bfloat16* out, float lo, float hi) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(lo, hi);
}

// Pack -> fp32 array and back (round to nearest even), pairwise where VEC is even.
template <typename T, int VEC>
__device__ __forceinline__ void widen(const Pack<T, VEC>& in, float (&out)[VEC]) {
  if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const float2 f = to_float2(&in.v[j]);
      out[j] = f.x;
      out[j + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = to_float(in.v[j]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> narrow(const float (&in)[VEC]) {
  Pack<T, VEC> out;
  if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) from_float2(&out.v[j], in[j], in[j + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = from_float<T>(in[j]);
  }
  return out;
}

struct Params {
  const void* x;         // (rows, n)
  const void* residual;  // (rows, n) or null
  const void* weight;    // (n,) or null
  const void* bias;      // (n,) or null
  void* y;               // (rows, n)
  void* sum;             // (rows, n) or null (store_sum false)
  int64_t rows;
  int n;                 // row length in elements
  float eps;
};

// Sum of v over the threads of one row (blockDim.x of them). With one warp per row there is no shared memory
// and no barrier, so a warp whose row is out of range may return early. `scratch` holds one float per warp and
// must not be reused by a later call (each call gets its own array, which saves a second barrier).
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// Read-only load through the non-coherent (texture) path; one 128-bit instruction for a 16-byte pack.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const Pack<T, VEC>* ptr) {
  Pack<T, VEC> out;
  if constexpr (sizeof(Pack<T, VEC>) == 16) {
    *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(ptr));
  } else {
    out.v[0] = __ldg(&ptr->v[0]);
  }
  return out;
}

// Scalar path may need 1024 threads per row (16 elements each for N = 16384); the vector paths need at most
// 512 (4096 16-byte vectors / 8 per thread), which leaves them up to 128 registers per thread.
template <int VEC>
constexpr int max_threads() { return VEC == 1 ? 1024 : 512; }

// grid: warp-per-row layout: ceil(rows / blockDim.y) blocks of (32, kWarpRowsPerBlock);
//       block-per-row layout: rows blocks of (32 * WPR, 1).
template <typename T, int VEC, int VPT>
__global__ void __launch_bounds__(max_threads<VEC>(), 1) add_layer_norm_kernel(const Params p) {
  using P = Pack<T, VEC>;
  __shared__ float scratch_mean[32];
  __shared__ float scratch_var[32];

  pdl_wait();  // x and residual come from earlier kernels
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= p.rows) return;  // only in the warp-per-row layout (block-per-row has exactly `rows` blocks)
  const int tid = threadIdx.x;
  const int tpr = blockDim.x;  // threads per row
  const int nv = p.n / VEC;    // vectors per row (exact: VEC divides n)
  const int64_t base = row * nv;

  const P* __restrict__ x = reinterpret_cast<const P*>(p.x) + base;
  const P* __restrict__ r = p.residual ? reinterpret_cast<const P*>(p.residual) + base : nullptr;
  P* __restrict__ s_out = p.sum ? reinterpret_cast<P*>(p.sum) + base : nullptr;

  // Issue every load of the row before any store so all of them are in flight at once. The row stays in
  // registers as T (s is rounded to T anyway, so nothing is lost), zero past its end; it is widened to fp32
  // on the fly in each pass, which halves the registers of the 16-bit types.
  P a[VPT];
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
    // s = T(x + r): add in fp32 and round once, exactly like eager `x + r`.
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) {
        float fa[VEC], fb[VEC];
        widen(a[i], fa);
        widen(b[i], fb);
#pragma unroll
        for (int j = 0; j < VEC; ++j) fa[j] += fb[j];
        a[i] = narrow<T, VEC>(fa);
      }
    }
  }

  // weight and bias are shared by all rows (L1/L2 hits). On the vector paths, where their packs take at most 16
  // registers each, they are loaded now, so their latency hides behind the reductions instead of being paid
  // per vector at the end (the scalar path's 1024-thread blocks leave no registers for that).
  constexpr bool kPrefetchAffine = VEC > 1 && sizeof(P) * VPT <= 64;
  const P* __restrict__ w = reinterpret_cast<const P*>(p.weight);
  const P* __restrict__ bias = reinterpret_cast<const P*>(p.bias);
  P wv[VPT], bv[VPT];
  if constexpr (kPrefetchAffine) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) {
        if (w) wv[i] = load(w + tid + i * tpr);
        if (bias) bv[i] = load(bias + tid + i * tpr);
      }
    }
  }

  float local = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (s_out && tid + i * tpr < nv) s_out[tid + i * tpr] = a[i];
    float f[VEC];
    widen(a[i], f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) local += f[j];
  }
  const float inv_n = 1.f / static_cast<float>(p.n);
  const float mean = row_sum(local, scratch_mean) * inv_n;

  // Second pass over the registers: sum of squared deviations (biased variance, like torch).
  local = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (tid + i * tpr < nv) {
      float f[VEC];
      widen(a[i], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) local += (f[j] - mean) * (f[j] - mean);
    }
  }
  const float rstd = rsqrtf(row_sum(local, scratch_var) * inv_n + p.eps);

  // The next kernel (PDL) may launch now, with only the normalisation and the stores left: triggered at the start
  // instead, its blocks moved in beside this kernel's while those still loaded and reduced, and 20 add+LN calls of
  // 128 x 4096 in one graph took 3.39 us each instead of 2.63 (H100; torch.compile's kernel 2.98).
  pdl_launch_dependents();

  // y = (s - mean) * rstd * w + b
  P* __restrict__ y = reinterpret_cast<P*>(p.y) + base;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = tid + i * tpr;
    if (idx < nv) {
      float f[VEC];
      widen(a[i], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = (f[j] - mean) * rstd;
      if (w) {
        float fw[VEC];
        widen(kPrefetchAffine ? wv[i] : load(w + idx), fw);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] *= fw[j];
      }
      if (bias) {
        float fb[VEC];
        widen(kPrefetchAffine ? bv[i] : load(bias + idx), fb);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] += fb[j];
      }
      y[idx] = narrow<T, VEC>(f);
    }
  }
}

struct Config {
  int vpt;             // vectors per thread (template argument)
  int threads_per_row; // blockDim.x
  int rows_per_block;  // blockDim.y
};

// Fewest warps per row such that each thread holds at most max_vpt vectors, then the smallest vpt that covers
// the row with that many warps (balances odd lengths, e.g. 257 vectors -> 3 warps x 3 vectors).
Config pick_config(int nv, int max_vpt) {
  const int wpr = (nv + 32 * max_vpt - 1) / (32 * max_vpt);
  const int vpt = (nv + 32 * wpr - 1) / (32 * wpr);
  return {vpt, 32 * wpr, wpr == 1 ? kWarpRowsPerBlock : 1};
}

using Kernel = void (*)(Params);

template <int VEC>
void launch(Kernel kernel, const Params& p, const Config& c, cudaStream_t stream) {
  const int64_t blocks = (p.rows + c.rows_per_block - 1) / c.rows_per_block;
  TORCH_CHECK(blocks <= INT32_MAX, "add_layer_norm: too many rows (", p.rows, ")");
  TORCH_CHECK(c.threads_per_row <= max_threads<VEC>(), "add_layer_norm: row of ", p.n, " elements too long");
  launch_kernel(kernel, static_cast<unsigned>(blocks), dim3(c.threads_per_row, c.rows_per_block), 0, stream, p);
}

// The instantiation whose VPT equals vpt, for VPT in [1, MAX_VPT].
template <typename T, int VEC, int MAX_VPT>
Kernel kernel_for(int vpt) {
  if constexpr (MAX_VPT >= 1) {
    if (vpt == MAX_VPT) return add_layer_norm_kernel<T, VEC, MAX_VPT>;
    return kernel_for<T, VEC, MAX_VPT - 1>(vpt);
  } else {
    TORCH_CHECK(false, "add_layer_norm: no kernel for ", vpt, " vectors per thread");
    return nullptr;
  }
}

// Vector paths: rows of nv vectors. By default each thread holds up to MAX_VPT vectors (fewest threads per row).
// A row already spread over a block (more than one warp) is spread wider, down to one vector per thread, as long
// as every row still gets a block in the first wave: with few rows (a decode step's, or ~1 MB of activations)
// the kernel is one round trip to memory, and more threads per row shorten each thread's chain of loads and
// reductions (H100, N = 4096 fp16, L2 flushed: add+LN of 128 rows 6.2-6.9 -> 5.7 us, 512 rows 9.0 -> 8.2 us).
template <typename T, int VEC, int MAX_VPT>
Config vector_config(int nv, int64_t rows) {
  const Config narrow = pick_config(nv, MAX_VPT);
  if (narrow.rows_per_block != 1) return narrow;  // warp-per-row layout
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
  const bool vectorized = p.n % kVec == 0 && aligned16(p.x) && aligned16(p.y) &&
                          (!p.residual || aligned16(p.residual)) && (!p.sum || aligned16(p.sum)) &&
                          (!p.weight || aligned16(p.weight)) && (!p.bias || aligned16(p.bias));
  if (vectorized) {
    constexpr int kMaxVpt = kMaxElemsPerThread / kVec;  // 4 for fp16/bf16, 8 for fp32
    const Config c = vector_config<T, kVec, kMaxVpt>(p.n / kVec, p.rows);
    launch<kVec>(kernel_for<T, kVec, kMaxVpt>(c.vpt), p, c, stream);
    return;
  }
  // Scalar path: only power-of-two VPTs are instantiated (it serves odd sizes and misaligned views).
  Config c = pick_config(p.n, kMaxScalarPerThread);
  int vpt = 1;
  while (vpt < c.vpt) vpt *= 2;
  c.vpt = vpt;
  switch (c.vpt) {
    case 1: return launch<1>(add_layer_norm_kernel<T, 1, 1>, p, c, stream);
    case 2: return launch<1>(add_layer_norm_kernel<T, 1, 2>, p, c, stream);
    case 4: return launch<1>(add_layer_norm_kernel<T, 1, 4>, p, c, stream);
    case 8: return launch<1>(add_layer_norm_kernel<T, 1, 8>, p, c, stream);
    case 16: return launch<1>(add_layer_norm_kernel<T, 1, 16>, p, c, stream);
    default: TORCH_CHECK(false, "add_layer_norm: no scalar kernel for ", c.vpt, " elements per thread");
  }
}

void check_param(const c10::optional<at::Tensor>& t, const at::Tensor& x, int64_t n, const char* name) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->device() == x.device(), "add_layer_norm: ", name, " must be on x's device");
  TORCH_CHECK(t->scalar_type() == x.scalar_type(), "add_layer_norm: ", name, " must have x's dtype");
  TORCH_CHECK(t->is_contiguous() && t->numel() == n, "add_layer_norm: ", name, " must be contiguous (N,)");
}

const void* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_layer_norm_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, bool store_sum) {
  TORCH_CHECK(x.is_cuda(), "add_layer_norm: x must be a CUDA tensor");
  TORCH_CHECK(x.dim() >= 1, "add_layer_norm: x must have at least one dimension");
  TORCH_CHECK(x.is_contiguous(), "add_layer_norm: x must be contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "add_layer_norm: dtype must be float16, bfloat16 or float32, got ", dtype);
  const int64_t n = x.size(-1);
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) {
    TORCH_CHECK(residual->device() == x.device(), "add_layer_norm: residual must be on x's device");
    TORCH_CHECK(residual->scalar_type() == dtype, "add_layer_norm: residual must have x's dtype");
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_layer_norm: residual must have x's shape");
    TORCH_CHECK(residual->is_contiguous(), "add_layer_norm: residual must be contiguous");
  }
  check_param(weight, x, n, "weight");
  check_param(bias, x, n, "bias");

  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  at::Tensor s = store_sum ? at::empty_like(x) : at::empty({0}, x.options());
  if (x.numel() == 0) return {y, s};
  TORCH_CHECK(n <= kMaxN, "add_layer_norm: hidden size ", n, " exceeds the supported maximum ", kMaxN);

  Params p;
  p.x = x.data_ptr();
  p.residual = has_residual ? residual->data_ptr() : nullptr;
  p.weight = data_or_null(weight);
  p.bias = data_or_null(bias);
  p.y = y.data_ptr();
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
  return {y, s};
}

}  // namespace fuseinfer
