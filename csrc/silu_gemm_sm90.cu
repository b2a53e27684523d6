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
// Why not cuBLASLt or CUTLASS: neither has a gated epilogue for 16-bit GEMMs (cuBLASLt's epilogues are per element;
// a CUTLASS epilogue sees one output tile, in which gate column j and up column F + j never meet). Here a CTA's
// B operand is two 128-row boxes of the same tensor map, gate rows [j0, j0 + 128) and up rows [j0, j0 + 128) (the
// map is (K, F, 2): rows past F are zero-filled per half), side by side as one 256-row operand, so each consumer
// thread holds gate and up of the same outputs 64 registers apart: the epilogue is elementwise.
//
// Structure (the wgmma attention prefill's, attention.cu): a persistent grid of one CTA per SM walks 128 x 128
// output tiles in grouped order (GROUP_M row tiles side by side, so a wave's x rows stay in L2 and each weight tile
// is read from DRAM about once per group). A producer thread loads x (128 x 64) and both weight boxes (2 x 128 x 64)
// per k-block through a STAGES-deep ring of shared-memory stages with TMA (128-byte swizzle, sm90.cuh); two consumer
// warpgroups of 64 rows each issue per k16 step one m64n256k16 wgmma (gate and up; operands in shared memory), keep
// one k-block's wgmmas in flight while waiting for the next, and hand each stage back when its wgmmas are done. The
// ring runs on across tiles. At a tile's end the consumers only round gate and up to T into a shared-memory
// hand-off buffer and go on to the next tile; three epilogue warps (of the producer's warpgroup, otherwise idle)
// compute silu(gate) * up from it and store y while the tensor cores run the next tile.
//
// Measured (H200; ncu at Llama-3.1-8B's MLP, 2048 rows): two m64n128 wgmmas per k16 step and the epilogue in the
// consumers 829 us, tensor pipe busy 86% of the cycles (cuBLAS's plain GEMM of the same size: 736 us, 95%); with the
// hand-off 816 us; with one m64n256 wgmma 778 us, 90%. Its time against cuBLASLt's GEMM + silu_mul
// (bench/bench_silu_gemm.py, one run): 0.96-0.99x at 2048-8192 rows of the Llama MLPs, 1.06-1.09x at Qwen2.5-1.5B's
// (K 1536), 1.0-1.5x at 128-512 rows (64-70 tiles at 128 rows, under one wave of 132 SMs; 280-448 at 512, a partial
// last wave). A few percent at best where it wins, more lost elsewhere: opt-in (FUSEINFER_SILU_GEMM=1), the default
// stays the pair.
#include "device_utils.cuh"
#include "knobs.h"
#include "launch.h"
#include "path_counts.h"
#include "sm90.cuh"
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

// The tile: BM = 128 rows of x (two consumer warpgroups of 64), BN = 128 outputs (128 gate and 128 up rows of w),
// BK = 64 k per stage (one 128-byte swizzled row).
constexpr int BM = 128, BN = 128, BK = 64;
constexpr int STAGES = 3;
constexpr int GROUP_M = 16;  // row tiles per raster group
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;  // one half (gate or up)
constexpr int STAGE_BYTES = A_BYTES + 2 * B_BYTES;
// The hand-off buffer: gate and up of one tile rounded to T, rows padded by 8 elements so that a warp's 32-bit
// writes (8 rows x 4 words) fall in 32 banks.
constexpr int C_LD = BN + 8;
constexpr int C_BYTES = 2 * BM * C_LD * 2;
constexpr int SMEM = STAGES * STAGE_BYTES + C_BYTES + 1024;  // + 1024-byte alignment slack (swizzle atoms)
constexpr int THREADS = 384;  // two consumer warpgroups, then a warpgroup of the producer warp and 3 epilogue warps
constexpr int EPI_THREADS = 96;
// An SM sub-partition (16384 registers) holds one producer / epilogue warp and two consumer warps.
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
static_assert(32 * (PRODUCER_REGS + 2 * CONSUMER_REGS) <= 16384, "registers of one SM sub-partition");

struct Params {
  void* y;  // (M, F) contiguous
  int m, f, k;
  int tiles_m, tiles_n;
  bool vec;  // y 16-byte aligned and F % 8 == 0: 16-byte stores of 8 outputs
};

