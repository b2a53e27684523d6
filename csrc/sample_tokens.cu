// Sampling's next-token choice: the op fuseinfer_C::sample_tokens (fuseinfer/ops/sample_tokens.py has the reference
// and the meaning of every argument). Two kernels of one algorithm: on sm_90 a thread-block cluster of 2..16 CTAs a
// row (sample_tokens_cluster_kernel, below, where its header says why and how), else one block a row (this one).
// Measured on an H200 before the cluster kernel (CUDA graph, per call), the one-block kernel took 109 us at 50272
// tokens (top-p) and 407 us at 151936: ten levels each a pass over the row on one SM; the greedy argmax ~9 us.
//
// Why: the PyTorch warpers sort the whole vocabulary (top-p), take a top-k, a softmax, a cumsum and a scatter, then
// the exponential race: ~15 kernels inside the decode graph, ~0.2 ms of a 1 ms step at batch 1. Here, per row:
//   1. read the row once: z = logit / temperature, its order-preserving 32-bit key (kept in shared memory when the
//      row fits, ~54k tokens; else later passes read the row again from L2), the row maximum m and the smallest
//      finite z;
//   2. top-k: select the k-th largest key over five levels of 256 bins with per-bin counts: first 256 equal
//      slices of [smallest, m] (a row's keys share their top bits, so key digits would put nearly every token in
//      a few bins, whose atomics serialise), then the 32 key bits, 8 a level, of the tokens in the chosen slice;
//   3. top-p: the same levels select the smallest key v* with mass(key <= v*) > (1 - top_p) * mass(kept), per-bin
//      probability mass exp(z - m) over the tokens top-k kept; then how many tokens equal to v* the reference's
//      cumulative sum drops (the lowest indices: a stable ascending sort), found by an ordered scan when any;
//   4. the draw over the kept tokens (min-p: exp(z - m) >= min_p): the Gumbel-max argmax of z - log(-log u), u from
//      Philox4x32-10 at counter (i / 4, row, offset), key seed, exactly as the reference.
// Histograms: 256 bins, 8 copies (warp w adds to copy w % 8); where a warp's tokens fall into few bins (ties), its
// lanes of one bin are merged first (match_any). -inf (and NaN) tokens take no part: no probability, and top-k
// keeps every token when fewer than k are finite.
// Launched with PDL (launch.h): the scores, the seed and the step counter come from earlier kernels.
#include "launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cooperative_groups.h>

#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

namespace fuseinfer {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;  // one radix digit: 8 bits, four levels for a 32-bit key
constexpr int kCopies = 8;
constexpr int kHistBytes = 2 * kCopies * kBins * 4;  // counts (u32) and masses (f32)
constexpr unsigned kFull = 0xffffffffu;

struct SampleParams {
  const float* scores;   // (B, V)
  int64_t* tokens;       // (B,)
  const int64_t* seed;   // (1,)
  const int64_t* offset; // (1,)
  int v;
  float temperature;
  bool scale;   // temperature != 1 (the reference divides only then)
  int top_k;    // 0: off (also when >= V: every token stays)
  float drop;   // 1 - top_p; top-p on when use_top_p
  bool use_top_p;
  float min_p;  // 0: off
  bool* kept;   // (B, V) or null: sample_tokens_kept's mask of the tokens the warpers keep (tests)
};

// The fp32 value's order-preserving key (ascending keys, ascending values; -0 and +0 share +0's key, as they compare
// equal in the reference).
__device__ __forceinline__ uint32_t order_key(float z) {
  uint32_t u = __float_as_uint(z);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Whether a key is a finite value's (-inf and NaN keys lie outside; keys of +inf too).
__device__ __forceinline__ bool is_finite_key(uint32_t k) { return k > 0x007fffffu && k < 0xff800000u; }

// Philox4x32-10 (Random123): four 32-bit words for counter c, key k (the reference's philox4x32).
__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) k.x += 0x9E3779B9u, k.y += 0xBB67AE85u;
    const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// Whether (g, i) beats (best, best_i) in the draw: larger key, then lower index (torch.argmax's first maximum).
__device__ __forceinline__ bool better(float g, int i, float best, int best_i) {
  return g > best || (g == best && i < best_i);
}

struct Shared {
  float f[kWarps];
  int i[kWarps];
  unsigned bin, count, index;
  float mass;
};

// Block reductions whose result every thread gets: each warp reduces the kWarps partials itself (lane j reads
// warp j's). (Not warp 0 alone and a shuffle from lane 0: that shuffle stays inside each warp, so warps 1..31 got
// their own lane 0's partial: -inf for the row maximum, and every warp but the first took the empty-row exit.)
static_assert(kWarps == 32, "block_max / block_sum: one partial per lane");

__device__ __forceinline__ float block_max(float v, Shared& sh) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) sh.f[threadIdx.x >> 5] = v;
  __syncthreads();
  v = warp_max(sh.f[threadIdx.x & 31]);
  __syncthreads();  // (the partials are read before the next reduction writes them)
  return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ int block_sum(int v, Shared& sh) {
  v = warp_sum_int(v);
  if ((threadIdx.x & 31) == 0) sh.i[threadIdx.x >> 5] = v;
  __syncthreads();
  v = warp_sum_int(sh.i[threadIdx.x & 31]);
  __syncthreads();
  return v;
}

// Per-bin counts (and, kMass, masses exp(z - m)) of the keys, in bin digit(key) (kBins: not counted); the copies
// merged into hcnt[0, kBins) / hmass[0, kBins) on return.
// Rounds of kThreads tokens per step of the passes over a row: their loads first, so that a warp has several in
// flight (one at a time, a row re-read from L2 would take ~0.5 us per round of latency).
constexpr int kUnroll = 4;

// kT threads, kNC copies (the one-block kernel: 1024, 8; the cluster kernel: 512, 4). kRange: also each bin's
// smallest and largest key, in hmin / hmax (the cluster kernel skips the levels whose byte they share).
template <bool kMass, int kT = kThreads, int kNC = kCopies, bool kRange = false, typename RawAt, typename KeyOf,
          typename Digit>
