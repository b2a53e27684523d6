// The weight-streaming skinny GEMM (decode GEMV) of linear_epilogue (fp16 / bf16 weights, linear.cu) and of
// w8a16_linear (int8 weights, w8a16_linear.cu), written once and templated on the weight format:
//
//   y (M, N) = act(scale[n] * (x (M, K) @ w (N, K)^T) + bias[n] + residual[m, n]),  M <= 16, one store of y,
//
// with `scale` only for int8 weights; or, with SILU (the gated MLP's gate/up projection, activation "silu_mul"),
//
//   y (M, F) = silu(gate) * up,  gate = scale[f] * (x @ w[f]^T) + bias[f],  up = the same of row F + f,
//
// for w (2F, K) holding the gate rows then the up rows (the Llama family's fused gate_up weight, as stored): a tile's
// 16 mma rows are then 8 gate rows and the 8 up rows of the same outputs (rows g and g + 8 of the lane, below), so
// both halves of an output meet in one block's epilogue, with no reordering of the weight. Or, with ROPE (the fused
// q/k/v projection at decode, w ((H + 2 Hkv) D, K)), the rotary embedding and the k / v cache write of
// rope.cu's qkv_rope_append in the epilogue: a tile's rows are dims d .. d + 7 of one head and the dims d + D/2 ..
// that rotate_half pairs with them (D % 16 == 0, so a tile stays within a head); q goes to q (B, H, S, D), k and v to
// the caches at slots[s]. A persistent grid (one wave: as many blocks as fit on the GPU, at most one per
// 16-row tile of w) walks the tiles; a block's warps split K and stream the tile with 16-byte L1-bypassing loads,
// always two k-blocks (of this or the next tile) in flight while multiplying the one before by all M tokens of x
// with mma.sync m16n8k16 (fp32 accumulate). At each tile's end the warps' partial sums meet in shared memory and the
// epilogue (scale, bias, residual, ReLU) runs before the single store, with its operands loaded a tile ahead.
// Launched with PDL (launch.h): each warp's first two k-blocks of weights are requested before waiting for the
// kernel that writes x (docs/notes.md: 77 -> 92% of copy for OPT-1.3b's qkv at M = 1 in a CUDA graph, against one
// k-block and the epilogue's loads at its end).
//
// What differs between the formats is a policy class W (HalfWeights, Int8Weights / Fp8Weights below):
//   W::kChunkElems          elements of K per 16-byte weight chunk (8 fp16/bf16, 16 int8 / e4m3); x's chunks are 8
//                           wide, so a weight chunk pairs with kChunkElems / 8 chunks of x;
//   W::unroll<NT>()         k-steps (of 4 chunks of a row) per k-block, for NT n-tiles of 8 tokens;
//   W::kScaled              whether the epilogue multiplies by scale[n];
//   W::mma<T, NT, U>(acc, frag)   the mmas of one k-block.
// Kept free of torch headers (the host launcher below is not) so that tools/int8_harness.cu compiles the kernel
// standalone with -DFUSEINFER_KERNEL_HARNESS.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_utils.cuh"
#include "fp8_convert.cuh"
#include "int8_convert.cuh"
#ifndef FUSEINFER_KERNEL_HARNESS
#include "launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <type_traits>
#endif

