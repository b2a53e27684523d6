// Linear layer with a fused epilogue: y = act(x @ w^T + bias + residual), one store of y.
//
// Two paths, chosen by the number of tokens M:
//   * M > kSkinnyMaxM (prefill), or any fp32 / unaligned input: cuBLASLt. Row-major y (M, N) is the
//     column-major matrix y^T (N x M, ld N), so we ask for y^T = w . x^T: A = w as a column-major K x N matrix
//     (ld K) with transa = T, B = x as a column-major K x M matrix (ld K), C = residual and D = y as N x M
//     (ld N). The bias (length N = rows of D) and ReLU run in the BIAS / RELU_BIAS epilogues, the residual as
//     beta = 1 with C = residual (C != D). Everything accumulates in fp32 (CUBLAS_COMPUTE_32F; no TF32 for fp32
//     inputs, PyTorch's default). The algorithm is chosen once per problem (shape, dtype, epilogue, residual,
//     pointer alignments, device, workspace size) and cached: for M >= kTuneMinM the first call times the
//     heuristic's first kTuneCandidates algorithms on its own operands and keeps the fastest (its first choice
//     was 1-5% slower than another of its list at OPT-1.3b prefill shapes on the H100, docs/notes.md); otherwise, with
//     FUSEINFER_GEMM_TUNE=0, or while the stream is captured into a CUDA graph (no timing possible; not cached, so
//     a later eager call tunes), the heuristic's first choice.
//   * fp16/bf16 with M <= kSkinnyMaxM (decode): a weight-streaming tensor-core kernel (skinny_linear_kernel).
//     Reading w once is the whole cost. A persistent grid (one wave: as many blocks as fit on the GPU, at most
//     one per 16-row tile of w) walks the tiles; a block's warps split K and stream the tile with 16-byte
//     L1-bypassing loads, always two k-blocks (of this or the next tile) in flight while multiplying the one
//     before by all M tokens of x with mma.sync m16n8k16 (fp32 accumulate). At each tile's end the warps'
//     partial sums meet in shared memory and the epilogue (bias, residual, ReLU) runs before the single store,
//     with its bias and residual loaded a tile ahead. Launched with PDL (launch.h): each warp's first two
//     k-blocks of weights are requested before waiting for the kernel that writes x (docs/notes.md: 77 -> 92% of copy
//     for OPT-1.3b's qkv at M = 1 in a CUDA graph, against one k-block and the epilogue's loads at its end).
// Both paths allocate nothing but y (and an aligned copy of a misaligned bias; cuBLASLt's workspace is PyTorch's
// cached per-stream one) and never sync the host, so they can be captured in a CUDA graph.
#include "device_utils.cuh"
#include "fuseinfer.h"
#include "launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

namespace fuseinfer {
namespace {

#define FUSEINFER_CUBLASLT_CHECK(expr)                                                                  \
  do {                                                                                                  \
    const cublasStatus_t status_ = (expr);                                                             \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "linear_epilogue: ", #expr, " failed with status ", \
                static_cast<int>(status_), " (", cublasLtGetStatusString(status_), ")");              \
  } while (0)

// ------------------------------------------------------------------------------------------------------------
// Skinny path (decode): y (M, N) for M <= 16 tokens.
// ------------------------------------------------------------------------------------------------------------

constexpr int kSkinnyMaxM = 16;     // tokens served by the skinny kernel (one or two n-tiles of 8)
constexpr int kSkinnyRows = 16;     // rows of w (outputs) per tile = the mma's m
constexpr int kSkinnyMaxWarps = 16;

// k-steps of 32 per k-block (the unit a warp loads at once): 4 for one n-tile, 2 for two, so that two
// k-blocks of fragments (the one being multiplied and the one in flight) fit in 128 registers.
template <int NT>
constexpr int skinny_unroll() { return NT == 1 ? 4 : 2; }

struct SkinnyParams {
  const void* x;         // (M, K)
  const void* w;         // (N, K)
  const void* bias;      // (N,) or null
  const void* residual;  // (M, N) or null
  void* y;               // (M, N)
  int m, n, k;
  bool relu;
};

// Streaming 16-byte load of w, which is read exactly once: bypass L1 (x, reused by every block, keeps it) and
// have L2 fetch 256 aligned bytes per miss from HBM (a row's k-block is 256 bytes for NT = 1, 128 for NT = 2).
// A coherent load, not ld.global.nc: ptxas treats .nc data as constant and may sink such a load below
// griddepcontrol.wait (pdl_wait), and did so for the first k-block's weights after an unrelated source change in
// the epilogue (SASS), which cost 4-13 points of copy (docs/notes.md). Plain loads stay where they are written.
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

// The 16-byte chunks of one k-block (U k-steps of 32) that a lane feeds to its mmas: rows g and g + 8 of the
// tile's w slab and token g of each n-tile of x.
template <int NT, int U>
struct SkinnyFrag {
  uint4 w_lo[U], w_hi[U], x[U][NT];
};

// Loads a k-block in two halves: skinny_load_w (the weights, which no earlier kernel writes, so it may run
// before pdl_wait) and skinny_load_x (the activations, then the TAIL zeroing). c0 is the lane's chunk index
// for its first k-step (k-block start / 8 + t). TAIL: the last k-block crosses K; chunks past the end are read
// at a clamped (valid) index and zeroed in both operands, so they add nothing. Loads are unconditional so
// that all of them can be in flight together.
template <int NT, int U, bool TAIL>
__device__ __forceinline__ void skinny_load_w(SkinnyFrag<NT, U>& f, const uint4* w_lo, const uint4* w_hi, int c0,
                                              int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = TAIL ? min(c0 + 4 * u, chunks - 1) : c0 + 4 * u;
    f.w_lo[u] = ld_stream(w_lo + c);
    f.w_hi[u] = ld_stream(w_hi + c);
  }
}

