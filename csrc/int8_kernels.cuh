// Device code of the int8 kernels (int8_linear.cu, quant.cu): int8 -> fp16/bf16 conversion in registers, the
// int8-weight decode GEMV (M <= 16), weight dequantization and row-wise (per-token / per-channel) quantization.
// Kept free of torch headers so that tools/int8_harness.cu compiles and runs them standalone.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "device_utils.cuh"
#ifndef FUSEINFER_KERNEL_HARNESS  // (the standalone harness has no torch: device_utils.cuh has the PDL calls)
#include "launch.h"
#endif

namespace fuseinfer {
namespace int8 {

// ------------------------------------------------------------------------------------------------------------
// int8 -> fp16 / bf16, four values of one 32-bit word at a time (exact: |q| <= 128 fits both formats).
// ------------------------------------------------------------------------------------------------------------

// fp16, the magic-number trick of FasterTransformer / TensorRT-LLM's weight-only GEMV: flipping the sign bit of each
// byte gives the biased byte u = q + 128 (0..255); prmt places u as the low byte under a high byte 0x64, which is the
// fp16 1024 + u (fp16 in [1024, 2048) has a step of 1), and one packed subtraction of 1152 = 1024 + 128 (0x6480)
// leaves q. 1 LOP3 + 2 PRMT + 2 HSUB2 per four weights. lo = (q0, q1), hi = (q2, q3) as half2 (low half first).
__device__ __forceinline__ void i8x4_to_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = w ^ 0x80808080u;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(lo) : "r"(u), "r"(0x64646464u), "r"(0x5150u));  // bytes u0 64 u1 64
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(hi) : "r"(u), "r"(0x64646464u), "r"(0x5352u));  // bytes u2 64 u3 64
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(lo) : "r"(lo), "r"(0x64806480u));
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(hi) : "r"(hi), "r"(0x64806480u));
}

// bf16 (7 mantissa bits cannot hold 1024 + u exactly): the same trick in fp32, 2^23 + u (0x4B0000uu) minus
// 2^23 + 128, then a packed round to bf16 (exact).
__device__ __forceinline__ float biased_byte_to_float(uint32_t u, uint32_t selector) {
  uint32_t bits;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(bits) : "r"(u), "r"(0x4B000000u), "r"(selector));
  return __uint_as_float(bits) - 8388736.f;
}

__device__ __forceinline__ void i8x4_to_bf16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = w ^ 0x80808080u;
  // selector bytes: (u byte i, 0x00, 0x00, 0x4B) -> 0x744i
  const __nv_bfloat162 a = __floats2bfloat162_rn(biased_byte_to_float(u, 0x7440u), biased_byte_to_float(u, 0x7441u));
  const __nv_bfloat162 b = __floats2bfloat162_rn(biased_byte_to_float(u, 0x7442u), biased_byte_to_float(u, 0x7443u));
  lo = *reinterpret_cast<const uint32_t*>(&a);
  hi = *reinterpret_cast<const uint32_t*>(&b);
}

template <typename T>
__device__ __forceinline__ void i8x4_to_x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (std::is_same_v<T, __half>) {
    i8x4_to_f16x4(w, lo, hi);
  } else {
    i8x4_to_bf16x4(w, lo, hi);
  }
}

// ------------------------------------------------------------------------------------------------------------
// Decode GEMV / skinny GEMM with int8 weights: y (M, N) = act(scale * (x (M, K) @ q (N, K)^T) + bias + residual),
// M <= 16. The structure of skinny_linear_kernel (linear.cu), with int8 weight chunks: see there for the persistent
// grid, the item sequence (tile, k-block) per warp, the two register fragments in flight, PDL and the epilogue.
// ------------------------------------------------------------------------------------------------------------

constexpr int kMaxM = 16;     // tokens served (one or two n-tiles of 8)
constexpr int kRows = 16;     // rows of q (outputs) per tile = the mma's m
constexpr int kMaxWarps = 16;

// k-steps of 64 per k-block (the unit a warp loads at once): 2 for one n-tile, 1 for two (two fragments in flight
// within the register budget of 16 warps per SM: each k-step holds 2 weight chunks and 2 * NT activation chunks).
template <int NT>
__host__ __device__ constexpr int unroll() { return NT == 1 ? 2 : 1; }

struct SkinnyParams {
  const void* x;         // (M, K), T
  const void* w;         // (N, K), int8
  const float* scale;    // (N,)
  const void* bias;      // (N,) T or null
  const void* residual;  // (M, N) T or null
  void* y;               // (M, N) T
  int m, n, k;
  bool relu;
};