// Tile t in grouped order: GROUP_M row tiles (the last group may be short) walked column tile by column tile.
__device__ __forceinline__ void tile_of(const Params& p, int t, int& mt, int& nt) {
  const int per_group = GROUP_M * p.tiles_n;
  const int gi = t / per_group, r = t - gi * per_group;
  const int size = min(GROUP_M, p.tiles_m - gi * GROUP_M);
  mt = gi * GROUP_M + r % size;
  nt = r / size;
}

__device__ __forceinline__ uint32_t bits16(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

template <typename T>
__device__ __forceinline__ uint32_t pack_t(float lo, float hi) {
  return bits16(from_float<T>(lo)) | (bits16(from_float<T>(hi)) << 16);
}

// silu(gate) * up of two T values as silu_mul.cu computes it: silu in fp32 rounded to T, the product rounded to T.
template <typename T>
__device__ __forceinline__ T silu_mul1(T gate, T up) {
  const float g = to_float(gate);
  const T act = from_float<T>(g / (1.f + expf(-g)));
  return from_float<T>(to_float(act) * to_float(up));
}

template <typename T>
__global__ void __launch_bounds__(THREADS, 1)
    silu_gemm_kernel(const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_w,
                     const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // per stage [x: BM][64] | [gate: BN][64] | [up: BN][64], 1024-byte aligned; then the hand-off buffer
  // [gate: BM][C_LD] | [up: BM][C_LD] of T
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  T* c_gate = reinterpret_cast<T*>(smem + STAGES * STAGE_BYTES);
  T* c_up = c_gate + BM * C_LD;
  __shared__ __align__(8) uint64_t full_bar[STAGES], empty_bar[STAGES], c_full, c_empty;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], 8);  // one arrival per consumer warp
    }
    mbar_init(&c_full, 256);          // every consumer thread, after writing its part of a tile
    mbar_init(&c_empty, EPI_THREADS);  // every epilogue thread, after reading the tile
    fence_mbarrier_init();
  }
  pdl_launch_dependents();
  pdl_wait();  // x comes from the previous kernel
  __syncthreads();

  const int tiles = p.tiles_m * p.tiles_n;
  const int k_blocks = (p.k + BK - 1) / BK;

  if (warp >= 8) {  // ---- the last warpgroup: lane 0 of warp 8 loads, warps 9-11 run the epilogue ----
    setmaxnreg_dec<PRODUCER_REGS>();
    if (warp == 8) {
      if (lane != 0) return;
      int it = 0;  // ring k-blocks loaded so far: k-block i uses stage i % STAGES for the (i / STAGES)-th time
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int mt, nt;
        tile_of(p, t, mt, nt);
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) mbar_wait(&empty_bar[s], (it / STAGES - 1) & 1);
          unsigned char* dst = smem + s * STAGE_BYTES;
          // every box's bytes land, zero-filled out of bounds
          mbar_expect_tx(&full_bar[s], STAGE_BYTES);
          tma_load_4d(dst, &tm_x, kb * BK, mt * BM, 0, 0, &full_bar[s]);
          tma_load_4d(dst + A_BYTES, &tm_w, kb * BK, nt * BN, 0, 0, &full_bar[s]);            // gate rows
          tma_load_4d(dst + A_BYTES + B_BYTES, &tm_w, kb * BK, nt * BN, 1, 0, &full_bar[s]);  // up rows
        }
      }
      return;
    }
    // Epilogue: a tile's 128 rows x 16 chunks of 8 outputs, chunk i of the 96 threads i, i + 96, ...: a warp covers
    // two rows, 16-byte loads of gate and up and one 16-byte store of y per chunk (scalar where F % 8 != 0).
    const int e = tid - 9 * 32;
    T* y = static_cast<T*>(p.y);
    int n = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
      int mt, nt;
      tile_of(p, t, mt, nt);
      mbar_wait(&c_full, n & 1);
      for (int i = e; i < BM * (BN / 8); i += EPI_THREADS) {
        const int r = i >> 4, c = (i & 15) * 8;
        const int row = mt * BM + r, col = nt * BN + c;
        if (row >= p.m || col >= p.f) continue;
        const uint4 gv = *reinterpret_cast<const uint4*>(c_gate + r * C_LD + c);
        const uint4 uv = *reinterpret_cast<const uint4*>(c_up + r * C_LD + c);
        const T* g8 = reinterpret_cast<const T*>(&gv);
        const T* u8 = reinterpret_cast<const T*>(&uv);
        T* out = y + static_cast<int64_t>(row) * p.f + col;
        if (p.vec && col + 8 <= p.f) {
          uint4 o;
          uint32_t* o32 = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            o32[j] = bits16(silu_mul1<T>(g8[2 * j], u8[2 * j])) |
                     (bits16(silu_mul1<T>(g8[2 * j + 1], u8[2 * j + 1])) << 16);
          }
          *reinterpret_cast<uint4*>(out) = o;
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (col + j < p.f) out[j] = silu_mul1<T>(g8[j], u8[j]);
          }
        }
      }
      mbar_arrive(&c_empty);
    }
    return;
  }

  // ---- consumer warpgroups: g holds rows 64 g .. 64 g + 63 of the tile ----
  setmaxnreg_inc<CONSUMER_REGS>();
  const int g = warp >> 2, wi = warp & 3;
  const uint32_t base = smem_addr(smem);
  // One m64n256 accumulator: the stage's gate and up boxes are one 256-row B operand (up right after gate), so
  // register 4i + e (i < 16) holds gate and register 64 + 4i + e up of the same output (layout: sm90.cuh).
  float d[128];
  int it = 0, n = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const int s = it % STAGES;
      mbar_wait(&full_bar[s], (it / STAGES) & 1);
      const uint32_t a_addr = base + s * STAGE_BYTES + g * 64 * 128;
      const uint32_t b_addr = base + s * STAGE_BYTES + A_BYTES;  // gate rows, then up rows
      wgmma_fence();
      wgmma_fence_operands(d);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const uint32_t off = kk * 32;  // k16 step: 32 bytes along a 128-byte row
        wgmma_ss_n256<T>(d, wgmma_desc(a_addr + off, 16, 1024), wgmma_desc(b_addr + off, 16, 1024), kb > 0 || kk > 0);
      }
      wgmma_commit();
      wgmma_fence_operands(d);
      wgmma_wait<1>();  // the previous k-block's wgmmas are done: its stage goes back
      if (kb > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty_bar[(it - 1) % STAGES]);
      }
    }
    wgmma_wait<0>();
    wgmma_fence_operands(d);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty_bar[(it - 1) % STAGES]);

    // Hand-off: gate and up rounded to T (the GEMM's output, as the unfused pair stores it) into the buffer, once
    // the epilogue warps are done with the previous tile; they finish the tile while this one's successor runs.
    // Register 4i + e of the lane is row 16 wi + lane / 4 + 8 (e / 2), column 8i + 2 (lane % 4) + e % 2.
    if (n > 0) mbar_wait(&c_empty, (n - 1) & 1);
    const int r0 = 64 * g + 16 * wi + (lane >> 2), c0 = 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int off = (r0 + 8 * h) * C_LD + c0 + 8 * i, r = 4 * i + 2 * h;
        *reinterpret_cast<uint32_t*>(c_gate + off) = pack_t<T>(d[r], d[r + 1]);
        *reinterpret_cast<uint32_t*>(c_up + off) = pack_t<T>(d[64 + r], d[64 + r + 1]);
      }
    }
    mbar_arrive(&c_full);
  }
