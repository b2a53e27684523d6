// The row machinery of the fused residual add + LayerNorm / RMSNorm kernels, written once: add_layer_norm
// (layer_norm.cu, stores y), add_layer_norm_quant (layer_norm_quant.cu, stores y quantised to int8 per token) and
// add_rms_norm (rms_norm.cu, RMS statistics, stores y) instantiate it with their own last pass (an Op class, below).
//
// One pass over memory: every row is loaded once into registers (x and residual read, s = x + residual rounded to
// x's dtype optionally written), its mean and biased variance are reduced in fp32 from those registers (two-pass:
// mean first, then the sum of squared deviations, so no E[x^2] - E[x]^2 cancellation; RMSNorm: the mean of squares
// alone, one pass), and the Op's last pass writes its outputs from the same registers.
//
// Work split (chosen on the host from the row length and the row count, see pick_config and vector_config):
//   * a row of at most 32 * VPT vectors: one warp per row, 4 rows per 128-thread block, shuffle reductions;
//   * a longer row: one block of 32 * WPR threads per row, shuffle + shared-memory reductions; spread over
//     more threads (fewer vectors each) when the rows fit in one wave anyway.
// VPT (vectors per thread) is a template parameter so the row lives in a fixed-size register array (kept in
// the input dtype, widened to fp32 on the fly in each pass). All loads of a row (x, residual, and, where the Op
// asks for it, on the vector paths with at most 64 bytes of row per thread also weight and bias) are issued before
// the first store or reduction, so each thread has them in flight at once; otherwise weight and bias are loaded in
// the last pass. A "vector" is 16 bytes (8 fp16/bf16 or 4 fp32) when N is a multiple of that and every pointer is
// 16-byte aligned; otherwise the scalar instantiation (vector = 1 element) serves any N and any alignment.
// Thread t of a row holds vectors t, t + T, t + 2T, ... (T = threads per row), so each load instruction of a
// warp touches 32 consecutive vectors (coalesced). Launched with PDL (launch.h).
//
// An Op provides: Params (deriving from RowParams, plus its outputs), kName (for errors), kPrefetchAffine,
// outputs_aligned(p) (its outputs' part of the vector-path condition) and
// finish<T, VEC, VPT, PREFETCHED>(p, row) (the last pass over a Row, after the statistics). Optionally
// `static constexpr Stats kStats = Stats::kRms` (add_rms_norm, rms_norm.cu): the statistics are then RMSNorm's, the
// mean of squares in fp32 in the same first pass over the registers (no mean subtraction, no second pass), with
// Row::mean 0 and Row::rstd = rsqrt(mean(s^2) + eps); without it (the LayerNorm ops) they are mean and variance,
// compiled to the same machine code as if the option did not exist.
#pragma once
#include "device_utils.cuh"
#include "launch.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fuseinfer {
namespace ln_rows {

constexpr int kMaxN = 16384;             // largest supported hidden size
constexpr int kMaxElemsPerThread = 32;   // row elements per thread on the vector paths (4 x 8 or 8 x 4)
constexpr int kMaxScalarPerThread = 16;  // same for the scalar path: 1024 threads * 16 = kMaxN
constexpr int kWarpRowsPerBlock = 4;     // rows per block in the warp-per-row layout

// The statistics a row's Op normalises with: LayerNorm's mean and biased variance, or RMSNorm's mean of squares.
enum class Stats { kMeanVar, kRms };

// Op::kStats where the Op declares it, else Stats::kMeanVar (the LayerNorm ops do not declare it).
template <class Op, class = void>
struct StatsOf {
  static constexpr Stats value = Stats::kMeanVar;
};
template <class Op>
struct StatsOf<Op, std::void_t<decltype(Op::kStats)>> {
  static constexpr Stats value = Op::kStats;
};

// Op::kRowInFp32 where the Op declares it, else false: the row is then widened to fp32 once, after the residual add,
// and kept so (Row::f) for the statistics and the last pass, instead of being widened again in each pass (twice the
// registers of a 16-bit row, one conversion per element and pass fewer; the same values, so the same bits).
template <class Op, class = void>
struct RowInFp32Of {
  static constexpr bool value = false;
};
template <class Op>
struct RowInFp32Of<Op, std::void_t<decltype(Op::kRowInFp32)>> {
  static constexpr bool value = Op::kRowInFp32;
};

// Op::kMinBlocks16 where the Op declares it, else 1: the 16-bit vector kernels' minimum resident blocks of
// max_threads (__launch_bounds__), i.e. a register cap of 65536 / (kMinBlocks16 * 512) per thread. LayerNorm +
// quantize asks 2 (64 registers): at 68 its 64-thread blocks of a 2048-wide fp16 row fit 14 per SM, so 2040 rows
// took 1.10 waves on 132 SMs, and the kernel is latency-bound per row (ncu): 16 per SM take them in one.
template <class Op, class = void>
struct MinBlocks16Of {
  static constexpr int value = 1;
};
template <class Op>
struct MinBlocks16Of<Op, std::void_t<decltype(Op::kMinBlocks16)>> {
  static constexpr int value = Op::kMinBlocks16;
};

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

// What every Op's Params starts with.
struct RowParams {
  const void* x;         // (rows, n)
  const void* residual;  // (rows, n) or null
  const void* weight;    // (n,) or null
  const void* bias;      // (n,) or null
  void* sum;             // (rows, n) or null (store_sum false)
  int64_t rows;
  int n;                 // row length in elements
  float eps;
};

// Sum (maximum) of v over the threads of one row (blockDim.x of them). With one warp per row there is no shared
// memory and no barrier, so a warp whose row is out of range may return early. `scratch` holds one float per warp
// and must not be reused by a later call (each call gets its own array, which saves a second barrier).
//
// The second stage (over the warps' partials) is the xor butterfly of warp_sum over only the lowest P lanes, P the
// smallest power of two >= the warp count: a full 32-lane butterfly over the partials padded with zeros adds
// exact zeros at its offsets >= P, so this gives the same bits in log2(P) shuffles instead of 5 (each group of P
// lanes runs the same butterfly, so every lane gets the result).
__device__ __forceinline__ int partial_lanes() {
  const int warps = static_cast<int>(blockDim.x >> 5);  // > 1 here
  return 1 << (32 - __clz(warps - 1));
}
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int lanes = partial_lanes(), k = lane & (lanes - 1);
  v = k < static_cast<int>(blockDim.x >> 5) ? scratch[k] : 0.f;
  for (int o = lanes >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float row_max(float v, float* scratch) {
  v = warp_max(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int lanes = partial_lanes(), k = lane & (lanes - 1);
  v = k < static_cast<int>(blockDim.x >> 5) ? scratch[k] : 0.f;
  for (int o = lanes >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Read-only load through the non-coherent (texture) path, for weight and bias only (no kernel writes them); one
// 128-bit instruction for a 16-byte pack. x and the residual, which earlier kernels write, take load_dep.
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

// Coherent load of a pack an earlier kernel wrote (device_utils.cuh: ld_dep says why not __ldg).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_dep(const Pack<T, VEC>* ptr) {
  return ld_dep_as(ptr);
}

// Scalar path may need 1024 threads per row (16 elements each for N = 16384); the vector paths need at most
// 512 (4096 16-byte vectors / 8 per thread), which leaves them up to 128 registers per thread.
template <int VEC>
constexpr int max_threads() { return VEC == 1 ? 1024 : 512; }

// The thread's part of one row after the statistics: s = x + residual (rounded to T) in `a`, zero past the row's
// end; weight and bias packs in wv / bv when prefetched. Pack i of the thread is the row's pack tid + i * tpr.
template <typename T, int VEC, int VPT>
struct Row {
  Pack<T, VEC> a[VPT], wv[VPT], bv[VPT];
  float f[VPT][VEC];    // a widened to fp32 (Op::kRowInFp32 only; otherwise unused, and compiled away)
  float mean, rstd;     // the row's statistics (Stats::kRms: mean 0, rstd = rsqrt(mean(s^2) + eps))
  int64_t index, base;  // the row, and its first pack's index in x
  int tid, tpr, nv;     // thread in the row, threads per row, packs per row
};

// The thread's pack i of s in fp32: kept (kRowInFp32) or widened now.
template <bool kRowInFp32, typename T, int VEC, int VPT>
__device__ __forceinline__ void row_values(const Row<T, VEC, VPT>& r, int i, float (&f)[VEC]) {
  if constexpr (kRowInFp32) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = r.f[i][j];
  } else {
    widen(r.a[i], f);
  }
}

// y = (s - mean) * rstd * w + b in fp32 for the thread's pack i (weight and bias prefetched, or loaded now;
// kRowInFp32: s from Row::f).
template <bool PREFETCHED, typename T, int VEC, int VPT, bool kRowInFp32 = false>
__device__ __forceinline__ void normalize(const Row<T, VEC, VPT>& r, const RowParams& p, int i, float (&f)[VEC]) {
  using P = Pack<T, VEC>;
  const P* __restrict__ w = reinterpret_cast<const P*>(p.weight);
  const P* __restrict__ bias = reinterpret_cast<const P*>(p.bias);
  const int idx = r.tid + i * r.tpr;
  row_values<kRowInFp32>(r, i, f);
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = (f[j] - r.mean) * r.rstd;
  if (w) {
    float fw[VEC];
    widen(PREFETCHED ? r.wv[i] : load(w + idx), fw);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] *= fw[j];
  }
  if (bias) {
    float fb[VEC];
    widen(PREFETCHED ? r.bv[i] : load(bias + idx), fb);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] += fb[j];
  }
}

// grid: warp-per-row layout: ceil(rows / blockDim.y) blocks of (32, kWarpRowsPerBlock);
//       block-per-row layout: rows blocks of (32 * WPR, 1).
template <class Op, typename T, int VEC, int VPT>
__global__ void __launch_bounds__(max_threads<VEC>(), VEC == 8 ? MinBlocks16Of<Op>::value : 1)
rows_kernel(const typename Op::Params p) {
  using P = Pack<T, VEC>;
  __shared__ float scratch_mean[32];
  __shared__ float scratch_var[32];

  pdl_wait();  // x and residual come from earlier kernels
  Row<T, VEC, VPT> r;
  r.index = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (r.index >= p.rows) return;  // only in the warp-per-row layout (block-per-row has exactly `rows` blocks)
  r.tid = threadIdx.x;
  r.tpr = blockDim.x;
  r.nv = p.n / VEC;  // vectors per row (exact: VEC divides n)
  r.base = r.index * r.nv;
  const int tid = r.tid, tpr = r.tpr, nv = r.nv;

  const P* __restrict__ x = reinterpret_cast<const P*>(p.x) + r.base;
  const P* __restrict__ res = p.residual ? reinterpret_cast<const P*>(p.residual) + r.base : nullptr;
  P* __restrict__ s_out = p.sum ? reinterpret_cast<P*>(p.sum) + r.base : nullptr;

  // Issue every load of the row before any store so all of them are in flight at once. The row stays in
  // registers as T (s is rounded to T anyway, so nothing is lost), zero past its end; it is widened to fp32
  // on the fly in each pass, which halves the registers of the 16-bit types.
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (tid + i * tpr < nv) {
      r.a[i] = load_dep(x + tid + i * tpr);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) r.a[i].v[j] = from_float<T>(0.f);
    }
  }
  if (res) {
    P b[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) b[i] = load_dep(res + tid + i * tpr);
    }
    // s = T(x + r): add in fp32 and round once, exactly like eager `x + r`.
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) {
        float fa[VEC], fb[VEC];
        widen(r.a[i], fa);
        widen(b[i], fb);
#pragma unroll
        for (int j = 0; j < VEC; ++j) fa[j] += fb[j];
        r.a[i] = narrow<T, VEC>(fa);
      }
    }
  }

  // weight and bias are shared by all rows (L1/L2 hits). On the vector paths, where their packs take at most 16
  // registers each, an Op that asks for it has them loaded now, so their latency hides behind the reductions
  // instead of being paid per vector at the end (the scalar path's 1024-thread blocks leave no registers for that).
  constexpr bool kPrefetchAffine = Op::kPrefetchAffine && VEC > 1 && sizeof(P) * VPT <= 64;
  if constexpr (kPrefetchAffine) {
    const P* __restrict__ w = reinterpret_cast<const P*>(p.weight);
    const P* __restrict__ bias = reinterpret_cast<const P*>(p.bias);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) {
        if (w) r.wv[i] = load(w + tid + i * tpr);
        if (bias) r.bv[i] = load(bias + tid + i * tpr);
      }
    }
  }

  // First pass over the registers: the sum (LayerNorm) or the sum of squares (RMSNorm; the zeros past the row's
  // end add nothing to either).
  constexpr bool kRms = StatsOf<Op>::value == Stats::kRms;
  constexpr bool kF32 = RowInFp32Of<Op>::value;
  float local = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (s_out && tid + i * tpr < nv) s_out[tid + i * tpr] = r.a[i];
    float f[VEC];
    widen(r.a[i], f);
    if constexpr (kF32) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) r.f[i][j] = f[j];
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (kRms) {
        local += f[j] * f[j];
      } else {
        local += f[j];
      }
    }
  }
  if constexpr (kRms) {
    // rsqrt(mean(s^2) + eps) as the reference computes it: the sum divided by n, then rsqrtf (torch's rsqrt on
    // CUDA)
    r.mean = 0.f;
    r.rstd = rsqrtf(row_sum(local, scratch_mean) / static_cast<float>(p.n) + p.eps);
  } else {
    const float inv_n = 1.f / static_cast<float>(p.n);
    r.mean = row_sum(local, scratch_mean) * inv_n;

    // Second pass over the registers: sum of squared deviations (biased variance, like torch).
    local = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + i * tpr < nv) {
        float f[VEC];
        row_values<kF32>(r, i, f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) local += (f[j] - r.mean) * (f[j] - r.mean);
      }
    }
    r.rstd = rsqrtf(row_sum(local, scratch_var) * inv_n + p.eps);
  }

  // The next kernel (PDL) may launch now, with only the normalisation and the stores left: triggered at the start
  // instead, its blocks moved in beside this kernel's while those still loaded and reduced, and 20 add+LN calls of
  // 128 x 4096 in one graph took 3.39 us each instead of 2.63 (H100; torch.compile's kernel 2.98).
  pdl_launch_dependents();
  Op::template finish<T, VEC, VPT, kPrefetchAffine>(p, r);
}

