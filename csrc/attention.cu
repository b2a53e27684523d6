// Causal attention over a KV cache with per-row key masks: the ops fuseinfer_C::attention and
// fuseinfer_C::attention_prefill_kernel (contracts at the registration, end of file).
//
// Three kernels, chosen by attention_cuda:
//
//  * Prefill on sm_90a (fp16/bf16, Sq > 16, H100/H200, an extension built for 9.0a): FlashAttention-3-style
//    forward, prefill_sm90_kernel below: TMA loads, wgmma, a producer warp and two or three consumer warpgroups
//    whose softmax overlaps their own tensor-core work; persistent, one block per SM taking work items from a
//    queue. Falls back to the next one when FUSEINFER_ATTN_SM90=0, a tensor does not fit a TMA map, the work
//    items (query blocks x B x H) exceed 2^31 or scale <= 0.
//
//  * Prefill (fp16/bf16, Sq > 16): FlashAttention-2-style forward. One thread block owns BM = 16 * WARPS query
//    rows of one (batch, head); each warp owns 16 rows and keeps its Q fragments in registers. The block walks
//    the key axis in tiles of BN keys up to the causal limit of its last query (tiles past it are never
//    touched), double-buffering K/V tiles in XOR-swizzled shared memory with cp.async. S = Q K^T and O += P V
//    run on tensor cores (mma.sync m16n8k16, ldmatrix / ldmatrix.trans, fp32 accumulators); the softmax is
//    online in the exp2 domain with fp32 row max / row sum. Causal, key_mask and tail masking are applied per
//    element only in tiles that need them; a warp skips tiles that lie wholly above its diagonal.
//
//  * Split-KV (flash-decoding; every dtype when Sq <= 16, and the simple fp32 path for any Sq): grid over
//    (batch * key/value head, split, chunk of QB rows), a row being one query of one of the query heads that read
//    that key/value head (grouped-query attention packs them; without GQA the rows are one head's queries).
//    Each block runs an online softmax over its slice of the keys with 16-byte loads (G = D / VEC threads share
//    one key row), merges its lanes and warps, and writes either the final output (one split) or a partial (max,
//    sum, unnormalised acc) to fp32 scratch; the last block of a (batch, key/value head, chunk) to arrive (atomic
//    counter, self-resetting) merges the partials into the output, so decode is one launch. The number of splits is picked so that the grid fills the SMs.
//    Its FP8 form (op attention_kv_fp8, fp16/bf16 queries, Sq <= 16) reads an e4m3 cache: 16-byte loads of 16
//    elements of a key or value row per thread (8-byte loads of 8 with four or more rows per block), converted
//    exactly to fp16 (fp8_convert.cuh); with up to two rows the scores run on tensor cores (mma m16n8k16, two
//    key rows per mma row pair). The key scale of the block's key/value head is applied to its
//    scores (folded into its query on CUDA cores), the value scale to its accumulator once at the end (per head,
//    not per element); its split count also fills the last wave of resident blocks (fp8_splits).
//
// Grouped-query attention: k and v have Hkv heads, H a multiple of Hkv; query head h reads key/value head
// h / (H / Hkv) (AttnParams::group). The prefills index the shared head per block / work item; split-KV packs a
// key/value head's query heads into one block's rows.
//
// Semantics shared by all: query i of row b attends key j iff key_mask[b, j] && j <= q_start[b] + i
// (q_start defaults to Skv - Sq); a query with no admissible key gets exactly 0. Scores are q.k * scale,
// softmax in fp32; output (B, Sq, H, D) contiguous in q's dtype. Rows of K/V past the causal limit of a block
// are never used (they may be unwritten cache slots holding anything, NaN included). All are launched with PDL
// (launch.h).

#include "device_utils.cuh"
#include "fp8_convert.cuh"
#include "knobs.h"
#include "launch.h"
#include "path_counts.h"
#include "sm90.cuh"
#include "tma_map.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fuseinfer {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// Everything both kernel families need; strides in elements.
struct AttnParams {
  const void* q;          // (B, H, Sq, D)
  const void* k;          // (B, Hkv, Skv, D): query head h reads key/value head h / group
  const void* v;          // (B, Hkv, Skv, D)
  void* out;              // (B, Sq, H, D) contiguous
  const bool* key_mask;   // (B, Skv) or nullptr
  const int* q_start;     // (B,) or nullptr
  int64_t q_sb, q_sh, q_ss;
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  int64_t m_sb, m_ss;     // key_mask strides
  int64_t qs_s;           // q_start stride
  int B, H, Sq, Skv;
  int group;              // query heads per key/value head, H / Hkv (1: multi-head attention)
  float scale_log2;       // scale * log2(e): scores live in the exp2 domain
  const float* kv_scale;  // FP8 caches (split-KV only): (2, Hkv) fp32, row 0 the keys' scale, row 1 the values'
  const float* out_scale; // 8-bit output (the prefills only, ops attention_fp8out / _int8out): one fp32 static
                          // scale; null: the output in T
  bool out_int8;          // with out_scale: int8 (else e4m3)
};

// ------------------------------------------------------------------------------------------------------------
// Small device helpers
// ------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2.approx(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats -> one 32-bit register of two 16-bit values (x in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 16 loaded bytes -> 16 / sizeof(T) floats.
__device__ __forceinline__ void unpack16(const uint4& r, const __half*, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __half22float2(h[j]);
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}
__device__ __forceinline__ void unpack16(const uint4& r, const __nv_bfloat16*, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __bfloat1622float2(h[j]);
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}
__device__ __forceinline__ void unpack16(const uint4& r, const float*, float* f) {
  f[0] = __uint_as_float(r.x);
  f[1] = __uint_as_float(r.y);
  f[2] = __uint_as_float(r.z);
  f[3] = __uint_as_float(r.w);
}
// 4 loaded 16-bit values (8 bytes) -> 4 floats.
template <typename T>
__device__ __forceinline__ void unpack4(const uint2& r, float* f) {
  const uint32_t w[2] = {r.x, r.y};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float2 t;
    if constexpr (std::is_same_v<T, __half>)
      t = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
    else
      t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}
// Four floats -> four e4m3 (a in the low byte), rounded to nearest even and saturated at +-448.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3)) |
         (static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3)) << 16);
}
// 8 loaded e4m3 bytes -> 8 floats (exact: e4m3 -> fp16 -> fp32).
__device__ __forceinline__ void unpack_e4m3x8(const uint2& r, float* f) {
  const uint32_t words[2] = {r.x, r.y};
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t lo, hi;
    fp8::e4m3x4_to_x4<__half>(words[w], lo, hi);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    f[4 * w] = a.x, f[4 * w + 1] = a.y, f[4 * w + 2] = b.x, f[4 * w + 3] = b.y;
  }
}
// 16 loaded e4m3 bytes -> 16 floats.
__device__ __forceinline__ void unpack_e4m3x16(const uint4& r, float* f) {
  unpack_e4m3x8(make_uint2(r.x, r.y), f);
  unpack_e4m3x8(make_uint2(r.z, r.w), f + 8);
}

// 16-byte global -> shared async copy; writes zeros (and reads nothing) when !valid.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Element offset of (row, 16-byte chunk) in a swizzled shared tile with D columns: chunk ^= row % 8, which
// makes every ldmatrix phase (8 rows, same logical chunk) hit 8 distinct bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// Sum of a value over the four lanes that hold one accumulator row.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

// Normalises the two query rows a thread holds in an m16n8-style accumulator (acc(d, e): n8 tile d, element e; rows
// row0 and row0 + 8) by their softmax sums l and stores them to out (B, Sq, H, D); rows with no admissible key have
// sum 0 and store 0. With p.out_scale the output is 8-bit: acc / l / out_scale rounded to nearest even and saturated
// at +-448 (e4m3) or clamped to +-127 (int8): the static per-tensor quantisation of the output projection's input,
// one multiply per element as in T (1 / l and 1 / out_scale folded), so out_proj reads 1 byte per element and no
// quantize pass runs.
template <typename T, int D, typename Acc>
__device__ __forceinline__ void store_rows(const AttnParams& p, Acc acc, const float (&l)[2], int b, int h, int row0,
                                           int lane) {
  const float qscale = p.out_scale != nullptr ? 1.f / *p.out_scale : 1.f;  // (uniform: one branch per call)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const int qrow = row0 + 8 * r;
    if (qrow < 0 || qrow >= p.Sq) continue;  // rows past the end, or (sm90 prefill) before the start
    const int64_t at = ((int64_t(b) * p.Sq + qrow) * p.H + h) * D + 2 * (lane & 3);
    if (p.out_scale != nullptr) {
      uint8_t* orow = static_cast<uint8_t*>(p.out) + at;
      const float f = inv * qscale;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        const float a = acc(d, 2 * r) * f, b = acc(d, 2 * r + 1) * f;
        uint16_t pair;
        if (p.out_int8) {  // round half to even, then the symmetric range
          const int qa = min(max(__float2int_rn(a), -127), 127), qb = min(max(__float2int_rn(b), -127), 127);
          pair = static_cast<uint16_t>((qa & 0xff) | ((qb & 0xff) << 8));
        } else {
          pair = static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
        }
        *reinterpret_cast<uint16_t*>(orow + d * 8) = pair;
      }
    } else {
      T* orow = static_cast<T*>(p.out) + at;
#pragma unroll
      for (int d = 0; d < D / 8; ++d)
        *reinterpret_cast<uint32_t*>(orow + d * 8) = pack2<T>(acc(d, 2 * r) * inv, acc(d, 2 * r + 1) * inv);
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Prefill: FlashAttention-2 forward on mma.sync
// ------------------------------------------------------------------------------------------------------------

// ROWS x D tile of a (rows, D) matrix with row stride `stride` -> swizzled shared memory; rows >= row_end are
// zero-filled and not read.
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t stride, int row0, int row_end, int tid) {
  constexpr int CH = D / 8;  // 16-byte chunks per row
  static_assert((ROWS * CH) % NT == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int it = 0; it < ROWS * CH / NT; ++it) {
    const int i = it * NT + tid;
    const int r = i / CH, ch = i % CH;
    const bool valid = row0 + r < row_end;
    const T* src = g + (valid ? (row0 + r) * stride + ch * 8 : 0);
    cp_async16(smem_addr(s + swz<D>(r, ch)), src, valid);
  }
}

