// Device helpers shared by the kernels: the PDL wait / trigger, fp32 <-> element-type conversion, warp reductions
// and the m16n8k16 tensor-core mma.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fuseinfer {

// Programmatic dependent launch (sm_90+; the contract is in launch.h, which launches kernels with it).
// Waits until the previous kernel in the stream has completed and its memory is visible (no-op without PDL).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Allows the next kernel in the stream to be launched before this one completes (no-op without PDL).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Coherent global loads for data that an earlier kernel of the stream writes (read after pdl_wait()). Not
// __ldg / ld.global.nc: ptxas treats .nc data as constant for the kernel's whole life and may move such a load above
// griddepcontrol.wait, where it reads the previous kernel's output before that kernel has written it. In a CUDA
// graph, where kernels run back to back, the int8 GEMV's activation loads did exactly that (wrong tokens with PDL,
// right ones without). asm volatile keeps each load after the wait, which is asm volatile too. Only data no kernel
// writes (weights, embeddings) may take the .nc path.
__device__ __forceinline__ uint4 ld_dep(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}
__device__ __forceinline__ uint2 ld_dep(const uint2* ptr) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}
__device__ __forceinline__ unsigned ld_dep(const unsigned* ptr) {
  unsigned v;
  asm volatile("ld.global.u32 %0, [%1];\n" : "=r"(v) : "l"(ptr));
  return v;
}
__device__ __forceinline__ unsigned short ld_dep(const unsigned short* ptr) {
  unsigned short v;
  asm volatile("ld.global.u16 %0, [%1];\n" : "=h"(v) : "l"(ptr));
  return v;
}
__device__ __forceinline__ float ld_dep(const float* ptr) {
  return __uint_as_float(ld_dep(reinterpret_cast<const unsigned*>(ptr)));
}

// ld_dep for any trivially copyable T of 2, 4, 8 or 16 bytes (a pack of elements, one element).
template <typename T>
__device__ __forceinline__ T ld_dep_as(const T* ptr) {
  static_assert(sizeof(T) == 16 || sizeof(T) == 8 || sizeof(T) == 4 || sizeof(T) == 2, "ld_dep_as: 2 to 16 bytes");
  T out;
  if constexpr (sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(&out) = ld_dep(reinterpret_cast<const uint4*>(ptr));
  } else if constexpr (sizeof(T) == 8) {
    *reinterpret_cast<uint2*>(&out) = ld_dep(reinterpret_cast<const uint2*>(ptr));
  } else if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<unsigned*>(&out) = ld_dep(reinterpret_cast<const unsigned*>(ptr));
  } else {
    *reinterpret_cast<unsigned short*>(&out) = ld_dep(reinterpret_cast<const unsigned short*>(ptr));
  }
  return out;
}

// One element to fp32 (exact for every type: a bf16 is the top half of an fp32) and back (round to nearest even).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __uint_as_float(static_cast<unsigned>(__bfloat16_as_ushort(v)) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The rotary embedding of the element pair that rotate_half mixes (x1 at column d of a head, x2 at d + D / 2), as
// transformers' apply_rotary_pos_emb computes x * cos + rotate_half(x) * sin: fp32 inside, each output rounded once.
template <typename T>
__device__ __forceinline__ void rope_pair(float x1, float x2, float c1, float s1, float c2, float s2, T& y1, T& y2) {
  y1 = from_float<T>(fmaf(x1, c1, -x2 * s1));
  y2 = from_float<T>(fmaf(x2, c2, x1 * s2));
}

// Sum and maximum of v over the 32 lanes of a warp (every lane gets the result).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// c (16x8, fp32) += a (16x16, row) * b (16x8, col) for T = __half or __nv_bfloat16 (sm_80+).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the hosts only pick tensor-core paths on sm_80+
#endif
}

}  // namespace fuseinfer
