// The fused q/k/v projection on sm_90a as one GEMM with the rotary embedding, the split into heads and the k / v
// cache write in its epilogue (linear_rope_append at prefill sizes, linear_rope.cu):
//
//   qkv = x @ w^T + bias  (M = B S rows, N = (H + 2 Hkv) D columns), then as qkv_rope_append (rope.cu):
//   q (B, H, S, D) = rope(q heads), k_cache[:, :, slots[s]] = rope(k heads), v_cache[:, :, slots[s]] = v heads,
//
// rounded as the unfused pair rounds: the projection (+ bias) to T, then the rotation in fp32 from those T values,
// each output rounded once (rope_pair, device_utils.cuh). Neither the (M, N) projection nor a second pass over it
// exists: the kernel reads x and w and writes q, k and v once.
//
// The GEMM is handoff_gemm_sm90.cuh's with 256 consecutive weight rows per tile (two 128-row boxes of a (K, N) map):
// 256 / D whole heads, so both columns of every rotate_half pair (d and d + D / 2 of a head) are in the tile's
// hand-off buffer and the three epilogue warps rotate and scatter it while the tensor cores run the next tile. The
// epilogue handles the pair's chunks (8 elements each) with 16-byte loads and stores.
// Needs D % 16 == 0 (8-element chunks of a half head) and 256 % D == 0 (no head straddles two tiles): D 16, 32, 64,
// 128 or 256.
//
// Measured against cuBLASLt's GEMM + qkv_rope_append (bench/bench_qkv_gemm.py, H200, one run, fp16): 1.00-1.06x the
// time at 2048-8192 rows of Llama-3.2-1B, Llama-3.1-8B and OPT-1.3b, 1.3x at Qwen2.5-1.5B's (N 2048, K 1536), 0.98-2.0x
// at 128-512 rows. The pass it saves (reading and writing the (M, N) projection) is worth 10-25% of the GEMM's time,
// and the GEMM runs at 81-87% of cuBLAS's rate at these shapes (m64n128 wgmmas per warpgroup from shared memory;
// fewer tiles than SMs below ~2000 rows), so at best it breaks even: opt-in (FUSEINFER_QKV_GEMM=1).
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
#include <climits>
#include <cstdint>
#include <type_traits>

namespace fuseinfer {
namespace qkv_rope_gemm {

using handoff_gemm::BH;
using handoff_gemm::BM;
using handoff_gemm::C_LD;
using handoff_gemm::EPI_THREADS;
constexpr int TILE_N = 2 * BH;  // projection columns per tile

template <typename T>
struct alignas(16) Chunk {  // 8 elements: one 16-byte load or store
  T x[8];
};

// The epilogue: a tile's units are (row, chunk j of 8 columns of a half head); unit i goes to thread i % 96, which
// loads the row's cos / sin at chunk j (both halves) and the row's cache slot once, then takes chunk j of each of the
// tile's 256 / D heads with the matching chunk of the head's second half: q and k heads rotated, v heads copied;
// 16-byte stores into q's row (b, head, s) or the cache row (b, head, slots[s]) (a slot outside [0, T) is skipped,
// as kv_cache_append does). The global loads are the epilogue's latency: each thread issues the next unit's before
// working on this one.
template <typename T>
struct RopeSplit {
  const T* cos;  // (M, D): row b S + s of the (B, S, D) table; nullptr: no rotation (the split and the write only)
  const T* sin;
  T* q;          // (B, H, S, D)
  T* k;          // (B, Hkv, T, D)
  T* v;
  const int64_t* slots;  // (S,) with stride slots_stride
  int64_t slots_stride;
  int m, seq, cache_len;  // M = B S, S, T
  int heads, kv_heads, d;

  struct Operands {
    Chunk<T> c1, c2, s1, s2;  // cos and sin at chunk j of both halves
    int64_t slot;
  };

