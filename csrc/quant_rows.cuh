// Per-row (per-token) 8-bit quantisation device code shared by the fused LayerNorm + quantize
// (layer_norm_quant.cu) and the standalone row quantize (quant.cu): the packed int8 / e4m3 stores, y / scale with
// IEEE division's bits at a few FFMAs per element, and the e4m3 row kernel quant8::quantize_fp8_rows_kernel
// (fuseinfer_C::quantize_fp8_rows). Everything here reproduces fuseinfer.ops.quant.quantize_int8_ref /
// fuseinfer.ops.fp8_linear.quantize_fp8_ref bit for bit. Free of torch headers (kernels and device functions only).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "device_utils.cuh"

namespace fuseinfer {
namespace quant8 {

// VEC 8-bit values stored as one instruction: 8 bytes for fp16/bf16 packs, 4 for fp32 packs (built as words, so no
// byte shuffling before the store), 1 for scalars.
template <int VEC>
struct alignas(VEC) QPack {
  static_assert(VEC % 4 == 0, "QPack: 4 or 8 values, or 1");
  uint32_t w[VEC / 4];  // element 0 in the lowest byte of w[0]
};
template <>
struct QPack<1> {
  uint8_t v;
};

// y / scale with __fdiv_rn's bits (see the header): the reciprocal refined once per row, then per element the fast
// path's quotient and one correction. kExact: the plain division (rows whose scale is out of the fast path's range).
template <bool kExact>
struct Divider {
  float scale, rcp;
  __device__ __forceinline__ explicit Divider(float s) : scale(s), rcp(0.f) {
    if constexpr (!kExact) {
      float r0;
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(s));  // MUFU.RCP, as in __fdiv_rn (s is normal here)
      rcp = __fmaf_rn(r0, __fmaf_rn(r0, -s, 1.f), r0);
    }
  }
  __device__ __forceinline__ float operator()(float a) const {
    if constexpr (kExact) {
      return __fdiv_rn(a, scale);
    } else {
      const float q0 = __fmaf_rn(a, rcp, 0.f);
      return __fmaf_rn(rcp, __fmaf_rn(q0, -scale, a), q0);
    }
  }
};

// The fast path's range for the scale: every y that can quantise to a nonzero value (|y| >= scale * 2^-11 for e4m3,
// scale / 2 for int8) and its quotient are then normal fp32 values far from the limits.
__device__ __forceinline__ bool fast_divide(float scale) { return scale >= 0x1p-64f && scale <= 0x1p64f; }

// round_half_even(clamp(v, -127, 127)) as the low byte of a word: v + 1.5 * 2^23 lies in [2^23, 2^24), where the
// fp32 ulp is 1, so the add itself rounds to the nearest even integer and the mantissa's low byte is that integer in
// two's complement. A NaN quotient clamps to -127 (fmaxf returns the non-NaN operand), as rintf then fmaxf did. No
// upper clamp: |y| <= amax and scale = RN(amax / 127) >= amax / 127 * (1 - 2^-24) (or FLT_MIN > amax / 127), so a
// correctly rounded y / scale is at most 127.00001, which the add rounds to 127.
__device__ __forceinline__ uint32_t int8_word(float v) { return __float_as_uint(fmaxf(v, -127.f) + 12582912.f); }

// Four int8 words -> their low bytes packed (element 0 in the lowest byte).
__device__ __forceinline__ uint32_t pack4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// y / scale for e4m3, whose zero is signed: the fast path's FFMAs turn -0 / scale into +0, where IEEE division (and
// the reference) give -0; the quotient's sign is always y's (scale > 0), so copying it back is exact (one LOP3).
template <class Div>
__device__ __forceinline__ float signed_quotient(float y, const Div& div) { return copysignf(div(y), y); }

// Quantises one pack of y (fp32, rounded to x's dtype) with the row's divider.
template <bool kFp8, int VEC, class Div>
__device__ __forceinline__ QPack<VEC> quantize(const float (&y)[VEC], const Div& div) {
  QPack<VEC> out;
  if constexpr (VEC == 1) {
    out.v = kFp8 ? __nv_cvt_float_to_fp8(signed_quotient(y[0], div), __NV_SATFINITE, __NV_E4M3)
                 : static_cast<uint8_t>(int8_word(div(y[0])) & 0xffu);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; j += 4) {
      if constexpr (kFp8) {  // pairs, element j in the low byte
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(
            make_float2(signed_quotient(y[j], div), signed_quotient(y[j + 1], div)), __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(
            make_float2(signed_quotient(y[j + 2], div), signed_quotient(y[j + 3], div)), __NV_SATFINITE, __NV_E4M3);
        out.w[j / 4] = __byte_perm(lo, hi, 0x5410);
      } else {
        out.w[j / 4] = pack4(int8_word(div(y[j])), int8_word(div(y[j + 1])), int8_word(div(y[j + 2])),
                             int8_word(div(y[j + 3])));
      }
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------------------
// Row-wise e4m3 quantisation (quantize_fp8_ref(x, -1)): scale[r] = max(amax_r / 448, FLT_MIN) (IEEE division; a
// NaN amax stays NaN, as torch's clamp_min), q = e4m3(clamp(x / scale, +-448)) rounded to nearest even. A block per
// row (grid-stride over rows): pass 1 the absolute maximum (a block reduction), pass 2 re-reads the row (L1 hits)
// and stores V e4m3 bytes per 16-byte load of x. VEC: K % V == 0 and x 16-byte aligned.
// Launched with PDL (launch.h): x is an earlier kernel's output, read after pdl_wait() with coherent loads.
// ------------------------------------------------------------------------------------------------------------

// |v| as fp32 bits: non-negative floats order as their bit patterns, and every NaN's (sign cleared) lies above
// infinity's, so an unsigned max of these propagates a NaN as torch's amax does (fmaxf would drop it).
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ unsigned warp_max_bits(unsigned v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Maximum over the block (blockDim.x a multiple of 32); red: 32 words of shared memory.
__device__ __forceinline__ unsigned block_max_bits(unsigned v, unsigned* red) {
  v = warp_max_bits(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();  // red is free (its previous use, the last row's, is done)
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return warp_max_bits(lane < warps ? red[lane] : 0u);
}

// The row's quantised bytes, x re-read (after pdl_wait, coherent loads).
template <typename T, bool VEC, class Div>
__device__ __forceinline__ void store_fp8_row(const T* xr, uint8_t* qr, int64_t k, const Div& div) {
  constexpr int V = 16 / sizeof(T);  // values per 16-byte load
  if constexpr (VEC) {
    for (int64_t c = threadIdx.x; c < k / V; c += blockDim.x) {
      const uint4 v = ld_dep(reinterpret_cast<const uint4*>(xr) + c);
      const T* e = reinterpret_cast<const T*>(&v);
      float y[V];
#pragma unroll
      for (int i = 0; i < V; ++i) y[i] = to_float(e[i]);
      reinterpret_cast<QPack<V>*>(qr)[c] = quantize<true, V>(y, div);
    }
  } else {
    for (int64_t c = threadIdx.x; c < k; c += blockDim.x) {
      const float y[1] = {to_float(ld_dep_as(xr + c))};
      reinterpret_cast<QPack<1>*>(qr)[c] = quantize<true, 1>(y, div);
    }
  }
}

template <typename T, bool VEC>
__global__ void quantize_fp8_rows_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scale,
                                         int64_t rows, int64_t k) {
  constexpr int V = 16 / sizeof(T);
  __shared__ unsigned red[32];
  pdl_launch_dependents();
  pdl_wait();  // x is the previous kernel's output
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * k;
    unsigned amax = 0u;  // bits of max |x| over the row
    if constexpr (VEC) {
#pragma unroll 4  // (about four loads per thread and row: issued together, not one latency after another)
      for (int64_t c = threadIdx.x; c < k / V; c += blockDim.x) {
        const uint4 v = ld_dep(reinterpret_cast<const uint4*>(xr) + c);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < V; ++i) amax = max(amax, abs_bits(to_float(e[i])));
      }
    } else {
      for (int64_t c = threadIdx.x; c < k; c += blockDim.x) amax = max(amax, abs_bits(to_float(ld_dep_as(xr + c))));
    }
    amax = block_max_bits(amax, red);
    float s = __fdiv_rn(__uint_as_float(amax), 448.f);
    s = s < FLT_MIN ? FLT_MIN : s;  // (not fmaxf: a NaN scale stays NaN, as the reference's)
    if (threadIdx.x == 0) scale[r] = s;
    if (fast_divide(s)) {
      store_fp8_row<T, VEC>(xr, q + r * k, k, Divider<false>(s));
    } else {  // FLT_MIN (an all-zero row), a tiny or huge amax, inf, NaN: the plain division
      store_fp8_row<T, VEC>(xr, q + r * k, k, Divider<true>(s));
    }
  }
}

}  // namespace quant8
}  // namespace fuseinfer