struct Config {
  int vpt;             // vectors per thread (template argument)
  int threads_per_row; // blockDim.x
  int rows_per_block;  // blockDim.y
};

// Fewest warps per row such that each thread holds at most max_vpt vectors, then the smallest vpt that covers
// the row with that many warps (balances odd lengths, e.g. 257 vectors -> 3 warps x 3 vectors).
inline Config pick_config(int nv, int max_vpt) {
  const int wpr = (nv + 32 * max_vpt - 1) / (32 * max_vpt);
  const int vpt = (nv + 32 * wpr - 1) / (32 * wpr);
  return {vpt, 32 * wpr, wpr == 1 ? kWarpRowsPerBlock : 1};
}

template <class Op, int VEC>
void launch(void (*kernel)(typename Op::Params), const typename Op::Params& p, const Config& c, cudaStream_t stream) {
  const int64_t blocks = (p.rows + c.rows_per_block - 1) / c.rows_per_block;
  TORCH_CHECK(blocks <= INT32_MAX, Op::kName, ": too many rows (", p.rows, ")");
  TORCH_CHECK(c.threads_per_row <= max_threads<VEC>(), Op::kName, ": row of ", p.n, " elements too long");
  launch_kernel(kernel, static_cast<unsigned>(blocks), dim3(c.threads_per_row, c.rows_per_block), 0, stream, p);
}