template <int NT, int U, bool TAIL>
__device__ __forceinline__ void skinny_load_x(SkinnyFrag<NT, U>& f, const uint4* const (&xs)[NT], int c0,
                                              int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = TAIL ? min(c0 + 4 * u, chunks - 1) : c0 + 4 * u;
#pragma unroll
    for (int j = 0; j < NT; ++j) f.x[u][j] = __ldg(xs[j] + c);
  }
  if (TAIL) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + 4 * u >= chunks) {
        f.w_lo[u] = f.w_hi[u] = zero;
#pragma unroll
        for (int j = 0; j < NT; ++j) f.x[u][j] = zero;
      }
    }
  }
}

template <typename T, int NT, int U>
__device__ __forceinline__ void skinny_mma(float (&acc)[NT][4], const SkinnyFrag<NT, U>& f) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      mma_16816<T>(acc[j], {f.w_lo[u].x, f.w_hi[u].x, f.w_lo[u].y, f.w_hi[u].y}, f.x[u][j].x, f.x[u][j].y);
      mma_16816<T>(acc[j], {f.w_lo[u].z, f.w_hi[u].z, f.w_lo[u].w, f.w_hi[u].w}, f.x[u][j].z, f.x[u][j].w);
    }
  }
}

// Persistent grid (at most one wave) of blocks of 32 * W threads (W <= 16 warps, W <= k-blocks). Tile i (16
// rows of w, outputs y[:, 16i : 16i + 16]) belongs to block i % gridDim.x; a block walks its tiles in order.
// Lane (g = lane / 4, t = lane % 4) of a warp loads, per k-step of 32 at k0, the 16-byte chunks
//   w[16i + g][k0 + 8t : +8], w[16i + g + 8][k0 + 8t : +8] and x[8j + g][k0 + 8t : +8] for n-tile j.
// The order of k inside an mma is free (the same permutation on both operands), so those chunks are the
// mma fragments as they are: mma 1 takes k0 + 8t + {0..3}, mma 2 takes k0 + 8t + {4..7}, i.e.
//   A = {w_lo.x, w_hi.x, w_lo.y, w_hi.y}, B = {x.x, x.y} and A = {w_lo.z, w_hi.z, w_lo.w, w_hi.w}, B = {x.z, x.w}
// (A rows g / g + 8 and "columns" 2t, 2t + 1 / 2t + 8, 2t + 9; B column g and rows 2t, 2t + 1 / 2t + 8, 2t + 9).
// Warp v handles the k-blocks (32 U elements of K; TAIL: the last one is partial, K % 8 == 0 so a chunk is
// either inside K or past it) v, v + W, v + 2W, ... of each of the block's tiles. Its work is one sequence
// over (tile, k-block) in two register fragments: it multiplies one item, then reloads that fragment with the
// item after the other fragment's, across tile boundaries too, so every warp keeps w streaming from launch to
// exit. At a tile's last item the warps leave their partial sums in shared memory (two buffers, alternating
// per tile, so one barrier per tile suffices), sync, and run the tile's epilogue while the next tile's first
// k-blocks are in flight.
// Rows >= N and tokens >= M read the last valid row instead: an mma output (i, j) depends only on row i of A
// and column j of B, so those reads only feed accumulators that are never stored.
template <typename T, int NT, bool TAIL>
__global__ void __launch_bounds__(32 * kSkinnyMaxWarps) skinny_linear_kernel(const SkinnyParams p) {
  constexpr int U = skinny_unroll<NT>();
  constexpr int kChunksPerBlock = 4 * U;  // 16-byte chunks per row in a k-block
  constexpr int kTokens = 8 * NT;
  __shared__ float partial[2][kSkinnyMaxWarps][kSkinnyRows][kTokens + 1];  // +1: fewer bank conflicts

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int chunks = p.k / 8;  // 16-byte chunks per row
  const int k_blocks = (chunks + kChunksPerBlock - 1) / kChunksPerBlock;  // TAIL <=> chunks % kChunksPerBlock
  const int tiles = (p.n + kSkinnyRows - 1) / kSkinnyRows;

  const uint4* w = reinterpret_cast<const uint4*>(p.w);
  const uint4* xs[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xs[j] = reinterpret_cast<const uint4*>(p.x) + static_cast<int64_t>(min(8 * j + g, p.m - 1)) * chunks;
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
    return w + static_cast<int64_t>(min(tile * kSkinnyRows + r, p.n - 1)) * chunks;
  };
  auto load_w = [&](SkinnyFrag<NT, U>& f, Item i) {
    skinny_load_w<NT, U, TAIL>(f, w_row(i.tile, g), w_row(i.tile, g + 8), i.kb * kChunksPerBlock + t, chunks);
  };
  auto load_x = [&](SkinnyFrag<NT, U>& f, Item i) {
    skinny_load_x<NT, U, TAIL>(f, xs, i.kb * kChunksPerBlock + t, chunks);
  };

  // The epilogue operands of the thread's first output of a tile (row threadIdx.x % 16, token threadIdx.x / 16),
  // requested a tile ahead so that the epilogue, which ends the kernel, does not wait for a round trip to memory.
  const int e_row = threadIdx.x % kSkinnyRows, e_token = threadIdx.x / kSkinnyRows;
  auto e_index = [&](int tile) -> int64_t {  // -1: no such output
    const int n = tile * kSkinnyRows + e_row;
    return tile < tiles && e_token < p.m && n < p.n ? static_cast<int64_t>(e_token) * p.n + n : -1;
  };
  auto load_bias = [&](int tile) {
    const int64_t idx = e_index(tile);
    return bias != nullptr && idx >= 0 ? to_float(bias[tile * kSkinnyRows + e_row]) : 0.f;
  };
  auto load_residual = [&](int tile) {
    const int64_t idx = e_index(tile);
    return residual != nullptr && idx >= 0 ? to_float(residual[idx]) : 0.f;
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // PDL (launch.h): the weights of the warp's first two items and the first tile's bias are requested before
  // waiting for the kernel that writes x and the residual, so this grid's DRAM traffic starts while that kernel is
  // still finishing (all of it when the blocks are resident beside it and one item pair covers the block's tiles).
  pdl_launch_dependents();
  SkinnyFrag<NT, U> f0, f1;
  Item i0{static_cast<int>(blockIdx.x), warp};
  Item i1 = after(i0);
  load_w(f0, i0);
  if (i1.tile < tiles) load_w(f1, i1);
  float e_bias = load_bias(i0.tile);
  pdl_wait();
  load_x(f0, i0);
  if (i1.tile < tiles) load_x(f1, i1);
  float e_residual = load_residual(i0.tile);

  // step(cur, ci, oi): multiply `cur` (item ci), reload it with the item after oi (the one in the other fragment),
  // and finish ci's tile if ci was its last item; false once the other fragment holds nothing. The loop alternates
  // the two fragments (no copy, which would wait for the in-flight loads before issuing the next ones), so two
  // items are in flight while one is multiplied.
  auto step = [&](SkinnyFrag<NT, U>& cur, Item& ci, const Item& oi) {
    skinny_mma<T>(acc, cur);
    const bool more = oi.tile < tiles;
    const Item ni = after(oi);
    if (more && ni.tile < tiles) {
      load_w(cur, ni);
      load_x(cur, ni);
    }
    if (ci.kb + warps >= k_blocks) {
      // Accumulator fragment: acc[j] = {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)} as
      // (row, token - 8j). Partial sums meet in shared memory (two buffers by tile parity: one barrier per tile).
      float(&part)[kSkinnyMaxWarps][kSkinnyRows][kTokens + 1] = partial[(ci.tile / gridDim.x) % 2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        part[warp][g][8 * j + 2 * t] = acc[j][0];
        part[warp][g][8 * j + 2 * t + 1] = acc[j][1];
        part[warp][g + 8][8 * j + 2 * t] = acc[j][2];
        part[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      }
      __syncthreads();

      // Epilogue: thread o sums output (row o % 16, token o / 16) over the warps; 16 consecutive threads
      // store 16 consecutive outputs of one token.
      const int n0 = ci.tile * kSkinnyRows;
      for (int o = threadIdx.x; o < kSkinnyRows * kTokens; o += blockDim.x) {
        const int row = o % kSkinnyRows;
        const int token = o / kSkinnyRows;
        const int n = n0 + row;
        if (token >= p.m || n >= p.n) continue;
        float s = 0.f;
        for (int v = 0; v < warps; ++v) s += part[v][row][token];
        const int64_t idx = static_cast<int64_t>(token) * p.n + n;
        if (o == threadIdx.x) {  // the prefetched operands (0 where there are none)
          s += e_bias;
          s += e_residual;
        } else {
          if (bias) s += to_float(bias[n]);
          if (residual) s += to_float(residual[idx]);
        }
        if (p.relu && s < 0.f) s = 0.f;  // NaN passes through, like torch.relu
        y[idx] = from_float<T>(s);
      }
      e_bias = load_bias(ci.tile + gridDim.x);
      e_residual = load_residual(ci.tile + gridDim.x);
    }
    ci = ni;
    return more;
  };
  while (step(f0, i0, i1) && step(f1, i1, i0)) {
  }
}

template <typename T, int NT, bool TAIL>
void launch_skinny(const SkinnyParams& p, cudaStream_t stream) {
  constexpr int kElemsPerBlock = 32 * skinny_unroll<NT>();
  const int tiles = (p.n + kSkinnyRows - 1) / kSkinnyRows;
  const int k_blocks = (p.k + kElemsPerBlock - 1) / kElemsPerBlock;
  // 16 warps per block (one block per SM: 127 registers for NT = 1, 101 for NT = 2) while there are fewer
  // tiles than two per SM, else 8 (two blocks per SM, each with its own barrier); never more warps than
  // k-blocks. The grid is one wave, capped at one block per tile.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int warps = std::max(1, std::min(tiles < 2 * sms ? kSkinnyMaxWarps : 8, k_blocks));
  const auto kernel = skinny_linear_kernel<T, NT, TAIL>;
  const int resident = sms * blocks_per_sm(reinterpret_cast<const void*>(kernel), 32 * warps);
  launch_kernel(kernel, std::min(tiles, resident), 32 * warps, 0, stream, p);
}

template <typename T, int NT>
void launch_skinny(const SkinnyParams& p, cudaStream_t stream) {
  if ((p.k / 8) % (4 * skinny_unroll<NT>()) != 0) {
    launch_skinny<T, NT, true>(p, stream);
  } else {
    launch_skinny<T, NT, false>(p, stream);
  }
}

template <typename T>
void launch_skinny(const SkinnyParams& p, cudaStream_t stream) {
  if (p.m <= 8) {
    launch_skinny<T, 1>(p, stream);
  } else {
    launch_skinny<T, 2>(p, stream);
  }
}

bool skinny_supported(const at::Tensor& x, const at::Tensor& w, int64_t m) {
  const auto dtype = x.scalar_type();
  return m <= kSkinnyMaxM && (dtype == at::kHalf || dtype == at::kBFloat16) && x.size(1) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 &&
         at::cuda::getCurrentDeviceProperties()->major >= 8;
}

// ------------------------------------------------------------------------------------------------------------
// cuBLASLt path.
// ------------------------------------------------------------------------------------------------------------

struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  ~MatmulDesc() { if (desc) cublasLtMatmulDescDestroy(desc); }
};
struct Layout {
  cublasLtMatrixLayout_t desc = nullptr;
  ~Layout() { if (desc) cublasLtMatrixLayoutDestroy(desc); }
};
struct Preference {
  cublasLtMatmulPreference_t desc = nullptr;
  ~Preference() { if (desc) cublasLtMatmulPreferenceDestroy(desc); }
};

// Largest power of two (<= 256, cuBLASLt's default assumption) that divides the address.
uint32_t alignment_of(const void* ptr) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  uint32_t align = 256;
  while (align > 1 && addr % align != 0) align /= 2;
  return align;
}