__device__ void histogram(const RawAt& raw_at, const KeyOf& key_of, int v, const Digit& digit, float m,
                          unsigned* hcnt, float* hmass, unsigned* hmin = nullptr, unsigned* hmax = nullptr) {
  for (int j = threadIdx.x; j < kNC * kBins; j += kT) {
    hcnt[j] = 0;
    if constexpr (kMass) hmass[j] = 0.f;
    if constexpr (kRange) hmin[j] = 0xffffffffu, hmax[j] = 0u;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, copy = (threadIdx.x >> 5) % kNC;
  unsigned* cnt = hcnt + copy * kBins;
  float* mass = hmass + copy * kBins;
  for (int base = 0; base < v; base += kUnroll * kT) {  // (whole warps every round: the warp intrinsics)
    uint32_t raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kT + static_cast<int>(threadIdx.x);
      raw[u] = i < v ? raw_at(i) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kT + static_cast<int>(threadIdx.x);
      unsigned bin = kBins;  // kBins: not counted
      float w = 0.f;
      uint32_t k = 0;
      if (i < v) {
        k = key_of(raw[u]);
        bin = digit(k);
        if (kMass && bin != kBins) w = __expf(key_value(k) - m);
      }
      if (!__any_sync(kFull, bin != kBins)) continue;
      const unsigned peers = __match_any_sync(kFull, bin);
      const bool leader = lane == __ffs(peers) - 1 && bin != kBins;
      if (leader) atomicAdd(cnt + bin, static_cast<unsigned>(__popc(peers)));
      if constexpr (kRange) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        const unsigned kmin = __reduce_min_sync(peers, k), kmax = __reduce_max_sync(peers, k);  // (each bin's lanes)
        if (leader) atomicMin(hmin + copy * kBins + bin, kmin), atomicMax(hmax + copy * kBins + bin, kmax);
#endif
      }
      if constexpr (kMass) {
        unsigned leaders = __ballot_sync(kFull, leader);
        if (__popc(leaders) <= 4) {  // few bins in this warp: one warp sum each
          while (leaders) {
            const int l = __ffs(leaders) - 1;
            leaders &= leaders - 1;
            const unsigned b = __shfl_sync(kFull, bin, l);
            const float part = warp_sum(bin == b ? w : 0.f);
            if (lane == l) atomicAdd(mass + b, part);
          }
        } else if (bin != kBins) {
          atomicAdd(mass + bin, w);
        }
      }
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kT) {
    unsigned c = 0, lo = 0xffffffffu, hi = 0u;
    float s = 0.f;
    for (int j = 0; j < kNC; ++j) {
      c += hcnt[j * kBins + b];
      if constexpr (kMass) s += hmass[j * kBins + b];
      if constexpr (kRange) lo = min(lo, hmin[j * kBins + b]), hi = max(hi, hmax[j * kBins + b]);
    }
    hcnt[b] = c;
    if constexpr (kMass) hmass[b] = s;
    if constexpr (kRange) hmin[b] = lo, hmax[b] = hi;
  }
  __syncthreads();
}

// Warp 0: the bin holding the rem-th largest counted key (bins from the top); sh.bin, sh.count = keys in higher bins.
__device__ void select_count_desc(const unsigned* hcnt, unsigned rem, Shared& sh) {
  const int lane = threadIdx.x & 31;
  unsigned c[8], tot = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) tot += (c[j] = hcnt[kBins - 1 - 8 * lane - j]);
  unsigned incl = tot;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const unsigned n = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += n;
  }
  const unsigned excl = incl - tot;
  if (excl < rem && rem <= incl) {  // exactly one lane: the counted keys number >= rem
    unsigned acc = excl;
    for (int j = 0; j < 8; ++j) {
      if (acc + c[j] >= rem) {
        sh.bin = kBins - 1 - 8 * lane - j;
        sh.count = acc;
        break;
      }
      acc += c[j];
    }
  }
}

// Warp 0: the first bin (ascending) whose cumulative mass exceeds t; none (float rounding, or t >= the total): the
// highest bin with a key. sh.bin, sh.mass = the mass of the lower bins, sh.count = the bin's keys.
__device__ void select_mass_asc(const unsigned* hcnt, const float* hmass, float t, Shared& sh) {
  const int lane = threadIdx.x & 31;
  t = fmaxf(t, 0.f);  // (rounding may leave it just below 0: the first bin with mass, not an empty one)
  float ms[8], tot = 0.f;
  unsigned any = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    tot += (ms[j] = hmass[8 * lane + j]);
    any |= hcnt[8 * lane + j];
  }
  float incl = tot;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const float n = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += n;
  }
  float excl = __shfl_up_sync(kFull, incl, 1);
  if (lane == 0) excl = 0.f;
  const unsigned over = __ballot_sync(kFull, incl > t);
  const unsigned filled = __ballot_sync(kFull, any != 0);
  int pick = -1;  // the bin
  float below = 0.f;
  if (over) {
    if (lane == __ffs(over) - 1) {
      float acc = excl;
      for (int j = 0; j < 8 && pick < 0; ++j) {
        if (acc + ms[j] > t) pick = 8 * lane + j, below = acc;
        else acc += ms[j];
      }
      if (pick < 0) {  // (the lane's own sum rounded otherwise): its highest bin with a key
        acc = excl;
        for (int j = 0; j < 8; ++j) {
          if (hcnt[8 * lane + j]) pick = 8 * lane + j, below = acc;
          acc += ms[j];
        }
      }
    }
  } else if (filled && lane == 31 - __clz(filled)) {
    float acc = excl;
    for (int j = 0; j < 8; ++j) {
      if (hcnt[8 * lane + j]) pick = 8 * lane + j, below = acc;
      acc += ms[j];
    }
  }
  if (pick >= 0) {
    sh.bin = pick;
    sh.mass = below;
    sh.count = hcnt[pick];
  }
}