// grid (B * H, ceil(Sq / BM)), block 32 * WARPS, dynamic smem 2 stages x (K, V) x BN x D. Blocks of the query heads
// of one key/value head (GQA) read the same K/V tiles, mostly from L2.
// GQA: whether p.group may exceed 1 (a separate instance, so that multi-head attention keeps its register budget: the
// division left the D = 64 instance a spill at its 128-register bound).
template <typename T, int D, int WARPS, int BN, int MIN_BLOCKS, bool GQA>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) prefill_kernel(const AttnParams p) {
  constexpr int NT = 32 * WARPS;
  constexpr int BM = 16 * WARPS;   // query rows per block, 16 per warp
  constexpr int NTILE = BN / 8;    // n8 tiles of S per warp
  constexpr int KSTEP = D / 16;    // k16 steps of Q K^T
  constexpr int STAGE = 2 * BN * D;  // elements of one K + V stage
  static_assert(D % 64 == 0 && BN % 32 == 0 && BM <= 2 * BN, "Q tile must fit in one K/V stage");
  static_assert(BN / 32 <= WARPS, "one mask word per warp");
  pdl_launch_dependents();
  pdl_wait();  // q, k, v, masks come from earlier kernels

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);  // [stage][K | V][BN][D], Q aliased on stage 1 at start
  __shared__ uint32_t s_mbits[2][BN / 32];    // key_mask bits of the tile in each stage

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;  // heaviest (last) query blocks launch first
  const int Sq = p.Sq, Skv = p.Skv;
  const int qs = p.q_start ? p.q_start[b * p.qs_s] : Skv - Sq;
  const int last_q = min(m0 + BM, Sq) - 1;
  const int n_end = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(Skv, int64_t(qs) + last_q + 1)));
  const int n_tiles = (n_end + BN - 1) / BN;
  const bool has_mask = p.key_mask != nullptr;

  const T* qg = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  const int hk = GQA ? h / p.group : h;  // key/value head
  const T* kg = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const bool* mrow = has_mask ? p.key_mask + b * p.m_sb : nullptr;
  auto mask_at = [&](int key) -> bool { return key < n_end && mrow[key * p.m_ss]; };

  // Prologue: Q tile (BM x D) into stage 1, K/V tile 0 into stage 0, key_mask bits of tile 0.
  load_tile<T, D, BM, NT>(smem + STAGE, qg, p.q_ss, m0, Sq, tid);
  if (n_tiles > 0) {
    load_tile<T, D, BN, NT>(smem, kg, p.k_ss, 0, n_end, tid);
    load_tile<T, D, BN, NT>(smem + BN * D, vg, p.v_ss, 0, n_end, tid);
  }
  cp_async_commit();
  bool mask_next = false;  // warps < BN/32: this lane's key_mask bit of the tile after the next one
  if (has_mask && warp < BN / 32) {
    const unsigned bits = __ballot_sync(kFullMask, mask_at(warp * 32 + lane));
    if (lane == 0) s_mbits[0][warp] = bits;
    mask_next = mask_at(BN + warp * 32 + lane);
  }
  cp_async_wait_all();
  __syncthreads();

  // Q fragments (A operand) of this warp's 16 rows: qf[kk] covers columns 16kk..16kk+15.
  uint32_t qf[KSTEP][4];
  {
    const int r = warp * 16 + (lane & 15);
#pragma unroll
    for (int kk = 0; kk < KSTEP; ++kk)
      ldmatrix_x4(qf[kk], smem_addr(smem + STAGE + swz<D>(r, kk * 2 + (lane >> 4))));
  }

  // Accumulator layout (m16n8 C fragment): element e of tile t sits at row lane/4 + 8*(e/2),
  // column 8t + 2*(lane%4) + e%2. Thread rows r = 0, 1 are query rows qrow[r].
  float o[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of scaled scores (log2 domain)
  float row_sum[2] = {0.f, 0.f};              // this thread's share of the running sum
  const int warp_q0 = m0 + warp * 16;
  int lim[2];  // last admissible key of each thread row (causal and Skv / n_end bound)
#pragma unroll
  for (int r = 0; r < 2; ++r) lim[r] = min(qs + warp_q0 + (lane >> 2) + 8 * r, n_end - 1);

  const uint32_t xr = lane & 7;  // swizzle key of every ldmatrix row this lane addresses
  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait_all();
    __syncthreads();  // tile t is in stage t&1; everyone is done with stage (t+1)&1
    if (t + 1 < n_tiles) {
      T* st = smem + ((t + 1) & 1) * STAGE;
      load_tile<T, D, BN, NT>(st, kg, p.k_ss, (t + 1) * BN, n_end, tid);
      load_tile<T, D, BN, NT>(st + BN * D, vg, p.v_ss, (t + 1) * BN, n_end, tid);
      cp_async_commit();
      if (has_mask && warp < BN / 32) {
        const unsigned bits = __ballot_sync(kFullMask, mask_next);
        if (lane == 0) s_mbits[(t + 1) & 1][warp] = bits;
        mask_next = mask_at((t + 2) * BN + warp * 32 + lane);
      }
    }
    const int n0 = t * BN;
    if (qs + warp_q0 + 15 < n0) continue;  // whole tile above this warp's diagonal

    const T* sk = smem + (t & 1) * STAGE;
    const T* sv = sk + BN * D;

    // S (16 x BN) = Q K^T. ldmatrix.x4 on K rows gives B fragments of two n8 tiles:
    // matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
    float s[NTILE][4];
#pragma unroll
    for (int j = 0; j < NTILE; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    {
      const int kr = (lane & 7) + ((lane >> 4) << 3);  // K row within a 16-row pair of n tiles
      const int kc = (lane >> 3) & 1;                  // +0 / +8 columns
#pragma unroll
      for (int kk = 0; kk < KSTEP; ++kk) {
#pragma unroll
        for (int j2 = 0; j2 < NTILE / 2; ++j2) {
          uint32_t bf[4];
          ldmatrix_x4(bf, smem_addr(sk + (j2 * 16 + kr) * D + (((kk * 2 + kc) ^ xr) << 3)));
          mma_16816<T>(s[2 * j2], qf[kk], bf[0], bf[1]);
          mma_16816<T>(s[2 * j2 + 1], qf[kk], bf[2], bf[3]);
        }
      }
    }

    // Scale into the log2 domain and mask (-inf) where the tile needs it.
    const bool need_mask = has_mask || n0 + BN - 1 > qs + warp_q0 || n0 + BN > n_end;
    if (need_mask) {
      uint32_t mw[BN / 32];
#pragma unroll
      for (int w = 0; w < BN / 32; ++w) mw[w] = has_mask ? s_mbits[t & 1][w] : kFullMask;
#pragma unroll
      for (int j = 0; j < NTILE; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = j * 8 + 2 * (lane & 3) + (e & 1);  // column within the tile
          const bool ok = n0 + c <= lim[e >> 1] && ((mw[c >> 5] >> (c & 31)) & 1u);
          s[j][e] = ok ? s[j][e] * p.scale_log2 : -INFINITY;
        }
    } else {
#pragma unroll
      for (int j = 0; j < NTILE; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
    }

    // Online softmax: new row max over the 4 lanes of a row, rescale O and the sum, P = 2^(S - max).
    float mx[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int j = 0; j < NTILE; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
    float base[2], corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
      base[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // fully masked so far: keep P = 0, avoid inf - inf
      corr[r] = ex2(row_max[r] - base[r]);
      row_max[r] = mx[r];
      row_sum[r] *= corr[r];
    }
#pragma unroll
    for (int j = 0; j < NTILE; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = ex2(s[j][e] - base[e >> 1]);
        row_sum[e >> 1] += s[j][e];
      }
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] *= corr[e >> 1];

    // O (16 x D) += P (16 x BN) V (BN x D). P's A fragment for keys 16kk..16kk+15 is S tiles 2kk, 2kk+1
    // repacked; ldmatrix.x4.trans on V rows gives B fragments of two n8 (head-dim) tiles:
    // matrices (key 0-7, d 0-7), (key 8-15, d 0-7), (key 0-7, d 8-15), (key 8-15, d 8-15).
    {
      const int vr = (lane & 7) + (((lane >> 3) & 1) << 3);  // V row (key) within 16
      const int vc = lane >> 4;                              // +0 / +8 columns
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, smem_addr(sv + (kk * 16 + vr) * D + (((d2 * 2 + vc) ^ xr) << 3)));
          mma_16816<T>(o[2 * d2], pa, bf[0], bf[1]);
          mma_16816<T>(o[2 * d2 + 1], pa, bf[2], bf[3]);
        }
      }
    }
  }

  const float l[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
  store_rows<T, D>(p, [&](int d, int e) { return o[d][e]; }, l, b, h, warp_q0 + (lane >> 2), lane);
}

// ------------------------------------------------------------------------------------------------------------
// Prefill on sm_90a: warpgroup MMA (wgmma) fed by TMA
// ------------------------------------------------------------------------------------------------------------

// Persistent: one block per SM walks work items (a query block of BM = 64 * WG rows of one (batch, head)) in the
// order of Sm90Sched. A block has WG consumer warpgroups of 64 rows each and a producer warpgroup, one warp of
// which loads (the others leave at once; setmaxnreg moves their registers to the consumers). The producer loads
// each item's Q tile (double-buffered at D = 64) and its K/V tiles (BN keys) through a ring of STAGES
// shared-memory stages with TMA (128-byte swizzle, see sm90.cuh); the ring and the Q buffers run on across items,
// so the next item's Q and first tiles load while the consumers finish the current one, and a warpgroup whose
// rows end before the item's last tile (the diagonal) moves on to the next item. Each consumer warpgroup computes
// S = Q K^T (wgmma, both operands in shared memory), the online softmax in registers (same semantics and exp2
// domain as prefill_kernel), and O += P V (wgmma, P from registers, V read MN-major), then hands the stage back.
// Rows are 128 bytes (64 elements): a head dim of 128 is stored as two 64-column halves.
// Measured on an H100 (docs/notes.md): three consumer warpgroups beat two at D = 64 (320-327 vs 302 TFLOP/s, B 4, H 32,
// S 2048, one block per item); round-robin turns between warpgroups for issuing their GEMMs (FlashAttention-3's
// ping-pong, named barriers) made ptxas wait after every wgmma and lost 17-30%, so there is none.
// FP8: the FP8 form (prefill_sm90_kernel's FP8 instance): k, v as fp8_prep_kernel's e4m3 tiles, half the bytes of a
// stage, so four stages.
template <int D, bool FP8 = false>
struct Sm90Cfg {
  static constexpr int WG = D == 64 ? 3 : 2;  // D = 128 holds twice the O registers: two warpgroups
  static constexpr int BM = 64 * WG;
  static constexpr int BN = 128;
  static constexpr int STAGES = FP8 ? 4 : 3;
  static constexpr int Q_BUFS = D == 64 ? 2 : 1;  // D = 128: a second Q buffer does not fit beside three stages
  static constexpr int HALVES = D / 64;
  static constexpr int THREADS = 128 * (WG + 1);  // + the producer warpgroup (one warp of it loads)
  // Registers per thread after setmaxnreg: an SM sub-partition (16384 registers) holds one producer warp and WG
  // consumer warps, so 32 * (PRODUCER_REGS + WG * CONSUMER_REGS) <= 16384.
  static constexpr int PRODUCER_REGS = WG == 2 ? 40 : 24;
  static constexpr int CONSUMER_REGS = WG == 2 ? 232 : 160;
  static_assert(32 * (PRODUCER_REGS + WG * CONSUMER_REGS) <= 16384, "registers of one SM sub-partition");
  static constexpr int Q_BYTES = BM * D * 2;  // Q in T (FP8 too: its consumers quantise their rows in registers)
  static constexpr int KV_BYTES = BN * D * (FP8 ? 1 : 2);  // one K or V tile
  // D = 64: P V runs as m64n72 against V and a 64-column block of ones, so that O's columns 64..71 accumulate the
  // softmax row sums on the tensor cores instead of 64 FADDs per tile and thread (the consumers are issue-bound).
  // At D = 128 a third 64-column block would have to sit at the same stride after V's two halves. FP8 (V^T, D rows
  // of keys): 8 rows of ones after V^T's D rows in every stage, P V as m64n(D + 8).
  static constexpr bool SUM_COL = FP8 || HALVES == 1;
  static constexpr int O_REGS = D / 2 + (SUM_COL ? 4 : 0);  // accumulator registers of O per thread
  static constexpr int ONES_BYTES = SUM_COL && !FP8 ? BN * 128 : 0;  // the 16-bit kernel's block of ones
  static constexpr int TX_BYTES = 2 * KV_BYTES;                      // a stage's TMA loads: K and V
  static constexpr int STAGE_BYTES = TX_BYTES + (FP8 ? 8 * 128 : 0);  // FP8: + the stage's 8 rows of ones
  static constexpr int SMEM = Q_BUFS * Q_BYTES + STAGES * STAGE_BYTES + ONES_BYTES + 1024;  // + alignment slack
};

// Work items of the persistent prefill in the order the blocks claim them: block i starts with item i, then each
// block's producer claims the next unclaimed item from a global counter (so a block that drew light items takes
// more of them). The B * H heads go in groups of `group` whose K and V fit in part of L2; a group's items run
// heaviest query block (most key tiles under the causal mask) first, the group's heads side by side. So the
// launch ends on the lightest items (longest-processing-time order) and a group's K/V tiles are read from HBM
// about once. Query blocks are aligned to the end of the rows: block mb covers rows [Sq - (n_mb - mb) BM, + BM),
// so when BM does not divide Sq the short block is the first one, the lightest under the causal mask, instead of
// the last, the heaviest (whose missing warpgroup would idle through all of its key tiles: S = 2048 at BM = 192
// leaves 128 rows). Its rows before 0 come in as zeros from TMA, a warpgroup wholly before 0 computes nothing,
// and no row before 0 is stored.
struct Sm90Sched {
  int n_mb;   // query blocks per (batch, head)
  int bh;     // B * H
  int group;  // heads per group
  // [next item - gridDim.x, blocks done, then per block Q_BUFS slots]: the two counters are zero at launch and
  // the last block to finish zeroes them; a slot holds the item whose Q a block's Q buffer holds
  int* counter;
  __host__ __device__ __forceinline__ int items() const { return n_mb * bh; }  // the host checks it fits an int
  __device__ __forceinline__ void item(int w, int& mb, int& bh_out) const {
    const int per_group = group * n_mb;
    const int gi = w / per_group, r = w - gi * per_group;
    const int size = min(group, bh - gi * group);  // heads in this group (the last one may be short)
    mb = n_mb - 1 - r / size;
    bh_out = gi * group + r % size;
  }
};

// ---- FP8 operands ----
// The FP8 prefill (FUSEINFER_ATTN_FP8=1) reads keys and values quantised once per call by fp8_prep_kernel, in
// tiles of kFp8Tile = BN keys of one (batch, key/value head) (a ring stage's worth):
//   k8     (B, Hkv, tiles * 128, D) e4m3: key j of tile t is k[j] / ks[t];
//   vt8    (B, Hkv, tiles, D, 128) e4m3: the tile's V transposed (a row per head dim, the tile's keys along it),
//          v[key] / vs[t], with the keys of every 32 permuted (fp8_key_of): wgmma's 8-bit B operands are K-major
//          only, so P V reads V^T, and in this order P's accumulator registers, packed as they lie, are P V's A
//          fragments (no shuffles);
//   scales (B, Hkv, tiles) float2 (ks[t], vs[t]): powers of two with the tile's max |x| / scale <= 448 (1 for a zero
//          tile), so that O moves exactly between the value scales of consecutive tiles.
// Keys at or past the batch row's end, min(q_start + Sq, Skv) (unwritten cache slots may hold NaN), are zeros; no
// query sees them. Per-tile scales keep the prep one pass with no reduction across blocks; the query rows are
// quantised in the attention kernel's registers.
constexpr int kFp8Tile = 128;

// The key at position L of a 32-key block of vt8: the column of P that register packing puts there (pack_p).
__host__ __device__ constexpr int fp8_key_of(int L) {
  return (L & 16) + 2 * ((L >> 2) & 3) + (L & 1) + 8 * ((L >> 1) & 1);
}

// The power of two s with amax / s in (224, 448] (1 for amax 0 or not finite).
__device__ __forceinline__ float fp8_pow2_scale(float amax) {
  if (!(amax > 0.f) || !(amax <= FLT_MAX)) return 1.f;
  int e;
  const float m = frexpf(amax / 448.f, &e);  // amax / 448 = m 2^e, m in [0.5, 1)
  return ldexpf(1.f, m == 0.5f ? e - 1 : e);
}

