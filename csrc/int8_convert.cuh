// int8 <-> float device code: int8 -> fp16/bf16 conversion in registers (the int8-weight GEMV of skinny_gemv.cuh and
// the one-kernel decode step), weight dequantization (w8a16_linear.cu) and row-wise (per-token / per-channel)
// quantization (quant.cu). Kept free of torch headers so that tools/int8_harness.cu compiles and runs them
// standalone.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "device_utils.cuh"

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