// (m, n, k, data type, epilogue, has residual, alignment of A, B, C, D, device, workspace size)
using AlgoKey = std::array<int64_t, 12>;

constexpr int64_t kTuneMinM = 512;  // tune prefill-sized problems only: the gain is a few % of a >= 10 us GEMM
constexpr int kTuneCandidates = 8;  // the heuristic listed 7-8 at the OPT shapes swept (efb007a's sweep)

std::mutex& algo_cache_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<AlgoKey, cublasLtMatmulAlgo_t>& algo_cache() {
  static std::map<AlgoKey, cublasLtMatmulAlgo_t> cache;
  return cache;
}

// Index of the fastest of the heuristic's `found` algorithms: each is run once (warm-up), then timed over
// kTuneReps back-to-back calls, in two alternated rounds, and the best round counts. The calls write y, which the
// caller's final call overwrites (C != D, so repeated calls are idempotent). One that fails to run is skipped.
template <typename Matmul>
int tune_algorithm(const cublasLtMatmulHeuristicResult_t* results, int found, const Matmul& matmul,
                   const at::cuda::CUDAStream& stream) {
  constexpr int kTuneReps = 10, kTuneRounds = 2;
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);  // timing events, destroyed on any exit
  std::array<float, kTuneCandidates> best_ms;
  best_ms.fill(INFINITY);
  for (int i = 0; i < found; ++i) {
    if (matmul(results[i].algo) != CUBLAS_STATUS_SUCCESS) best_ms[i] = NAN;  // NaN: never chosen, never re-run
  }
  for (int round = 0; round < kTuneRounds; ++round) {
    for (int i = 0; i < found; ++i) {
      if (std::isnan(best_ms[i])) continue;
      start.record(stream);
      for (int rep = 0; rep < kTuneReps; ++rep) FUSEINFER_CUBLASLT_CHECK(matmul(results[i].algo));
      stop.record(stream);
      stop.synchronize();
      best_ms[i] = std::min(best_ms[i], start.elapsed_time(stop));
    }
  }
  int best = -1;  // ties keep the heuristic's earlier choice
  for (int i = 0; i < found; ++i) {
    if (!std::isnan(best_ms[i]) && (best < 0 || best_ms[i] < best_ms[best])) best = i;
  }
  return std::max(best, 0);  // none ran: the first, whose call then reports the error
}