template <bool kCached, bool kKept>
__global__ void __launch_bounds__(kThreads) sample_tokens_kernel(const SampleParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned* hcnt = reinterpret_cast<unsigned*>(smem);
  float* hmass = reinterpret_cast<float*>(hcnt + kCopies * kBins);
  uint32_t* keys = reinterpret_cast<uint32_t*>(hmass + kCopies * kBins);  // (V,) when kCached
  __shared__ Shared sh;
  pdl_launch_dependents();
  pdl_wait();  // the scores, seed and step counter come from earlier kernels
  const int row = blockIdx.x, v = p.v, tid = threadIdx.x;
  const float* x = p.scores + static_cast<int64_t>(row) * v;
  // a token's raw 32 bits (its key when cached, else its logit's bits: loaded apart from the key's computation)
  auto raw_at = [&](int i) -> uint32_t {
    if constexpr (kCached) {
      return keys[i];
    } else {
      return ld_dep(reinterpret_cast<const unsigned*>(x + i));
    }
  };
  auto key_of = [&](uint32_t raw) -> uint32_t {
    if constexpr (kCached) {
      return raw;
    } else {
      const float z = __uint_as_float(raw);
      return order_key(p.scale ? z / p.temperature : z);  // (IEEE division, as the reference's)
    }
  };
  auto key_at = [&](int i) -> uint32_t { return key_of(raw_at(i)); };

  // 1. keys, the maximum, the smallest finite value, the finite count
  float m = -INFINITY, zmin = INFINITY;
  int finite = 0;
  for (int base = 0; base < v; base += 2 * kUnroll * kThreads) {
    float xs[2 * kUnroll];
#pragma unroll
    for (int u = 0; u < 2 * kUnroll; ++u) {
      const int i = base + u * kThreads + tid;
      xs[u] = i < v ? ld_dep(x + i) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < 2 * kUnroll; ++u) {
      const int i = base + u * kThreads + tid;
      const float z = p.scale ? xs[u] / p.temperature : xs[u];  // (IEEE division, as the reference's)
      const uint32_t k = order_key(z);
      if (kCached && i < v) keys[i] = k;
      m = fmaxf(m, z);
      if (is_finite_key(k)) zmin = fminf(zmin, z), ++finite;
    }
  }
  m = block_max(m, sh);  // (its barriers publish the keys)
  zmin = -block_max(-zmin, sh);
  finite = block_sum(finite, sh);
  if (m == -INFINITY) {  // nothing to sample from: token 0, as the reference's argmax of an all -inf row
    if (tid == 0) p.tokens[row] = 0;
    if constexpr (kKept) {
      for (int i = tid; i < v; i += kThreads) p.kept[static_cast<int64_t>(row) * v + i] = true;  // (none removed)
    }
    return;
  }
  // the first level's slice of a finite value, ascending with it: 255 - floor((m - z) * scale), in [0, 255]
  // (monotone: each operation rounds monotonically); one slice when every finite value is equal
  float scale = m > zmin ? 255.99f / (m - zmin) : 0.f;
  if (!(scale <= 3.0e38f)) scale = 0.f;
  auto slice = [m, scale](uint32_t k) -> unsigned {
    return 255u - static_cast<unsigned>(fminf((m - key_value(k)) * scale, 255.f));
  };

  // 2. top-k: keys >= the k-th largest stay (every key when fewer than k are finite)
  uint32_t lo = 0;
  if (p.top_k > 0 && p.top_k < finite) {
    unsigned s0 = 0, rem = p.top_k;
    uint32_t prefix = 0;
    for (int level = 0; level < 5; ++level) {
      const int shift = 32 - 8 * level;  // (level 0: the slices)
      histogram<false>(raw_at, key_of, v, [&](uint32_t k) -> unsigned {
        if (!is_finite_key(k)) return kBins;
        if (level == 0) return slice(k);
        if (slice(k) != s0 || (shift < 24 && (k >> (shift + 8)) != (prefix >> (shift + 8)))) return kBins;
        return (k >> shift) & (kBins - 1);
      }, m, hcnt, hmass);
      if (tid < 32) select_count_desc(hcnt, rem, sh);
      __syncthreads();
      if (level == 0) s0 = sh.bin;
      else prefix |= sh.bin << shift;
      rem -= sh.count;
      __syncthreads();
    }
    lo = prefix;
  }

  // 3. top-p: keys > v* stay, and of those equal to v* the ones from index `cut` on
  uint32_t vstar = 0;
  int cut = 0;
  if (p.use_top_p) {
    uint32_t prefix = 0;
    float below = 0.f, target = 0.f;
    unsigned n = 0;
    unsigned s0 = 0;
    for (int level = 0; level < 5; ++level) {
      const int shift = 32 - 8 * level;  // (level 0: the slices)
      histogram<true>(raw_at, key_of, v, [&](uint32_t k) -> unsigned {
        if (!is_finite_key(k) || k < lo) return kBins;
        if (level == 0) return slice(k);
        if (slice(k) != s0 || (shift < 24 && (k >> (shift + 8)) != (prefix >> (shift + 8)))) return kBins;
        return (k >> shift) & (kBins - 1);
      }, m, hcnt, hmass);
      if (level == 0) {  // the kept mass, every bin of the first level
        float s = tid < kBins ? hmass[tid] : 0.f;
        s = warp_sum(s);
        if ((tid & 31) == 0) sh.f[tid >> 5] = s;
        __syncthreads();
        float total = 0.f;
        for (int w = 0; w < kBins / 32; ++w) total += sh.f[w];
        target = p.drop * total;
        __syncthreads();
      }
      if (tid < 32) select_mass_asc(hcnt, hmass, target - below, sh);
      __syncthreads();
      if (level == 0) s0 = sh.bin;
      else prefix |= sh.bin << shift;
      below += sh.mass;
      n = sh.count;
      __syncthreads();
    }
    vstar = prefix;
    // tokens equal to v* at ascending positions below + j * p, j = 1..n: those with below + j * p <= target drop
    const float pv = __expf(key_value(vstar) - m);
    int drop = pv > 0.f ? static_cast<int>(fminf(floorf((target - below) / pv), static_cast<float>(n))) : 0;
    drop = max(0, min(drop, static_cast<int>(n) - 1));  // at least one stays (the top token when t >= the total)
    if (drop > 0) {  // the drop-th (from 0) token equal to v*, in index order: the first that stays
      int seen = 0;
      for (int base = 0; base < v; base += kThreads) {
        const int i = base + tid;
        const bool eq = i < v && key_at(i) == vstar;
        const int here = __syncthreads_count(eq);
        if (seen + here > drop) {
          const unsigned bal = __ballot_sync(kFull, eq);
          if ((tid & 31) == 0) sh.i[tid >> 5] = __popc(bal);
          __syncthreads();
          int before = seen;
          for (int w = 0; w < (tid >> 5); ++w) before += sh.i[w];
          before += __popc(bal & ((1u << (tid & 31)) - 1));
          if (eq && before == drop) sh.index = i;
          __syncthreads();
          cut = sh.index;
          break;
        }
        seen += here;
      }
    }
  }

  // 4. the draw: Gumbel-max over the kept tokens
  const uint64_t seed = ld_dep_as(reinterpret_cast<const unsigned long long*>(p.seed));
  const uint64_t off = ld_dep_as(reinterpret_cast<const unsigned long long*>(p.offset));
  const uint2 key = make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
  float best = -INFINITY;
  int best_i = INT_MAX;
  const int groups = (v + 3) / 4;
  for (int g = tid; g < groups; g += kThreads) {
    uint32_t ks[4];
    if (kCached && 4 * g + 3 < v) {  // one 16-byte shared load (four scalar ones would conflict 4-way)
      const uint4 q = *reinterpret_cast<const uint4*>(keys + 4 * g);
      ks[0] = q.x, ks[1] = q.y, ks[2] = q.z, ks[3] = q.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) ks[e] = 4 * g + e < v ? key_at(4 * g + e) : 0u;
    }
    bool kept[4], any = false;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * g + e;
      const uint32_t k = ks[e];
      kept[e] = i < v && k >= lo && (k > vstar || (k == vstar && i >= cut));
      if (kept[e] && p.min_p > 0.f) kept[e] = expf(key_value(k) - m) >= p.min_p;
      if (kKept && i < v) p.kept[static_cast<int64_t>(row) * v + i] = kept[e];
      any |= kept[e];
    }
    if (!any) continue;  // (top-k, peaked rows: most groups of four hold no kept token, and need no numbers)
    const uint4 r = philox(make_uint4(g, row, static_cast<unsigned>(off), static_cast<unsigned>(off >> 32)), key);
    const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!kept[e]) continue;
      const float u = (static_cast<float>(words[e] >> 9) + 0.5f) * 0x1p-23f;
      const float gk = key_value(ks[e]) - logf(-logf(u));
      if (better(gk, 4 * g + e, best, best_i)) best = gk, best_i = 4 * g + e;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float ob = __shfl_xor_sync(kFull, best, o);
    const int oi = __shfl_xor_sync(kFull, best_i, o);
    if (better(ob, oi, best, best_i)) best = ob, best_i = oi;
  }
  if ((tid & 31) == 0) sh.f[tid >> 5] = best, sh.i[tid >> 5] = best_i;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (better(sh.f[w], sh.i[w], best, best_i)) best = sh.f[w], best_i = sh.i[w];
    }
    p.tokens[row] = best_i == INT_MAX ? 0 : best_i;
  }
}