namespace fuseinfer {
namespace skinny {

constexpr int kMaxM = 16;     // tokens served (one or two n-tiles of 8)
constexpr int kRows = 16;     // rows of w (outputs) per tile = the mma's m
constexpr int kMaxWarps = 16;

struct Params {
  const void* x;         // (M, K), T
  const void* w;         // (N, K), T or int8
  const float* scale;    // (N,) for int8 weights, else unused
  const void* bias;      // (N,) T or null
  const void* residual;  // (M, N) T or null (always null with SILU)
  void* y;               // (M, N) T
  int m, n, k;           // with SILU: n = F outputs; w, scale and bias have 2F rows; ROPE: n = (H + 2 Hkv) D / 2
  bool relu;
};

// ROPE only (m = B S tokens, token = b S + s): the rotary tables (B, S, D) in T (null: no rotation, the split and the
// cache write alone, for OPT's q/k/v), q (B, H, S, D), the caches
// (B, Hkv, T, D) and their slots (S,) (stride slots_stride; a slot outside [0, T) is skipped). A kernel parameter of
// its own rather than more fields of Params: with them in Params, ptxas spilled registers in the plain fp16 kernel
// (M <= 8, at its 128-register cap), which cost the fp16 decode step ~10%.
struct RopeParams {
  const void* cos = nullptr;
  const void* sin = nullptr;
  void* q = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int64_t* slots = nullptr;
  int64_t slots_stride = 0;
  int seq = 0, cache_len = 0, heads = 0, kv_heads = 0, head_dim = 0;
};

// The norm prologue (template parameter NORM): none, RMSNorm (the Llama family's) or LayerNorm (OPT's).
enum Norm : int { kNoNorm = 0, kRmsNorm = 1, kLayerNorm = 2 };

// NORM only: the norm prologue's operands. x then holds the un-normalised rows h, and every block stages the
// normalised rows in shared memory before its first dot product, in fp32 statistics per row:
//   kRmsNorm:   x = round(round(h * rstd) * weight), rstd = rsqrt(mean(h^2) + eps): add_rms_norm (rms_norm.cu);
//   kLayerNorm: x = round((h - mean) * rstd * weight + bias), rstd = rsqrt(mean((h - mean)^2) + eps), two passes
//               (the mean, then the squared deviations: no E[h^2] - mean^2 cancellation on outlier channels) and one
//               rounding: add_layer_norm (layer_norm.cu),
// without a residual, then the GEMV, in one kernel. A kernel parameter of its own for the reason RopeParams is one;
// `bias` (LayerNorm only) after the fields the RMSNorm kernels read, which so keep their code.
struct NormParams {
  const void* weight = nullptr;  // (K,) T
  float eps = 0.f;
  const void* bias = nullptr;    // (K,) T, kLayerNorm
};

// The NORM prologue's shared memory. Its rows: 16-byte chunks per staged row of x, K / 8 and 4 more, so that
// consecutive rows start 64 bytes apart modulo 128 (the mma loads' quarter-warp reads tokens g, g + 1 at chunks
// t = 0..3: conflict-free).
__host__ __device__ constexpr int norm_row_chunks(int k) { return k / 8 + 4; }
// The rows, then the prologue's per-segment sums (at most kMaxM x kMaxWarps floats: of squares, RMSNorm; of values,
// LayerNorm, which then has a second such array, of squared deviations).
__host__ __device__ constexpr size_t norm_smem_bytes(int m, int k, int norm = kRmsNorm) {
  return static_cast<size_t>(m) * norm_row_chunks(k) * 16 +
         sizeof(float) * kMaxM * kMaxWarps * (norm == kLayerNorm ? 2 : 1);
}

enum Epilogue : int { kPlain = 0, kSiluMul = 1, kRope = 2 };

// Streaming 16-byte load of w, which is read exactly once: bypass L1 (x, reused by every block, keeps it) and
// have L2 fetch 256 aligned bytes per miss from HBM. A coherent load, not ld.global.nc: ptxas treats .nc data as
// constant and may sink such a load below griddepcontrol.wait (pdl_wait), and did so for the first k-block's weights
// after an unrelated source change in the epilogue (SASS), which cost 4-13 points of copy (docs/notes.md). Plain
// loads stay where they are written.
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

// The 16-byte chunks of one k-block (U k-steps) that a lane feeds to its mmas: rows g and g + 8 of the tile's w slab
// (one weight chunk each per k-step) and token g of each n-tile of x (XC = kChunkElems / 8 chunks per k-step).
template <int NT, int U, int XC>
struct Frag {
  uint4 w_lo[U], w_hi[U], x[U][NT][XC];
};

// Loads a k-block in two halves: load_w (the weights, which no earlier kernel writes, so it may run before pdl_wait)
// and load_x (the activations, then the TAIL zeroing). c0 is the lane's weight-chunk index for its first k-step
// (k-block * 4U + t). TAIL: the last k-block crosses K (K is a multiple of the chunk, so a chunk is inside K or past
// it); chunks past the end are read at a clamped (valid) index and zeroed in both operands, so they add nothing.
// Loads are unconditional so that all of them can be in flight together.
template <int NT, int U, int XC, bool TAIL>
__device__ __forceinline__ void load_w(Frag<NT, U, XC>& f, const uint4* w_lo, const uint4* w_hi, int c0, int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = TAIL ? min(c0 + 4 * u, chunks - 1) : c0 + 4 * u;
    f.w_lo[u] = ld_stream(w_lo + c);
    f.w_hi[u] = ld_stream(w_hi + c);
  }
}

// xs[j]: token 8j + g's row of x as 16-byte chunks (8 values each): weight chunk c covers x chunks XC c .. XC c + XC-1.
// SMEM (the NORM prologue): xs point into shared memory, where the block staged the normalised rows.
template <int NT, int U, int XC, bool TAIL, bool SMEM = false>
__device__ __forceinline__ void load_x(Frag<NT, U, XC>& f, const uint4* const (&xs)[NT], int c0, int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = TAIL ? min(c0 + 4 * u, chunks - 1) : c0 + 4 * u;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int h = 0; h < XC; ++h) {
        if constexpr (SMEM) {
          f.x[u][j][h] = xs[j][XC * c + h];
        } else {
          f.x[u][j][h] = ld_dep(xs[j] + XC * c + h);  // (written by the previous kernel)
        }
      }
    }
  }
  if (TAIL) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + 4 * u >= chunks) {
        f.w_lo[u] = f.w_hi[u] = zero;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int h = 0; h < XC; ++h) f.x[u][j][h] = zero;
        }
      }
    }
  }
}

// fp16 / bf16 weights: k-steps of 32 per k-block unit, 4 for one n-tile and 2 for two, so that two k-blocks of
// fragments (the one being multiplied and the one in flight) fit in 128 registers.
// Lane (g = lane / 4, t = lane % 4) loads, per k-step of 32 at k0, w[16i + g][k0 + 8t : +8], w[16i + g + 8][same]
// and x[8j + g][k0 + 8t : +8] for n-tile j. The order of k inside an mma is free (the same permutation on both
// operands), so those chunks are the mma fragments as they are: mma 1 takes k0 + 8t + {0..3}, mma 2 k0 + 8t + {4..7}:
//   A = {w_lo.x, w_hi.x, w_lo.y, w_hi.y}, B = {x.x, x.y} and A = {w_lo.z, w_hi.z, w_lo.w, w_hi.w}, B = {x.z, x.w}
// (A rows g / g + 8 and "columns" 2t, 2t + 1 / 2t + 8, 2t + 9; B column g and rows 2t, 2t + 1 / 2t + 8, 2t + 9).
struct HalfWeights {
  static constexpr int kChunkElems = 8;
  static constexpr bool kScaled = false;
  template <int NT>
  __host__ __device__ static constexpr int unroll() { return NT == 1 ? 4 : 2; }

  template <typename T, int NT, int U>
  __device__ __forceinline__ static void mma(float (&acc)[NT][4], const Frag<NT, U, 1>& f) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        mma_16816<T>(acc[j], {f.w_lo[u].x, f.w_hi[u].x, f.w_lo[u].y, f.w_hi[u].y}, f.x[u][j][0].x, f.x[u][j][0].y);
        mma_16816<T>(acc[j], {f.w_lo[u].z, f.w_hi[u].z, f.w_lo[u].w, f.w_hi[u].w}, f.x[u][j][0].z, f.x[u][j][0].w);
      }
    }
  }
};