// A streaming 16-byte load of weights, read exactly once (see ld_stream in linear.cu for why not .nc).
__device__ __forceinline__ uint4 ld_stream(const uint4* ptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
#else
  return __ldg(ptr);
#endif
}

// One k-block of a lane: per k-step u of 64, 16 int8 weights of rows g and g + 8 at k0 + 16t (one 16-byte chunk each)
// and the 16 activations of token g of each n-tile at the same k (two 16-byte chunks).
template <int NT, int U>
struct Frag {
  uint4 w_lo[U], w_hi[U], x[U][NT][2];
};

// c0: the lane's weight-chunk index for its first k-step (k-block * 4U + t; one chunk = 16 int8 = 16 of K).
// TAIL: the last k-block crosses K (K % 16 == 0, so a chunk is inside K or past it); chunks past the end are read at
// a clamped (valid) index and zeroed in both operands.
template <int NT, int U, bool TAIL>
__device__ __forceinline__ void load_w(Frag<NT, U>& f, const uint4* w_lo, const uint4* w_hi, int c0, int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = TAIL ? min(c0 + 4 * u, chunks - 1) : c0 + 4 * u;
    f.w_lo[u] = ld_stream(w_lo + c);
    f.w_hi[u] = ld_stream(w_hi + c);
  }
}

// xs[j]: token 8j + g's row of x as 16-byte chunks (8 values each): weight chunk c covers x chunks 2c and 2c + 1.
template <int NT, int U, bool TAIL>
__device__ __forceinline__ void load_x(Frag<NT, U>& f, const uint4* const (&xs)[NT], int c0, int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = TAIL ? min(c0 + 4 * u, chunks - 1) : c0 + 4 * u;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      f.x[u][j][0] = __ldg(xs[j] + 2 * c);
      f.x[u][j][1] = __ldg(xs[j] + 2 * c + 1);
    }
  }
  if (TAIL) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + 4 * u >= chunks) {
        f.w_lo[u] = f.w_hi[u] = zero;
#pragma unroll
        for (int j = 0; j < NT; ++j) f.x[u][j][0] = f.x[u][j][1] = zero;
      }
    }
  }
}

// Per k-step: the two weight chunks become 8 + 8 packed pairs (lo[i], hi[i]: row g / g + 8, values 2i, 2i + 1 of
// the chunk), and four m16n8k16 mmas consume them. The order of k inside an mma is free (the same permutation on both
// operands): mma i takes the chunk's values 4i .. 4i + 3 of every lane, as
//   A = {lo[2i], hi[2i], lo[2i + 1], hi[2i + 1]}   (rows g / g + 8; mma-k 2t, 2t + 1 then 2t + 8, 2t + 9)
//   B = {xw[2i], xw[2i + 1]}                       (token g; the same mma-k), xw = the 8 words of the x chunks.
template <typename T, int NT, int U>
__device__ __forceinline__ void mma_block(float (&acc)[NT][4], const Frag<NT, U>& f) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    uint32_t lo[8], hi[8];
    const uint32_t wl[4] = {f.w_lo[u].x, f.w_lo[u].y, f.w_lo[u].z, f.w_lo[u].w};
    const uint32_t wh[4] = {f.w_hi[u].x, f.w_hi[u].y, f.w_hi[u].z, f.w_hi[u].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      i8x4_to_x4<T>(wl[i], lo[2 * i], lo[2 * i + 1]);
      i8x4_to_x4<T>(wh[i], hi[2 * i], hi[2 * i + 1]);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint32_t xw[8] = {f.x[u][j][0].x, f.x[u][j][0].y, f.x[u][j][0].z, f.x[u][j][0].w,
                              f.x[u][j][1].x, f.x[u][j][1].y, f.x[u][j][1].z, f.x[u][j][1].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        mma_16816<T>(acc[j], {lo[2 * i], hi[2 * i], lo[2 * i + 1], hi[2 * i + 1]}, xw[2 * i], xw[2 * i + 1]);
      }
    }
  }
}