// ---- The cluster kernel (sm_90): one thread-block cluster of C CTAs per row ----
// Why: the one-block kernel's ten histogram levels each pass over the whole row on one SM (~10 us a level at 50k
// tokens). Here C CTAs (2..16, one per SM where the batch leaves room) share a row: CTA r keeps the keys of tokens
// [r * chunk, r * chunk + chunk) in its own shared memory and builds its slice's 256-bin histogram; the level's
// choice needs the whole row's histogram, which each CTA sums from every CTA's over distributed shared memory
// (cluster.map_shared_rank) after one cluster barrier, in rank order, so every CTA sums the same numbers in the
// same order and makes the same choice without another exchange. Two exchange buffers alternate between levels:
// a CTA writes level L's (counts, masses) into buffer L % 2 after the barrier of level L - 1, which every CTA passed
// only once it had read level L - 2's from that buffer: one cluster barrier a level. The selection rules (slices
// of [smallest, m], then the key bytes; select_count_desc, select_mass_asc), the tie scan and the draw (Philox
// groups of four: chunk is a multiple of four, so a group never straddles two CTAs) are the one-block kernel's,
// and so is the kept set but where fp32 mass sums round otherwise (the bins' sums run in another order).
// Fewer levels: each bin also keeps its smallest and largest key (a warp's lanes of one bin reduce theirs first,
// __reduce_min_sync / __reduce_max_sync, then one shared atomic each). Once a level has chosen a bin, the levels of
// the key bytes its keys all share are skipped (each would find every candidate in one bin: nothing above it for
// top-k, no mass below it for top-p, so skipping changes no result), and a bin whose keys are all one value ends the
// selection. Keys of one value slice share their first byte, and often more (fp16-rounded logits have 10 mantissa
// bits: the last byte is never needed); ties end at once.
// The tokens tied at v* that top-p drops (the lowest indices first): each CTA reads every CTA's count of them (its
// last level's chosen bin, whose keys are all v*) and finds its own cut: none, all or the j-th of its tied tokens.
// The draw's winner: each CTA's, pushed into CTA 0's shared memory, one barrier, CTA 0 picks. A CTA never exits
// while another may still read its shared memory (a barrier follows every remote read).
// Below sm_90, for vocabularies under kClusterMinVocab (one block is quick there) and where a slice of the row does
// not fit in shared memory, the host takes the one-block kernel.
constexpr int kCThreads = 512;
constexpr int kCWarps = kCThreads / 32;
constexpr int kCCopies = 4;  // (fewer tokens a CTA than the one-block kernel's: fewer copies to clear and merge)
constexpr int kMaxCluster = 16;
constexpr int kClusterMinVocab = 4096;
// copies of (counts, masses, smallest keys, largest keys); two exchange buffers
constexpr int kCHistBytes = 4 * kCCopies * kBins * 4 + 2 * kBins * 16;

struct ClusterShared {
  float m, neg_zmin;  // this CTA's slice: maximum, -(smallest finite value)
  int finite;         // and its finite count (every CTA reads them)
  float best[kMaxCluster];  // CTA 0: each CTA's draw winner (written by that CTA)
  int best_i[kMaxCluster];
};

template <int kW>
__device__ __forceinline__ float block_max_w(float v, Shared& sh) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) sh.f[threadIdx.x >> 5] = v;
  __syncthreads();
  v = warp_max((threadIdx.x & 31) < kW ? sh.f[threadIdx.x & 31] : -INFINITY);
  __syncthreads();
  return v;
}

template <int kW>
__device__ __forceinline__ int block_sum_w(int v, Shared& sh) {
  v = warp_sum_int(v);
  if ((threadIdx.x & 31) == 0) sh.i[threadIdx.x >> 5] = v;
  __syncthreads();
  v = warp_sum_int((threadIdx.x & 31) < kW ? sh.i[threadIdx.x & 31] : 0);
  __syncthreads();
  return v;
}

