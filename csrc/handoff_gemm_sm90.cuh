// The sm_90a GEMM under the fused-epilogue projections (silu_gemm_sm90.cu: gate/up with SiLU(gate) * up;
// qkv_rope_gemm_sm90.cu: q/k/v with the rotary embedding, the split and the cache write):
//
//   acc (M, 256 per tile) = x (M, K) @ w^T over two 128-row boxes of w per tile, + bias, rounded to T,
//
// handed to an epilogue policy that sees the whole 64 x 256 tile at once. The two boxes are what makes the fused
// epilogues elementwise: gate rows [j0, j0 + 128) and up rows [F + j0, ...) for SiLU * up; 256 consecutive rows of
// the q/k/v weight (whole heads, so both columns of every rotate_half pair) for the rotary.
//
// Why not cuBLASLt or CUTLASS: neither has these epilogues for 16-bit GEMMs (cuBLASLt's are per element; a CUTLASS
// epilogue sees one output tile, in which gate column j and up column F + j never meet, and writes one tensor where
// the q/k/v epilogue scatters to three).
//
// Structure (the wgmma attention prefill's, attention.cu): a persistent grid of one CTA per SM walks 64 x 256 tiles
// in grouped order (GROUP_M row tiles side by side, so a wave's x rows stay in L2 and each weight tile is read from
// DRAM about once per group). A producer thread loads x (64 x 64) and both weight boxes (2 x 128 x 64) per k-block
// through a STAGES-deep ring of shared-memory stages with TMA (128-byte swizzle, sm90.cuh); consumer warpgroup g
// issues per k16 step one m64n128k16 wgmma against box g (operands in shared memory, x shared by both), keeps one
// k-block's wgmmas in flight while waiting for the next, and hands each stage back when its wgmmas are done. The ring
// runs on across tiles. At a tile's end the consumers only add the bias, round to T into a shared-memory hand-off
// buffer (half g) and go on to the next tile; three epilogue warps (of the producer's warpgroup, otherwise idle) run
// the policy on it while the tensor cores run the next tile.
//
// 64-row tiles rather than 128 (two warpgroups over rows, each m64n256): the q/k/v projections have few 256-column
// tiles (12 for Llama-3.2-1B), so 128-row tiles left most SMs idle below a few thousand rows and quantised the last
// wave badly above (H200: 47 us at 128 rows where cuBLASLt + qkv_rope_append take 14; 24 us with 64-row tiles). The
// gate/up GEMM lost 2-8% at 2048 rows by it (one m64n256 wgmma per warpgroup and k16 step keeps the tensor cores
// busier than one m64n128); both are opt-in, so one kernel serves them.
#pragma once
#include "device_utils.cuh"
#include "launch.h"
#include "sm90.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fuseinfer {
namespace handoff_gemm {

// The tile: BM = 64 rows of x, two boxes of BH = 128 weight rows (one per consumer warpgroup), BK = 64 k per stage
// (one 128-byte swizzled row).
constexpr int BM = 64, BH = 128, BK = 64;
constexpr int STAGES = 4;
constexpr int GROUP_M = 32;  // row tiles per raster group
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BH * BK * 2;  // one box
constexpr int STAGE_BYTES = A_BYTES + 2 * B_BYTES;
// The hand-off buffer: the tile's two 128-column halves rounded to T, rows padded by 8 elements so that a warp's
// 32-bit writes (8 rows x 4 words) fall in 32 banks.
constexpr int C_LD = BH + 8;
constexpr int C_BYTES = 2 * BM * C_LD * 2;
constexpr int SMEM = STAGES * STAGE_BYTES + C_BYTES + 1024;  // + 1024-byte alignment slack (swizzle atoms)
constexpr int THREADS = 384;  // two consumer warpgroups, then a warpgroup of the producer warp and 3 epilogue warps
constexpr int EPI_THREADS = 96;
// Registers per thread after setmaxnreg: the launch gives each of the 384 threads 168 (65536 / 384 rounded down to
// a multiple of 8), and the warpgroups only trade them, so 128 PRODUCER_REGS + 256 CONSUMER_REGS <= 384 * 168. The
// consumers hold a 64-register accumulator; the epilogue warps keep loads in flight.
constexpr int PRODUCER_REGS = 136, CONSUMER_REGS = 184;
static_assert(PRODUCER_REGS + 2 * CONSUMER_REGS <= 3 * 168, "the registers the launch gives the block");

// The GEMM's geometry. w's tensor map is 4-D (K, rows, planes, 1); tile nt's box h (0, 1) starts at row
// nt * tile_rows + h * half_rows of plane h * half_plane: (gate/up) tile_rows 128, half_rows 0, half_plane 1 on a
// (K, F, 2) map; (q/k/v) tile_rows 256, half_rows 128, half_plane 0 on a (K, N, 1) map.
struct Grid {
  int m, k;
  int tiles_m, tiles_n;
  int tile_rows, half_rows, half_plane;
  const void* bias;  // (bias_n,) of T (kernels with BIAS): column nt * tile_rows + h * half_rows + c of half h
  int bias_n;
};

// Tile t in grouped order: GROUP_M row tiles (the last group may be short) walked column tile by column tile.
__device__ __forceinline__ void tile_of(const Grid& g, int t, int& mt, int& nt) {
  const int per_group = GROUP_M * g.tiles_n;
  const int gi = t / per_group, r = t - gi * per_group;
  const int size = min(GROUP_M, g.tiles_m - gi * GROUP_M);
  mt = gi * GROUP_M + r % size;
  nt = r / size;
}

__device__ __forceinline__ uint32_t bits16(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

template <typename T>
__device__ __forceinline__ uint32_t pack_t(float lo, float hi) {
  return bits16(from_float<T>(lo)) | (bits16(from_float<T>(hi)) << 16);
}

// BIAS: the hand-off adds p.bias (x @ w^T + bias). Epi: a trivially copyable policy with
//   __device__ void operator()(const T* lo, const T* hi, int mt, int nt, int e) const
// run by each epilogue thread e in [0, EPI_THREADS) on tile (mt, nt): lo and hi are the tile's halves (the boxes'
// columns), [BM][C_LD] each, element (r, c) at r * C_LD + c.
template <typename T, bool BIAS, typename Epi>
__global__ void __launch_bounds__(THREADS, 1)
    handoff_gemm_kernel(const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_w,
                        const Grid p, const Epi epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // per stage [x: BM][64] | [box 0: BH][64] | [box 1: BH][64], 1024-byte aligned (each part a multiple of 1024
  // bytes); then the hand-off buffer
  // [half 0: BM][C_LD] | [half 1: BM][C_LD] of T
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  T* c_lo = reinterpret_cast<T*>(smem + STAGES * STAGE_BYTES);
  T* c_hi = c_lo + BM * C_LD;
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
  pdl_wait();  // x (and the epilogue's operands) come from earlier kernels
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
        const int row0 = nt * p.tile_rows;
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) mbar_wait(&empty_bar[s], (it / STAGES - 1) & 1);
          unsigned char* dst = smem + s * STAGE_BYTES;
          // every box's bytes land, zero-filled out of bounds
          mbar_expect_tx(&full_bar[s], STAGE_BYTES);
          tma_load_4d(dst, &tm_x, kb * BK, mt * BM, 0, 0, &full_bar[s]);
          tma_load_4d(dst + A_BYTES, &tm_w, kb * BK, row0, 0, 0, &full_bar[s]);
          tma_load_4d(dst + A_BYTES + B_BYTES, &tm_w, kb * BK, row0 + p.half_rows, p.half_plane, 0, &full_bar[s]);
        }
      }
      return;
    }
    const int e = tid - 9 * 32;
    int n = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
      int mt, nt;
      tile_of(p, t, mt, nt);
      mbar_wait(&c_full, n & 1);
      epi(c_lo, c_hi, mt, nt, e);
      mbar_arrive(&c_empty);
    }
    return;
  }

  // ---- consumer warpgroups: g computes the tile's columns of box g ----
  setmaxnreg_inc<CONSUMER_REGS>();
  const int g = warp >> 2, wi = warp & 3;
  const uint32_t base = smem_addr(smem);
  const T* bias = static_cast<const T*>(p.bias);
  T* c_out = g == 0 ? c_lo : c_hi;
  float d[64];  // m64n128: register 4i + e is row 16 wi + lane / 4 + 8 (e / 2), column 8i + 2 (lane % 4) + e % 2
  int it = 0, n = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const int s = it % STAGES;
      mbar_wait(&full_bar[s], (it / STAGES) & 1);
      const uint32_t a_addr = base + s * STAGE_BYTES;
      const uint32_t b_addr = a_addr + A_BYTES + g * B_BYTES;
      wgmma_fence();
      wgmma_fence_operands(d);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const uint32_t off = kk * 32;  // k16 step: 32 bytes along a 128-byte row
        wgmma_ss_n128<T>(d, wgmma_desc(a_addr + off, 16, 1024), wgmma_desc(b_addr + off, 16, 1024), kb > 0 || kk > 0);
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

    // Hand-off: (+ bias in fp32) rounded to T (the GEMM's output as cuBLASLt's bias epilogue rounds it) into half g
    // of the buffer, once the epilogue warps are done with the previous tile; they finish the tile while this one's
    // successor runs.
    if (n > 0) mbar_wait(&c_empty, (n - 1) & 1);
    const int r0 = 16 * wi + (lane >> 2), c0 = 2 * (lane & 3);
    int col0 = 0;  // (BIAS) this thread's first bias column
    if constexpr (BIAS) {
      int mt, nt;
      tile_of(p, t, mt, nt);
      col0 = nt * p.tile_rows + g * p.half_rows + c0;
    }
#pragma unroll
    for (int i = 0; i < BH / 8; ++i) {
      float bc[2] = {0.f, 0.f};  // (BIAS)
      if constexpr (BIAS) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = col0 + 8 * i + j;
          bc[j] = c < p.bias_n ? to_float(ld_dep_as(bias + c)) : 0.f;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int off = (r0 + 8 * h) * C_LD + c0 + 8 * i, r = 4 * i + 2 * h;
        if constexpr (BIAS) {
          *reinterpret_cast<uint32_t*>(c_out + off) = pack_t<T>(d[r] + bc[0], d[r + 1] + bc[1]);
        } else {
          *reinterpret_cast<uint32_t*>(c_out + off) = pack_t<T>(d[r], d[r + 1]);
        }
      }
    }
    mbar_arrive(&c_full);
  }
#else
  (void)tm_x;
  (void)tm_w;
  (void)p;
  (void)epi;
#endif
}

}  // namespace handoff_gemm
}  // namespace fuseinfer