// int8 weights (scale per output row): k-steps of 64 per k-block unit, 2 for one n-tile, 1 for two (two fragments in
// flight within the register budget of 16 warps per SM: each k-step holds 2 weight chunks and 2 * NT activation
// chunks). Per k-step the lane's two weight chunks (16 int8 of rows g and g + 8 at k0 + 16t) become 8 + 8 packed
// pairs in registers (int8_convert.cuh, exact; lo[i], hi[i]: values 2i, 2i + 1 of the chunk), and four m16n8k16
// mmas consume them: mma i takes the chunk's values 4i .. 4i + 3 of every lane, as
//   A = {lo[2i], hi[2i], lo[2i + 1], hi[2i + 1]}   (rows g / g + 8; mma-k 2t, 2t + 1 then 2t + 8, 2t + 9)
//   B = {xw[2i], xw[2i + 1]}                       (token g; the same mma-k), xw = the 8 words of the x chunks.
// E4M3: float8 e4m3 weights instead (fp8_convert.cuh: one conversion instruction per pair on sm_89+, exact), the
// same layout, scale and epilogue.
template <bool E4M3>
struct ByteWeights {
  static constexpr int kChunkElems = 16;
  static constexpr bool kScaled = true;
  template <int NT>
  __host__ __device__ static constexpr int unroll() { return NT == 1 ? 2 : 1; }