template <bool kKept>
__global__ void __launch_bounds__(kCThreads) sample_tokens_cluster_kernel(const SampleParams p, const int chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned* hcnt = reinterpret_cast<unsigned*>(smem);                // (kCCopies, kBins)
  float* hmass = reinterpret_cast<float*>(hcnt + kCCopies * kBins);  // (kCCopies, kBins)
  unsigned* hmin = reinterpret_cast<unsigned*>(hmass + kCCopies * kBins);  // (kCCopies, kBins)
  unsigned* hmax = hmin + kCCopies * kBins;                                // (kCCopies, kBins)
  uint4* xbuf = reinterpret_cast<uint4*>(hmax + kCCopies * kBins);  // (2, kBins): (count, mass bits, min, max)
  uint32_t* keys = reinterpret_cast<uint32_t*>(xbuf + 2 * kBins);   // (chunk,) this CTA's tokens' keys
  __shared__ Shared sh;
  __shared__ ClusterShared cs;
  cg::cluster_group cluster = cg::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  pdl_launch_dependents();
  pdl_wait();  // the scores, seed and step counter come from earlier kernels
  const int row = blockIdx.x / csize, v = p.v, tid = threadIdx.x, lane = tid & 31;
  const int begin = rank * chunk;                // (a multiple of 4)
  const int n = max(0, min(v - begin, chunk));  // this CTA's tokens: [begin, begin + n)
  const float* x = p.scores + static_cast<int64_t>(row) * v + begin;

  // 1. keys, the maximum, the smallest finite value, the finite count: the slice's, then the row's
  float m = -INFINITY, zmin = INFINITY;
  int finite = 0;
  for (int base = 0; base < n; base += 2 * kUnroll * kCThreads) {
    float xs[2 * kUnroll];
#pragma unroll
    for (int u = 0; u < 2 * kUnroll; ++u) {
      const int i = base + u * kCThreads + tid;
      xs[u] = i < n ? ld_dep(x + i) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < 2 * kUnroll; ++u) {
      const int i = base + u * kCThreads + tid;
      const float z = p.scale ? xs[u] / p.temperature : xs[u];  // (IEEE division, as the reference's)
      const uint32_t k = order_key(z);
      if (i < n) keys[i] = k;
      m = fmaxf(m, z);
      if (is_finite_key(k)) zmin = fminf(zmin, z), ++finite;
    }
  }
  m = block_max_w<kCWarps>(m, sh);  // (its barriers publish the keys)
  zmin = -block_max_w<kCWarps>(-zmin, sh);
  finite = block_sum_w<kCWarps>(finite, sh);
  if (tid == 0) cs.m = m, cs.neg_zmin = -zmin, cs.finite = finite;
  cluster.sync();
  {  // every warp reduces the CTAs' statistics itself (lane r reads CTA r's)
    float mr = -INFINITY, nzr = -INFINITY;
    int fr = 0;
    if (lane < csize) {
      const ClusterShared* o = cluster.map_shared_rank(&cs, static_cast<unsigned>(lane));
      mr = o->m, nzr = o->neg_zmin, fr = o->finite;
    }
    m = warp_max(mr);
    zmin = -warp_max(nzr);
    finite = warp_sum_int(fr);
  }
  if (m == -INFINITY) {  // nothing to sample from: token 0 (every CTA of the row takes this exit)
    if (rank == 0 && tid == 0) p.tokens[row] = 0;
    if constexpr (kKept) {
      for (int i = tid; i < n; i += kCThreads) p.kept[static_cast<int64_t>(row) * v + begin + i] = true;
    }
    cluster.sync();  // (the others may still be reading this CTA's statistics)
    return;
  }
  float scale = m > zmin ? 255.99f / (m - zmin) : 0.f;  // (the one-block kernel's slices, same numbers)
  if (!(scale <= 3.0e38f)) scale = 0.f;
  auto slice = [m, scale](uint32_t k) -> unsigned {
    return 255u - static_cast<unsigned>(fminf((m - key_value(k)) * scale, 255.f));
  };
  auto raw_at = [&](int i) -> uint32_t { return keys[i]; };
  auto key_of = [](uint32_t raw) -> uint32_t { return raw; };

  // One level: this CTA's histogram, exchanged through xbuf[lvl % 2]; on return hcnt, hmass, hmin, hmax [0, kBins)
  // hold the row's (every CTA the same numbers).
  int lvl = 0;
  auto level = [&](auto mass_tag, const auto& digit) {
    constexpr bool kMass = decltype(mass_tag)::value;
    histogram<kMass, kCThreads, kCCopies, true>(raw_at, key_of, n, digit, m, hcnt, hmass, hmin, hmax);
    uint4* mine = xbuf + (lvl & 1) * kBins;
    if (tid < kBins) {
      mine[tid] = make_uint4(hcnt[tid], __float_as_uint(kMass ? hmass[tid] : 0.f), hmin[tid], hmax[tid]);
    }
    cluster.sync();
    if (tid < kBins) {
      unsigned c = 0, lo = 0xffffffffu, hi = 0u;
      float s = 0.f;
      uint4 o[kMaxCluster];
#pragma unroll
      for (int r = 0; r < kMaxCluster; ++r) {  // (all loads first: DSMEM latency once)
        o[r] = r < csize ? cluster.map_shared_rank(mine, static_cast<unsigned>(r))[tid]
                         : make_uint4(0u, 0u, 0xffffffffu, 0u);
      }
#pragma unroll
      for (int r = 0; r < kMaxCluster; ++r) {  // (rank order: every CTA sums the masses alike)
        c += o[r].x, s += __uint_as_float(o[r].y), lo = min(lo, o[r].z), hi = max(hi, o[r].w);
      }
      hcnt[tid] = c;
      hmass[tid] = s;
      hmin[tid] = lo;
      hmax[tid] = hi;
    }
    __syncthreads();
    ++lvl;
  };
  // After a level chose a bin whose keys span [kmin, kmax]: whether they are one key (the selection is done), else
  // the next level's shift (the highest byte where they differ; the levels of the bytes above would each find every
  // candidate in one bin: no count above it, no mass below it) and the prefix the candidates share above it.
  auto advance = [](uint32_t kmin, uint32_t kmax, int& shift, uint32_t& prefix) -> bool {
    const uint32_t d = kmin ^ kmax;
    if (d == 0) {
      prefix = kmin;
      return true;
    }
    shift = (31 - __clz(d)) / 8 * 8;
    if (shift < 24) prefix = kmin & ~((1u << (shift + 8)) - 1u);
    return false;
  };

  // 2. top-k: keys >= the k-th largest stay (every key when fewer than k are finite)
  uint32_t lo = 0;
  if (p.top_k > 0 && p.top_k < finite) {
    unsigned s0 = 0, rem = p.top_k;
    uint32_t prefix = 0;
    for (int shift = 32;;) {  // (32: the slices)
      level(std::false_type{}, [&](uint32_t k) -> unsigned {
        if (!is_finite_key(k)) return kBins;
        if (shift == 32) return slice(k);
        if (slice(k) != s0 || (shift < 24 && (k >> (shift + 8)) != (prefix >> (shift + 8)))) return kBins;
        return (k >> shift) & (kBins - 1);
      });
      if (tid < 32) select_count_desc(hcnt, rem, sh);
      __syncthreads();
      const unsigned bin = sh.bin;
      const uint32_t kmin = hmin[bin], kmax = hmax[bin];
      rem -= sh.count;
      __syncthreads();
      if (shift == 32) s0 = bin;
      else prefix |= bin << shift;
      if (advance(kmin, kmax, shift, prefix)) break;
    }
    lo = prefix;
  }

  // 3. top-p: keys > v* stay, and of those equal to v* the ones from index `cut` on
  uint32_t vstar = 0;
  int cut = 0;
  if (p.use_top_p) {
    uint32_t prefix = 0;
    float below = 0.f, target = 0.f;
    unsigned cnt = 0, s0 = 0, last_bin = 0;
    for (int shift = 32;;) {  // (32: the slices)
      level(std::true_type{}, [&](uint32_t k) -> unsigned {
        if (!is_finite_key(k) || k < lo) return kBins;
        if (shift == 32) return slice(k);
        if (slice(k) != s0 || (shift < 24 && (k >> (shift + 8)) != (prefix >> (shift + 8)))) return kBins;
        return (k >> shift) & (kBins - 1);
      });
      if (shift == 32) {  // the kept mass, every bin of the first level
        float s = tid < kBins ? hmass[tid] : 0.f;
        s = warp_sum(s);
        if ((tid & 31) == 0) sh.f[tid >> 5] = s;
        __syncthreads();
        float total = 0.f;
        for (int w = 0; w < kBins / 32; ++w) total += sh.f[w];
        target = p.drop * total;
        __syncthreads();
      }
      if (tid < 32) select_mass_asc(hcnt, hmass, target - below, sh);
      __syncthreads();
      const unsigned bin = sh.bin;
      const uint32_t kmin = hmin[bin], kmax = hmax[bin];
      below += sh.mass;
      cnt = sh.count;
      __syncthreads();
      if (shift == 32) s0 = bin;
      else prefix |= bin << shift;
      last_bin = bin;
      if (advance(kmin, kmax, shift, prefix)) break;
    }
    vstar = prefix;  // (every key of the last level's chosen bin)
    // tokens equal to v* at ascending positions below + j * p, j = 1..cnt: those with below + j * p <= target drop
    const float pv = __expf(key_value(vstar) - m);
    int drop = pv > 0.f ? static_cast<int>(fminf(floorf((target - below) / pv), static_cast<float>(cnt))) : 0;
    drop = max(0, min(drop, static_cast<int>(cnt) - 1));  // at least one stays (the top token when t >= the total)
    if (drop > 0) {
      // the tied tokens of the CTAs before this one, and this one's (the last level's chosen bin, per CTA: its
      // tokens are those equal to v*)
      const uint4* last = xbuf + ((lvl - 1) & 1) * kBins;
      const int tied = lane < csize
          ? static_cast<int>(cluster.map_shared_rank(last, static_cast<unsigned>(lane))[last_bin].x) : 0;
      const int before = warp_sum_int(lane < rank ? tied : 0);
      const int mine = __shfl_sync(kFull, tied, rank);
      const int local = drop - before;  // the first tied token that stays: this CTA's local-th (from 0)
      if (local <= 0) {
        cut = 0;  // (in an earlier CTA, or this one's first: every tied token here stays)
      } else if (local >= mine) {
        cut = INT_MAX;  // (in a later CTA: none here stays)
      } else {
        int seen = 0;
        for (int base = 0; base < n; base += kCThreads) {
          const int i = base + tid;
          const bool eq = i < n && keys[i] == vstar;
          const int here = __syncthreads_count(eq);
          if (seen + here > local) {
            const unsigned bal = __ballot_sync(kFull, eq);
            if (lane == 0) sh.i[tid >> 5] = __popc(bal);
            __syncthreads();
            int at = seen;
            for (int w = 0; w < (tid >> 5); ++w) at += sh.i[w];
            at += __popc(bal & ((1u << lane) - 1));
            if (eq && at == local) sh.index = begin + i;
            __syncthreads();
            cut = sh.index;
            break;
          }
          seen += here;
        }
      }
    }
  }

  // 4. the draw: Gumbel-max over this CTA's kept tokens, then over the CTAs
  const uint64_t seed = ld_dep_as(reinterpret_cast<const unsigned long long*>(p.seed));
  const uint64_t off = ld_dep_as(reinterpret_cast<const unsigned long long*>(p.offset));
  const uint2 key = make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
  float best = -INFINITY;
  int best_i = INT_MAX;
  const int groups = (n + 3) / 4;
  for (int g = tid; g < groups; g += kCThreads) {
    uint32_t ks[4];
    if (4 * g + 3 < n) {  // one 16-byte shared load (four scalar ones would conflict 4-way)
      const uint4 q = *reinterpret_cast<const uint4*>(keys + 4 * g);
      ks[0] = q.x, ks[1] = q.y, ks[2] = q.z, ks[3] = q.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) ks[e] = 4 * g + e < n ? keys[4 * g + e] : 0u;
    }
    const int i0 = begin + 4 * g;  // the group's first token in the row
    bool kept[4], any = false;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = i0 + e;
      const uint32_t k = ks[e];
      kept[e] = 4 * g + e < n && k >= lo && (k > vstar || (k == vstar && i >= cut));
      if (kept[e] && p.min_p > 0.f) kept[e] = expf(key_value(k) - m) >= p.min_p;
      if (kKept && 4 * g + e < n) p.kept[static_cast<int64_t>(row) * v + i] = kept[e];
      any |= kept[e];
    }
    if (!any) continue;
    const uint4 r = philox(make_uint4(static_cast<unsigned>(i0 / 4), row, static_cast<unsigned>(off),
                                      static_cast<unsigned>(off >> 32)), key);
    const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!kept[e]) continue;
      const float u = (static_cast<float>(words[e] >> 9) + 0.5f) * 0x1p-23f;
      const float gk = key_value(ks[e]) - logf(-logf(u));
      if (better(gk, i0 + e, best, best_i)) best = gk, best_i = i0 + e;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float ob = __shfl_xor_sync(kFull, best, o);
    const int oi = __shfl_xor_sync(kFull, best_i, o);
    if (better(ob, oi, best, best_i)) best = ob, best_i = oi;
  }
  if (lane == 0) sh.f[tid >> 5] = best, sh.i[tid >> 5] = best_i;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kCWarps; ++w) {
      if (better(sh.f[w], sh.i[w], best, best_i)) best = sh.f[w], best_i = sh.i[w];
    }
    ClusterShared* first = cluster.map_shared_rank(&cs, 0u);
    first->best[rank] = best;
    first->best_i[rank] = best_i;
  }
  cluster.sync();  // (also: no CTA exits while another may read its shared memory)
  if (rank == 0 && tid == 0) {
    best = cs.best[0], best_i = cs.best_i[0];
    for (int r = 1; r < csize; ++r) {
      if (better(cs.best[r], cs.best_i[r], best, best_i)) best = cs.best[r], best_i = cs.best_i[r];
    }
    p.tokens[row] = best_i == INT_MAX ? 0 : best_i;
  }