// grid (tiles, B * Hkv), 256 threads: one tile of one (batch, key/value head). Reads its keys and values once (16-byte
// loads), takes their max |x| over the block, writes k8 rows directly and V^T through shared memory (bytes, then
// 32-bit words of four permuted keys from 4 x 4 byte transposes, staged XOR-swizzled so that the transposing writes
// and the row-wise copy-out meet few bank conflicts).
template <typename T, int D>
__global__ void __launch_bounds__(256) fp8_prep_kernel(const AttnParams p, uint8_t* __restrict__ k8,
                                                       uint8_t* __restrict__ vt8, float2* __restrict__ scales,
                                                       int tiles) {
  constexpr int NT = 256, CH = D / 8, PER = kFp8Tile * CH / NT;  // 16-byte chunks of K (and of V) per thread
  pdl_launch_dependents();
  pdl_wait();  // k, v, q_start come from earlier kernels
  __shared__ __align__(16) uint8_t v8[kFp8Tile][D];  // the tile's V in e4m3, key-major
  __shared__ uint32_t vt_words[D][32];               // V^T words: row d, word u at u ^ (d / 4 % 32)
  __shared__ float red[2][NT / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t = blockIdx.x, bhk = blockIdx.y, hkv = p.H / p.group, b = bhk / hkv, hk = bhk % hkv;
  const int qs = p.q_start ? p.q_start[b * p.qs_s] : p.Skv - p.Sq;
  const int n_end = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(p.Skv, int64_t(qs) + p.Sq)));
  const int row0 = t * kFp8Tile;
  if (row0 >= n_end) return;  // no query reads this tile
  const T* kg = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  uint4 kr[PER], vr[PER];
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = i * NT + tid, r = c / CH, ch = c % CH;
    const bool valid = row0 + r < n_end;
    kr[i] = valid ? *reinterpret_cast<const uint4*>(kg + (row0 + r) * p.k_ss + ch * 8) : make_uint4(0, 0, 0, 0);
    vr[i] = valid ? *reinterpret_cast<const uint4*>(vg + (row0 + r) * p.v_ss + ch * 8) : make_uint4(0, 0, 0, 0);
    float f[8];
    unpack16(kr[i], static_cast<const T*>(nullptr), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax[0] = fmaxf(amax[0], fabsf(f[e]));
    unpack16(vr[i], static_cast<const T*>(nullptr), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax[1] = fmaxf(amax[1], fabsf(f[e]));
  }
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax[a] = fmaxf(amax[a], __shfl_xor_sync(kFullMask, amax[a], off));
    if (lane == 0) red[a][warp] = amax[a];
  }
  __syncthreads();
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    amax[a] = red[a][0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) amax[a] = fmaxf(amax[a], red[a][w]);
  }
  const float ks = fp8_pow2_scale(amax[0]), vs = fp8_pow2_scale(amax[1]);
  if (tid == 0) scales[int64_t(bhk) * tiles + t] = make_float2(ks, vs);
  const float kinv = 1.f / ks, vinv = 1.f / vs;  // exact: powers of two
  uint8_t* krow = k8 + (int64_t(bhk) * tiles * kFp8Tile + row0) * D;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = i * NT + tid, r = c / CH, ch = c % CH;
    float f[8];
    unpack16(kr[i], static_cast<const T*>(nullptr), f);
    *reinterpret_cast<uint2*>(krow + r * D + ch * 8) =
        make_uint2(e4m3x4(f[0] * kinv, f[1] * kinv, f[2] * kinv, f[3] * kinv),
                   e4m3x4(f[4] * kinv, f[5] * kinv, f[6] * kinv, f[7] * kinv));
    unpack16(vr[i], static_cast<const T*>(nullptr), f);
    *reinterpret_cast<uint2*>(&v8[r][ch * 8]) = make_uint2(e4m3x4(f[0] * vinv, f[1] * vinv, f[2] * vinv, f[3] * vinv),
                                                          e4m3x4(f[4] * vinv, f[5] * vinv, f[6] * vinv, f[7] * vinv));
  }
  __syncthreads();
  // Word u of V^T rows d..d+3 (d = 4 d4): keys 32 (u / 8) + fp8_key_of(4 (u % 8) + j), j = 0..3, one 32-bit load of
  // dims d..d+3 per key, then a 4 x 4 byte transpose; a warp's lanes take consecutive d4
#pragma unroll 2
  for (int w = tid; w < D / 4 * 32; w += NT) {
    const int d4 = w % (D / 4), u = w / (D / 4), k0 = 32 * (u >> 3), L = 4 * (u & 7);
    uint32_t x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = *reinterpret_cast<const uint32_t*>(&v8[k0 + fp8_key_of(L + j)][4 * d4]);
    const uint32_t lo01 = __byte_perm(x[0], x[1], 0x5140), hi01 = __byte_perm(x[0], x[1], 0x7362);
    const uint32_t lo23 = __byte_perm(x[2], x[3], 0x5140), hi23 = __byte_perm(x[2], x[3], 0x7362);
    const uint32_t words[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                               __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
    for (int i = 0; i < 4; ++i) vt_words[4 * d4 + i][u ^ (d4 & 31)] = words[i];
  }
  __syncthreads();
  uint32_t* vtile = reinterpret_cast<uint32_t*>(vt8 + (int64_t(bhk) * tiles + t) * D * kFp8Tile);
#pragma unroll 4
  for (int w = tid; w < D * 32; w += NT) {  // lanes take consecutive words of one row: 128-byte stores
    const int d = w / 32, u = w % 32;
    vtile[w] = vt_words[d][u ^ ((d >> 2) & 31)];
  }
}