  template <typename T, int NT, int U>
  __device__ __forceinline__ static void mma(float (&acc)[NT][4], const Frag<NT, U, 2>& f) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint32_t lo[8], hi[8];
      const uint32_t wl[4] = {f.w_lo[u].x, f.w_lo[u].y, f.w_lo[u].z, f.w_lo[u].w};
      const uint32_t wh[4] = {f.w_hi[u].x, f.w_hi[u].y, f.w_hi[u].z, f.w_hi[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (E4M3) {
          fp8::e4m3x4_to_x4<T>(wl[i], lo[2 * i], lo[2 * i + 1]);
          fp8::e4m3x4_to_x4<T>(wh[i], hi[2 * i], hi[2 * i + 1]);
        } else {
          int8::i8x4_to_x4<T>(wl[i], lo[2 * i], lo[2 * i + 1]);
          int8::i8x4_to_x4<T>(wh[i], hi[2 * i], hi[2 * i + 1]);
        }
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
};
using Int8Weights = ByteWeights<false>;
using Fp8Weights = ByteWeights<true>;

// Persistent grid (at most one wave) of blocks of 32 * W threads (W <= 16 warps, W <= k-blocks). Tile i (16 rows of
// w, outputs y[:, 16i : 16i + 16]) belongs to block i % gridDim.x; a block walks its tiles in order.
// Warp v handles the k-blocks v, v + W, v + 2W, ... of each of the block's tiles. Its work is one sequence over
// (tile, k-block) in two register fragments: it multiplies one item, then reloads that fragment with the item after
// the other fragment's, across tile boundaries too, so every warp keeps w streaming from launch to exit. At a tile's
// last item the warps leave their partial sums in shared memory (two buffers, alternating per tile, so one barrier
// per tile suffices), sync, and run the tile's epilogue while the next tile's first k-blocks are in flight.
// Rows >= N and tokens >= M read the last valid row instead: an mma output (i, j) depends only on row i of A and
// column j of B, so those reads only feed accumulators that are never stored.
// SILU: tile i covers outputs 8i .. 8i + 7; its mma rows r < 8 are gate rows 8i + r and rows r >= 8 the up rows
// F + 8i + r - 8. The tile count, ceil(F / 8), equals that of the plain GEMV over the 2F rows, so the launch (warps,
// grid) and every row's k order and warp split are the plain GEMV's: gate and up come out bit-identical to
// linear_epilogue's, and rounding them to T before silu * up (as silu_mul.cu does) gives linear + silu_mul's bits.
// ROPE: the same pairing, tile i covering pairs 8i .. 8i + 7 of (head, d < D/2): rows head D + d and head D + D/2 + d.
// NORM (kRmsNorm, kLayerNorm): x holds the un-normalised rows h; each block first stages the norm of its M rows in
// (dynamic) shared memory, norm_smem_bytes(M, K, NORM), which its k-blocks then read instead of global memory
// (NormParams).
template <class W, typename T, int NT, bool TAIL, int EPI = kPlain, int NORM = kNoNorm>
__global__ void __launch_bounds__(32 * kMaxWarps)
    skinny_kernel(const Params p, const RopeParams rp, const NormParams np) {
  constexpr bool SILU = EPI == kSiluMul, ROPE = EPI == kRope;
  constexpr bool STAGED = NORM != kNoNorm;  // x read from the prologue's staged rows in shared memory
  constexpr int U = W::template unroll<NT>();
  constexpr int XC = W::kChunkElems / 8;  // 16-byte chunks of x per weight chunk
  constexpr int kChunksPerBlock = 4 * U;  // 16-byte weight chunks per row in a k-block
  constexpr int kTokens = 8 * NT;
  constexpr int kOut = SILU || ROPE ? kRows / 2 : kRows;  // outputs (row pairs) per tile
  using F = Frag<NT, U, XC>;
  __shared__ float partial[2][kMaxWarps][kRows][kTokens + 1];  // +1: fewer bank conflicts

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int chunks = p.k / W::kChunkElems;  // 16-byte weight chunks per row
  const int k_blocks = (chunks + kChunksPerBlock - 1) / kChunksPerBlock;  // TAIL <=> chunks % kChunksPerBlock
  const int tiles = (p.n + kOut - 1) / kOut;

  const uint4* w = reinterpret_cast<const uint4*>(p.w);
  extern __shared__ uint4 norm_x[];  // NORM: (M, norm_row_chunks(K)) 16-byte chunks, the normalised rows
  const uint4* xs[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if constexpr (STAGED) {
      xs[j] = norm_x + min(8 * j + g, p.m - 1) * norm_row_chunks(p.k);
    } else {
      xs[j] = reinterpret_cast<const uint4*>(p.x) + static_cast<int64_t>(min(8 * j + g, p.m - 1)) * (p.k / 8);
    }
  }
  const T* bias = static_cast<const T*>(p.bias);
  const T* residual = static_cast<const T*>(p.residual);
  T* y = static_cast<T*>(p.y);

  // A warp's items: (tile, k-block) for the block's tiles in order and, within a tile, its k-blocks
  // warp, warp + W, ... The host launches at most `tiles` blocks and at most `k_blocks` warps, so every warp
  // has an item in every tile of its block.
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
  auto w_row = [&](int tile, int r) {  // the lane's rows r of tile `tile`
    if constexpr (SILU) {  // r < 8: gate row of output 8 tile + r; r >= 8: the up row of output 8 tile + r - 8
      const int out = min(tile * kOut + (r & (kOut - 1)), p.n - 1);
      return w + static_cast<int64_t>(r >= kOut ? p.n + out : out) * chunks;
    }
    if constexpr (ROPE) {  // pair `out` = (head, d): r < 8 row head D + d, r >= 8 row head D + D/2 + d
      const int out = min(tile * kOut + (r & (kOut - 1)), p.n - 1), half = rp.head_dim / 2;
      const int head = out / half, d = out - head * half;
      return w + static_cast<int64_t>(head * rp.head_dim + d + (r >= kOut ? half : 0)) * chunks;
    }
    return w + static_cast<int64_t>(min(tile * kRows + r, p.n - 1)) * chunks;
  };
  auto load_weights = [&](F& f, Item i) {
    load_w<NT, U, XC, TAIL>(f, w_row(i.tile, g), w_row(i.tile, g + 8), i.kb * kChunksPerBlock + t, chunks);
  };
  auto load_acts = [&](F& f, Item i) { load_x<NT, U, XC, TAIL, STAGED>(f, xs, i.kb * kChunksPerBlock + t, chunks); };

  // The epilogue operands of the thread's first output of a tile (row threadIdx.x % kOut, token
  // threadIdx.x / kOut), requested a tile ahead so that the epilogue, which ends the kernel, does not wait for a
  // round trip to memory. `off`: 0, or (SILU) p.n for the output's up row.
  const int e_row = threadIdx.x % kOut, e_token = threadIdx.x / kOut;
  auto e_index = [&](int tile) -> int64_t {  // -1: no such output
    const int n = tile * kOut + e_row;
    return tile < tiles && e_token < p.m && n < p.n ? static_cast<int64_t>(e_token) * p.n + n : -1;
  };
  auto load_scale = [&](int tile, int off = 0) {
    return e_index(tile) >= 0 ? p.scale[off + tile * kOut + e_row] : 0.f;
  };
  auto load_bias = [&](int tile, int off = 0) {
    return bias != nullptr && e_index(tile) >= 0 ? to_float(bias[off + tile * kOut + e_row]) : 0.f;
  };
  // ROPE: the thread's first pair's rotary factors (q / k heads) and cache slot (k / v heads), read after pdl_wait
  // (earlier kernels write them) but, like the operands above, a tile ahead of its epilogue
  // Kept as the dtype's 16-bit patterns, two per register, and a 32-bit slot: the prefetched operands live through
  // the main loop, and as four floats and an int64 they pushed the fp16 kernel for up to 8 tokens (at its
  // 128-register cap) into spilling.
  struct RopeOperands {
    uint32_t c = 0, s = 0;  // cos / sin at d (low half) and d + D/2 (high half), T's bits
    int slot = -1;          // the cache slot, -1 where there is none or it lies outside [0, T)
  };
  auto bits = [](T v) {
    uint16_t b;
    memcpy(&b, &v, 2);
    return static_cast<uint32_t>(b);
  };
  auto load_rope_at = [&](int token, int head, int d) {  // (token, pair (head, d))'s
    RopeOperands r;
    if constexpr (ROPE) {
      const int half = rp.head_dim / 2;
      if (rp.cos != nullptr && head < rp.heads + rp.kv_heads) {
        const int64_t at = static_cast<int64_t>(token) * rp.head_dim + d;
        const T* cs = static_cast<const T*>(rp.cos) + at;
        const T* sn = static_cast<const T*>(rp.sin) + at;
        r.c = bits(ld_dep_as(cs)) | bits(ld_dep_as(cs + half)) << 16;
        r.s = bits(ld_dep_as(sn)) | bits(ld_dep_as(sn + half)) << 16;
      }
      if (head >= rp.heads) {
        const int64_t slot = ld_dep_as(rp.slots + (token % rp.seq) * rp.slots_stride);
        r.slot = slot >= 0 && slot < rp.cache_len ? static_cast<int>(slot) : -1;
      }
    }
    return r;
  };
  auto unpack = [](uint32_t pair, int high) {  // one of the two T values of `pair`, as float
    const uint16_t b = static_cast<uint16_t>(pair >> (16 * high));
    T v;
    memcpy(&v, &b, 2);
    return to_float(v);
  };
  auto load_rope = [&](int tile) {  // the thread's first pair of the tile, if any
    if (e_index(tile) < 0) return RopeOperands{};
    const int half = rp.head_dim / 2, out = tile * kOut + e_row;
    const int head = out / half;
    return load_rope_at(e_token, head, out - head * half);
  };
  auto load_residual = [&](int tile) {
    const int64_t idx = e_index(tile);
    return residual != nullptr && idx >= 0 ? to_float(residual[idx]) : 0.f;
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // PDL (launch.h): the weights of the warp's first two items and the first tile's scale and bias (never written by
  // the previous kernel) are requested before waiting for the kernel that writes x and the residual, so this grid's
  // DRAM traffic starts while that kernel is still finishing (all of it when the blocks are resident beside it and
  // one item pair covers the block's tiles).
  pdl_launch_dependents();
  F f0, f1;
  Item i0{static_cast<int>(blockIdx.x), warp};
  Item i1 = after(i0);
  load_weights(f0, i0);
  if (i1.tile < tiles) load_weights(f1, i1);
  float e_scale = 0.f, e_scale_up = 0.f, e_bias_up = 0.f;  // (_up: SILU's up rows)
  if constexpr (W::kScaled && !ROPE) e_scale = load_scale(i0.tile);
  // SILU with the RMSNorm prologue and a partial last k-block: the epilogue loads its operands itself (held
  // through the main loop, they pushed that kernel for up to 8 tokens into spilling, as the rotary operands below)
  constexpr bool kPrefetchSilu = SILU && !(STAGED && TAIL);
  float e_bias = ROPE || (SILU && !kPrefetchSilu) ? 0.f : load_bias(i0.tile);
  if constexpr (kPrefetchSilu) {
    if constexpr (W::kScaled) e_scale_up = load_scale(i0.tile, p.n);
    e_bias_up = load_bias(i0.tile, p.n);
  }
  pdl_wait();
  if constexpr (STAGED) {
    // The norm prologue (x = h, written by the previous kernel: coherent loads after the wait). Each row is cut
    // into `parts` segments, one per warp (all warps busy at M = 1: one load per lane at K = 2048, one round trip),
    // and each warp copies its segment to shared memory while summing, in fp32, its squares (RMSNorm) or its values
    // (LayerNorm). After a barrier every warp adds its row's segment sums in one fixed order (deterministic, unlike
    // atomics); LayerNorm then sums its segment's squared deviations from that mean (a second pass over the staged
    // rows, and a second barrier). Each warp then rewrites its segment as RMSNorm's round_T(round_T(h * rstd) *
    // weight), the roundings of add_rms_norm (rms_norm.cu) and transformers' LlamaRMSNorm, or LayerNorm's
    // round_T((h - mean) * rstd * weight + bias), add_layer_norm's (layer_norm_rows.cuh: one rounding); a last
    // barrier before the first k-block reads the rows. The first two items' weights are in flight meanwhile.
    // (`#pragma unroll 1`: those weights hold 64 registers here; unrolled, the loops spilled.)
    constexpr bool LN = NORM == kLayerNorm;
    const int row_chunks = p.k / 8;
    const int parts = max(1, warps / p.m);                  // warps per row
    const int seg = (row_chunks + parts - 1) / parts;       // chunks per segment
    float* seg_ss = reinterpret_cast<float*>(norm_x + p.m * norm_row_chunks(p.k));  // (M, parts) sums (of squares)
    for (int item = warp; item < p.m * parts; item += warps) {
      const int r = item / parts, c_end = min(row_chunks, (item - r * parts + 1) * seg);
      const uint4* h = reinterpret_cast<const uint4*>(p.x) + static_cast<int64_t>(r) * row_chunks;
      uint4* dst = norm_x + r * norm_row_chunks(p.k);
      float ss = 0.f;
#pragma unroll 1
      for (int c = (item - r * parts) * seg + lane; c < c_end; c += 32) {
        const uint4 v = ld_dep(h + c);
        dst[c] = v;
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if constexpr (LN) {
            ss += to_float(e[i]);
          } else {
            ss += to_float(e[i]) * to_float(e[i]);
          }
        }
      }
      ss = warp_sum(ss);
      if (lane == 0) seg_ss[item] = ss;
    }
    __syncthreads();
    // LayerNorm: the row's mean (as layer_norm_rows.cuh forms it: the sum times 1 / K) and its (M, parts) sums of
    // squared deviations
    float* seg_dev = seg_ss + kMaxM * kMaxWarps;
    const float inv_k = 1.f / static_cast<float>(p.k);
    auto row_mean = [&](int r) {
      float sum = 0.f;
      for (int q = 0; q < parts; ++q) sum += seg_ss[r * parts + q];
      return sum * inv_k;
    };
    if constexpr (LN) {
      for (int item = warp; item < p.m * parts; item += warps) {
        const int r = item / parts, c_end = min(row_chunks, (item - r * parts + 1) * seg);
        const float mean = row_mean(r);
        const uint4* src = norm_x + r * norm_row_chunks(p.k);
        float dev = 0.f;
#pragma unroll 1
        for (int c = (item - r * parts) * seg + lane; c < c_end; c += 32) {
          const uint4 v = src[c];
          const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
          for (int i = 0; i < 8; ++i) dev += (to_float(e[i]) - mean) * (to_float(e[i]) - mean);
        }
        dev = warp_sum(dev);
        if (lane == 0) seg_dev[item] = dev;
      }
      __syncthreads();
    }
    const uint4* nw = static_cast<const uint4*>(np.weight);
    const uint4* nb = static_cast<const uint4*>(np.bias);
    for (int item = warp; item < p.m * parts; item += warps) {
      const int r = item / parts, c_end = min(row_chunks, (item - r * parts + 1) * seg);
      float ss = 0.f, mean = 0.f, rstd;
      if constexpr (LN) {
        mean = row_mean(r);
        for (int q = 0; q < parts; ++q) ss += seg_dev[r * parts + q];
        rstd = rsqrtf(ss * inv_k + np.eps);  // biased variance, as layer_norm_rows.cuh
      } else {
        for (int q = 0; q < parts; ++q) ss += seg_ss[r * parts + q];
        // rsqrt(mean(h^2) + eps) as rms_norm.cu forms it: the sum divided by K, then rsqrtf
        rstd = rsqrtf(ss / static_cast<float>(p.k) + np.eps);
      }
      uint4* dst = norm_x + r * norm_row_chunks(p.k);
#pragma unroll 1
      for (int c = (item - r * parts) * seg + lane; c < c_end; c += 32) {
        uint4 v = dst[c];
        const uint4 wv = __ldg(nw + c);  // (a weight: never written by a kernel)
        T* e = reinterpret_cast<T*>(&v);
        const T* we = reinterpret_cast<const T*>(&wv);
        if constexpr (LN) {
          const uint4 bv = __ldg(nb + c);
          const T* be = reinterpret_cast<const T*>(&bv);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float f = (to_float(e[i]) - mean) * rstd;  // layer_norm_rows.cuh's normalize: then * w, + b
            f *= to_float(we[i]);
            f += to_float(be[i]);
            e[i] = from_float<T>(f);
          }
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const T n = from_float<T>(to_float(e[i]) * rstd);
            e[i] = from_float<T>(to_float(n) * to_float(we[i]));
          }
        }
        dst[c] = v;
      }
    }
    __syncthreads();
  }
  load_acts(f0, i0);
  if (i1.tile < tiles) load_acts(f1, i1);
  float e_residual = ROPE ? 0.f : load_residual(i0.tile);
  // (a K with a partial last k-block (TAIL) needs more registers in the main loop: there the epilogue loads its
  // rotary operands itself rather than holding them through the loop, which spilled)
  // (nor with the RMSNorm prologue: its bf16 kernel for up to 8 tokens then spilled a register)
  constexpr bool kPrefetchRope = ROPE && !TAIL && !STAGED;
  RopeOperands e_rope;
  if constexpr (kPrefetchRope) e_rope = load_rope(i0.tile);