#else
  __trap();  // the host picks this kernel only for an sm_90+ build on an sm_90+ GPU
#endif
}

}  // namespace

namespace {

// The cluster kernel's launch: C CTAs a row, with PDL when pdl_enabled().
template <bool kKept>
void launch_cluster(const SampleParams& p, int64_t b, int c, int chunk, int smem, cudaStream_t stream) {
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = static_cast<unsigned>(c);
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1] = pdl_attribute();
  // (per launch: cluster_fits set the shared memory of the last new (C, V) it saw, which may be less than this one's)
  C10_CUDA_CHECK(cudaFuncSetAttribute(sample_tokens_cluster_kernel<kKept>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (c > 8) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(sample_tokens_cluster_kernel<kKept>,
                                        cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  launch_kernel_with(attrs, pdl_enabled() ? 2 : 1, sample_tokens_cluster_kernel<kKept>,
                     dim3(static_cast<unsigned>(b * c)), kCThreads, smem, stream, p, chunk);
}

// Tokens a CTA of a C-CTA cluster takes (a multiple of 4: the draw's Philox groups stay whole) and its dynamic
// shared memory.
int cluster_chunk(int64_t v, int c) { return static_cast<int>(((v + c - 1) / c + 3) / 4 * 4); }
int cluster_smem(int64_t v, int c) { return kCHistBytes + 4 * cluster_chunk(v, c); }

// Whether C-CTA clusters of the cluster kernel at v tokens fit on this GPU (the kernel built for sm_90+, the
// shared memory, at least one cluster resident); cached per (device, C, V).
bool cluster_fits(int64_t v, int c) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int64_t>, bool> cache;
  const int device = static_cast<int>(at::cuda::current_device());
  const auto key = std::make_tuple(device, c, v);
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  bool fits = false;
  cudaFuncAttributes fattr{};
  int optin = 0;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fattr, sample_tokens_cluster_kernel<false>));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int smem = cluster_smem(v, c);
  if (fattr.binaryVersion >= 90 && smem + static_cast<int>(sizeof(Shared) + sizeof(ClusterShared)) + 1024 <= optin) {
    fits = true;
    for (auto kernel : {sample_tokens_cluster_kernel<false>, sample_tokens_cluster_kernel<true>}) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      if (c > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      cudaLaunchConfig_t config = {};
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = static_cast<unsigned>(c);
      attr.val.clusterDim.y = 1;
      attr.val.clusterDim.z = 1;
      config.gridDim = dim3(static_cast<unsigned>(c));
      config.blockDim = dim3(kCThreads);
      config.dynamicSmemBytes = smem;
      config.attrs = &attr;
      config.numAttrs = 1;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
        (void)cudaGetLastError();  // (a cluster size the GPU refuses: not this path)
        clusters = 0;
      }
      fits = fits && clusters > 0;
    }
  }
  cache.emplace(key, fits);
  return fits;
}