// The FP8 instance (FP8 = true) reads k and v as fp8_prep_kernel's e4m3 tiles (tm_k over k8, tm_v over vt8) with their
// per-tile scales fp8_scales (B * Hkv rows of fp8_tiles (key, value) pairs); its consumers quantise their Q rows to
// e4m3 in registers (one scale per row) and run Q K^T and P V as e4m3 wgmmas (k32) with P from registers; everything
// else is the 16-bit kernel's. See fp8_prep_kernel for the layouts.
template <typename T, int D, bool FP8 = false>
__global__ void __launch_bounds__(Sm90Cfg<D, FP8>::THREADS, 1)
    prefill_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v, const AttnParams p, const Sm90Sched sched,
                        const float2* __restrict__ fp8_scales, int fp8_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90Cfg<D, FP8>;
  constexpr int BN = C::BN, STAGE_BYTES = C::STAGE_BYTES;
  extern __shared__ unsigned char smem_raw[];
  // [Q: Q_BUFS][HALVES][BM][64] | per stage [K: HALVES][BN][64] [V: HALVES][BN][64] | [ones: BN][64] (SUM_COL),
  // 1024-byte aligned (swizzle atoms)
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* q_s = smem;
  unsigned char* kv_s = smem + C::Q_BUFS * C::Q_BYTES;
  unsigned char* ones_s = kv_s + C::STAGES * STAGE_BYTES;
  __shared__ __align__(8) uint64_t full_bar[C::STAGES], empty_bar[C::STAGES], q_full[C::Q_BUFS],
      q_empty[C::Q_BUFS], tail_bar;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], 4 * C::WG);  // one arrival per consumer warp
    }
    for (int i = 0; i < C::Q_BUFS; ++i) {
      mbar_init(&q_full[i], 1);
      mbar_init(&q_empty[i], 4 * C::WG);
    }
    mbar_init(&tail_bar, 1);
    fence_mbarrier_init();
  }
  if constexpr (FP8) {  // e4m3 1.0 (0x38) in the 8 rows after each stage's V^T
    for (int i = tid; i < C::STAGES * 64; i += C::THREADS)
      reinterpret_cast<uint4*>(kv_s + (i / 64) * STAGE_BYTES + C::TX_BYTES)[i % 64] =
          make_uint4(0x38383838u, 0x38383838u, 0x38383838u, 0x38383838u);
    fence_proxy_async_smem();  // read by wgmma (the async proxy) after the barrier below
  } else if constexpr (C::SUM_COL) {
    const uint32_t one = pack2<T>(1.f, 1.f);
    for (int i = tid; i < C::ONES_BYTES / 16; i += C::THREADS)
      reinterpret_cast<uint4*>(ones_s)[i] = make_uint4(one, one, one, one);
    fence_proxy_async_smem();  // read by wgmma (the async proxy) after the barrier below
  }
  pdl_launch_dependents();
  pdl_wait();  // q, k, v, masks come from earlier kernels
  __syncthreads();

  const int Sq = p.Sq, Skv = p.Skv;
  const bool has_mask = p.key_mask != nullptr;
  volatile int* slots = sched.counter + 2 + blockIdx.x * C::Q_BUFS;
  // Geometry of work item w, the same for the producer and the consumers: its (b, h), first query row m0, the
  // q_start of its row and n_end, the end of the keys its last query may see.
  struct Item {
    int b, h, hk, m0, qs, n_end, n_tiles;  // hk: the key/value head of query head h
  };
  auto item = [&](int w) {
    Item it;
    int mb, bh;
    sched.item(w, mb, bh);
    it.b = bh / p.H;
    it.h = bh % p.H;
    it.hk = p.group == 1 ? it.h : it.h / p.group;
    it.m0 = Sq - (sched.n_mb - mb) * C::BM;  // blocks end-aligned: see Sm90Sched
    it.qs = p.q_start ? p.q_start[it.b * p.qs_s] : Skv - Sq;
    const int last_q = min(it.m0 + C::BM, Sq) - 1;
    it.n_end = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(Skv, int64_t(it.qs) + last_q + 1)));
    it.n_tiles = (it.n_end + BN - 1) / BN;
    return it;
  };

  if (warp >= 4 * C::WG) {  // ---- producer warpgroup: its first warp loads, the others leave ----
    setmaxnreg_dec<C::PRODUCER_REGS>();
    if (warp > 4 * C::WG) return;
    int tile = 0;   // ring tiles loaded so far: tile k uses stage k % STAGES for the (k / STAGES)-th time
    int tails = 0;  // completed phases of tail_bar
    // The block's n-th item (n counted from 0) uses Q buffer n % Q_BUFS; its index reaches the consumers in the
    // buffer's slot, written before the arrival on q_full that they wait for; after the last item a slot holds
    // an index >= items, which ends the consumers' loop. (The slots are in global memory: compute-sanitizer's
    // racecheck does not model mbarriers and would report a shared-memory handoff.)
    for (int n = 0, w = blockIdx.x;; ++n) {
      int w_next = 0;  // claimed now, so that the atomic's round trip hides behind this item's loads
      if (lane == 0 && w < sched.items()) w_next = gridDim.x + atomicAdd(&sched.counter[0], 1);
      const int qb = n % C::Q_BUFS;
      if (n >= C::Q_BUFS) mbar_wait(&q_empty[qb], (n / C::Q_BUFS - 1) & 1);
      if (w >= sched.items()) {
        if (lane == 0) {
          slots[qb] = w;
          mbar_arrive(&q_full[qb]);
          __threadfence();  // this block's claims happen before its count as done
          if (atomicAdd(&sched.counter[1], 1) == gridDim.x - 1) {  // every block has made its last claim
            sched.counter[0] = 0;
            sched.counter[1] = 0;
          }
        }
        break;
      }
      const Item it = item(w);
      if (lane == 0) {
        slots[qb] = w;
        mbar_expect_tx(&q_full[qb], C::Q_BYTES);
        for (int hf = 0; hf < C::HALVES; ++hf)
          tma_load_4d(q_s + qb * C::Q_BYTES + hf * C::BM * 128, &tm_q, hf * 64, it.m0, it.h, it.b, &q_full[qb]);
      }
      for (int t = 0; t < it.n_tiles; ++t, ++tile) {
        const int s = tile % C::STAGES, n0 = t * BN;
        if (tile >= C::STAGES) mbar_wait(&empty_bar[s], (tile / C::STAGES - 1) & 1);
        // The last tile may reach past n_end into rows that are not ours to use (unwritten cache slots may hold
        // NaN, and 0 * NaN would poison P V): it lands on tail_bar, the warp zeroes V's rows >= n_end, then
        // releases the stage with a plain arrival. Rows >= Skv are zero-filled by TMA. (FP8: the prep kernel wrote
        // zeros past the batch row's end, and keys between an item's n_end and it are written ones.)
        const bool tail = !FP8 && t == it.n_tiles - 1 && it.n_end < Skv && it.n_end < n0 + BN;
        unsigned char* k_dst = kv_s + s * STAGE_BYTES;
        unsigned char* v_dst = k_dst + C::KV_BYTES;
        uint64_t* bar = tail ? &tail_bar : &full_bar[s];
        if (lane == 0) {
          mbar_expect_tx(bar, C::TX_BYTES);
          if constexpr (FP8) {  // k8 rows n0.. (D bytes each), vt8 tile t (D rows of BN keys)
            tma_load_4d(k_dst, &tm_k, 0, n0, it.hk, it.b, bar);
            tma_load_4d(v_dst, &tm_v, 0, 0, t, it.b * (p.H / p.group) + it.hk, bar);
          } else {
            for (int hf = 0; hf < C::HALVES; ++hf) {
              tma_load_4d(k_dst + hf * BN * 128, &tm_k, hf * 64, n0, it.hk, it.b, bar);
              tma_load_4d(v_dst + hf * BN * 128, &tm_v, hf * 64, n0, it.hk, it.b, bar);
            }
          }
        }
        if (tail) {
          mbar_wait(&tail_bar, tails++ & 1);
          const int first = it.n_end - n0;  // first row to zero
          for (int i = first * 8 + lane; i < BN * 8; i += 32)  // 16-byte chunks of a half's rows
            for (int hf = 0; hf < C::HALVES; ++hf)
              *reinterpret_cast<uint4*>(v_dst + hf * BN * 128 + i * 16) = make_uint4(0, 0, 0, 0);
          fence_proxy_async_smem();
          __syncwarp();
          if (lane == 0) mbar_arrive(&full_bar[s]);
        }
      }
      w = __shfl_sync(kFullMask, w_next, 0);
    }
    return;
  }

  // ---- consumer warpgroups ----
  setmaxnreg_inc<C::CONSUMER_REGS>();
  // Software pipeline (FlashAttention-3's intra-warpgroup overlap): while the tensor cores run S = Q K^T of tile t
  // and O += P V of tile t - 1, nothing waits; the softmax of tile t then overlaps the P V of tile t - 1.
  const int g = __shfl_sync(kFullMask, warp >> 2, 0), wi = warp & 3;  // broadcast: see w below
  // Descriptors of stage 0's K and V tiles; another stage's, and a k16 (k32) step's, differ in the start address only.
  // FP8 at D = 64: K's rows are 64 bytes, in the 64-byte swizzle.
  const uint64_t k_desc0 =
      FP8 && D == 64 ? wgmma_desc_sw64(smem_addr(kv_s), 512) : wgmma_desc(smem_addr(kv_s), 16, 1024);
  const uint32_t v_addr0 = smem_addr(kv_s) + C::KV_BYTES, ones_addr = smem_addr(ones_s);
  auto stage16 = [&](int k) {  // broadcast: see w below
    return static_cast<uint32_t>(__shfl_sync(kFullMask, (k % C::STAGES) * (STAGE_BYTES >> 4), 0));
  };
  auto wait_full = [&](int k) { mbar_wait(&full_bar[k % C::STAGES], (k / C::STAGES) & 1); };
  auto release = [&](int k) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty_bar[k % C::STAGES]);
  };
  float o[C::O_REGS];  // O, then (SUM_COL) the row sums in registers D/2..D/2+3 (columns D..D+7, all alike)
  float sc[BN / 2];          // S of the tile in the softmax, then its P in fp32
  // P of the previous tile as wgmma A fragments: keys 16kk..16kk+15 in pa[kk]; FP8: the 32 keys of block kk
  // (permuted, see fp8_prep_kernel) in pa[kk]
  uint32_t pa[FP8 ? BN / 32 : BN / 16][4];
  uint32_t qa[FP8 ? D / 32 : 1][4];  // FP8: this warp's 16 Q rows in e4m3, columns 32s..32s+31 in qa[s]
  float q_scale[2] = {1.f, 1.f};     // FP8: the scale of each thread row's e4m3 Q
  auto issue_qk = [&](uint64_t q_desc, int k) {  // sc = Q K^T of ring tile k (committed, not waited)
    const uint64_t k_desc = wgmma_desc_add(k_desc0, stage16(k));
    if constexpr (FP8) {
#pragma unroll
      for (int s = 0; s < D / 32; ++s) wgmma_rs_e4m3(sc, qa[s], wgmma_desc_add(k_desc, 2 * s), s > 0);  // 32 B a step
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t off = (kk % 4) * 32;  // k16 step: 32 bytes along a 128-byte row
        wgmma_ss_n128<T>(sc, wgmma_desc_add(q_desc, ((kk / 4) * C::BM * 128 + off) >> 4),
                         wgmma_desc_add(k_desc, ((kk / 4) * BN * 128 + off) >> 4), kk > 0);
      }
    }
    wgmma_commit();
  };
  auto issue_pv = [&](int k) {  // o += pa V of ring tile k (committed, not waited)
    const uint32_t v_addr = v_addr0 + 16 * stage16(k);
    if constexpr (FP8) {  // V^T: D rows of BN keys (128 bytes) and 8 rows of ones, k32 steps of 32 bytes along them
      const uint64_t v_desc = wgmma_desc(v_addr, 16, 1024);
#pragma unroll
      for (int kk = 0; kk < BN / 32; ++kk) wgmma_rs_e4m3(o, pa[kk], wgmma_desc_add(v_desc, 2 * kk), 1);
    } else {
      // V's 64-column blocks: D / 64 halves BN * 128 bytes apart, or (SUM_COL) V and the block of ones
      const uint64_t v_desc = wgmma_desc(v_addr, C::SUM_COL ? ones_addr - v_addr : BN * 128, 1024);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<T>(o, pa[kk], wgmma_desc_add(v_desc, kk * 16 * 128 >> 4), 1);
    }
    wgmma_commit();
  };
  int tile = 0;  // ring tiles of earlier items (the producer's count)
  for (int n = 0;; ++n) {
    const int qb = n % C::Q_BUFS;
    mbar_wait(&q_full[qb], (n / C::Q_BUFS) & 1);
    // Broadcast from lane 0 (every lane reads the same slot) so that ptxas knows the item is warp-uniform: the
    // ring stage and the wgmma descriptors are then computed in uniform registers, off the consumers' issue slots.
    const int w = __shfl_sync(kFullMask, slots[qb], 0);
    if (w >= sched.items()) break;
    const Item it = item(w);
    const int q0 = it.m0 + 64 * g;  // first query row of this warpgroup
    // Tiles this warpgroup computes: up to the causal limit of its last row; later ones it only hands back.
    const int last_key = it.qs + q0 + 63;
    const int my_tiles = q0 + 64 <= 0 || last_key < 0 ? 0 : min(it.n_tiles, last_key / BN + 1);
    const uint64_t q_desc = wgmma_desc(smem_addr(q_s + qb * C::Q_BYTES) + g * 64 * 128, 16, 1024);
    if constexpr (FP8) {
      // This warp's 16 Q rows (T, 128-byte-swizzled 64-column halves) -> e4m3 A fragments with one scale per row,
      // max |q| / 448 (1 for a zero row, whose scores are 0 whatever the scale). The Q buffer is then free.
      const unsigned char* qt = q_s + qb * C::Q_BYTES;
      uint2 raw[D / 32][4];
      float amax[2] = {0.f, 0.f};
#pragma unroll
      for (int s = 0; s < D / 32; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // qa[s][j]: row 8 * (j % 2) + lane / 4, columns 32s + 16 * (j / 2) + 4 * (lane % 4)
          const int r = 64 * g + 16 * wi + (lane >> 2) + 8 * (j & 1);
          const int col = 32 * s + 16 * (j >> 1) + 4 * (lane & 3), cc = col & 63;
          raw[s][j] = *reinterpret_cast<const uint2*>(qt + (col >> 6) * C::BM * 128 + r * 128 +
                                                      (((cc >> 3) ^ (r & 7)) << 4) + (cc & 7) * 2);
          float f[4];
          unpack4<T>(raw[s][j], f);
          amax[j & 1] = fmaxf(amax[j & 1], fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3]))));
        }
      float inv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        amax[r] = fmaxf(amax[r], __shfl_xor_sync(kFullMask, amax[r], 1));
        amax[r] = fmaxf(amax[r], __shfl_xor_sync(kFullMask, amax[r], 2));
        q_scale[r] = amax[r] > 0.f ? amax[r] / 448.f : 1.f;
        inv[r] = amax[r] > 0.f ? 448.f / amax[r] : 0.f;
      }
#pragma unroll
      for (int s = 0; s < D / 32; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float f[4];
          unpack4<T>(raw[s][j], f);
          const float x = inv[j & 1];
          qa[s][j] = e4m3x4(f[0] * x, f[1] * x, f[2] * x, f[3] * x);
        }
      __syncwarp();
      if (lane == 0) mbar_arrive(&q_empty[qb]);
    }
    const bool* mrow = has_mask ? p.key_mask + it.b * p.m_sb : nullptr;
#pragma unroll
    for (int i = 0; i < C::O_REGS; ++i) o[i] = 0.f;
    float corr[2];             // factor that takes O to the running max of the newest tile
    float row_max[2] = {-INFINITY, -INFINITY};  // running max of raw scores
    float row_sum[2] = {0.f, 0.f};              // !SUM_COL: this thread's share of the running sum
    int lim[2];                                  // last admissible key of each thread row
#pragma unroll
    for (int r = 0; r < 2; ++r) lim[r] = min(it.qs + q0 + 16 * wi + (lane >> 2) + 8 * r, it.n_end - 1);

    // key_mask bits, read one tile ahead so that the loads' latency hides behind a tile's work: this lane's bits
    // of keys 32w + lane of the next tile. (Each warp reads them itself: no shared-memory handoff to synchronise.)
    bool mask_next[BN / 32];
    auto load_mask = [&](int t) {
#pragma unroll
      for (int w32 = 0; w32 < BN / 32; ++w32) {
        const int key = t * BN + 32 * w32 + lane;
        mask_next[w32] = key < it.n_end && mrow[key * p.m_ss];
      }
    };
    if (has_mask) load_mask(0);
    // Raw scores may exceed the running max by up to kStaleMax / scale_log2 before O is rescaled (FlashAttention-4's
    // conditional rescaling): P <= 2^kStaleMax stays exact in fp32 and in P's 16-bit type, and most tiles skip the
    // O * corr multiply. The decision is per warp (its 16 rows), so the skip is a uniform branch.
    constexpr float kStaleMax = 8.f;
    bool rescale_o = false;  // whether O must be multiplied by corr after the P V of the previous tile
    // ks: FP8, the key scale of tile t
    auto softmax = [&](int t, float ks) {  // mask sc, update row max / sum, sc = P; sets corr and rescale_o
      const int n0 = t * BN;
      // sc[i] holds column c = 8 * (i / 4) + 2 * (lane % 4) + i % 2 of the tile: admissible while c - 2 * (lane % 4)
      // <= room, so each test is against a compile-time constant
      const int room[2] = {lim[0] - n0 - 2 * (lane & 3), lim[1] - n0 - 2 * (lane & 3)};
      if (has_mask) {
        // key_mask bits of this thread's columns: column c = 8 * (i / 4) + 2 * (lane % 4) + i % 2 of sc[i] lies in
        // word i / 16 at bit 8 * ((i / 4) % 4) + i % 2 after a shift by 2 * (lane % 4)
        uint32_t mw[BN / 32];
#pragma unroll
        for (int w32 = 0; w32 < BN / 32; ++w32) mw[w32] = __ballot_sync(kFullMask, mask_next[w32]) >> (2 * (lane & 3));
        load_mask(t + 1);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
          const bool ok = (i >> 2) * 8 + (i & 1) <= room[(i >> 1) & 1] &&
                          ((mw[i >> 4] >> (((i >> 2) & 3) * 8 + (i & 1))) & 1u);
          sc[i] = ok ? sc[i] : -INFINITY;
        }
      } else if (n0 + BN - 1 > it.qs + q0 + 16 * wi || n0 + BN > it.n_end) {  // the causal diagonal or the end
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) sc[i] = (i >> 2) * 8 + (i & 1) <= room[(i >> 1) & 1] ? sc[i] : -INFINITY;
      }
      if constexpr (FP8) {
        // The exp2-domain score of sc[i] is sc[i] * c[r]: the softmax scale times Q's row scale times the tile's key
        // scale (all > 0), which changes from tile to tile, so row_max holds the running max of scaled scores.
        const float c[2] = {p.scale_log2 * q_scale[0] * ks, p.scale_log2 * q_scale[1] * ks};
        float mx[2] = {-INFINITY, -INFINITY}, base[2];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], sc[i]);
        bool grown = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
          mx[r] = fmaxf(row_max[r], mx[r] * c[r]);
          grown |= mx[r] - row_max[r] > kStaleMax;  // false while both are -inf
        }
        rescale_o = __any_sync(kFullMask, grown);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (rescale_o) {
            base[r] = mx[r] == -INFINITY ? 0.f : mx[r];
            corr[r] = ex2(row_max[r] - base[r]);
            row_max[r] = mx[r];
          } else {
            base[r] = row_max[r] == -INFINITY ? 0.f : row_max[r];
          }
        }