#endif
}

}  // namespace silu_gemm

// y = silu(x @ w[:F]^T) * (x @ w[F:]^T) with the kernel above; false (nothing launched) where it does not apply:
// not built for sm_90a, another GPU, FUSEINFER_SILU_GEMM off (the default), fp32, K % 8 != 0 (TMA's 16-byte
// strides), x or w not 16-byte aligned, or tensor maps that do not encode. x (M, K) and w (2F, K) contiguous in one
// dtype, y (M, F).
bool silu_gemm_sm90(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
#if defined(FUSEINFER_SM90A)
  using namespace silu_gemm;
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
      !make_tensor_map(&tm_w, w.data_ptr(), bf16, 1, 2, f, static_cast<int>(k), 0, f * k, k, BN))
    return false;
  Params p;
  p.y = y.data_ptr();
  p.m = static_cast<int>(m);
  p.f = static_cast<int>(f);
  p.k = static_cast<int>(k);
  p.tiles_m = static_cast<int>((m + BM - 1) / BM);
  p.tiles_n = static_cast<int>((f + BN - 1) / BN);
  p.vec = f % 8 == 0 && reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0;
  if (int64_t(p.tiles_m) * p.tiles_n > INT32_MAX) return false;
  auto kernel = bf16 ? silu_gemm_kernel<__nv_bfloat16> : silu_gemm_kernel<__half>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  const int ctas = std::min(p.tiles_m * p.tiles_n, props->multiProcessorCount);
  launch_kernel(kernel, dim3(ctas), THREADS, SMEM, at::cuda::getCurrentCUDAStream(), tm_x, tm_w, p);
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