// The cluster size for (b, v) rows: the largest power of two in [2, 16] with b * C CTAs within the GPU's SMs (one
// CTA an SM: the levels are latency, not throughput), raised while a slice of the row does not fit in shared memory;
// 0 (the one-block kernel) below sm_90, below kClusterMinVocab tokens, or where no cluster size fits.
int pick_cluster(int64_t b, int64_t v) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  if (prop->major < 9 || v < kClusterMinVocab) return 0;
  int c = kMaxCluster;
  while (c > 2 && b * c > prop->multiProcessorCount) c /= 2;
  for (; c <= kMaxCluster; c *= 2) {
    if (cluster_fits(v, c)) return c;
  }
  return 0;
}

// cluster: -1 the host's pick (pick_cluster), 0 the one-block kernel, 2..16 that cluster size (tests).
void launch_sample(const at::Tensor& scores, const at::Tensor& seed, const at::Tensor& offset, double temperature,
                   int64_t top_k, double top_p, double min_p, at::Tensor& tokens, at::Tensor* kept,
                   int64_t cluster = -1) {
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == at::kFloat && scores.dim() == 2 && scores.is_contiguous(),
              "sample_tokens_cuda: scores must be a contiguous (B, V) float32 CUDA tensor");
  const int64_t b = scores.size(0), v = scores.size(1);
  TORCH_CHECK(b >= 1 && b <= 65535 && v >= 1 && v < (int64_t{1} << 30), "sample_tokens_cuda: unsupported shape ",
              scores.sizes());
  for (const at::Tensor* t : {&seed, &offset}) {
    TORCH_CHECK(t->device() == scores.device() && t->scalar_type() == at::kLong && t->numel() == 1,
                "sample_tokens_cuda: seed and offset must be (1,) int64 tensors on the scores' device");
  }
  TORCH_CHECK(temperature > 0, "sample_tokens_cuda: temperature must be > 0");
  const at::cuda::CUDAGuard guard(scores.device());
  SampleParams p{};
  p.scores = scores.data_ptr<float>();
  p.tokens = tokens.data_ptr<int64_t>();
  p.seed = seed.data_ptr<int64_t>();
  p.offset = offset.data_ptr<int64_t>();
  p.v = static_cast<int>(v);
  p.temperature = static_cast<float>(temperature);
  p.scale = temperature != 1.0;
  p.top_k = top_k > 0 && top_k < v ? static_cast<int>(top_k) : 0;
  p.use_top_p = top_p < 1.0;
  p.drop = static_cast<float>(1.0 - top_p);  // (the reference compares its fp32 cumsum with 1 - top_p as fp32)
  p.min_p = min_p > 0 ? static_cast<float>(min_p) : 0.f;
  p.kept = kept != nullptr ? kept->data_ptr<bool>() : nullptr;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int c = static_cast<int>(cluster);
  if (cluster < 0) {
    c = pick_cluster(b, v);
  } else if (cluster > 0) {
    TORCH_CHECK((c == 2 || c == 4 || c == 8 || c == 16) && at::cuda::getCurrentDeviceProperties()->major >= 9 &&
                    cluster_fits(v, c) && b * c <= 65535,
                "sample_tokens_cuda: a cluster of ", c, " CTAs cannot serve ", v, " tokens a row on this GPU");
  }
  if (c > 0) {
    const int chunk = cluster_chunk(v, c), smem = cluster_smem(v, c);
    if (kept != nullptr) launch_cluster<true>(p, b, c, chunk, smem, stream);
    else launch_cluster<false>(p, b, c, chunk, smem, stream);
    return;
  }
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, scores.get_device()));
  const int64_t cached_bytes = kHistBytes + 4 * v;
  const bool cached = cached_bytes + static_cast<int64_t>(sizeof(Shared)) + 1024 <= optin;
  const int smem = static_cast<int>(cached ? cached_bytes : kHistBytes);
  auto kernel = kept != nullptr ? (cached ? sample_tokens_kernel<true, true> : sample_tokens_kernel<false, true>)
                                : (cached ? sample_tokens_kernel<true, false> : sample_tokens_kernel<false, false>);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  launch_kernel(kernel, dim3(static_cast<unsigned>(b)), kThreads, smem, stream, p);
}

}  // namespace