void cublaslt_linear(const at::Tensor& x, const at::Tensor& w, const void* bias, const at::Tensor* residual,
                     bool relu, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const auto dtype = x.scalar_type();
  const cudaDataType_t data_type =
      dtype == at::kHalf ? CUDA_R_16F : dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute_type = CUBLAS_COMPUTE_32F;
  const cublasLtEpilogue_t epilogue =
      bias ? (relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
           : (relu ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT);
  const void* c_ptr = residual ? residual->data_ptr() : y.data_ptr();
  const float alpha = 1.f;
  const float beta = residual ? 1.f : 0.f;

  MatmulDesc op;
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&op.desc, compute_type, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  FUSEINFER_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  FUSEINFER_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  FUSEINFER_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (bias) {
    FUSEINFER_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }

  // Column-major views: A = w (K x N, ld K), B = x (K x M, ld K), C = residual and D = y (N x M, ld N).
  Layout a, b, c, d;
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&a.desc, data_type, k, n, k));
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&b.desc, data_type, k, m, k));
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&c.desc, data_type, n, m, n));
  FUSEINFER_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&d.desc, data_type, n, m, n));

  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  const uint32_t align_a = alignment_of(w.data_ptr()), align_b = alignment_of(x.data_ptr()),
                 align_c = alignment_of(c_ptr), align_d = alignment_of(y.data_ptr());

  const AlgoKey key = {m, n, k, static_cast<int64_t>(data_type), static_cast<int64_t>(epilogue),
                       residual != nullptr, align_a, align_b, align_c, align_d, x.get_device(),
                       static_cast<int64_t>(workspace_size)};
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    const std::lock_guard<std::mutex> lock(algo_cache_mutex());
    const auto it = algo_cache().find(key);
    if (it != algo_cache().end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (cached) count_path(Path::kLinearLtCached);
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  auto matmul = [&](const cublasLtMatmulAlgo_t& al) {
    return cublasLtMatmul(handle, op.desc, &alpha, w.data_ptr(), a.desc, x.data_ptr(), b.desc, &beta, c_ptr, c.desc,
                          y.data_ptr(), d.desc, &al, workspace, workspace_size, stream);
  };
  if (!cached) {
    Preference pref;
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref.desc));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_size, sizeof(workspace_size)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));
    std::array<cublasLtMatmulHeuristicResult_t, kTuneCandidates> results = {};
    int found = 0;
    FUSEINFER_CUBLASLT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, op.desc, a.desc, b.desc, c.desc, d.desc,
                                                            pref.desc, kTuneCandidates, results.data(), &found));
    TORCH_CHECK(found > 0, "linear_epilogue: cuBLASLt has no algorithm for M=", m, " N=", n, " K=", k,
                " dtype ", dtype);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    algo = results[0].algo;
    const bool tune = !capturing && found > 1 && m >= kTuneMinM && knob(Knob::kGemmTune) != 0;
    if (tune) algo = results[tune_algorithm(results.data(), found, matmul, stream)].algo;
    count_path(capturing ? Path::kLinearLtCaptured : tune ? Path::kLinearLtTuned : Path::kLinearLtHeuristic);
    if (!capturing) {
      const std::lock_guard<std::mutex> lock(algo_cache_mutex());
      algo_cache().emplace(key, algo);
    }
  }

  FUSEINFER_CUBLASLT_CHECK(matmul(algo));
}