  __device__ void operator()(const T* lo, const T* hi, int mt, int nt, int e) const {
    using P = Chunk<T>;
    const int half = d / 2, chunks = half / 8, units = BM * chunks;
    const int head0 = nt * (TILE_N / d), n_heads = min(TILE_N / d, heads + 2 * kv_heads - head0);
    const bool rotates = cos != nullptr && head0 < heads + kv_heads;  // a q or k head in the tile
    const bool writes_cache = head0 + n_heads > heads;                // a k or v head in the tile
    auto load = [&](int i, Operands& o) {
      const int r = i / chunks, j = i - r * chunks, row = mt * BM + r;
      if (row >= m) return;
      if (rotates) {
        const T* cg = cos + int64_t(row) * d + 8 * j;
        const T* sg = sin + int64_t(row) * d + 8 * j;
        o.c1 = ld_dep_as(reinterpret_cast<const P*>(cg));
        o.c2 = ld_dep_as(reinterpret_cast<const P*>(cg + half));
        o.s1 = ld_dep_as(reinterpret_cast<const P*>(sg));
        o.s2 = ld_dep_as(reinterpret_cast<const P*>(sg + half));
      }
      if (writes_cache) o.slot = ld_dep_as(slots + (row % seq) * slots_stride);
    };
    Operands cur;
    if (e < units) load(e, cur);
    for (int i = e; i < units; i += EPI_THREADS) {
      Operands next;
      if (i + EPI_THREADS < units) load(i + EPI_THREADS, next);
      const int r = i / chunks, j = i - r * chunks, row = mt * BM + r;
      if (row < m) {
        const int64_t b = row / seq, s = row - b * seq;
        for (int hh = 0; hh < n_heads; ++hh) {
          const int head = head0 + hh;
          const int c1 = hh * d + 8 * j, c2 = c1 + half;  // tile columns of the pair's chunks
          const P x1 = *reinterpret_cast<const P*>((c1 < BH ? lo + c1 : hi + (c1 - BH)) + r * C_LD);
          const P x2 = *reinterpret_cast<const P*>((c2 < BH ? lo + c2 : hi + (c2 - BH)) + r * C_LD);
          P y1 = x1, y2 = x2;  // v: as projected
          if (cos != nullptr && head < heads + kv_heads) {  // q or k: x cos + rotate_half(x) sin
#pragma unroll
            for (int c = 0; c < 8; ++c)
              rope_pair(to_float(x1.x[c]), to_float(x2.x[c]), to_float(cur.c1.x[c]), to_float(cur.s1.x[c]),
                        to_float(cur.c2.x[c]), to_float(cur.s2.x[c]), y1.x[c], y2.x[c]);
          }
          T* dst;
          if (head < heads) {
            dst = q + ((b * heads + head) * seq + s) * d;
          } else {
            if (cur.slot < 0 || cur.slot >= cache_len) continue;
            const bool is_k = head < heads + kv_heads;
            const int hk = head - heads - (is_k ? 0 : kv_heads);
            dst = (is_k ? k : v) + ((b * kv_heads + hk) * cache_len + cur.slot) * d;
          }
          *reinterpret_cast<P*>(dst + 8 * j) = y1;
          *reinterpret_cast<P*>(dst + half + 8 * j) = y2;
        }
      }
      cur = next;
    }
  }
};

}  // namespace qkv_rope_gemm

// q = qkv_rope_append(x @ w^T + bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots) with the kernel above
// (without cos / sin: the split and the cache write alone); false (nothing launched) where it does not apply: not
// built for sm_90a, another GPU, FUSEINFER_QKV_GEMM=0, not fp16 / bf16, w not in x's dtype, K % 8 != 0 (TMA's
// 16-byte strides), a head dim with D % 16 != 0 or 256 % D != 0, a pointer not 16-byte aligned, sizes past 2^30,
// or tensor maps that do not encode. The caller (linear_rope_append) has checked the shapes: x (M, K) contiguous
// with M = B S, w (N, K) contiguous, N = (H + 2 Hkv) D, bias (N,) or null, cos / sin (B, S, D) contiguous or both
// null, q (B, H, S, D) and the caches (B, Hkv, T, D) contiguous, slots (S,) int64.
bool qkv_rope_gemm_sm90(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, const at::Tensor* cos,
                        const at::Tensor* sin, int64_t seq, int64_t heads, int64_t kv_heads, at::Tensor& q,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
#if defined(FUSEINFER_SM90A)
  using namespace handoff_gemm;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), d = n / (heads + 2 * kv_heads);
  if (n < 1 || d < 16) return false;  // (before the modulo below: an empty weight has D = 0)
  auto aligned = [](const at::Tensor* t) {
    return t == nullptr || reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
  };
  constexpr int64_t kMax = int64_t(1) << 30;
  if (knob(Knob::kQkvGemm) == 0 || props->major != 9 || props->minor != 0 ||
      (dtype != at::kHalf && dtype != at::kBFloat16) || w.scalar_type() != dtype || k % 8 != 0 || d % 16 != 0 ||
      qkv_rope_gemm::TILE_N % d != 0 || m < 1 || m > kMax || n > kMax || k > kMax || k_cache.size(2) > kMax ||
      !aligned(&x) || !aligned(&w) || !aligned(&q) || !aligned(&k_cache) || !aligned(&v_cache) || !aligned(cos) ||
      !aligned(sin))
    return false;
  const bool bf16 = dtype == at::kBFloat16;
  CUtensorMap tm_x, tm_w;
  // x as (1, 1, M, K) in boxes of BM rows; w as (1, 1, N, K) in boxes of BH rows (rows past N zero-filled)
  if (!make_tensor_map(&tm_x, x.data_ptr(), bf16, 1, 1, m, static_cast<int>(k), 0, 0, k, BM) ||
      !make_tensor_map(&tm_w, w.data_ptr(), bf16, 1, 1, n, static_cast<int>(k), 0, 0, k, BH))
    return false;
  Grid g{};
  g.m = static_cast<int>(m);
  g.k = static_cast<int>(k);
  g.tiles_m = static_cast<int>((m + BM - 1) / BM);
  g.tiles_n = static_cast<int>((n + qkv_rope_gemm::TILE_N - 1) / qkv_rope_gemm::TILE_N);
  if (int64_t(g.tiles_m) * g.tiles_n > INT32_MAX) return false;
  g.tile_rows = qkv_rope_gemm::TILE_N;
  g.half_rows = BH;
  g.half_plane = 0;
  g.bias = bias ? bias->data_ptr() : nullptr;
  g.bias_n = static_cast<int>(n);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int ctas = static_cast<int>(std::min<int64_t>(int64_t(g.tiles_m) * g.tiles_n, props->multiProcessorCount));
  auto run = [&](auto* tag, auto has_bias) {
    using T = std::remove_pointer_t<decltype(tag)>;
    qkv_rope_gemm::RopeSplit<T> epi{};
    epi.cos = cos ? static_cast<const T*>(cos->data_ptr()) : nullptr;
    epi.sin = sin ? static_cast<const T*>(sin->data_ptr()) : nullptr;
    epi.q = static_cast<T*>(q.data_ptr());
    epi.k = static_cast<T*>(k_cache.data_ptr());
    epi.v = static_cast<T*>(v_cache.data_ptr());
    epi.slots = slots.data_ptr<int64_t>();
    epi.slots_stride = slots.stride(0);
    epi.m = g.m;
    epi.seq = static_cast<int>(seq);
    epi.cache_len = static_cast<int>(k_cache.size(2));
    epi.heads = static_cast<int>(heads);
    epi.kv_heads = static_cast<int>(kv_heads);
    epi.d = static_cast<int>(d);
    auto kernel = handoff_gemm_kernel<T, decltype(has_bias)::value, qkv_rope_gemm::RopeSplit<T>>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    launch_kernel(kernel, dim3(ctas), THREADS, SMEM, stream, tm_x, tm_w, g, epi);
  };
  if (bf16) {
    if (bias)
      run(static_cast<__nv_bfloat16*>(nullptr), std::true_type{});
    else
      run(static_cast<__nv_bfloat16*>(nullptr), std::false_type{});
  } else {
    if (bias)
      run(static_cast<__half*>(nullptr), std::true_type{});
    else
      run(static_cast<__half*>(nullptr), std::false_type{});
  }
  count_path(Path::kLinearQkvRopeGemm);
  return true;
#else
  (void)x, (void)w, (void)bias, (void)cos, (void)sin, (void)seq, (void)heads, (void)kv_heads, (void)q, (void)k_cache,
      (void)v_cache, (void)slots;
  return false;
#endif
}

}  // namespace fuseinfer