at::Tensor sample_tokens_cuda(const at::Tensor& scores, const at::Tensor& seed, const at::Tensor& offset,
                              double temperature, int64_t top_k, double top_p, double min_p) {
  at::Tensor tokens = at::empty({scores.size(0)}, scores.options().dtype(at::kLong));
  launch_sample(scores, seed, offset, temperature, top_k, top_p, min_p, tokens, nullptr);
  return tokens;
}

// The same draw, and the (B, V) mask of the tokens the warpers keep (the tests compare it with the reference's).
std::tuple<at::Tensor, at::Tensor> sample_tokens_kept_cuda(const at::Tensor& scores, const at::Tensor& seed,
                                                           const at::Tensor& offset, double temperature,
                                                           int64_t top_k, double top_p, double min_p) {
  at::Tensor tokens = at::empty({scores.size(0)}, scores.options().dtype(at::kLong));
  at::Tensor kept = at::empty(scores.sizes(), scores.options().dtype(at::kBool));
  launch_sample(scores, seed, offset, temperature, top_k, top_p, min_p, tokens, &kept);
  return {tokens, kept};
}

// sample_tokens_kept with the kernel chosen: cluster -1 the host's pick, 0 the one-block kernel, 2/4/8/16 the cluster
// kernel at that cluster size (an error where it cannot run). For the tests, which run both kernels on one input.
std::tuple<at::Tensor, at::Tensor> sample_tokens_kept_with_cuda(const at::Tensor& scores, const at::Tensor& seed,
                                                                const at::Tensor& offset, double temperature,
                                                                int64_t top_k, double top_p, double min_p,
                                                                int64_t cluster) {
  at::Tensor tokens = at::empty({scores.size(0)}, scores.options().dtype(at::kLong));
  at::Tensor kept = at::empty(scores.sizes(), scores.options().dtype(at::kBool));
  launch_sample(scores, seed, offset, temperature, top_k, top_p, min_p, tokens, &kept, cluster);
  return {tokens, kept};
}

// sample_tokens with the kernel chosen as sample_tokens_kept_with's (the benchmark times both kernels).
at::Tensor sample_tokens_with_cuda(const at::Tensor& scores, const at::Tensor& seed, const at::Tensor& offset,
                                   double temperature, int64_t top_k, double top_p, double min_p, int64_t cluster) {
  at::Tensor tokens = at::empty({scores.size(0)}, scores.options().dtype(at::kLong));
  launch_sample(scores, seed, offset, temperature, top_k, top_p, min_p, tokens, nullptr, cluster);
  return tokens;
}

// The cluster size sample_tokens takes for these scores (B, V) on their GPU: 0 for the one-block kernel.
int64_t sample_tokens_cluster_size_cuda(const at::Tensor& scores) {
  TORCH_CHECK(scores.is_cuda() && scores.dim() == 2, "sample_tokens_cluster_size: scores must be a (B, V) CUDA tensor");
  const at::cuda::CUDAGuard guard(scores.device());
  return pick_cluster(scores.size(0), scores.size(1));
}

// sample_tokens (fuseinfer/ops/sample_tokens.py has the reference): scores (B, V) fp32 -> (B,) int64 tokens drawn
// after the warpers temperature, top-k (0: off), top-p (1: off), min-p (0: off); seed, offset (1,) int64.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("sample_tokens(Tensor scores, Tensor seed, Tensor offset, float temperature, int top_k, float top_p, "
        "float min_p) -> Tensor");
  m.def("sample_tokens_kept(Tensor scores, Tensor seed, Tensor offset, float temperature, int top_k, float top_p, "
        "float min_p) -> (Tensor, Tensor)");
  m.def("sample_tokens_kept_with(Tensor scores, Tensor seed, Tensor offset, float temperature, int top_k, "
        "float top_p, float min_p, int cluster) -> (Tensor, Tensor)");
  m.def("sample_tokens_with(Tensor scores, Tensor seed, Tensor offset, float temperature, int top_k, float top_p, "
        "float min_p, int cluster) -> Tensor");
  m.def("sample_tokens_cluster_size(Tensor scores) -> int");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("sample_tokens", &sample_tokens_cuda);
  m.impl("sample_tokens_kept", &sample_tokens_kept_cuda);
  m.impl("sample_tokens_kept_with", &sample_tokens_kept_with_cuda);
  m.impl("sample_tokens_with", &sample_tokens_with_cuda);
  m.impl("sample_tokens_cluster_size", &sample_tokens_cluster_size_cuda);
}

}  // namespace fuseinfer