#pragma unroll
        for (int i = 0; i < BN / 2; ++i)  // P <= 2^kStaleMax = 256: within e4m3's 448 (row sums: SUM_COL)
          sc[i] = ex2(fmaf(sc[i], c[(i >> 1) & 1], -base[(i >> 1) & 1]));
        return;
      }
      // scale > 0 (the host checks), so the max of raw scores is the max of scaled ones
      float mx[2] = {row_max[0], row_max[1]}, base[2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], sc[i]);
      bool grown = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
        grown |= mx[r] * p.scale_log2 - row_max[r] * p.scale_log2 > kStaleMax;  // false while both are -inf
      }
      rescale_o = __any_sync(kFullMask, grown);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (rescale_o) {
          base[r] = mx[r] == -INFINITY ? 0.f : mx[r] * p.scale_log2;  // fully masked so far: P = 0
          corr[r] = ex2(row_max[r] * p.scale_log2 - base[r]);
          row_max[r] = mx[r];
          if constexpr (!C::SUM_COL) row_sum[r] *= corr[r];
        } else {
          base[r] = row_max[r] == -INFINITY ? 0.f : row_max[r] * p.scale_log2;
        }
      }
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        sc[i] = ex2(fmaf(sc[i], p.scale_log2, -base[(i >> 1) & 1]));
        if constexpr (!C::SUM_COL) row_sum[(i >> 1) & 1] += sc[i];
      }
    };
    auto pack_p = [&] {  // accumulator columns 16kk..16kk+15 -> A fragment kk
      if constexpr (FP8) {
        // Columns 32kk..32kk+31 as they lie in the registers -> A fragment kk of the permuted keys (fp8_key_of):
        // register j takes row 8 * (j % 2) + lane / 4 at columns 2 * (lane % 4) + {0, 1, 8, 9} + 16 * (j / 2)
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk) {
          const float* x = sc + 16 * kk;
          pa[kk][0] = e4m3x4(x[0], x[1], x[4], x[5]);
          pa[kk][1] = e4m3x4(x[2], x[3], x[6], x[7]);
          pa[kk][2] = e4m3x4(x[8], x[9], x[12], x[13]);
          pa[kk][3] = e4m3x4(x[10], x[11], x[14], x[15]);
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
          for (int j = 0; j < 4; ++j) pa[kk][j] = pack2<T>(sc[8 * kk + 2 * j], sc[8 * kk + 2 * j + 1]);
      }
    };
    // FP8: the (key, value) scales of the item's tiles; O is in units of v_unit, the value scale of the last tile added
    const float2* tile_scales =
        FP8 ? fp8_scales + (int64_t(it.b) * (p.H / p.group) + it.hk) * fp8_tiles : nullptr;
    auto scales_of = [&](int t) { return FP8 ? tile_scales[t] : make_float2(1.f, 1.f); };
    float v_unit = 1.f;

    if (my_tiles > 0) {
      wait_full(tile);
      float2 ts = scales_of(0);
      wgmma_fence_operands(sc);
      wgmma_fence();
      issue_qk(q_desc, tile);
      wgmma_wait<0>();
      wgmma_fence_operands(sc);
      softmax(0, ts.x);  // O is still 0: no rescale
      v_unit = ts.y;
      pack_p();
      for (int t = 1; t < my_tiles; ++t) {
        wait_full(tile + t);
        ts = scales_of(t);  // loaded before the wgmmas are issued, used after them
        wgmma_fence_operands(sc);
        wgmma_fence_operands(o);
        wgmma_fence_operands(pa);
        wgmma_fence();
        issue_qk(q_desc, tile + t);
        issue_pv(tile + t - 1);
        wgmma_wait<1>();  // S of tile t is ready; P V of tile t - 1 may still run
        wgmma_fence_operands(sc);
        softmax(t, ts.x);
        wgmma_wait<0>();
        wgmma_fence_operands(o);
        wgmma_fence_operands(pa);
        release(tile + t - 1);
        if constexpr (FP8) {
          // O to the new running max and to tile t's value scale (powers of two: exact); the row sums (registers
          // D/2..) to the new running max only
          const float vr = v_unit / ts.y;
          v_unit = ts.y;
          if (rescale_o || vr != 1.f) {
            const float g[2] = {rescale_o ? corr[0] : 1.f, rescale_o ? corr[1] : 1.f};
            const float f[2] = {g[0] * vr, g[1] * vr};
#pragma unroll
            for (int i = 0; i < C::O_REGS; ++i) o[i] *= i < D / 2 ? f[(i >> 1) & 1] : g[(i >> 1) & 1];
          }
        } else if (rescale_o) {
#pragma unroll
          for (int i = 0; i < C::O_REGS; ++i) o[i] *= corr[(i >> 1) & 1];
        }
        pack_p();
      }
    }
    // This warp's S = Q K^T are done (each waited above): the producer may load the next item's Q here. (FP8: done
    // when its Q went into registers.)
    if constexpr (!FP8) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&q_empty[qb]);
    }
    if (my_tiles > 0) {
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
      wgmma_fence();
      issue_pv(tile + my_tiles - 1);
      wgmma_wait<0>();
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
      release(tile + my_tiles - 1);
    }
    for (int t = my_tiles; t < it.n_tiles; ++t) {  // tiles past this warpgroup's rows: hand them back
      wait_full(tile + t);
      release(tile + t);
    }
    tile += it.n_tiles;
    float l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = (C::SUM_COL ? o[D / 2 + 2 * r] : quad_sum(row_sum[r])) / v_unit;
    store_rows<T, D>(p, [&](int d, int e) { return o[4 * d + e]; }, l, it.b, it.h, q0 + 16 * wi + (lane >> 2),
                     lane);
  }
#else
  __trap();  // the host picks this kernel only in an sm_90a-only build for sm_90 (setup.py), running on sm_90
#endif
}

// ------------------------------------------------------------------------------------------------------------
// Split-KV (flash-decoding)
// ------------------------------------------------------------------------------------------------------------

constexpr int kSplitThreads = 128;

// FP8 (e4m3 cache, fp16 / bf16 queries): with one or two query rows a thread reads 16 e4m3 of a row in one 16-byte
// load (VEC 16), so the per-row work (the G-lane score reduction, masks, exponentials, addresses) is paid once per 16
// bytes as in the fp16 form rather than once per 8: with 8-byte loads of 8 elements the kernel issued twice the
// instructions per byte of the fp16 form and ran well short of the memory's speed. More rows per block then need
// more registers (16 accumulator floats per row), hence fewer resident blocks.
// With four or eight rows the multiply-adds per byte dominate and the 16 floats per row would not fit: those keep
// 8-byte loads of 8.
template <typename T, int D, int QB, bool FP8 = false>
struct SplitCfg {
  static constexpr bool WIDE8 = FP8 && QB <= 2;                  // FP8 with 16-byte loads of 16 e4m3
  static constexpr int VEC = WIDE8 ? 16 : 16 / int(sizeof(T));   // elements per thread per row (one load)
  static constexpr int G = D / VEC;                // threads sharing one key row
  static constexpr int KPS = kSplitThreads / G;    // keys per block step
  // FP8 with 16-byte loads: the scores on tensor cores (see split_kv_kernel): the lanes of a key row's 64-dim half
  // are exactly an mma's thread-in-group, and the per-element fp16 -> fp32 conversions and multiply-adds of the
  // scores give way to four mmas per two key rows. With one row, six key rows in flight per thread at four blocks
  // per SM (as many bytes in flight as the fp16 form; five blocks of four would spill).
  static constexpr bool MMA = WIDE8;
  static constexpr int U = MMA && QB == 1 ? 6 : (QB >= 8 ? 2 : 4);  // key rows in flight per thread
  static constexpr int KPI = KPS * U;              // keys per block iteration
  static constexpr int MIN_BLOCKS = WIDE8 ? (QB == 1 && !MMA ? 5 : 4)
                                          : (QB == 1 ? 6 : (QB == 2 ? 4 : (QB == 4 ? 3 : 2)));  // resident blocks / SM
  static_assert(G <= 32 && 32 % G == 0, "a key row must be read by a power-of-two part of a warp");
};

// Grouped-query attention packs the query heads of one key/value head into a block (FlashDecoding's GQA packing):
// the rows of key/value head hk are the group * Sq pairs (query head hk * group + r / Sq, query r % Sq), so each K/V
// row a block loads serves every query head that reads it (decode with Sq = 1 and 4 query heads per key/value head
// reads the cache once instead of four times). With group 1 the rows are the queries of head h, as before.
// grid (B * Hkv, splits, ceil(R / QB)), R = group * Sq rows; block kSplitThreads. Block (bkv, split, z) handles
// rows z*QB .. z*QB+QB-1 over keys [split * kps, (split + 1) * kps) of [0, key_end), where key_end is the causal
// limit of its latest query and kps = round_up(ceil(key_end / splits), KPI). splits == 1: writes out. Else the
// first `used` = ceil(key_end / kps) splits write part_acc (B*Hkv, R, splits, D) and part_ml (B*Hkv, R, splits)
// = (max, sum), every block counts itself in at counters[bkv * gridDim.z + z] (zero on entry), and the last
// one to arrive merges the used partials into out and sets the counter back to zero.
// FP8: k and v are e4m3 (strides in bytes) with p.kv_scale; a thread reads VEC = 16 (QB <= 2, one 16-byte load) or
// 8 (one 8-byte load) elements of a row (SplitCfg).
template <typename T, int D, int QB, bool FP8 = false>
__global__ void __launch_bounds__(kSplitThreads, SplitCfg<T, D, QB, FP8>::MIN_BLOCKS)
    split_kv_kernel(const AttnParams p, float* __restrict__ part_acc, float2* __restrict__ part_ml,
                    int* __restrict__ counters) {
  using Cfg = SplitCfg<T, D, QB, FP8>;
  constexpr int VEC = Cfg::VEC, G = Cfg::G, KPS = Cfg::KPS, U = Cfg::U, KPI = Cfg::KPI;
  constexpr int NW = kSplitThreads / 32;
  static_assert(!FP8 || ((VEC == 8 || VEC == 16) && sizeof(T) == 2),
                "the FP8 form takes fp16 / bf16 queries (8 or 16 elements per thread)");
  using KV = std::conditional_t<FP8, uint8_t, T>;  // a cache element
  using Load = std::conditional_t<FP8 && VEC == 8, uint2, uint4>;  // VEC cache elements
  pdl_launch_dependents();
  pdl_wait();  // q, the cache, its scales, q_start and the counters come from earlier kernels

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = tid / G, c = tid % G;  // key slot within a step, 16-byte chunk of the row
  const int kv_heads = p.H / p.group, rows = p.group * p.Sq;
  const int bkv = blockIdx.x, b = bkv / kv_heads, hk = bkv % kv_heads;
  const int split = blockIdx.y, splits = gridDim.y;
  const int r0 = blockIdx.z * QB, nq = min(QB, rows - r0);
  const int qs = p.q_start ? p.q_start[b * p.qs_s] : p.Skv - p.Sq;
  // Row i of the block: query head hk * group + (r0 + i) / Sq, query (r0 + i) % Sq (row i itself when group is 1).
  auto row_head = [&](int i) { return p.group == 1 ? hk : hk * p.group + (r0 + i) / p.Sq; };
  auto row_query = [&](int i) { return p.group == 1 ? r0 + i : (r0 + i) % p.Sq; };
  int lim[QB];  // last admissible key of each row (causal); rows past nq see no key
  int last_query = 0;
#pragma unroll
  for (int i = 0; i < QB; ++i) {
    lim[i] = i < nq ? qs + row_query(i) : INT_MIN;
    if (i < nq) last_query = max(last_query, row_query(i));
  }
  const int key_end =
      static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(p.Skv, int64_t(qs) + last_query + 1)));
  // FP8: this key/value head's scales (written by the prefill's calibration: coherent loads after the wait)
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (FP8) {
    k_scale = ld_dep(p.kv_scale + hk);
    v_scale = ld_dep(p.kv_scale + kv_heads + hk);
  }
  const int kps = ((key_end + splits - 1) / splits + KPI - 1) / KPI * KPI;
  const int kb0 = split * kps, kb1 = min(kb0 + kps, key_end);

  // This thread's slice of each row's query, pre-scaled into the log2 domain (and, FP8, by the key scale: q.(s k)
  // = (s q).k); missing rows are 0.
  float qf[QB][VEC];
  {
    const T* qg = static_cast<const T*>(p.q) + b * p.q_sb + c * VEC;
    const float qscale = p.scale_log2 * k_scale;
#pragma unroll
    for (int i = 0; i < QB; ++i) {
      const T* qrow = qg + (i < nq ? row_head(i) * p.q_sh + int64_t(row_query(i)) * p.q_ss : 0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[i][e] = i < nq ? to_float(qrow[e]) * qscale : 0.f;
    }
  }
  // MMA: S = K Q^T per pair of key rows as one m16n8k16 mma per 16 dims, fp32 accumulation. Lane (g, t) = (lane / 4,
  // lane % 4) loads dims 16 c .. 16 c + 15 (c = tid % G: c = t at D = 64, c = 4 h + t at D = 128, h = g % 2 the
  // row's 64-dim half) of key rows u and u + 1 of its key slot, the mma's rows g and g + 8. Column n of the mma is
  // block row n's query (D = 64) or the half n % 2 of block row n / 2's (D = 128); rows past QB are 0: lane (g, t)
  // supplies B column g, the dims it loads of block row lane / G's query. The mma's k index of mma j is mapped so that
  // each lane's fragments come from its own loads: k = 2 t + e (e = 0, 1) is dim 16 c + 4 j + e and k = 2 t + 8 + e
  // is dim 16 c + 4 j + 2 + e, the same bijection for K (A, row-major) and q (B, column-major) within a half, so
  // C[g][n] is the exact dot product (D = 64), or, at D = 128, that of key half g % 2 with query half n % 2: the
  // entries with equal halves are summed over the two halves' lanes (lane ^ 4) and the rest are ignored. e4m3 keys
  // are exact fp16; the queries go in fp16 as given (fp16) or (bf16) scaled by a power of two that puts their
  // largest |value| in [2^14, 2^15) (exact within fp16's range; the scale is divided out with the log2 scale and
  // the key scale, per query, after the mma).
  [[maybe_unused]] uint32_t qb[4][2];  // MMA: B fragments of mma j (f16x2)
  [[maybe_unused]] float s_fac[QB];    // MMA: raw score -> log2 domain (scale_log2 * k_scale / the query's scale)
  if constexpr (Cfg::MMA) {
    const int qi = lane / G;  // the block row whose query this lane's B fragment holds
    const bool has = qi < QB && qi < nq;
    const T* qrow = static_cast<const T*>(p.q) + b * p.q_sb + c * VEC +
                    (has ? row_head(qi) * p.q_sh + int64_t(row_query(qi)) * p.q_ss : 0);
    float qv[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) qv[e] = has ? to_float(qrow[e]) : 0.f;
    float pw = 1.f;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      float mx = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) mx = fmaxf(mx, fabsf(qv[e]));
#pragma unroll
      for (int off = 1; off < G; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));  // query qi's G lanes
      if (mx > 0.f && mx <= FLT_MAX) {
        int ex;
        frexpf(mx, &ex);  // mx = f 2^ex, f in [0.5, 1)
        pw = ldexpf(1.f, 15 - ex);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      qb[j][0] = pack2<__half>(qv[4 * j] * pw, qv[4 * j + 1] * pw);
      qb[j][1] = pack2<__half>(qv[4 * j + 2] * pw, qv[4 * j + 3] * pw);
    }
