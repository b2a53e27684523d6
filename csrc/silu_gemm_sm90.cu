// The gated MLP's gate/up projection on sm_90a as one GEMM with SiLU(gate) * up in its epilogue (linear_epilogue's
// activation "silu_mul" at prefill sizes):
//
//   y (M, F) = silu(x @ w[:F]^T) * (x @ w[F:]^T),  x (M, K), w (2F, K): the gate rows, then the up rows (the
//   family's fused gate_up weight as stored; no reordering),
//
// rounded as linear + silu_mul.cu round it: gate and up to T, silu in fp32 rounded to T, the product rounded to T.
// The (M, 2F) gate/up intermediate never exists: the kernel writes y once, half of a plain GEMM's output, and the
// separate silu_mul pass (reading 2F and writing F per row) is gone.
//
// The GEMM is handoff_gemm_sm90.cuh's: a tile's two weight boxes are gate rows [j0, j0 + 128) and up rows
// [j0, j0 + 128) of a (K, F, 2) tensor map (rows past F zero-filled per half), so the hand-off buffer's halves hold
// gate and up of the same 128 outputs and the epilogue is elementwise.
//
// Measured against cuBLASLt's GEMM + silu_mul (bench/bench_silu_gemm.py, H200, one run, fp16): 0.99-1.11x the time
// at 2048-8192 rows of the Llama MLPs, 1.14-1.21x at Qwen2.5-1.5B's (K 1536), 0.76-1.28x at 128-512 rows. Not faster
// where prefill spends its time: opt-in (FUSEINFER_SILU_GEMM=1), the default stays the pair.
#include "handoff_gemm_sm90.cuh"
#include "knobs.h"
#include "path_counts.h"
#include "tma_map.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace fuseinfer {
namespace silu_gemm {

using handoff_gemm::BH;
using handoff_gemm::BM;
using handoff_gemm::C_LD;
using handoff_gemm::EPI_THREADS;

// silu(gate) * up of two T values as silu_mul.cu computes it: silu in fp32 rounded to T, the product rounded to T.
template <typename T>
__device__ __forceinline__ T silu_mul1(T gate, T up) {
  const float g = to_float(gate);
  const T act = from_float<T>(g / (1.f + expf(-g)));
  return from_float<T>(to_float(act) * to_float(up));
}

// The epilogue: a tile's BM rows x 16 chunks of 8 outputs, chunk i of the 96 threads i, i + 96, ...: a warp covers
// two rows, 16-byte loads of gate and up and one 16-byte store of y per chunk (scalar where F % 8 != 0).
template <typename T>
struct SiluMul {
  T* y;  // (M, F) contiguous
  int m, f;
  bool vec;  // y 16-byte aligned and F % 8 == 0: 16-byte stores of 8 outputs

  __device__ void operator()(const T* c_gate, const T* c_up, int mt, int nt, int e) const {
    for (int i = e; i < BM * (BH / 8); i += EPI_THREADS) {
      const int r = i >> 4, c = (i & 15) * 8;
      const int row = mt * BM + r, col = nt * BH + c;
      if (row >= m || col >= f) continue;
      const uint4 gv = *reinterpret_cast<const uint4*>(c_gate + r * C_LD + c);
      const uint4 uv = *reinterpret_cast<const uint4*>(c_up + r * C_LD + c);
      const T* g8 = reinterpret_cast<const T*>(&gv);
      const T* u8 = reinterpret_cast<const T*>(&uv);
      T* out = y + static_cast<int64_t>(row) * f + col;
      if (vec && col + 8 <= f) {
        uint4 o;
        uint32_t* o32 = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          o32[j] = handoff_gemm::bits16(silu_mul1<T>(g8[2 * j], u8[2 * j])) |
                   (handoff_gemm::bits16(silu_mul1<T>(g8[2 * j + 1], u8[2 * j + 1])) << 16);
        }
        *reinterpret_cast<uint4*>(out) = o;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (col + j < f) out[j] = silu_mul1<T>(g8[j], u8[j]);
        }
      }
    }
  }
};

}  // namespace silu_gemm

// y = silu(x @ w[:F]^T) * (x @ w[F:]^T) with the kernel above; false (nothing launched) where it does not apply:
// not built for sm_90a, another GPU, FUSEINFER_SILU_GEMM off (the default), fp32, K % 8 != 0 (TMA's 16-byte
// strides), x or w not 16-byte aligned, or tensor maps that do not encode. x (M, K) and w (2F, K) contiguous in one
// dtype, y (M, F).
bool silu_gemm_sm90(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
#if defined(FUSEINFER_SM90A)
  using namespace handoff_gemm;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), k = x.size(1), f = w.size(0) / 2;
  if (knob(Knob::kSiluGemm) == 0 || props->major != 9 || props->minor != 0 ||
      (dtype != at::kHalf && dtype != at::kBFloat16) || k % 8 != 0 || m < 1 || f < 1 || m > INT32_MAX / 2 ||
      f > INT32_MAX / 2 || k > INT32_MAX / 2 || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 != 0)
    return false;
  const bool bf16 = dtype == at::kBFloat16;
  CUtensorMap tm_x, tm_w;
  // x as (1, 1, M, K) in boxes of BM rows; w as (1, 2, F, K): half 0 the gate rows, half 1 the up rows
  if (!make_tensor_map(&tm_x, x.data_ptr(), bf16, 1, 1, m, static_cast<int>(k), 0, 0, k, BM) ||
      !make_tensor_map(&tm_w, w.data_ptr(), bf16, 1, 2, f, static_cast<int>(k), 0, f * k, k, BH))
    return false;
  Grid g{};
  g.m = static_cast<int>(m);
  g.k = static_cast<int>(k);
  g.tiles_m = static_cast<int>((m + BM - 1) / BM);
  g.tiles_n = static_cast<int>((f + BH - 1) / BH);
  g.tile_rows = BH;
  g.half_rows = 0;
  g.half_plane = 1;
  if (int64_t(g.tiles_m) * g.tiles_n > INT32_MAX) return false;
  const bool vec = f % 8 == 0 && reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int ctas = std::min(g.tiles_m * g.tiles_n, props->multiProcessorCount);
  auto run = [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    const silu_gemm::SiluMul<T> epi{static_cast<T*>(y.data_ptr()), g.m, static_cast<int>(f), vec};
    auto kernel = handoff_gemm_kernel<T, false, silu_gemm::SiluMul<T>>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    launch_kernel(kernel, dim3(ctas), THREADS, SMEM, stream, tm_x, tm_w, g, epi);
  };
  if (bf16)
    run(static_cast<__nv_bfloat16*>(nullptr));
  else
    run(static_cast<__half*>(nullptr));
  count_path(Path::kLinearSiluGemm);
  return true;
#else
  (void)x;
  (void)w;
  (void)y;
  return false;
#endif
}

}  // namespace fuseinfer