  // step(cur, ci, oi): multiply `cur` (item ci), reload it with the item after oi (the one in the other fragment),
  // and finish ci's tile if ci was its last item; false once the other fragment holds nothing. The loop alternates
  // the two fragments (no copy, which would wait for the in-flight loads before issuing the next ones), so two
  // items are in flight while one is multiplied.
  auto step = [&](F& cur, Item& ci, const Item& oi) {
    W::template mma<T>(acc, cur);
    const bool more = oi.tile < tiles;
    const Item ni = after(oi);
    if (more && ni.tile < tiles) {
      load_weights(cur, ni);
      load_acts(cur, ni);
    }
    if (ci.kb + warps >= k_blocks) {
      // Accumulator fragment: acc[j] = {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)} as
      // (row, token - 8j). Partial sums meet in shared memory (two buffers by tile parity: one barrier per tile).
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

      // Epilogue: thread o sums output (row o % 16, token o / 16) over the warps, then scales it (int8 weights),
      // adds bias and residual, (ReLU) and rounds once; 16 consecutive threads store 16 consecutive outputs of one
      // token. SILU: output (row o % 8, token o / 8) from gate row o % 8 and up row o % 8 + 8, each scaled, biased
      // and rounded to T as the GEMV would store it, then silu and the product rounded as silu_mul.cu does.
      if constexpr (ROPE) {
        // Epilogue: thread o finishes pair (o % 8, token o / 8): both rows summed over the warps, scaled, biased
        // and rounded to T as the GEMV would store them, then rotated as rope.cu does (fp32, one rounding) for q and
        // k heads, and stored where qkv_rope_append stores them. cos, sin and slots come from earlier kernels
        // (after pdl_wait above; coherent loads).
        const int half = rp.head_dim / 2;
        for (int o = threadIdx.x; o < kOut * kTokens; o += blockDim.x) {
          const int row = o % kOut;
          const int token = o / kOut;
          const int out = ci.tile * kOut + row;
          if (token >= p.m || out >= p.n) continue;
          const int head = out / half, d = out - head * half;
          const int r_lo = head * rp.head_dim + d, r_hi = r_lo + half;
          float lo = 0.f, hi = 0.f;
          for (int v = 0; v < warps; ++v) {
            lo += part[v][row][token];
            hi += part[v][row + kOut][token];
          }
          if constexpr (W::kScaled) {
            lo = lo * p.scale[r_lo] + (bias ? to_float(bias[r_lo]) : 0.f);
            hi = hi * p.scale[r_hi] + (bias ? to_float(bias[r_hi]) : 0.f);
          } else if (bias) {
            lo += to_float(bias[r_lo]);
            hi += to_float(bias[r_hi]);
          }
          const T a = from_float<T>(lo), b2 = from_float<T>(hi);
          T y1 = a, y2 = b2;  // v: as stored
          const int64_t s = token % rp.seq, b = token / rp.seq;
          const RopeOperands ro = kPrefetchRope && o == threadIdx.x ? e_rope : load_rope_at(token, head, d);
          if (rp.cos != nullptr && head < rp.heads + rp.kv_heads) {  // q or k: x cos + rotate_half(x) sin
            rope_pair(to_float(a), to_float(b2), unpack(ro.c, 0), unpack(ro.s, 0), unpack(ro.c, 1), unpack(ro.s, 1),
                      y1, y2);
          }
          T* dst;
          if (head < rp.heads) {
            dst = static_cast<T*>(rp.q) + ((b * rp.heads + head) * rp.seq + s) * rp.head_dim;
          } else {
            const bool is_k = head < rp.heads + rp.kv_heads;
            const int hk = head - rp.heads - (is_k ? 0 : rp.kv_heads);
            const int64_t slot = ro.slot;
            if (slot < 0) continue;  // outside [0, T): skipped, as kv_cache_append does
            T* cache = static_cast<T*>(is_k ? rp.k_cache : rp.v_cache);
            dst = cache + ((b * rp.kv_heads + hk) * rp.cache_len + slot) * rp.head_dim;
          }
          dst[d] = y1;
          dst[d + half] = y2;
        }
        if constexpr (kPrefetchRope) e_rope = load_rope(ci.tile + gridDim.x);
        ci = ni;
        return more;
      }
      if constexpr (SILU) {
        const int n0 = ci.tile * kOut;
        for (int o = threadIdx.x; o < kOut * kTokens; o += blockDim.x) {
          const int row = o % kOut;
          const int token = o / kOut;
          const int n = n0 + row;
          if (token >= p.m || n >= p.n) continue;
          float s = 0.f, u = 0.f;
          for (int v = 0; v < warps; ++v) {
            s += part[v][row][token];
            u += part[v][row + kOut][token];
          }
          float sg = 1.f, su = 1.f, bg = 0.f, bu = 0.f;  // scale and bias of the gate and the up row
          if (kPrefetchSilu && o == threadIdx.x) {  // the prefetched operands (0 where there are none)
            if constexpr (W::kScaled) sg = e_scale, su = e_scale_up;
            bg = e_bias, bu = e_bias_up;
          } else {
            if constexpr (W::kScaled) sg = p.scale[n], su = p.scale[p.n + n];
            if (bias) bg = to_float(bias[n]), bu = to_float(bias[p.n + n]);
          }
          float gate, up;
          if constexpr (W::kScaled) {
            gate = s * sg + bg;
            up = u * su + bu;
          } else {
            gate = s + bg;
            up = u + bu;
          }
          gate = to_float(from_float<T>(gate));
          up = to_float(from_float<T>(up));
          const float act = to_float(from_float<T>(gate / (1.f + expf(-gate))));
          y[static_cast<int64_t>(token) * p.n + n] = from_float<T>(act * up);
        }
        if constexpr (kPrefetchSilu) {
          if constexpr (W::kScaled) {
            e_scale = load_scale(ci.tile + gridDim.x);
            e_scale_up = load_scale(ci.tile + gridDim.x, p.n);
          }
          e_bias = load_bias(ci.tile + gridDim.x);
          e_bias_up = load_bias(ci.tile + gridDim.x, p.n);
        }
        ci = ni;
        return more;
      }
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
          if constexpr (W::kScaled) {
            s = s * e_scale + e_bias + e_residual;
          } else {
            s += e_bias;
            s += e_residual;
          }
        } else {
          if constexpr (W::kScaled) s *= p.scale[n];
          if (bias) s += to_float(bias[n]);
          if (residual) s += to_float(residual[idx]);
        }
        if (p.relu && s < 0.f) s = 0.f;  // NaN passes through, like torch.relu
        y[idx] = from_float<T>(s);
      }
      if constexpr (W::kScaled) e_scale = load_scale(ci.tile + gridDim.x);
      e_bias = load_bias(ci.tile + gridDim.x);
      e_residual = load_residual(ci.tile + gridDim.x);
    }
    ci = ni;
    return more;
  };
  while (step(f0, i0, i1) && step(f1, i1, i0)) {
  }
}

