// float8 e4m3 -> fp16 / bf16 device code: the e4m3-weight GEMV of skinny_gemv.cuh and the one-kernel decode step
// convert a 32-bit word of four e4m3 weights in registers. Exact: every e4m3 value (max 448, 3 mantissa bits,
// smallest subnormal 2^-9) is an fp16 and a bf16 value. Kept free of torch headers like int8_convert.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace fuseinfer {
namespace fp8 {

// Two e4m3 (low byte first) -> half2 (low half first). Hopper and Ada convert a pair in one instruction; older
// GPUs (which have no FP8 models to run, but the file compiles for every arch) take the bit layout: an e4m3 value
// shifted into fp16's fields is itself times 2^-8 (normal and subnormal alike), so one exact multiply by 256 fixes it.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t pair) {
  uint32_t out;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(pair));
#else
  const uint32_t b = (static_cast<uint32_t>(pair) & 0xffu) | ((static_cast<uint32_t>(pair) & 0xff00u) << 8);
  const uint32_t bits = ((b & 0x00800080u) << 8) | ((b & 0x007f007fu) << 7);  // sign, then exponent and mantissa
  const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&bits), __half2half2(__float2half(256.f)));
  out = *reinterpret_cast<const uint32_t*>(&v);
#endif
  return out;
}

// Four e4m3 of one word -> lo = (v0, v1), hi = (v2, v3) as packed T pairs (low element first), the layout of
// int8::i8x4_to_x4, so the two weight formats share their mma fragments.
template <typename T>
__device__ __forceinline__ void e4m3x4_to_x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = e4m3x2_to_f16x2(static_cast<uint16_t>(w & 0xffffu));
  hi = e4m3x2_to_f16x2(static_cast<uint16_t>(w >> 16));
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // fp16 -> fp32 -> bf16, exact
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    const __nv_bfloat162 ab = __floats2bfloat162_rn(a.x, a.y), bb = __floats2bfloat162_rn(b.x, b.y);
    lo = *reinterpret_cast<const uint32_t*>(&ab);
    hi = *reinterpret_cast<const uint32_t*>(&bb);
  }
}

// fp32 -> e4m3, rounded to nearest even and saturated at +-448 (the FP8 KV cache's writes: ops/kv_cache.py's
// quantize_kv rounds and clamps the same way).
__device__ __forceinline__ uint8_t e4m3_from_float(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace fp8
}  // namespace fuseinfer