// Grid, items and epilogue as skinny_linear_kernel (linear.cu); tile i = 16 rows of q, outputs y[:, 16i : 16i + 16].
// The epilogue multiplies the fp32 sum over the warps by the row's scale, then adds bias and residual, (ReLU) and
// rounds once. Rows >= N and tokens >= M read the last valid row: they only feed accumulators never stored.
template <typename T, int NT, bool TAIL>
__global__ void __launch_bounds__(32 * kMaxWarps) skinny_kernel(const SkinnyParams p) {
  constexpr int U = unroll<NT>();
  constexpr int kChunksPerBlock = 4 * U;  // 16-byte weight chunks per row in a k-block
  constexpr int kTokens = 8 * NT;
  __shared__ float partial[2][kMaxWarps][kRows][kTokens + 1];  // +1: fewer bank conflicts

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int chunks = p.k / 16;  // 16-byte weight chunks per row
  const int k_blocks = (chunks + kChunksPerBlock - 1) / kChunksPerBlock;
  const int tiles = (p.n + kRows - 1) / kRows;

  const uint4* w = reinterpret_cast<const uint4*>(p.w);
  const uint4* xs[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xs[j] = reinterpret_cast<const uint4*>(p.x) + static_cast<int64_t>(min(8 * j + g, p.m - 1)) * (p.k / 8);
  }
  const T* bias = static_cast<const T*>(p.bias);
  const T* residual = static_cast<const T*>(p.residual);
  T* y = static_cast<T*>(p.y);

  struct Item {
    int tile, kb;
  };
  auto after = [&](Item i) {
    i.kb += warps;
    if (i.kb >= k_blocks) {
      i.kb = warp;
      i.tile += gridDim.x;
    }
    return i;
  };
  auto w_row = [&](int tile, int r) {
    return w + static_cast<int64_t>(min(tile * kRows + r, p.n - 1)) * chunks;
  };
  auto load_weights = [&](Frag<NT, U>& f, Item i) {
    load_w<NT, U, TAIL>(f, w_row(i.tile, g), w_row(i.tile, g + 8), i.kb * kChunksPerBlock + t, chunks);
  };
  auto load_acts = [&](Frag<NT, U>& f, Item i) {
    load_x<NT, U, TAIL>(f, xs, i.kb * kChunksPerBlock + t, chunks);
  };

  // Epilogue operands of the thread's first output of a tile, requested a tile ahead.
  const int e_row = threadIdx.x % kRows, e_token = threadIdx.x / kRows;
  auto e_index = [&](int tile) -> int64_t {  // -1: no such output
    const int n = tile * kRows + e_row;
    return tile < tiles && e_token < p.m && n < p.n ? static_cast<int64_t>(e_token) * p.n + n : -1;
  };
  auto load_scale = [&](int tile) {
    return e_index(tile) >= 0 ? p.scale[tile * kRows + e_row] : 0.f;
  };
  auto load_bias = [&](int tile) {
    return bias != nullptr && e_index(tile) >= 0 ? to_float(bias[tile * kRows + e_row]) : 0.f;
  };
  auto load_residual = [&](int tile) {
    const int64_t idx = e_index(tile);
    return residual != nullptr && idx >= 0 ? to_float(residual[idx]) : 0.f;
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // PDL: weights, scales and bias (never written by the previous kernel) before the wait; x and residual after.
  pdl_launch_dependents();
  Frag<NT, U> f0, f1;
  Item i0{static_cast<int>(blockIdx.x), warp};
  Item i1 = after(i0);
  load_weights(f0, i0);
  if (i1.tile < tiles) load_weights(f1, i1);
  float e_scale = load_scale(i0.tile);
  float e_bias = load_bias(i0.tile);
  pdl_wait();
  load_acts(f0, i0);
  if (i1.tile < tiles) load_acts(f1, i1);
  float e_residual = load_residual(i0.tile);

  auto step = [&](Frag<NT, U>& cur, Item& ci, const Item& oi) {
    mma_block<T>(acc, cur);
    const bool more = oi.tile < tiles;
    const Item ni = after(oi);
    if (more && ni.tile < tiles) {
      load_weights(cur, ni);
      load_acts(cur, ni);
    }
    if (ci.kb + warps >= k_blocks) {
      float(&part)[kMaxWarps][kRows][kTokens + 1] = partial[(ci.tile / gridDim.x) % 2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        part[warp][g][8 * j + 2 * t] = acc[j][0];
        part[warp][g][8 * j + 2 * t + 1] = acc[j][1];
        part[warp][g + 8][8 * j + 2 * t] = acc[j][2];
        part[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      }
      __syncthreads();

      const int n0 = ci.tile * kRows;
      for (int o = threadIdx.x; o < kRows * kTokens; o += blockDim.x) {
        const int row = o % kRows;
        const int token = o / kRows;
        const int n = n0 + row;
        if (token >= p.m || n >= p.n) continue;
        float s = 0.f;
        for (int v = 0; v < warps; ++v) s += part[v][row][token];
        const int64_t idx = static_cast<int64_t>(token) * p.n + n;
        if (o == threadIdx.x) {  // the prefetched operands (0 where there are none)
          s = s * e_scale + e_bias + e_residual;
        } else {
          s *= p.scale[n];
          if (bias) s += to_float(bias[n]);
          if (residual) s += to_float(residual[idx]);
        }
        if (p.relu && s < 0.f) s = 0.f;  // NaN passes through, like torch.relu
        y[idx] = from_float<T>(s);
      }
      e_scale = load_scale(ci.tile + gridDim.x);
      e_bias = load_bias(ci.tile + gridDim.x);
      e_residual = load_residual(ci.tile + gridDim.x);
    }
    ci = ni;
    return more;
  };
  while (step(f0, i0, i1) && step(f1, i1, i0)) {
  }
}

// ------------------------------------------------------------------------------------------------------------
// Dequantization: out (N, K) = q (N, K) * scale[row], in fp32, rounded once to T (as dequantize_weight_ref).
// VEC: K % 16 == 0 and 16-byte aligned pointers; a thread converts 16 weights per grid-stride step.
// ------------------------------------------------------------------------------------------------------------
template <typename T, bool VEC>
__global__ void dequantize_kernel(const int8_t* __restrict__ q, const float* __restrict__ scale, T* __restrict__ out,
                                  int64_t rows, int64_t k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (VEC) {
    const int64_t per_row = k / 16;
    const int64_t total = rows * per_row;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < total; c += stride) {
      const float s = scale[c / per_row];
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(q) + c);
      const int8_t* b = reinterpret_cast<const int8_t*>(&v);
      alignas(16) T vals[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) vals[i] = from_float<T>(static_cast<float>(b[i]) * s);
      const uint4* src = reinterpret_cast<const uint4*>(vals);
      uint4* dst = reinterpret_cast<uint4*>(out) + c * static_cast<int64_t>(sizeof(T));
#pragma unroll
      for (int i = 0; i < static_cast<int>(sizeof(T)); ++i) dst[i] = src[i];
    }
  } else {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * k; e += stride) {
      out[e] = from_float<T>(static_cast<float>(q[e]) * scale[e / k]);
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Row-wise symmetric quantization (per token of activations (M, K), per output channel of weights (N, K)):
// scale[r] = max(max|x[r, :]| / 127, FLT_MIN), q = rint(x / scale) clamped to [-127, 127] (round half to even;
// IEEE division, as PyTorch's reference, so q and scale match it bit for bit). A block per row (grid-stride over
// rows): pass 1 the absolute maximum (a block reduction), pass 2 re-reads the row (L1/L2 hits) and stores the
// int8 values, V per thread and step (V = 16 bytes of x).
// ------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();  // red is free (its previous use, the last row's, is done)
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : 0.f;
  return warp_max(v);
}

__device__ __forceinline__ int quantize_one(float v, float inv_den) {
  return max(-127, min(127, __float2int_rn(v / inv_den)));
}

template <typename T, bool VEC>
__global__ void quantize_rows_kernel(const T* __restrict__ x, int8_t* __restrict__ q, float* __restrict__ scale,
                                     int64_t rows, int64_t k) {
  constexpr int V = 16 / sizeof(T);  // values per 16-byte load
  __shared__ float red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * k;
    int8_t* qr = q + r * k;
    float amax = 0.f;
    if constexpr (VEC) {
      for (int64_t c = threadIdx.x; c < k / V; c += blockDim.x) {
        const uint4 v = *(reinterpret_cast<const uint4*>(xr) + c);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < V; ++i) amax = fmaxf(amax, fabsf(to_float(e[i])));
      }
    } else {
      for (int64_t c = threadIdx.x; c < k; c += blockDim.x) amax = fmaxf(amax, fabsf(to_float(xr[c])));
    }
    amax = block_max(amax, red);
    const float s = fmaxf(amax / 127.f, FLT_MIN);
    if (threadIdx.x == 0) scale[r] = s;
    if constexpr (VEC) {
      for (int64_t c = threadIdx.x; c < k / V; c += blockDim.x) {
        const uint4 v = *(reinterpret_cast<const uint4*>(xr) + c);
        const T* e = reinterpret_cast<const T*>(&v);
        uint32_t packed[(V + 3) / 4] = {};
#pragma unroll
        for (int i = 0; i < V; ++i) {
          packed[i / 4] |= (static_cast<uint32_t>(quantize_one(to_float(e[i]), s)) & 0xffu) << (8 * (i % 4));
        }
        if constexpr (V == 8) {
          *(reinterpret_cast<uint2*>(qr) + c) = make_uint2(packed[0], packed[1]);
        } else {
          *(reinterpret_cast<uint32_t*>(qr) + c) = packed[0];
        }
      }
    } else {
      for (int64_t c = threadIdx.x; c < k; c += blockDim.x) qr[c] = static_cast<int8_t>(quantize_one(to_float(xr[c]), s));
    }
  }
}

}  // namespace int8
}  // namespace fuseinfer