#ifndef FUSEINFER_KERNEL_HARNESS
// Whether the skinny kernel serves x (M, K) @ w^T: fp16/bf16 activations, M <= 16, K a multiple of the weight chunk,
// 16-byte aligned x and w, sm_80+.
template <class W>
bool supported(const at::Tensor& x, const at::Tensor& w, int64_t m) {
  const auto dtype = x.scalar_type();
  return m <= kMaxM && (dtype == at::kHalf || dtype == at::kBFloat16) && x.size(1) % W::kChunkElems == 0 &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 &&
         at::cuda::getCurrentDeviceProperties()->major >= 8;
}

// Whether the `norm` prologue's staged rows fit the device's shared memory beside the kernel's own (M tokens, K).
inline bool norm_fits(int64_t m, int64_t k, Norm norm = kRmsNorm) {
  const int nt = m <= 8 ? 1 : 2;
  const size_t own = sizeof(float) * 2 * kMaxWarps * kRows * (8 * nt + 1);  // skinny_kernel's `partial`
  return m >= 1 && m <= kMaxM && k % 8 == 0 &&
         own + norm_smem_bytes(static_cast<int>(m), static_cast<int>(k), norm) <=
             at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
}

template <class W, typename T, int NT, bool TAIL, int EPI, int NORM>
void launch(const Params& p, const RopeParams& rp, const NormParams& np, cudaStream_t stream) {
  constexpr int kElemsPerBlock = 4 * W::kChunkElems * W::template unroll<NT>();
  constexpr int kOut = EPI == kPlain ? kRows : kRows / 2;
  const int tiles = (p.n + kOut - 1) / kOut;
  const int k_blocks = (p.k + kElemsPerBlock - 1) / kElemsPerBlock;
  // 16 warps per block (one block per SM: 127 registers for fp16 weights and NT = 1, 101 for NT = 2) while there
  // are fewer tiles than two per SM, else 8 (two blocks per SM, each with its own barrier); never more warps than
  // k-blocks. The grid is one wave, capped at one block per tile.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int warps = std::max(1, std::min(tiles < 2 * sms ? kMaxWarps : 8, k_blocks));
  const auto kernel = skinny_kernel<W, T, NT, TAIL, EPI, NORM>;
  // NORM: the staged rows in dynamic shared memory (norm_fits() checked that they fit)
  const size_t smem = NORM != kNoNorm ? norm_smem_bytes(p.m, p.k, NORM) : 0;
  if constexpr (NORM != kNoNorm) allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  const int resident = sms * blocks_per_sm(reinterpret_cast<const void*>(kernel), 32 * warps, smem);
  launch_kernel(kernel, std::min(tiles, resident), 32 * warps, smem, stream, p, rp, np);
}