#pragma unroll
    for (int i = 0; i < QB; ++i) s_fac[i] = p.scale_log2 * k_scale / __shfl_sync(kFullMask, pw, G * i);
  }
  float m[QB], l[QB], acc[QB][VEC];  // per query: running max, sum, this thread's D-slice of P V
#pragma unroll
  for (int i = 0; i < QB; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[i][e] = 0.f;
  }

  const KV* kg = static_cast<const KV*>(p.k) + b * p.k_sb + hk * p.k_sh + c * VEC;
  const KV* vg = static_cast<const KV*>(p.v) + b * p.v_sb + hk * p.v_sh + c * VEC;
  const bool* mrow = p.key_mask ? p.key_mask + b * p.m_sb : nullptr;
  // FP8 with 16-byte loads: walking pointers (one 64-bit add per row) instead of a 64-bit key * stride product per
  // row: at one byte an element the address arithmetic is a visible share of the instructions per byte.
  const KV* kp = kg + int64_t(kb0 + grp) * p.k_ss;
  const KV* vp = vg + int64_t(kb0 + grp) * p.v_ss;
  const int64_t kstep = int64_t(KPS) * p.k_ss, vstep = int64_t(KPS) * p.v_ss;
  for (int kb = kb0; kb < kb1; kb += KPI) {
    // Issue every load of the iteration first: U key rows (K and V) and their mask bytes.
    Load kr[U], vr[U];
    bool ok[U];
    if constexpr (Cfg::WIDE8) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int key = kb + u * KPS + grp;
        const bool in = key < kb1;
        kr[u] = in ? ld_dep(reinterpret_cast<const Load*>(kp + u * kstep)) : Load{};
        vr[u] = in ? ld_dep(reinterpret_cast<const Load*>(vp + u * vstep)) : Load{};
        ok[u] = in && (mrow == nullptr || mrow[key * p.m_ss]);
      }
      kp += U * kstep;
      vp += U * vstep;
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int key = kb + u * KPS + grp;
        const bool in = key < kb1;
        kr[u] = in ? ld_dep(reinterpret_cast<const Load*>(kg + key * p.k_ss)) : Load{};
        vr[u] = in ? ld_dep(reinterpret_cast<const Load*>(vg + key * p.v_ss)) : Load{};
        ok[u] = in && (mrow == nullptr || mrow[key * p.m_ss]);
      }
    }
    // Scores of the U keys for every query (G-lane reduction), -inf where not admissible.
    float sc[U][QB];
    if constexpr (Cfg::MMA) {
      static_assert(U % 2 == 0 && QB <= 2 && (G == 4 || G == 8), "MMA: pairs of key rows, one or two halves");
#pragma unroll
      for (int u = 0; u < U; u += 2) {
        float s4[4] = {0.f, 0.f, 0.f, 0.f};  // (row g: keys of u, row g + 8: of u + 1) x (queries 2t, 2t + 1)
        const uint32_t* k0 = reinterpret_cast<const uint32_t*>(&kr[u]);
        const uint32_t* k1 = reinterpret_cast<const uint32_t*>(&kr[u + 1]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t a[4];  // rows g, g + 8 at k 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3])
          fp8::e4m3x4_to_x4<__half>(k0[j], a[0], a[2]);
          fp8::e4m3x4_to_x4<__half>(k1[j], a[1], a[3]);
          mma_16816<__half>(s4, a, qb[j][0], qb[j][1]);
        }
        const int key0 = kb + u * KPS + grp, key1 = key0 + KPS;
        // D = 64: query i's scores (keys u, u + 1) are s4[i], s4[2 + i] of lane t = 0 of the key slot. D = 128: the
        // half-h partials are s4[h], s4[2 + h] of lane t = i of half h's group; summed over the halves (lane ^ 4)
        // they sit in lane 8 g' + i of the key slot g' = lane / 8.
        float x0 = 0.f, x1 = 0.f;
        if constexpr (G == 8) {
          const bool h1 = (lane >> 2) & 1;
          x0 = h1 ? s4[1] : s4[0];
          x1 = h1 ? s4[3] : s4[2];
          x0 += __shfl_xor_sync(kFullMask, x0, 4);
          x1 += __shfl_xor_sync(kFullMask, x1, 4);
        }
#pragma unroll
        for (int i = 0; i < QB; ++i) {
          const float s0 = G == 4 ? __shfl_sync(kFullMask, s4[i], lane & ~3)
                                  : __shfl_sync(kFullMask, x0, (lane & ~7) + i);
          const float s1 = G == 4 ? __shfl_sync(kFullMask, s4[2 + i], lane & ~3)
                                  : __shfl_sync(kFullMask, x1, (lane & ~7) + i);
          sc[u][i] = ok[u] && key0 <= lim[i] ? s0 * s_fac[i] : -INFINITY;
          sc[u + 1][i] = ok[u + 1] && key1 <= lim[i] ? s1 * s_fac[i] : -INFINITY;
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float kf[VEC];
        if constexpr (FP8 && VEC == 16)
          unpack_e4m3x16(kr[u], kf);
        else if constexpr (FP8)
          unpack_e4m3x8(kr[u], kf);
        else
          unpack16(kr[u], static_cast<const T*>(nullptr), kf);
        const int key = kb + u * KPS + grp;
#pragma unroll
        for (int i = 0; i < QB; ++i) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < VEC; ++e) s = fmaf(qf[i][e], kf[e], s);
#pragma unroll
          for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(kFullMask, s, off);
          sc[u][i] = ok[u] && key <= lim[i] ? s : -INFINITY;
        }
      }
    }
    // Online update: new max over the U keys, rescale, then P V one key row at a time.
    float base[QB];  // exponent base; 0 while a query has nothing admissible (keeps P = 0, avoids inf - inf)
#pragma unroll
    for (int i = 0; i < QB; ++i) {
      float mx = m[i];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][i]);
      base[i] = mx == -INFINITY ? 0.f : mx;
      const float corr = ex2(m[i] - base[i]);
      m[i] = mx;
      l[i] *= corr;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[i][e] *= corr;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[VEC];
      if constexpr (FP8 && VEC == 16)
        unpack_e4m3x16(vr[u], vf);
      else if constexpr (FP8)
        unpack_e4m3x8(vr[u], vf);
      else
        unpack16(vr[u], static_cast<const T*>(nullptr), vf);
#pragma unroll
      for (int i = 0; i < QB; ++i) {
        const float pu = ex2(sc[u][i] - base[i]);
        l[i] += pu;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[i][e] = fmaf(pu, vf[e], acc[i][e]);
      }
    }
  }

  if constexpr (FP8) {  // P (s v) = s (P v): the value scale once per accumulator (partials are merged scaled)
#pragma unroll
    for (int i = 0; i < QB; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[i][e] *= v_scale;
  }
  // Merge the key slots of a warp (lanes with equal c), then the warps through shared memory.
#pragma unroll
  for (int off = G; off < 32; off <<= 1)
#pragma unroll
    for (int i = 0; i < QB; ++i) {
      const float mo = __shfl_xor_sync(kFullMask, m[i], off);
      const float lo = __shfl_xor_sync(kFullMask, l[i], off);
      const float mn = fmaxf(m[i], mo);
      const float ca = mn == -INFINITY ? 0.f : ex2(m[i] - mn);
      const float cb = mn == -INFINITY ? 0.f : ex2(mo - mn);
      m[i] = mn;
      l[i] = l[i] * ca + lo * cb;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[i][e] = acc[i][e] * ca + __shfl_xor_sync(kFullMask, acc[i][e], off) * cb;
    }
  __shared__ float s_acc[NW][QB][D];
  __shared__ float s_m[NW][QB], s_l[NW][QB];
  if (lane < G) {
#pragma unroll
    for (int i = 0; i < QB; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) s_acc[warp][i][c * VEC + e] = acc[i][e];
      if (lane == 0) {
        s_m[warp][i] = m[i];
        s_l[warp][i] = l[i];
      }
    }
  }
  __syncthreads();
  // Splits that own keys (kps = 0 when the chunk has no key at all); the others write no partial.
  T* out = static_cast<T*>(p.out);
  const int used = kps > 0 ? (key_end + kps - 1) / kps : 0;
  if (splits == 1 || split < used) {
    for (int idx = tid; idx < nq * D; idx += kSplitThreads) {
      const int i = idx / D, d = idx % D;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < NW; ++w) mx = fmaxf(mx, s_m[w][i]);
      float a = 0.f, sum = 0.f;
      if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          const float cw = ex2(s_m[w][i] - mx);
          sum += cw * s_l[w][i];
          a += cw * s_acc[w][i][d];
        }
      }
      if (splits == 1) {
        out[((int64_t(b) * p.Sq + row_query(i)) * p.H + row_head(i)) * D + d] =
            from_float<T>(sum > 0.f ? a / sum : 0.f);
      } else {
        const int64_t row = (int64_t(bkv) * rows + r0 + i) * splits + split;
        part_acc[row * D + d] = a;
        if (d == 0) part_ml[row] = make_float2(mx, sum);
      }
    }
  }
  if (splits == 1) return;

  // Arrival (threadFenceReduction pattern): every thread fences its partial, one thread counts the block in;
  // the last block of this (bh, chunk) resets the counter for the next launch and merges the used splits.
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* cnt = counters + int64_t(bkv) * gridDim.z + blockIdx.z;
    const bool last = atomicAdd(cnt, 1) == splits - 1;
    if (last) *cnt = 0;
    __threadfence();
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;
  for (int idx = tid; idx < nq * D; idx += kSplitThreads) {
    const int i = idx / D, d = idx % D;
    const int64_t row = (int64_t(bkv) * rows + r0 + i) * splits;  // first split of this row
    float mx = -INFINITY;
#pragma unroll 4
    for (int s = 0; s < used; ++s) mx = fmaxf(mx, __ldcg(&part_ml[row + s]).x);
    float a = 0.f, sum = 0.f;
    if (mx != -INFINITY) {
#pragma unroll 4
      for (int s = 0; s < used; ++s) {
        const float2 ml = __ldcg(&part_ml[row + s]);
        const float cw = ex2(ml.x - mx);
        sum += cw * ml.y;
        a += cw * __ldcg(&part_acc[(row + s) * D + d]);
      }
    }
    out[((int64_t(b) * p.Sq + row_query(i)) * p.H + row_head(i)) * D + d] =
        from_float<T>(sum > 0.f ? a / sum : 0.f);
  }
}

// ------------------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------------------

template <typename T, int D, int WARPS, int BN, int MIN_BLOCKS>
void run_prefill(const AttnParams& p, cudaStream_t stream) {
  constexpr int BM = 16 * WARPS;
  const int smem = 4 * BN * D * static_cast<int>(sizeof(T));
  auto kernel = p.group == 1 ? prefill_kernel<T, D, WARPS, BN, MIN_BLOCKS, false>
                             : prefill_kernel<T, D, WARPS, BN, MIN_BLOCKS, true>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(p.B * p.H, (p.Sq + BM - 1) / BM);
  launch_kernel(kernel, grid, 32 * WARPS, smem, stream, p);
}

// Global int32 counters for two kernels, one pool each: the split-KV merge's arrival counters (all zero between
// launches: the last block of each (bh, chunk) resets its own) and the wgmma prefill's work queue (two counters,
// zero between launches: the kernel's last block resets them; then per-block scratch slots). One buffer per (pool,
// device, stream) for eager launches, which stream order keeps apart, and one per (pool, device) for every
// captured launch, so graphs holding this op must not replay concurrently with each other. Buffers are created by
// eager calls only, with cudaMalloc, outside PyTorch's caching allocator, and never freed (a captured graph keeps
// their address): torch.compile's CUDA graphs run their warm-up in a private memory pool whose allocator state they
// later rewind, which handed a buffer created there to other tensors (the reduce-overhead test read a non-zero
// queue). A capture that finds no buffer, or a launch needing more than kCounters, gets a per-call at::zeros (a
// memset in the graph; still correct).
constexpr int64_t kCounters = 1 << 16;
enum class CounterPool { kSplitKv, kPrefillQueue };