// The instantiation whose VPT equals vpt, for VPT in [1, MAX_VPT].
template <class Op, typename T, int VEC, int MAX_VPT>
auto kernel_for(int vpt) -> void (*)(typename Op::Params) {
  if constexpr (MAX_VPT >= 1) {
    if (vpt == MAX_VPT) return rows_kernel<Op, T, VEC, MAX_VPT>;
    return kernel_for<Op, T, VEC, MAX_VPT - 1>(vpt);
  } else {
    TORCH_CHECK(false, Op::kName, ": no kernel for ", vpt, " vectors per thread");
    return nullptr;
  }
}

// Vector paths: rows of nv vectors. By default each thread holds up to MAX_VPT vectors (fewest threads per row).
// A row already spread over a block (more than one warp) is spread wider, down to one vector per thread, as long
// as every row still gets a block in the first wave: with few rows (a decode step's, or ~1 MB of activations)
// the kernel is one round trip to memory, and more threads per row shorten each thread's chain of loads and
// reductions (H100, N = 4096 fp16, L2 flushed: add+LN of 128 rows 6.2-6.9 -> 5.7 us, 512 rows 9.0 -> 8.2 us).
template <class Op, typename T, int VEC, int MAX_VPT>
Config vector_config(int nv, int64_t rows) {
  const Config narrow = pick_config(nv, MAX_VPT);
  if (narrow.rows_per_block != 1) return narrow;  // warp-per-row layout
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for (int vpt = 1; vpt < MAX_VPT; ++vpt) {
    const Config wide = pick_config(nv, vpt);
    if (wide.vpt != vpt || wide.threads_per_row > max_threads<VEC>()) continue;
    const void* kernel = reinterpret_cast<const void*>(kernel_for<Op, T, VEC, MAX_VPT>(vpt));
    if (static_cast<int64_t>(sms) * blocks_per_sm(kernel, wide.threads_per_row) >= rows) return wide;
  }
  return narrow;
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Picks the layout and the instantiation for p's rows of T and launches it.
template <class Op, typename T>
void dispatch(const typename Op::Params& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorized = p.n % kVec == 0 && aligned16(p.x) && Op::outputs_aligned(p) &&
                          (!p.residual || aligned16(p.residual)) && (!p.sum || aligned16(p.sum)) &&
                          (!p.weight || aligned16(p.weight)) && (!p.bias || aligned16(p.bias));
  if (vectorized) {
    constexpr int kMaxVpt = kMaxElemsPerThread / kVec;  // 4 for fp16/bf16, 8 for fp32
    const Config c = vector_config<Op, T, kVec, kMaxVpt>(p.n / kVec, p.rows);
    launch<Op, kVec>(kernel_for<Op, T, kVec, kMaxVpt>(c.vpt), p, c, stream);
    return;
  }
  // Scalar path: only power-of-two VPTs are instantiated (it serves odd sizes and misaligned views).
  Config c = pick_config(p.n, kMaxScalarPerThread);
  int vpt = 1;
  while (vpt < c.vpt) vpt *= 2;
  c.vpt = vpt;
  switch (c.vpt) {
    case 1: return launch<Op, 1>(rows_kernel<Op, T, 1, 1>, p, c, stream);
    case 2: return launch<Op, 1>(rows_kernel<Op, T, 1, 2>, p, c, stream);
    case 4: return launch<Op, 1>(rows_kernel<Op, T, 1, 4>, p, c, stream);
    case 8: return launch<Op, 1>(rows_kernel<Op, T, 1, 8>, p, c, stream);
    case 16: return launch<Op, 1>(rows_kernel<Op, T, 1, 16>, p, c, stream);
    default: TORCH_CHECK(false, Op::kName, ": no scalar kernel for ", c.vpt, " elements per thread");
  }
}

// Checks the rows every row op takes: x a contiguous CUDA tensor of at least one dimension in fp16 / bf16 / fp32, and
// an optional residual with x's device, dtype and shape, contiguous.
inline void check_rows(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              op, ": dtype must be float16, bfloat16 or float32, got ", dtype);
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->device() == x.device(), op, ": residual must be on x's device");
    TORCH_CHECK(residual->scalar_type() == dtype, op, ": residual must have x's dtype");
    TORCH_CHECK(residual->sizes() == x.sizes(), op, ": residual must have x's shape");
    TORCH_CHECK(residual->is_contiguous(), op, ": residual must be contiguous");
  }
}