template <class W, typename T, int NT, int EPI, int NORM>
void launch(const Params& p, const RopeParams& rp, const NormParams& np, cudaStream_t stream) {
  if ((p.k / W::kChunkElems) % (4 * W::template unroll<NT>()) != 0) {
    launch<W, T, NT, true, EPI, NORM>(p, rp, np, stream);
  } else {
    launch<W, T, NT, false, EPI, NORM>(p, rp, np, stream);
  }
}

// Launches the kernel for T = __half or __nv_bfloat16 (one n-tile up to 8 tokens, else two); NORM with the norm
// prologue of `np`.
template <class W, typename T, int EPI, int NORM = kNoNorm>
void launch(const Params& p, cudaStream_t stream, const RopeParams& rp = {}, const NormParams& np = {}) {
  if (p.m <= 8) {
    launch<W, T, 1, EPI, NORM>(p, rp, np, stream);
  } else {
    launch<W, T, 2, EPI, NORM>(p, rp, np, stream);
  }
}

// launch<W, T, EPI> with the `kind` prologue where `norm` is given. Built: RMSNorm for fp16 / bf16 weights (every
// epilogue; the Llama family's), LayerNorm for fp16 / bf16 and int8 weights with the plain and the q/k/v epilogue
// (OPT's, also W8A16); no other combination is instantiated.
template <class W, typename T, int EPI>
void launch_norm(const Params& p, cudaStream_t stream, const RopeParams& rp, const NormParams* norm,
                 Norm kind = kRmsNorm) {
  if (norm != nullptr) {
    constexpr bool half = std::is_same_v<W, HalfWeights>;
    if constexpr (half) {
      if (kind == kRmsNorm) return launch<W, T, EPI, kRmsNorm>(p, stream, rp, *norm);
    }
    if constexpr ((half || std::is_same_v<W, Int8Weights>) && EPI != kSiluMul) {
      if (kind == kLayerNorm) return launch<W, T, EPI, kLayerNorm>(p, stream, rp, *norm);
    }
    TORCH_CHECK(false, "skinny GEMV: no ", kind == kLayerNorm ? "LayerNorm" : "RMSNorm",
                " prologue for these weights and this epilogue");
  }
  launch<W, T, EPI>(p, stream, rp);
}