int* new_counter_buffer(cudaStream_t stream) {  // kCounters zeros on the current device
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, kCounters * sizeof(int)));
  C10_CUDA_CHECK(cudaMemsetAsync(ptr, 0, kCounters * sizeof(int), stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));  // the graph buffer may first be used on another stream
  return static_cast<int*>(ptr);
}

int* kernel_counters(CounterPool pool, int64_t need, const at::TensorOptions& opts, at::Tensor& per_call) {
  if (need <= kCounters) {
    static std::mutex mu;
    static auto* eager = new std::map<std::tuple<CounterPool, int, int64_t>, int*>();  // (pool, device, stream id)
    static auto* graph = new std::map<std::pair<CounterPool, int>, int*>();             // (pool, device)
    const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
    const int dev = stream.device_index();
    const std::lock_guard<std::mutex> lock(mu);
    if (at::cuda::currentStreamCaptureStatus() != at::cuda::CaptureStatus::None) {
      const auto it = graph->find({pool, dev});
      if (it != graph->end()) return it->second;
    } else {
      if (graph->find({pool, dev}) == graph->end()) graph->emplace(std::make_pair(pool, dev), new_counter_buffer(stream));
      auto it = eager->find({pool, dev, stream.id()});
      if (it == eager->end()) it = eager->emplace(std::make_tuple(pool, dev, stream.id()), new_counter_buffer(stream)).first;
      return it->second;
    }
  }
  per_call = at::zeros({need}, opts.dtype(at::kInt));
  return per_call.data_ptr<int>();
}

#if defined(FUSEINFER_SM90A)
// The wgmma prefill runs on sm_90 (H100/H200) unless FUSEINFER_ATTN_SM90=0 (read at each call, so that tests and
// benchmarks can compare the two kernels in one process; then the mma.sync kernel runs).
bool sm90_prefill_enabled() {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  return knob(Knob::kAttnSm90) != 0 && props->major == 9 && props->minor == 0;
}

// Launches prefill_sm90_kernel (FP8: after fp8_prep_kernel, on its operands); false (nothing launched) when the
// tensors do not fit TMA maps or the grids.
template <typename T, int D, bool FP8>
bool run_prefill_sm90(const AttnParams& p, const at::TensorOptions& opts, cudaStream_t stream) {
  using C = Sm90Cfg<D, FP8>;
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  CUtensorMap tq, tk, tv;
  const int kv_heads = p.H / p.group;  // K and V maps span the Hkv key/value heads
  if (!make_tensor_map(&tq, p.q, bf16, p.B, p.H, p.Sq, D, p.q_sb, p.q_sh, p.q_ss, C::BM)) return false;
  at::Tensor k8, vt8, scales;  // FP8: fp8_prep_kernel's outputs (see there)
  const int64_t tiles = (int64_t(p.Skv) + kFp8Tile - 1) / kFp8Tile, bhk = int64_t(p.B) * kv_heads;
  if constexpr (FP8) {
    if (bhk > 65535 || tiles > INT32_MAX / kFp8Tile) return false;
    k8 = at::empty({bhk, tiles * kFp8Tile, D}, opts.dtype(at::kByte));
    vt8 = at::empty({bhk, tiles, D, kFp8Tile}, opts.dtype(at::kByte));
    scales = at::empty({bhk, tiles, 2}, opts.dtype(at::kFloat));
    const int64_t k_dims[4] = {D, tiles * kFp8Tile, kv_heads, p.B};
    const int64_t k_strides[3] = {D, tiles * kFp8Tile * D, kv_heads * tiles * kFp8Tile * D};
    const int64_t v_dims[4] = {kFp8Tile, D, tiles, bhk};
    const int64_t v_strides[3] = {kFp8Tile, int64_t(D) * kFp8Tile, tiles * D * kFp8Tile};
    if (!make_tensor_map_u8(&tk, k8.data_ptr(), k_dims, k_strides, D, C::BN) ||
        !make_tensor_map_u8(&tv, vt8.data_ptr(), v_dims, v_strides, kFp8Tile, D))
      return false;
  } else if (!make_tensor_map(&tk, p.k, bf16, p.B, kv_heads, p.Skv, D, p.k_sb, p.k_sh, p.k_ss, C::BN) ||
             !make_tensor_map(&tv, p.v, bf16, p.B, kv_heads, p.Skv, D, p.v_sb, p.v_sh, p.v_ss, C::BN)) {
    return false;
  }
  auto kernel = prefill_sm90_kernel<T, D, FP8>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  Sm90Sched sched;
  const int64_t n_mb = (p.Sq + C::BM - 1) / C::BM, bh = int64_t(p.B) * p.H;
  if (n_mb * bh > INT32_MAX) return false;
  sched.n_mb = static_cast<int>(n_mb);
  sched.bh = static_cast<int>(bh);
  // Heads per group: K and V of a group (2 * Skv * D * 2 bytes per key/value head, half that in FP8, shared by
  // p.group consecutive query heads) fill at most half of L2.
  const int64_t kv_bytes = int64_t(FP8 ? 2 : 4) * p.Skv * D;
  sched.group = static_cast<int>(std::clamp<int64_t>(props->l2CacheSize / 2 / kv_bytes * p.group, 1, bh));
  const int ctas = std::min(sched.items(), props->multiProcessorCount);
  at::Tensor per_call_counters;
  sched.counter = kernel_counters(CounterPool::kPrefillQueue, 2 + int64_t(ctas) * C::Q_BUFS, opts, per_call_counters);
  float2* fp8_scales = nullptr;
  if constexpr (FP8) {
    fp8_scales = reinterpret_cast<float2*>(scales.data_ptr<float>());
    launch_kernel(fp8_prep_kernel<T, D>, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(bhk)), 256, 0,
                  stream, p, k8.data_ptr<uint8_t>(), vt8.data_ptr<uint8_t>(), fp8_scales, static_cast<int>(tiles));
  }
  launch_kernel(kernel, dim3(ctas), C::THREADS, C::SMEM, stream, tq, tk, tv, p, sched, fp8_scales,
                static_cast<int>(tiles));
  return true;
}
#endif

template <typename T>
void prefill(const AttnParams& p, int D, const at::TensorOptions& opts, cudaStream_t stream) {
#if defined(FUSEINFER_SM90A)
  if (p.scale_log2 > 0.f && sm90_prefill_enabled()) {
    // FUSEINFER_ATTN_FP8=1: Q K^T and P V in e4m3 (the 16-bit kernel when its operands do not fit)
    if (knob(Knob::kAttnFp8) != 0 && (D == 64 ? run_prefill_sm90<T, 64, true>(p, opts, stream)
                                              : run_prefill_sm90<T, 128, true>(p, opts, stream))) {
      count_path(Path::kAttentionWgmmaFp8);
      return;
    }
    if (D == 64 ? run_prefill_sm90<T, 64, false>(p, opts, stream) : run_prefill_sm90<T, 128, false>(p, opts, stream)) {
      count_path(Path::kAttentionWgmma);
      return;
    }
  }
#endif
  count_path(Path::kAttentionMmaSync);
  if (D == 64)
    run_prefill<T, 64, 8, 64, 2>(p, stream);
  else
    run_prefill<T, 128, 8, 64, 1>(p, stream);
}

// Blocks of split_kv_kernel<T, D, QB, FP8> resident on one SM (its registers and shared memory decide; at least its
// launch bounds' MIN_BLOCKS), asked once per instantiation, on the first device that launches it.
template <typename T, int D, int QB, bool FP8>
int split_resident_blocks() {
  static const int blocks = [] {
    int n = 0;
    C10_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, split_kv_kernel<T, D, QB, FP8>, kSplitThreads, 0));
    return std::max(n, SplitCfg<T, D, QB, FP8>::MIN_BLOCKS);
  }();
  return blocks;
}

// The FP8 form's split count: base blocks (b, key/value head, chunk) times splits over `slots` resident blocks. All
// blocks of a launch run about equally long, so a grid of 1.3 waves takes as long as 2 full ones: pick the fewest
// splits whose grid fills its last wave to 90% or more (or the best filling one), e.g. batch 24 x 32 heads at 4
// blocks on 132 SMs (528 slots): 2 splits (1536 blocks, 2.9 waves) rather than 1 (768 blocks, 1.45 waves). Merging
// the partials costs one (D + 2)-float row per split and query, small against the keys a split reads (>= KPI).
int fp8_splits(int64_t base, int64_t slots, int64_t max_splits) {
  int best = 1;
  double best_fill = 0.0;
  for (int64_t s = 1; s <= std::max<int64_t>(1, max_splits); ++s) {
    const int64_t blocks = base * s, waves = (blocks + slots - 1) / slots;
    const double fill = double(blocks) / double(waves * slots);
    if (fill >= 0.9) return static_cast<int>(s);
    if (fill > best_fill + 1e-9) best = static_cast<int>(s), best_fill = fill;
  }
  return best;
}

template <typename T, int D, int QB, bool FP8>
void run_split_kv(const AttnParams& p, const at::Tensor& q, cudaStream_t stream) {
  using Cfg = SplitCfg<T, D, QB, FP8>;
  const int64_t rows = int64_t(p.group) * p.Sq;  // per key/value head: its query heads' queries (GQA packing)
  const int qchunks = static_cast<int>(std::min<int64_t>((rows + QB - 1) / QB, INT32_MAX));
  TORCH_CHECK(qchunks <= 65535, "attention_cuda: Sq = ", p.Sq, " is too long for the split-KV path");
  const int kv_blocks = p.B * (p.H / p.group);
  const int64_t base = int64_t(kv_blocks) * qchunks;
  // fp16 / bf16: as many splits as fit in one wave of resident blocks (launch bounds guarantee MIN_BLOCKS per SM; a
  // partial second wave would idle most SMs), at least one full iteration (KPI keys) per split, and a quarter of the
  // keys but between 128 and 256 keys per split: a split's fixed cost (its query, its partials, the merge) wants
  // that much work. Timed as decode replays it (CUDA graphs, H200): batch 1 at 2048 keys 12.4 us with 8 splits
  // against 16.8 with one wave's 32; Llama-3.1-8B's heads at 512 keys 13.2 with 4 against 16.8 with 16. One split
  // (no scratch, no merge) when Skv <= 128 or the (b, hkv, chunk) blocks alone fill over half the wave.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t max_splits = std::min<int64_t>(128, (p.Skv + Cfg::KPI - 1) / Cfg::KPI);
  int splits;
  if constexpr (FP8) {
    splits = fp8_splits(base, int64_t(sms) * split_resident_blocks<T, D, QB, FP8>(), max_splits);
  } else {
    const int64_t want = int64_t(sms) * Cfg::MIN_BLOCKS / base;
    const int64_t keys_per_split = std::min<int64_t>(256, std::max<int64_t>(128, p.Skv / 4));
    const int64_t by_work = (p.Skv + keys_per_split - 1) / keys_per_split;
    splits = static_cast<int>(std::max<int64_t>(1, std::min({want, max_splits, by_work})));
  }
  // FUSEINFER_SPLITKV_SPLITS > 0 forces the count (benchmarks sweep it), still at most one split per KPI keys
  if (const int forced = knob(Knob::kSplitKvSplits); forced > 0) {
    splits = static_cast<int>(std::min<int64_t>(forced, std::max<int64_t>(1, max_splits)));
  }
  count_path(Path::kAttentionSplitKv);

  at::Tensor part_acc, part_ml, per_call_counters;
  float* acc_ptr = nullptr;
  float2* ml_ptr = nullptr;
  int* counters = nullptr;
  if (splits > 1) {
    const int64_t rows = int64_t(p.B) * p.H * p.Sq;
    part_acc = at::empty({rows, splits, D}, q.options().dtype(at::kFloat));
    part_ml = at::empty({rows, splits, 2}, q.options().dtype(at::kFloat));
    acc_ptr = part_acc.data_ptr<float>();
    ml_ptr = reinterpret_cast<float2*>(part_ml.data_ptr<float>());
    counters = kernel_counters(CounterPool::kSplitKv, base, q.options(), per_call_counters);
  }
  launch_kernel(split_kv_kernel<T, D, QB, FP8>, dim3(kv_blocks, splits, qchunks), kSplitThreads, 0, stream, p,
                acc_ptr, ml_ptr, counters);
}

// QB from the rows of a key/value head (group * Sq): a block serves up to QB of them.
template <typename T, int D, bool FP8>
void split_kv_d(const AttnParams& p, const at::Tensor& q, cudaStream_t stream) {
  const int64_t rows = int64_t(p.group) * p.Sq;
  if (rows == 1)
    run_split_kv<T, D, 1, FP8>(p, q, stream);
  else if (rows == 2)
    run_split_kv<T, D, 2, FP8>(p, q, stream);
  else if (rows <= 4)
    run_split_kv<T, D, 4, FP8>(p, q, stream);
  else
    run_split_kv<T, D, 8, FP8>(p, q, stream);
}

// FP8: k, v e4m3 with p.kv_scale (fp16 / bf16 queries only).
template <typename T, bool FP8 = false>
void split_kv(const AttnParams& p, const at::Tensor& q, int D, cudaStream_t stream) {
  if (D == 64)
    split_kv_d<T, 64, FP8>(p, q, stream);
  else
    split_kv_d<T, 128, FP8>(p, q, stream);
}