const at::Tensor* defined_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

}  // namespace

at::Tensor linear_epilogue_cuda(
    const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, const std::string& activation) {
  TORCH_CHECK(activation == "none" || activation == "relu",
              "linear_epilogue: activation must be 'none' or 'relu', got '", activation, "'");
  const bool relu = activation == "relu";
  const at::Tensor* b = defined_or_null(bias);
  const at::Tensor* r = defined_or_null(residual);
  TORCH_CHECK(!(relu && r), "linear_epilogue: relu cannot be combined with a residual");
  TORCH_CHECK(x.is_cuda() && w.device() == x.device(), "linear_epilogue: x and w must be on one CUDA device");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_epilogue: x must be (M, K) and w (N, K), got ", x.sizes(), " and ", w.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "linear_epilogue: dtype must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(w.scalar_type() == dtype, "linear_epilogue: w must have x's dtype");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_epilogue: x and w must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  if (b) {
    TORCH_CHECK(b->device() == x.device() && b->scalar_type() == dtype, "linear_epilogue: bias must match x");
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n && b->is_contiguous(), "linear_epilogue: bias must be (N,)");
  }
  if (r) {
    TORCH_CHECK(r->device() == x.device() && r->scalar_type() == dtype, "linear_epilogue: residual must match x");
    TORCH_CHECK(r->dim() == 2 && r->size(0) == m && r->size(1) == n && r->is_contiguous(),
                "linear_epilogue: residual must be contiguous (M, N)");
  }

  const at::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) {  // empty product: only the epilogue remains
    y.zero_();
    if (b) y.add_(*b);
    if (r) y.add_(*r);
    return relu ? y.relu_() : y;
  }
  TORCH_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, "linear_epilogue: dimension too large");

  if (skinny_supported(x, w, m)) {
    count_path(Path::kLinearSkinny);
    SkinnyParams p;
    p.x = x.data_ptr();
    p.w = w.data_ptr();
    p.bias = b ? b->data_ptr() : nullptr;
    p.residual = r ? r->data_ptr() : nullptr;
    p.y = y.data_ptr();
    p.m = static_cast<int>(m);
    p.n = static_cast<int>(n);
    p.k = static_cast<int>(k);
    p.relu = relu;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (dtype == at::kHalf) {
      launch_skinny<__half>(p, stream);
    } else {
      launch_skinny<__nv_bfloat16>(p, stream);
    }
    return y;
  }

  // cuBLASLt's alignment preferences cover A, B, C and D but not the bias, whose kernels may assume 16 bytes:
  // a bias sliced out of a larger buffer gets an aligned copy (N elements, negligible).
  at::Tensor bias_aligned;
  if (b) bias_aligned = reinterpret_cast<uintptr_t>(b->data_ptr()) % 16 == 0 ? *b : b->clone();
  cublaslt_linear(x, w, b ? bias_aligned.data_ptr() : nullptr, r, relu, y);
  return y;
}

}  // namespace fuseinfer