// y (M, N) = act(scale * (x @ w^T) + bias + residual) on the current stream, for operands that supported<W>()
// accepts and the entry point has checked (scale: (N,) fp32 for int8 weights, else null; bias, residual: x's dtype,
// or null; y preallocated, contiguous). silu: y (M, F) = silu(gate) * up of w (2F, K) (gate rows, then up rows;
// scale and bias (2F,)), no residual.
template <class W>
void run(const at::Tensor& x, const at::Tensor& w, const float* scale, const at::Tensor* bias,
         const at::Tensor* residual, bool relu, at::Tensor& y, bool silu = false, const NormParams* norm = nullptr,
         Norm norm_kind = kRmsNorm) {
  Params p;
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.scale = scale;
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.residual = residual ? residual->data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(y.size(1));  // w's rows, or half of them (silu)
  p.k = static_cast<int>(x.size(1));
  p.relu = relu;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (silu) {
    TORCH_CHECK(residual == nullptr && !relu && w.size(0) == 2 * y.size(1), "skinny GEMV: bad silu_mul operands");
    if (x.scalar_type() == at::kHalf) {
      launch_norm<W, __half, kSiluMul>(p, stream, {}, norm, norm_kind);
    } else {
      launch_norm<W, __nv_bfloat16, kSiluMul>(p, stream, {}, norm, norm_kind);
    }
  } else if (x.scalar_type() == at::kHalf) {
    launch_norm<W, __half, kPlain>(p, stream, {}, norm, norm_kind);
  } else {
    launch_norm<W, __nv_bfloat16, kPlain>(p, stream, {}, norm, norm_kind);
  }
}

// q (B, H, S, D) = the rotated q heads of x (B S, K) @ w^T (w ((H + 2 Hkv) D, K)), with the rotated k and the v heads
// written into k_cache / v_cache (B, Hkv, T, D) at slots (S,): linear (+ scale, bias) and qkv_rope_append in one
// kernel, for operands that supported<W>() accepts with head_dim % 16 == 0 and that the entry point has checked
// (cos, sin (B, S, D) contiguous in x's dtype; q, the caches contiguous; slots int64).
template <class W>
void run_rope(const at::Tensor& x, const at::Tensor& w, const float* scale, const at::Tensor* bias,
              const at::Tensor* cos, const at::Tensor* sin, int64_t seq, int64_t heads, int64_t kv_heads,
              at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
              const NormParams* norm = nullptr, Norm norm_kind = kRmsNorm) {
  Params p;
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.scale = scale;
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.residual = nullptr;
  p.y = nullptr;
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(w.size(0) / 2);  // row pairs
  p.k = static_cast<int>(x.size(1));
  p.relu = false;
  RopeParams rp;
  rp.cos = cos ? cos->data_ptr() : nullptr;  // (null: no rotation)
  rp.sin = sin ? sin->data_ptr() : nullptr;
  rp.q = q.data_ptr();
  rp.k_cache = k_cache.data_ptr();
  rp.v_cache = v_cache.data_ptr();
  rp.slots = slots.data_ptr<int64_t>();
  rp.slots_stride = slots.stride(0);
  rp.seq = static_cast<int>(seq);
  rp.cache_len = static_cast<int>(k_cache.size(2));
  rp.heads = static_cast<int>(heads);
  rp.kv_heads = static_cast<int>(kv_heads);
  rp.head_dim = static_cast<int>(q.size(3));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kHalf) {
    launch_norm<W, __half, kRope>(p, stream, rp, norm, norm_kind);
  } else {
    launch_norm<W, __nv_bfloat16, kRope>(p, stream, rp, norm, norm_kind);
  }
}
#endif

}  // namespace skinny
}  // namespace fuseinfer