// t itself when its base and its strides over the first three dims allow 16-byte accesses, else an aligned
// contiguous copy (on the current stream, from PyTorch's allocator: graph-capturable).
at::Tensor aligned16(const at::Tensor& t) {
  const int64_t vec = 16 / t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) ok = ok && (t.size(d) == 1 || t.stride(d) % vec == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// p's key_mask and q_start (checked: a (B, Skv) bool mask and a (B,) int32 q_start on `device`, or absent).
void set_mask_params(AttnParams& p, const c10::optional<at::Tensor>& key_mask, const c10::optional<at::Tensor>& q_start,
                     int64_t B, int64_t Skv, const at::Device& device) {
  if (key_mask.has_value() && key_mask->defined()) {
    const at::Tensor& mask = *key_mask;
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == B && mask.size(1) == Skv,
                "attention_cuda: key_mask must be a (B, Skv) = (", B, ", ", Skv, ") bool tensor, got ",
                mask.scalar_type(), " ", mask.sizes());
    TORCH_CHECK(mask.device() == device, "attention_cuda: key_mask must be on q's device");
    p.key_mask = mask.data_ptr<bool>();
    p.m_sb = mask.stride(0);
    p.m_ss = mask.stride(1);
  }
  if (q_start.has_value() && q_start->defined()) {
    const at::Tensor& qstart = *q_start;
    TORCH_CHECK(qstart.scalar_type() == at::kInt && qstart.dim() == 1 && qstart.size(0) == B,
                "attention_cuda: q_start must be a (B,) = (", B, ",) int32 tensor, got ", qstart.scalar_type(),
                " ", qstart.sizes());
    TORCH_CHECK(qstart.device() == device, "attention_cuda: q_start must be on q's device");
    p.q_start = qstart.data_ptr<int>();
    p.qs_s = qstart.stride(0);
  }
}

}  // namespace

std::string attention_prefill_kernel() {
#if defined(FUSEINFER_SM90A)
  if (sm90_prefill_enabled() && tensor_map_encoder() != nullptr) return knob(Knob::kAttnFp8) != 0 ? "wgmma_fp8" : "wgmma";
#endif
  return "mma.sync";
}

namespace {

// attention, attention_fp8out and attention_int8out: out_scale null for an output in q's dtype, else one fp32 value
// on q's device (the prefills then store e4m3, or int8 with `int8`, see store_rows; the ops' wrappers send other
// calls elsewhere).
at::Tensor attention_impl(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                          const c10::optional<at::Tensor>& key_mask, const c10::optional<at::Tensor>& q_start,
                          double scale, const at::Tensor* out_scale, bool int8 = false) {
  TORCH_CHECK(q_in.is_cuda() && k_in.is_cuda() && v_in.is_cuda(), "attention_cuda: q, k, v must be CUDA tensors");
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4,
              "attention_cuda: q, k, v must be 4-D (B, H, S, D)");
  TORCH_CHECK(k_in.device() == q_in.device() && v_in.device() == q_in.device(),
              "attention_cuda: q, k, v must be on one device");
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "attention_cuda: dtype must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(k_in.scalar_type() == dtype && v_in.scalar_type() == dtype,
              "attention_cuda: q, k, v must share one dtype");
  const int64_t B = q_in.size(0), H = q_in.size(1), Sq = q_in.size(2), D = q_in.size(3), Skv = k_in.size(2);
  const int64_t Hkv = k_in.size(1);
  TORCH_CHECK(k_in.size(0) == B && Hkv > 0 && H % Hkv == 0 && k_in.size(3) == D && v_in.sizes() == k_in.sizes(),
              "attention_cuda: k and v must be (B, Hkv, Skv, D) matching q ", q_in.sizes(),
              " with H a multiple of Hkv, got k ", k_in.sizes(), " and v ", v_in.sizes());
  TORCH_CHECK(D == 64 || D == 128, "attention_cuda: head dim must be 64 or 128 (got ", D,
              "); use the reference implementation for other head dims");
  TORCH_CHECK(q_in.stride(3) == 1 && k_in.stride(3) == 1 && v_in.stride(3) == 1,
              "attention_cuda: the last dim of q, k, v must be contiguous (stride 1)");
  TORCH_CHECK(B * H <= INT32_MAX && Sq <= INT32_MAX && Skv <= INT32_MAX, "attention_cuda: sizes too large");
  TORCH_CHECK(std::isfinite(scale), "attention_cuda: scale must be finite");

  const bool use_prefill = dtype != at::kFloat && Sq > 16;
  if (out_scale != nullptr) {
    TORCH_CHECK(use_prefill, "attention: the 8-bit output is written by the prefill kernels (fp16/bf16, more than "
                "16 queries); run attention and quantize its output for other calls");
    TORCH_CHECK(out_scale->is_cuda() && out_scale->device() == q_in.device() &&
                    out_scale->scalar_type() == at::kFloat && out_scale->numel() == 1,
                "attention: out_scale must be one float32 value on q's device, got ", out_scale->scalar_type(), " ",
                out_scale->sizes());
  }
  const at::cuda::CUDAGuard guard(q_in.device());
  at::Tensor out = at::empty({B, Sq, H, D}, out_scale == nullptr ? q_in.options()
                                            : q_in.options().dtype(int8 ? at::kChar : at::kFloat8_e4m3fn));
  if (out.numel() == 0) return out;
  if (Skv == 0) return out.zero_();

  AttnParams p{};
  set_mask_params(p, key_mask, q_start, B, Skv, q_in.device());
  if (out_scale != nullptr) p.out_scale = out_scale->data_ptr<float>();
  p.out_int8 = int8;

  // 16-byte loads: K/V always, Q too on the cp.async (prefill) path.
  const at::Tensor q = use_prefill ? aligned16(q_in) : q_in;
  const at::Tensor k = aligned16(k_in), v = aligned16(v_in);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_ss = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_ss = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_ss = v.stride(2);
  p.B = static_cast<int>(B), p.H = static_cast<int>(H), p.Sq = static_cast<int>(Sq), p.Skv = static_cast<int>(Skv);
  p.group = static_cast<int>(H / Hkv);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int d = static_cast<int>(D);
  if (use_prefill) {
    if (dtype == at::kHalf)
      prefill<__half>(p, d, q.options(), stream);
    else
      prefill<__nv_bfloat16>(p, d, q.options(), stream);
  } else if (dtype == at::kHalf) {
    split_kv<__half>(p, q, d, stream);
  } else if (dtype == at::kBFloat16) {
    split_kv<__nv_bfloat16>(p, q, d, stream);
  } else {
    split_kv<float>(p, q, d, stream);
  }
  return out;
}

}  // namespace

at::Tensor attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& key_mask, const c10::optional<at::Tensor>& q_start,
                          double scale) {
  return attention_impl(q, k, v, key_mask, q_start, scale, nullptr);
}

at::Tensor attention_fp8out_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const c10::optional<at::Tensor>& key_mask, const c10::optional<at::Tensor>& q_start,
                                 double scale, const at::Tensor& out_scale) {
  return attention_impl(q, k, v, key_mask, q_start, scale, &out_scale);
}

at::Tensor attention_int8out_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const c10::optional<at::Tensor>& key_mask, const c10::optional<at::Tensor>& q_start,
                                  double scale, const at::Tensor& out_scale) {
  return attention_impl(q, k, v, key_mask, q_start, scale, &out_scale, true);
}


// attention(q, k, v, key_mask, q_start, scale): q (B, H, Sq, D); k, v: (B, Hkv, Skv, D) with H a multiple of Hkv
// (grouped-query attention: query head h reads key/value head h / (H / Hkv)); last dim contiguous, other strides
// arbitrary. key_mask: (B, Skv) bool, true = real token (None: all real). q_start: (B,) int32, key index of
// query 0 (None: Skv - Sq for every row). Query i of row b attends key j iff key_mask[b, j] and j <= q_start[b] + i;
// a query with no key gets 0. Returns (B, Sq, H, D) contiguous, q's dtype.
// attention_prefill_kernel(): the kernel attention runs for prefill (fp16/bf16, Sq > 16) on the current device:
// "wgmma" (sm_90a build on an sm_90 GPU, FUSEINFER_ATTN_SM90 not 0; a call still falls back when a tensor does not
// fit a TMA map, there are more than 2^31 work items or scale <= 0), "wgmma_fp8" (the same with FUSEINFER_ATTN_FP8=1;
// a call the FP8 form cannot take runs the 16-bit one) or "mma.sync".
at::Tensor attention_kv_fp8_cuda(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                                 const c10::optional<at::Tensor>& key_mask, const c10::optional<at::Tensor>& q_start,
                                 double scale, const at::Tensor& kv_scale) {
  TORCH_CHECK(q.is_cuda() && k_in.is_cuda() && v_in.is_cuda() && kv_scale.is_cuda(),
              "attention_kv_fp8_cuda: q, k, v and kv_scale must be CUDA tensors");
  TORCH_CHECK(q.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4,
              "attention_kv_fp8_cuda: q, k, v must be 4-D (B, H, S, D)");
  TORCH_CHECK(k_in.device() == q.device() && v_in.device() == q.device() && kv_scale.device() == q.device(),
              "attention_kv_fp8_cuda: q, k, v and kv_scale must be on one device");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "attention_kv_fp8_cuda: q must be float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k_in.scalar_type() == at::kFloat8_e4m3fn && v_in.scalar_type() == at::kFloat8_e4m3fn,
              "attention_kv_fp8_cuda: k and v must be float8_e4m3fn");
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Skv = k_in.size(2);
  const int64_t Hkv = k_in.size(1);
  TORCH_CHECK(k_in.size(0) == B && Hkv > 0 && H % Hkv == 0 && k_in.size(3) == D && v_in.sizes() == k_in.sizes(),
              "attention_kv_fp8_cuda: k and v must be (B, Hkv, Skv, D) matching q ", q.sizes(),
              " with H a multiple of Hkv, got k ", k_in.sizes(), " and v ", v_in.sizes());
  TORCH_CHECK(D == 64 || D == 128, "attention_kv_fp8_cuda: head dim must be 64 or 128, got ", D);
  TORCH_CHECK(Sq <= 16, "attention_kv_fp8_cuda: at most 16 queries (decode); a prefill dequantizes the cache");
  TORCH_CHECK(kv_scale.scalar_type() == at::kFloat && kv_scale.dim() == 2 && kv_scale.size(0) == 2 &&
                  kv_scale.size(1) == Hkv && kv_scale.is_contiguous(),
              "attention_kv_fp8_cuda: kv_scale must be a contiguous (2, Hkv) = (2, ", Hkv, ") float32 tensor, got ",
              kv_scale.scalar_type(), " ", kv_scale.sizes());
  TORCH_CHECK(q.stride(3) == 1 && k_in.stride(3) == 1 && v_in.stride(3) == 1,
              "attention_kv_fp8_cuda: the last dim of q, k, v must be contiguous (stride 1)");
  TORCH_CHECK(B * H <= INT32_MAX && Skv <= INT32_MAX, "attention_kv_fp8_cuda: sizes too large");
  TORCH_CHECK(std::isfinite(scale), "attention_kv_fp8_cuda: scale must be finite");
  const at::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({B, Sq, H, D}, q.options());
  if (out.numel() == 0) return out;
  if (Skv == 0) return out.zero_();
  AttnParams p{};
  set_mask_params(p, key_mask, q_start, B, Skv, q.device());
  const at::Tensor k = aligned16(k_in), v = aligned16(v_in);  // 16-byte (and 8-byte) loads of e4m3
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_ss = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_ss = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_ss = v.stride(2);
  p.B = static_cast<int>(B), p.H = static_cast<int>(H), p.Sq = static_cast<int>(Sq), p.Skv = static_cast<int>(Skv);
  p.group = static_cast<int>(H / Hkv);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.kv_scale = kv_scale.data_ptr<float>();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dtype == at::kHalf)
    split_kv<__half, true>(p, q, static_cast<int>(D), stream);
  else
    split_kv<__nv_bfloat16, true>(p, q, static_cast<int>(D), stream);
  return out;
}

// attention_kv_fp8(q, k, v, key_mask, q_start, scale, kv_scale): attention's decode over an FP8 cache. q (B, H, Sq,
// D) fp16 / bf16 with Sq <= 16, D 64 or 128; k, v (B, Hkv, Skv, D) float8_e4m3fn, a stored x meaning
// x * kv_scale[0, h] (keys) or x * kv_scale[1, h] (values); kv_scale (2, Hkv) fp32 contiguous. Masking and output
// as attention's.
// attention_fp8out(q, k, v, key_mask, q_start, scale, out_scale): attention's prefill (fp16 / bf16 q, k, v, Sq > 16)
// with its output quantized in the kernel's epilogue: (B, Sq, H, D) float8_e4m3fn, out / out_scale rounded to
// nearest even and saturated at +-448; out_scale one fp32 value (the static, calibrated scale of the output
// projection's input). attention_int8out: the same with an int8 output, round(out / out_scale) clamped to +-127.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? q_start, float scale) -> Tensor");
  m.def("attention_fp8out(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? q_start, float scale, "
        "Tensor out_scale) -> Tensor");
  m.def("attention_int8out(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? q_start, float scale, "
        "Tensor out_scale) -> Tensor");
  m.def("attention_prefill_kernel() -> str", &attention_prefill_kernel);
  m.def("attention_kv_fp8(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? q_start, float scale, "
        "Tensor kv_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_fp8out", &attention_fp8out_cuda);
  m.impl("attention_int8out", &attention_int8out_cuda);
  m.impl("attention_kv_fp8", &attention_kv_fp8_cuda);
}

}  // namespace fuseinfer