// Checks an optional weight or bias against x: on x's device, x's dtype, contiguous (N,).
inline void check_param(const char* op, const c10::optional<at::Tensor>& t, const at::Tensor& x, int64_t n,
                        const char* name) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->device() == x.device(), op, ": ", name, " must be on x's device");
  TORCH_CHECK(t->scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype");
  TORCH_CHECK(t->is_contiguous() && t->numel() == n, op, ": ", name, " must be contiguous (N,)");
}

inline const void* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

// Fills the common part of an Op's Params; y-side outputs are the Op's.
inline void fill_rows(RowParams& p, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                      const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
                      void* sum) {
  const int64_t n = x.size(-1);
  p.x = x.data_ptr();
  p.residual = data_or_null(residual);
  p.weight = data_or_null(weight);
  p.bias = data_or_null(bias);
  p.sum = sum;
  p.rows = x.numel() / n;
  p.n = static_cast<int>(n);
  p.eps = static_cast<float>(eps);
}

// Launches Op's kernel for x's dtype (fp16, bf16 or fp32) on the current stream.
template <class Op>
void dispatch_dtype(const typename Op::Params& p, at::ScalarType dtype) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (dtype) {
    case at::kHalf: dispatch<Op, __half>(p, stream); break;
    case at::kBFloat16: dispatch<Op, __nv_bfloat16>(p, stream); break;
    default: dispatch<Op, float>(p, stream); break;
  }
}

}  // namespace ln_rows
}  // namespace fuseinfer
