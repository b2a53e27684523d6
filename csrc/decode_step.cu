// One decode step of a pre-LN OPT (all layers, final LayerNorm, LM head) as one persistent kernel.
//
// Why: the per-op decode step is ~200 dependent kernels; each costs ~2 µs of fill and drain on top of its
// bytes, which keeps batch-1 decode at ~65% of copy bandwidth. Here one block per SM runs the whole step:
//   * the producer warp streams this block's share of every weight matrix, in the order the step uses them
//     (per layer: qkv, the old keys and values of its attention items, out_proj, fc1, fc2; then the LM head),
//     through a ring of shared-memory stages with cp.async.bulk (TMA) and mbarriers, one lane per row. None of
//     it depends on this step's activations, so the stream runs ahead of the consumers by up to the ring: a load
//     issued after a phase starts would queue behind the whole grid's in-flight stream (~5 µs on the H100),
//     which is also why a tile's bias rides in its first stage and out_proj / fc2 keep their residual columns in
//     shared memory (KeptResidual) rather than reading them back;
//   * eight consumer warps compute each phase. A phase's outputs needed by other blocks reach them as tagged
//     words (two elements and the epoch that wrote them in one 8-byte store, see st_tagged); a reader polls
//     each word until it carries the epoch it expects. There is no grid barrier: every hand-off waits only for
//     the words it reads, and the chain of them bounds how far a block runs ahead (see the buffer notes at the
//     loop), so one copy of each buffer is enough.
// Phases of layer l (x = the consumer's activation rows in shared memory, h = the residual stream):
//   x = LN1(h)              every block, redundantly (M rows over all consumer threads)
//   qkv = x Wqkv^T + b      tiles of 16 rows of W: q -> q, k and v -> kv_new (tagged) and the caches at slot
//                           q_start[m]
//   attention               one warp per (row, head, 32 keys): partial softmax sums over the keys from the ring
//                           and the new one from kv_new; the last warp of a (row, head) to finish merges them
//                           (atomic counter) into attn (tagged)
//   h += attn Wo^T + b      (polls attn; h tagged)
//   x = LN2(h); f = relu(x W1^T + b)   (polls h; f tagged)
//   h += f W2^T + b         (polls f; h tagged)
// then x = LN_final(h), logits = x Wlm^T (rounded to the model dtype, returned as fp32).
//
// GEMV tiles: 16 rows of W (outputs) x 512 columns per ring stage (rows padded to 1088 bytes so the
// fragment loads are free of bank conflicts); tile i of a matrix belongs to block i % gridDim.x. Each warp
// multiplies k-steps of 32 with m16n8k16 tensor-core mmas (the layout of linear.cu's skinny kernel: rows of
// W are the mma's m, up to 8 tokens its n), and the warps' partial sums meet in shared memory.
// Activations written by one block and read by another are read with ld.global.cg (L2, never a stale L1).
// Numerics follow the per-op path: fp32 accumulation and statistics, one rounding to the model dtype at
// each point where the per-op path stores a tensor.
// docs/notes.md ("Fast decode: the one-kernel step") has the measurements and the trace findings.
// int8 weight-only models (Q8, docs/quantization.md "int8 in the one-kernel step"): the four decoder matrices
// stream as int8 tiles (the same 1 KiB rows per stage, so 1024 k per stage), a tile's first stage also carries its
// 16 fp32 per-channel scales (in row 1's padding); consume converts the int8 weights to fp16/bf16 in registers
// (exact), runs the same mmas with fp32 accumulation, and multiplies each output's dot product by its scale once,
// in the epilogue, before the bias and residual. The LM head stays fp16/bf16. Q8 = false is the fp16/bf16 kernel.
// FP8 models (E4M3, with Q8): the same stream of 8-bit tiles holds float8 e4m3 weights, converted by
// fp8_convert.cuh (one instruction per pair on Hopper) instead; everything else is the int8 kernel's.
// The Llama family (Llama, Mistral, Qwen2; LLAMA = true, fp16/bf16 weights; op llama_decode_step): the same phases
// and hand-offs with RMSNorm (no mean, no bias), q/k/v = x Wqkv^T (+ Qwen2's bias) with the rotary applied in the
// epilogue (cos / sin of this step's positions, (B, D) from the caller, staged in shared memory once per launch),
// grouped-query attention (items per (row, q head, 32 keys), reading kv head h / (H / Hkv)), o_proj and down_proj
// without bias, and f = SiLU(x Wg^T) * (x Wu^T) in the gate/up epilogue. Rotary pairs dim d with d + D/2 and SiLU
// pairs gate row f with up row f: the producer loads such pairs into rows o and o + 8 of one tile (produce's PERM
// addressing, no permuted weight copy), and the epilogue exchanges them with one shuffle (consume's kSwap).
// FP8 KV caches (KV8, either family, fp16/bf16 weights; RuntimeConfig(kv_cache="fp8")): float8 e4m3 keys and values
// with per-(layer, kv head) fp32 scales (ops/kv_cache.py). The producer streams e4m3 rows (an attention item is half
// the bytes: 4 items of D = 64 per stage, 2 of D = 128); a warp dequantizes exactly (fp8_convert.cuh) and applies the
// scales as attention.cu's FP8 form does: the key scale on q . k, the value scale once on the sum p v. The q/k/v
// epilogue stores the new key and value as kv_cache_append_fp8 does (rounded to T, divided by the scale, rounded to
// e4m3 with saturation) into the cache and, as the two bytes of each pair, into kv_new, so this step attends to the
// stored value like the per-op path, which reads it back from the cache. The scales (the prefill's calibration writes
// them) are staged in shared memory once per launch, after pdl_wait, like the rotary tables.
#include "device_utils.cuh"
#include "fp8_convert.cuh"
#include "int8_convert.cuh"
#include "knobs.h"
#include "launch.h"
#include "sm90.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fuseinfer {
namespace {

constexpr int kMaxBlocks = 1024;        // SMs
constexpr int kMaxLayers = 96;          // layers carried in the kernel parameters (OPT-66b has 64)
constexpr int kMaxTokens = 8;           // rows per step: the mma's n
constexpr int kConsumerWarps = 8;
constexpr int kConsumers = 32 * kConsumerWarps;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kTileRows = 16;
constexpr int kChunk = 512;                // k elements per ring stage
constexpr int kStageRow = kChunk * 2 + 64;  // bytes; 64 of padding: conflict-free 16-byte fragment loads
constexpr int kStageBytes = kTileRows * kStageRow;
constexpr int kMinStages = 3;
constexpr int kSlice = 32;                 // keys per attention work item (one per lane)
static_assert(kMaxTokens <= kConsumerWarps, "layer_norm_rows: one consumer warp per row's statistics");

struct LayerWeights {
  const void *ln1_w, *ln1_b, *wqkv, *bqkv, *wo, *bo, *ln2_w, *ln2_b, *w1, *b1, *w2, *b2;
  void *k_cache, *v_cache;  // (B, H, T, D)
};

struct StepParams {
  int m, e, f, heads, vocab, layers, capacity, slices_cap, stages, x_stride;
  float eps, scale_log2;  // attention scale * log2(e)
  const int64_t* tokens;     // (B,) or (B, 1)
  const int64_t* positions;  // OPT positions (B,); the embedding row is position + 2
  const int* q_start;        // (B,) cache slot of this token
  const bool* key_mask;      // (B, T)
  const void *embed, *pos_embed, *lnf_w, *lnf_b, *lm_head;
  float* logits;  // (B, V)
  int64_t* trace;  // null, or (gridDim.x, trace_events(layers)): see decode_step_trace()
  // workspace (see workspace_layout); tagged buffers hold E / 2 (F / 2) 8-byte words per row
  unsigned* launches;  // (kMaxBlocks,) each block's count of its launches so far: the epochs of this one
  int* attn_count;     // (B, H): slices merged so far in this launch
  float* attn_part;    // (B, H, slices_cap, D + 2): max, sum, o[D]
  uint64_t* h[2];      // (B, E) tagged: h[0] after out_proj, h[1] after fc2 (and the embeddings)
  uint64_t *q, *kv_new;  // (B, E), (B, 2 E) tagged: the new token's query, key and value
  uint64_t *attn, *ffn;  // (B, E), (B, F) tagged
  LayerWeights layer[kMaxLayers];
  // Q8: fp32 per-output-channel scales of layer l's qkv, out_proj, fc1, fc2 (null otherwise). After layer[], so
  // outside the shared-memory copy (params_bytes): only the producer reads them, from the parameter space.
  const float* wscale[kMaxLayers][4];
  // Llama family only (zero for OPT). Also outside the shared-memory copy: read from the parameter space.
  int kv_heads;              // key/value heads (grouped-query attention: q head h reads kv head h / (heads / kv_heads))
  bool qkv_bias;             // whether layer[l].bqkv holds the q/k/v bias (Qwen2)
  const void *cos, *sin;     // (B, D) rotary tables of this step's positions, in the model dtype
  // KV8 (float8 e4m3 caches) only: layer l's (2, Hkv) fp32 scales (the keys' row, then the values'), a stored x
  // meaning x * scale. The prefill's calibration writes them: the consumers stage them in shared memory after
  // pdl_wait (kv_scale_table), and nothing else reads these pointers.
  const float* kv_scale[kMaxLayers];
};

// Trace row of a block (FUSEINFER_DECODE_TRACE=1): the consumers' timestamps (ns) at the 2 + kTracePhases *
// layers phase ends, then per layer the producer's and the consumers' total time waiting on the ring so far.
constexpr int kTracePhases = 6;  // qkv, attention, out_proj, LN2 + fc1, fc2, next LN (profile_decode.py)
__host__ __device__ constexpr int trace_events(int layers) { return 2 + (kTracePhases + 2) * layers; }

// ---- TMA weight stream (the mbarrier primitives are in sm90.cuh) ----

// bytes (multiple of 16) from global src to shared dst, completing on bar's transaction count. The weight
// stream is read once per step: it is marked evict-first in L2 so that it does not push out what the
// consumers read back (activations, the KV cache, the small parameters).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Barrier among the consumer warps only (the producer never joins).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ int64_t now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<int64_t>(t);
}

// Tagged words: element pair (low 32 bits, the first element in the low half, as in memory) and the epoch
// that wrote it (high 32 bits) in one 8-byte relaxed store, so a reader that sees the epoch sees the pair:
// an aligned 8-byte access is single-copy atomic, and the pair needs no fence to travel with its tag.
__device__ __forceinline__ void st_tagged(uint64_t* word, uint32_t pair, uint32_t epoch) {
  const uint64_t v = (static_cast<uint64_t>(epoch) << 32) | pair;
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;\n" ::"l"(word), "l"(v) : "memory");
}

__device__ __forceinline__ void ld_tagged2(const uint64_t* word, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];\n" : "=l"(a), "=l"(b) : "l"(word) : "memory");
}

__device__ __forceinline__ bool tags_are(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint32_t epoch) {
  return ((a >> 32) == epoch) & ((b >> 32) == epoch) & ((c >> 32) == epoch) & ((d >> 32) == epoch);
}

// The element pairs of four tagged words, as one 16-byte chunk.
__device__ __forceinline__ uint4 untag(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return make_uint4(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c),
                    static_cast<uint32_t>(d));
}

__device__ __forceinline__ uint64_t ld_tagged(const uint64_t* word) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(word) : "memory");
  return v;
}

// One back-off between two tries of a poll that began at t0. Every consumer thread of every block may be polling
// a few lines: the sleep spares L2 (H100: -20 us). A writer that never comes is a bug: after 10 s the kernel
// traps rather than hang the GPU.
__device__ __forceinline__ void poll_backoff(int64_t t0) {
  __nanosleep(128);
  if (now_ns() - t0 > 10'000'000'000LL) __trap();
}

// The waiting parts of poll_chunk and poll_word, out of line: they run only when a writer is late, and inlined in
// every loop that stages rows they would grow the kernel (instruction-cache misses) and its register pressure.
__device__ __noinline__ uint4 poll_chunk_wait(const uint64_t* w, uint32_t epoch) {
  const int64_t t0 = now_ns();
  uint64_t a, b, c, d;
  do {
    poll_backoff(t0);
    ld_tagged2(w, a, b);
    ld_tagged2(w + 2, c, d);
  } while (!tags_are(a, b, c, d, epoch));
  return untag(a, b, c, d);
}

__device__ __noinline__ uint32_t poll_word_wait(const uint64_t* w, uint32_t epoch) {
  const int64_t t0 = now_ns();
  uint64_t v;
  do {
    poll_backoff(t0);
    v = ld_tagged(w);
  } while ((v >> 32) != epoch);
  return static_cast<uint32_t>(v);
}

// The element pair of one tagged word, once it carries `epoch`.
__device__ __forceinline__ uint32_t poll_word(const uint64_t* w, uint32_t epoch) {
  const uint64_t v = ld_tagged(w);
  return (v >> 32) == epoch ? static_cast<uint32_t>(v) : poll_word_wait(w, epoch);
}

// Eight elements (a 16-byte chunk of an untagged row) from words [4c, 4c + 4), once all four carry `epoch`.
__device__ __forceinline__ uint4 poll_chunk(const uint64_t* words, int c, uint32_t epoch) {
  const uint64_t* w = words + 4 * static_cast<int64_t>(c);
  uint64_t a, b, d, e;
  ld_tagged2(w, a, b);
  ld_tagged2(w + 2, d, e);
  return tags_are(a, b, d, e, epoch) ? untag(a, b, d, e) : poll_chunk_wait(w, epoch);
}

// Element n of a tagged row whose epoch the caller has already seen (by a poll of the same word).
template <typename T>
__device__ __forceinline__ float ld_tagged_elem(const uint64_t* words, int64_t n) {
  const uint64_t v = ld_tagged(words + n / 2);
  const uint32_t low = static_cast<uint32_t>(n % 2 ? v >> 16 : v);  // element n in the low 16 bits
  return to_float(*reinterpret_cast<const T*>(&low));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t u;
  T* e = reinterpret_cast<T*>(&u);
  e[0] = from_float<T>(lo);
  e[1] = from_float<T>(hi);
  return u;
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = to_float(e[j]);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int j = 0; j < 8; ++j) e[j] = from_float<T>(f[j]);
  return u;
}

// KV8: the pair (s0, s1) of new keys or values as kv_cache_append_fp8 stores it: rounded to T (the projection's
// output), divided by its head's scale (fp32, rounded to nearest), then rounded to e4m3 with saturation at +-448;
// the two bytes in the low 16 bits, the first element in the low byte (as in memory).
template <typename T>
__device__ __forceinline__ uint32_t e4m3_pair(float s0, float s1, float scale) {
  const uint32_t lo = fp8::e4m3_from_float(__fdiv_rn(to_float(from_float<T>(s0)), scale));
  const uint32_t hi = fp8::e4m3_from_float(__fdiv_rn(to_float(from_float<T>(s1)), scale));
  return lo | hi << 8;
}

// Two e4m3 (the low 16 bits, low byte first) -> two floats (exact).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
  const uint32_t h = fp8::e4m3x2_to_f16x2(static_cast<uint16_t>(pair));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// ---- the weight stream: one sequence of (matrix, tile, k-chunk) stages, walked by producer and consumers ----

struct Ring {
  char* stages;     // stages * kStageBytes
  uint64_t* full;   // producer -> consumers (tx bytes)
  uint64_t* empty;  // consumers -> producer (one arrive per consumer warp)
  int count;
  int index = 0;
  uint32_t phase = 0;
  bool timed = false;     // trace: accumulate the time spent waiting on the ring
  int64_t wait_ns = 0;
  __device__ void wait(uint64_t* bar, uint32_t parity) {
    if (!timed) return mbar_wait(bar, parity);
    const int64_t t0 = now_ns();
    mbar_wait(bar, parity);
    wait_ns += now_ns() - t0;
  }
  __device__ void advance() {
    if (++index == count) {
      index = 0;
      phase ^= 1;
    }
  }
};

// Producer (the whole warp): every stage of this block's tiles of w (N x K), in the consumers' order. A tile's
// first stage also carries its 16 bias values (bias: null or N elements, N a multiple of 16), in the padding of
// its first row, so the epilogue does not wait for a global load. Q8: w is int8, a stage holds kQ8Chunk k of each
// row (the same bytes), and the tile's first stage also carries its 16 fp32 scales (scale: N floats, 16-byte
// aligned) in the padding of its second row.
constexpr int kQ8Chunk = 2 * kChunk;  // int8 k elements per ring stage
constexpr int kScaleOffset = kStageRow + kChunk * 2;  // byte offset in a stage of the tile's scales (row 1's padding)
static_assert(kTileRows * 4 <= kStageRow - kChunk * 2, "a tile's fp32 scales fit a row's padding");

// PERM (the Llama family): the tiles of rows below perm_rows pair rows across halves instead of taking 16 consecutive
// ones. Those rows form groups of 2 half (a head of D = 2 half rows of q or k, whose rotary pairs dim d with d + D/2;
// or the whole (2F, E) gate/up weight, half = F, gate row f with up row f): the group's tile b holds rows 8b .. 8b + 7
// of its first half in tile rows 0-7 and the same of its second half in tile rows 8-15, so the rotary and
// SiLU(gate) * up are tile-local epilogues, with no permuted copy of the weight (the same pairing as skinny_gemv.cuh's
// ROPE and SILU epilogues). A tile's bias then comes in two 16-byte pieces, in the same order.
template <bool Q8 = false, bool PERM = false>
__device__ void produce(Ring& ring, const void* w, const void* bias, int n, int k, uint64_t policy,
                        const float* scale = nullptr, int perm_rows = 0, int half = 0) {
  constexpr int kElem = Q8 ? 1 : 2;                  // bytes per weight
  constexpr int kStageK = Q8 ? kQ8Chunk : kChunk;    // k per stage
  const int lane = threadIdx.x & 31;
  const char* base = static_cast<const char*>(w);
  const int tiles = (n + kTileRows - 1) / kTileRows;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int rows = min(kTileRows, n - tile * kTileRows);
    // the W rows of tile rows 0-7 and 8-15 (PERM; else first_row .. first_row + 15)
    int first_row = tile * kTileRows, second_row = first_row + kTileRows / 2;
    if constexpr (PERM) {
      if (first_row < perm_rows) {
        const int group = first_row / (2 * half) * (2 * half), b = (first_row - group) / kTileRows;
        first_row = group + 8 * b;
        second_row = first_row + half;
      }
    }
    for (int k0 = 0; k0 < k; k0 += kStageK) {
      const uint32_t bytes = min(kStageK, k - k0) * kElem;
      const bool with_bias = bias != nullptr && k0 == 0;
      const bool with_scale = Q8 && k0 == 0;
      ring.wait(&ring.empty[ring.index], ring.phase ^ 1);
      if (lane == 0) {
        mbar_expect_tx(&ring.full[ring.index],
                       bytes * rows + (with_bias ? kTileRows * 2 : 0) + (with_scale ? kTileRows * 4 : 0));
      }
      __syncwarp();
      char* dst = ring.stages + ring.index * kStageBytes;
      if constexpr (PERM) {  // (full tiles: n is a multiple of 16; no int8 weights, no scales)
        const int row = lane < kTileRows / 2 ? first_row + lane : second_row + lane - kTileRows / 2;
        if (lane < kTileRows) {
          bulk_copy(dst + lane * kStageRow, base + (static_cast<int64_t>(row) * k + k0) * kElem, bytes,
                    &ring.full[ring.index], policy);
        } else if (lane < kTileRows + 2 && with_bias) {  // 8 bias values of rows 0-7, then of rows 8-15
          const int at = lane == kTileRows ? first_row : second_row;
          bulk_copy(dst + kChunk * 2 + (lane - kTileRows) * kTileRows, static_cast<const char*>(bias) + at * 2,
                    kTileRows, &ring.full[ring.index], policy);
        }
      } else if (lane < rows) {
        bulk_copy(dst + lane * kStageRow, base + (static_cast<int64_t>(tile * kTileRows + lane) * k + k0) * kElem,
                  bytes, &ring.full[ring.index], policy);
      } else if (lane == kTileRows && with_bias) {
        bulk_copy(dst + kChunk * 2, static_cast<const char*>(bias) + tile * kTileRows * 2, kTileRows * 2,
                  &ring.full[ring.index], policy);
      } else if (lane == kTileRows + 1 && with_scale) {
        bulk_copy(dst + kScaleOffset, scale + tile * kTileRows, kTileRows * 4, &ring.full[ring.index], policy);
      }
      ring.advance();
    }
  }
}

// Consumers: y[m, n] for this block's tiles, x (M rows of K in shared memory, stride x_stride bytes) times
// the streamed w. Thread o < 16 M owns output (row o % 16, token o / 16) of each tile: epi.pre(token, n, j, bias)
// (j: the tile's index among this block's; bias from the ring when Epilogue::kBias) is added to the accumulated
// dot product, epi.keep(j, sum) sees every sum and epi.store(token, n, sum) stores it; a tagged epilogue (kPairs)
// stores outputs n and n + 1 (even n) together from the even thread, store(token, n, sum_n, sum_n+1); an epilogue
// with kSwap first replaces each sum by swap(token, n, sum, sum of the tile row o ^ 8) (the PERM tiles' pairs).
// Q8: int8 w; a warp step covers 64 k (lane (g, t): 16 weights of rows g and g + 8, k = 16 t .. 16 t + 15 of the
// step, one 16-byte load each as in the fp16 path), converted to T in registers, four mmas; the sum of a tile's
// output is its dot product times the channel's scale (from the tile's first stage), then plus epi.pre's extra.
template <typename T, bool Q8 = false, bool E4M3 = false, typename Epilogue>
__device__ void consume(Ring& ring, const char* x, int x_stride, int m, int n, int k,
                        float (*partial)[kConsumerWarps][kTileRows][kMaxTokens + 1], int& pbuf, const Epilogue& epi) {
  constexpr int kStageK = Q8 ? kQ8Chunk : kChunk;  // k per stage
  constexpr int kStepK = Q8 ? 64 : 32;             // k per warp step
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // token g (clamped: its outputs are dropped), at this lane's first k of a step
  const char* xrow = x + min(g, m - 1) * x_stride + t * (kStepK / 4) * 2;
  const int tiles = (n + kTileRows - 1) / kTileRows;
  const int out_row = threadIdx.x % kTileRows, out_token = threadIdx.x / kTileRows;
  for (int tile = blockIdx.x, j = 0; tile < tiles; tile += gridDim.x, ++j) {
    const int col = tile * kTileRows + out_row;
    const bool owner = out_token < m && col < n;
    float extra = 0.f;
    [[maybe_unused]] float wscale = 0.f;  // Q8: this output's channel scale
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc2[4] = {0.f, 0.f, 0.f, 0.f};  // two chains of dependent mmas
    for (int k0 = 0; k0 < k; k0 += kStageK) {
      const int steps = min(kStageK, k - k0) / kStepK;
      ring.wait(&ring.full[ring.index], ring.phase);
      const char* w = ring.stages + ring.index * kStageBytes + t * 16;
      if (k0 == 0 && owner) {
        const T* bias = reinterpret_cast<const T*>(ring.stages + ring.index * kStageBytes + kChunk * 2);
        extra = epi.pre(out_token, col, j, Epilogue::kBias ? to_float(bias[out_row]) : 0.f);
        if constexpr (Q8) {
          wscale = reinterpret_cast<const float*>(ring.stages + ring.index * kStageBytes + kScaleOffset)[out_row];
        }
      }
      for (int s = warp; s < steps; s += kConsumerWarps) {
        const uint4 lo = *reinterpret_cast<const uint4*>(w + g * kStageRow + s * 64);
        const uint4 hi = *reinterpret_cast<const uint4*>(w + (g + 8) * kStageRow + s * 64);
        if constexpr (Q8) {
          // 16 int8 weights per row -> 8 words of T pairs: row g's are l[0..7], row g + 8's h[0..7] (k order)
          const uint4 x0 = *reinterpret_cast<const uint4*>(xrow + (k0 + s * 64) * 2);       // k 16 t .. + 7
          const uint4 x1 = *reinterpret_cast<const uint4*>(xrow + (k0 + s * 64) * 2 + 16);  // k 16 t + 8 .. + 15
          uint32_t l[8], h[8];
          const auto convert = [](uint32_t w, uint32_t& a, uint32_t& b) {
            if constexpr (E4M3) {
              fp8::e4m3x4_to_x4<T>(w, a, b);
            } else {
              int8::i8x4_to_x4<T>(w, a, b);
            }
          };
          convert(lo.x, l[0], l[1]);
          convert(lo.y, l[2], l[3]);
          convert(lo.z, l[4], l[5]);
          convert(lo.w, l[6], l[7]);
          convert(hi.x, h[0], h[1]);
          convert(hi.y, h[2], h[3]);
          convert(hi.z, h[4], h[5]);
          convert(hi.w, h[6], h[7]);
          const uint32_t a0[4] = {l[0], h[0], l[1], h[1]};  // k 0-3 of the lane's 16, with x0.x, x0.y
          const uint32_t a1[4] = {l[2], h[2], l[3], h[3]};  // k 4-7, x0.z, x0.w
          const uint32_t a2[4] = {l[4], h[4], l[5], h[5]};  // k 8-11, x1.x, x1.y
          const uint32_t a3[4] = {l[6], h[6], l[7], h[7]};  // k 12-15, x1.z, x1.w
          mma_16816<T>(acc, a0, x0.x, x0.y);
          mma_16816<T>(acc2, a1, x0.z, x0.w);
          mma_16816<T>(acc, a2, x1.x, x1.y);
          mma_16816<T>(acc2, a3, x1.z, x1.w);
        } else {
          const uint4 xv = *reinterpret_cast<const uint4*>(xrow + (k0 + s * 32) * 2);
          const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
          const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
          mma_16816<T>(acc, a0, xv.x, xv.y);
          mma_16816<T>(acc2, a1, xv.z, xv.w);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&ring.empty[ring.index]);
      ring.advance();
    }
    // acc = {(row g, token 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += acc2[i];
    float(&part)[kConsumerWarps][kTileRows][kMaxTokens + 1] = partial[pbuf];
    part[warp][g][2 * t] = acc[0];
    part[warp][g][2 * t + 1] = acc[1];
    part[warp][g + 8][2 * t] = acc[2];
    part[warp][g + 8][2 * t + 1] = acc[3];
    consumers_sync();
    float s = extra;
    if (owner) {
      if constexpr (Q8) {
        float dot = 0.f;
#pragma unroll
        for (int v = 0; v < kConsumerWarps; ++v) dot += part[v][out_row][out_token];
        s = fmaf(dot, wscale, extra);  // the scale once per output, on the fp32 dot product
      } else {
#pragma unroll
        for (int v = 0; v < kConsumerWarps; ++v) s += part[v][out_row][out_token];
      }
      epi.keep(j, s);
    }
    if constexpr (Epilogue::kSwap) {  // the tile's rows o and o ^ 8 (rotary pairs, gate and up) meet: same token
      const float other = __shfl_xor_sync(0xffffffffu, s, kTileRows / 2);
      if (owner) s = epi.swap(out_token, col, s, other);
    }
    if constexpr (Epilogue::kPairs) {  // outputs n, n + 1 sit in lanes 2j, 2j + 1 (N is even: same owner)
      const float s_next = __shfl_down_sync(0xffffffffu, s, 1);
      if (owner && out_row % 2 == 0) epi.store(out_token, col, s, s_next);
    } else if (owner) {
      epi.store(out_token, col, s);
    }
    pbuf ^= 1;  // the next tile writes the other buffer, so no second barrier is needed here
  }
}

// x[r] = LayerNorm(src row r) for r < m. src = the tagged rows h_in of epoch `epoch` (polled), or (layer 0,
// h_in null) the embeddings' sum, which block 0 also stores to h_out as epoch `epoch`. Three steps, one round
// trip to memory: (1) every consumer thread loads 16-byte chunks of the rows and of
// the LayerNorm weight and bias (all loads in flight at once) into shared memory: the rows raw into x, weight
// and bias into lnp (2 E elements); (2) warp r computes row r's statistics from shared memory in fp32, two
// passes (mean, then squared deviations) as layer_norm.cu; (3) every thread normalises its chunks in place.
// Loops run over rows at run time (no unrolling over kMaxTokens): the code stays small, which matters in a
// kernel whose per-layer loop does not fit the instruction cache.
// LLAMA: RMSNorm as transformers' (and add_rms_norm's): no mean, no bias, x * rstd rounded to the model dtype, then
// times the weight (rounded); the embeddings have no position table.
template <typename T, bool LLAMA = false>
__device__ void layer_norm_rows(const StepParams& p, char* x, char* lnp, const T* w, const T* b,
                                const uint64_t* h_in, uint64_t* h_out, uint32_t epoch, float (*stat)[2]) {
  constexpr int kParams = LLAMA ? 1 : 2;  // weight (and bias)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = p.e / 8;
  uint4* wb = reinterpret_cast<uint4*>(lnp);  // (2, E): weight, then bias
  // Items 0 .. kParams chunks - 1 are the weight's and the bias's chunks, then (row, chunk) of the rows.
  auto load = [&](int i) -> uint4 {
    if (i < kParams * chunks) return __ldg(reinterpret_cast<const uint4*>(i < chunks ? w : b) + i % chunks);
    i -= kParams * chunks;
    if (h_in != nullptr) return poll_chunk(h_in, i, epoch);
    const int r = i / chunks, c = i % chunks;
    float v[8], pe[8];
    unpack8<T>(__ldg(reinterpret_cast<const uint4*>(p.embed) + p.tokens[r] * chunks + c), v);
    if constexpr (!LLAMA) {
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(p.pos_embed) + (p.positions[r] + 2) * chunks + c), pe);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += pe[j];
    }
    const uint4 u = pack8<T>(v);  // the sum rounded to the model dtype, as the per-op path stores it
    if (blockIdx.x == 0) {
      uint64_t* o = h_out + 4 * static_cast<int64_t>(i);
      st_tagged(o, u.x, epoch);
      st_tagged(o + 1, u.y, epoch);
      st_tagged(o + 2, u.z, epoch);
      st_tagged(o + 3, u.w, epoch);
    }
    return u;
  };
  const int items = (kParams + p.m) * chunks;
  constexpr int kBatch = 4;  // loads in flight per thread before the first store
  for (int i0 = threadIdx.x; i0 < items; i0 += kBatch * kConsumers) {
    uint4 u[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (i0 + j * kConsumers < items) u[j] = load(i0 + j * kConsumers);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j * kConsumers;
      if (i < kParams * chunks) {
        wb[i] = u[j];
      } else if (i < items) {
        reinterpret_cast<uint4*>(x + (i / chunks - kParams) * p.x_stride)[i % chunks] = u[j];
      }
    }
  }
  consumers_sync();
  if (LLAMA && warp < p.m) {  // row `warp`'s mean square
    const uint4* xr = reinterpret_cast<const uint4*>(x + warp * p.x_stride);
    float s = 0.f;
    for (int c = lane; c < chunks; c += 32) {
      float v[8];
      unpack8<T>(xr[c], v);
#pragma unroll
      for (int j = 0; j < 8; ++j) s += v[j] * v[j];
    }
    s = warp_sum(s);
    if (lane == 0) {
      stat[warp][0] = 0.f;
      stat[warp][1] = rsqrtf(s / p.e + p.eps);
    }
  } else if (warp < p.m) {  // statistics of row `warp`
    const uint4* xr = reinterpret_cast<const uint4*>(x + warp * p.x_stride);
    float s = 0.f;
    for (int c = lane; c < chunks; c += 32) {
      float v[8];
      unpack8<T>(xr[c], v);
#pragma unroll
      for (int j = 0; j < 8; ++j) s += v[j];
    }
    const float mean = warp_sum(s) / p.e;
    s = 0.f;
    for (int c = lane; c < chunks; c += 32) {
      float v[8];
      unpack8<T>(xr[c], v);
#pragma unroll
      for (int j = 0; j < 8; ++j) s += (v[j] - mean) * (v[j] - mean);
    }
    s = warp_sum(s);
    if (lane == 0) {
      stat[warp][0] = mean;
      stat[warp][1] = rsqrtf(s / p.e + p.eps);
    }
  }
  consumers_sync();
  for (int i = threadIdx.x; i < p.m * chunks; i += kConsumers) {
    const int r = i / chunks, c = i % chunks;
    uint4* xr = reinterpret_cast<uint4*>(x + r * p.x_stride);
    float v[8], wv[8], bv[8];
    unpack8<T>(xr[c], v);
    unpack8<T>(wb[c], wv);
    if constexpr (LLAMA) {
      const float rstd = stat[r][1];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = wv[j] * to_float(from_float<T>(v[j] * rstd));  // weight * x.to(dtype)
    } else {
      unpack8<T>(wb[chunks + c], bv);
      const float mean = stat[r][0], rstd = stat[r][1];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (v[j] - mean) * rstd * wv[j] + bv[j];
    }
    xr[c] = pack8<T>(v);
  }
  consumers_sync();
}

// x[r] = row r of the tagged rows src (M x K, written by other blocks as epoch `epoch`), for the GEMVs whose
// input is not normalised.
__device__ void stage_rows(const StepParams& p, char* x, const uint64_t* src, int k, uint32_t epoch) {
  const int chunks = k / 8;
#pragma unroll 4
  for (int i = threadIdx.x; i < p.m * chunks; i += kConsumers) {
    const int r = i / chunks, c = i % chunks;
    reinterpret_cast<uint4*>(x + r * p.x_stride)[c] = poll_chunk(src, i, epoch);
  }
  consumers_sync();
}

// ---- attention: work item (row m, head, slice of 32 keys) per warp ----
// The keys and values a step attends to were written by earlier steps, except the new token's: the producer
// streams the old ones of this block's items through the ring like weights (they do not depend on this step's
// activations either, so their loads overlap the phases before, instead of queueing behind the weight stream
// once the phase starts: one HBM round trip there costs ~5 µs on the H100). The new token's key and value, written
// by the qkv phase, are read from L2. Item i belongs to block i % G; its j-th item (j = 0, 1, ...) sits in
// ring stage j / kItemsPerStage and is computed by warp j % 8.

// Slices of 32 keys per (row, head): that of the longest row (the same for every block and layer of a launch).
__device__ __forceinline__ int attention_slices(const StepParams& p) {
  int len = 0;
  for (int r = 0; r < p.m; ++r) len = max(len, min(p.q_start[r] + 1, p.capacity));
  return (len + kSlice - 1) / kSlice;
}

struct AttnItem {
  int m, head, first;  // row, head, first key
  int keys;            // keys of the slice (<= 0: the row is shorter than the longest)
  int old;             // the first `old` keys come through the ring; a last one (the new token's) from L2
};

__device__ __forceinline__ AttnItem attention_item(const StepParams& p, int slices, int item) {
  AttnItem it;
  it.m = item / (p.heads * slices);
  it.head = (item / slices) % p.heads;
  it.first = (item % slices) * kSlice;
  const int slot = p.q_start[it.m];
  it.keys = min(kSlice, min(slot + 1, p.capacity) - it.first);  // keys first .. q_start[m]
  const bool fresh = slot < p.capacity && slot >= it.first && slot < it.first + kSlice;
  it.old = max(0, it.keys - (fresh ? 1 : 0));
  return it;
}

// KV8: e4m3 caches, one byte per element: an item takes half the bytes (4 items of D = 64 per stage, 2 of D = 128).
template <int D, bool KV8 = false>
struct AttnStage {
  static constexpr int kElem = KV8 ? 1 : 2;                 // bytes per cached element
  static constexpr int kRowBytes = D * kElem;               // one key or value
  static constexpr int kItemBytes = 2 * kSlice * kRowBytes;  // 32 keys, then 32 values
  static constexpr int kItemsPerStage = kStageBytes / kItemBytes;
  static_assert(kItemsPerStage >= 1, "an attention item fits a ring stage");
};

// This block's attention items (i = blockIdx.x + j G).
__device__ __forceinline__ int block_items(int items) {
  return blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
}

// Grouped-query attention (GQA, the Llama family): the items stay per (row, q head, slice); q head h reads the keys
// and values of kv head h / group (caches (B, heads / group, T, D)), so each kv slice streams once per q head of its
// group.
// Producer: the old keys and values of this block's items of layer L, in the consumers' order.
template <int D, bool GQA = false, bool KV8 = false>
__device__ void produce_attention(Ring& ring, const StepParams& p, const LayerWeights& L, int slices, uint64_t policy,
                                  int group = 1) {
  using S = AttnStage<D, KV8>;
  const int lane = threadIdx.x & 31;
  const int n = block_items(p.m * p.heads * slices);
  for (int j0 = 0; j0 < n; j0 += S::kItemsPerStage) {
    const int s = lane / 2;  // lane 2 s: item s's keys, lane 2 s + 1: its values
    const bool copies = s < min(S::kItemsPerStage, n - j0);
    const AttnItem it = attention_item(p, slices, blockIdx.x + (j0 + (copies ? s : 0)) * gridDim.x);
    const uint32_t bytes = __reduce_add_sync(0xffffffffu, copies ? it.old * S::kRowBytes : 0);
    ring.wait(&ring.empty[ring.index], ring.phase ^ 1);
    if (lane == 0) mbar_expect_tx(&ring.full[ring.index], bytes);  // (0 bytes: the arrival alone completes it)
    __syncwarp();
    if (copies && it.old > 0) {
      const int64_t at =  // (bytes)
          GQA ? ((static_cast<int64_t>(it.m) * (p.heads / group) + it.head / group) * p.capacity + it.first) *
                    S::kRowBytes
              : ((static_cast<int64_t>(it.m) * p.heads + it.head) * p.capacity + it.first) * S::kRowBytes;
      bulk_copy(ring.stages + ring.index * kStageBytes + s * S::kItemBytes + (lane % 2) * kSlice * S::kRowBytes,
                static_cast<const char*>(lane % 2 ? L.v_cache : L.k_cache) + at, it.old * S::kRowBytes,
                &ring.full[ring.index], policy);
    }
    ring.advance();
  }
}

// One warp: the item's partial softmax (max, sum, o) to p.attn_part. kv: its keys and values in the ring stage.
// The lane scores one key, then each lane accumulates D / 32 output dims over the 32 values.
// KV8: the keys and values are e4m3 (the ring's and the new token's, which kv_new carries as the bytes the cache
// got, so this step attends to the stored value as the per-op path does); kv_scale: the layer's (2, Hkv) scales in
// shared memory. As attention.cu's FP8 form: the scores are q . k times the key scale, the output sum p v times the
// value scale once (the partials are merged scaled).
template <typename T, int D, bool GQA = false, bool KV8 = false>
__device__ void attention_partial(const StepParams& p, int slices, int item, uint32_t epoch, const char* kv,
                                  float* q, int group = 1, const float* kv_scale = nullptr) {
  using S = AttnStage<D, KV8>;
  constexpr int kPerLane = D / 32;  // dims per lane (of q, the new key, the output): 2 or 4
  constexpr int kWords = kPerLane / 2;  // tagged words of them
  constexpr int kChunks = S::kRowBytes / 16;  // 16-byte chunks of a key
  constexpr int kChunkDims = 16 / S::kElem;  // dims per chunk: 8, or (KV8) 16
  // a lane's kPerLane elements of a cached value: 4 or 8 bytes, (KV8) 2 or 4
  using VLoad = std::conditional_t<KV8, std::conditional_t<kPerLane == 2, uint16_t, uint32_t>,
                                   std::conditional_t<kPerLane == 2, uint32_t, uint2>>;
  const int lane = threadIdx.x & 31;
  const AttnItem it = attention_item(p, slices, item);
  const int mh = it.m * p.heads + it.head;
  float mx = -INFINITY, sum = 0.f, o[kPerLane] = {};
  if (it.keys > 0) {
    // this lane's dims of q and, when the slice holds it, of the new token's key and value: tagged words that
    // qkv writes (the slice's other keys wait in shared memory)
    const bool has_new = it.old < it.keys;
    const int64_t at = (static_cast<int64_t>(it.m) * p.e + it.head * D + lane * kPerLane) / 2;
    uint32_t qw[kWords], kw[kWords] = {}, vw[kWords] = {};
#pragma unroll
    for (int w = 0; w < kWords; ++w) qw[w] = poll_word(p.q + at + w, epoch);
    if constexpr (GQA) {
      if (has_new) {  // row m: Hkv D keys, then Hkv D values, in a row of 2 E
        const uint64_t* k_new =
            p.kv_new + (static_cast<int64_t>(it.m) * 2 * p.e + it.head / group * D + lane * kPerLane) / 2;
        const int v_off = p.heads / group * D / 2;
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          kw[w] = poll_word(k_new + w, epoch);
          vw[w] = poll_word(k_new + v_off + w, epoch);
        }
      }
    } else if (has_new) {
      const uint64_t* k_new = p.kv_new + at + static_cast<int64_t>(it.m) * p.e / 2;  // row m: E keys, E values
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        kw[w] = poll_word(k_new + w, epoch);
        vw[w] = poll_word(k_new + p.e / 2 + w, epoch);
      }
    }
    const T* qe = reinterpret_cast<const T*>(qw);
    float new_dot = 0.f;  // the new key's score: every lane's share of the dot product
    if constexpr (KV8) {
      float kn[kPerLane];  // the new key's dims of this lane: the stored e4m3, unscaled
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        const float2 f = e4m3x2_to_float2(kw[w]);
        kn[2 * w] = f.x;
        kn[2 * w + 1] = f.y;
      }
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        q[lane * kPerLane + j] = to_float(qe[j]);
        new_dot += to_float(qe[j]) * kn[j];
      }
    } else {
      const T* ke = reinterpret_cast<const T*>(kw);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        q[lane * kPerLane + j] = to_float(qe[j]);
        new_dot += to_float(qe[j]) * to_float(ke[j]);
      }
    }
    new_dot = warp_sum(new_dot);
    VLoad v_new;
    if constexpr (KV8) {  // the lane's kPerLane bytes, from the low 16 bits of each word
      v_new = static_cast<VLoad>(kPerLane == 2 ? vw[0] & 0xffffu : (vw[0] & 0xffffu) | vw[kWords - 1] << 16);
    } else if constexpr (kPerLane == 2) {
      v_new = vw[0];
    } else {
      v_new = make_uint2(vw[0], vw[1]);
    }
    // key chunks in rotated order (chunk (c + lane) % kChunks at step c): the 32 lanes' rows share banks
    uint4 kc[kChunks];
    const uint4* krow = reinterpret_cast<const uint4*>(kv + lane * S::kRowBytes);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) kc[c] = lane < it.old ? krow[(c + lane) % kChunks] : make_uint4(0, 0, 0, 0);
    const bool valid = lane < it.keys && p.key_mask[static_cast<int64_t>(it.m) * p.capacity + it.first + lane];
    __syncwarp();
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float kf[kChunkDims];
      if constexpr (KV8) {
        const uint32_t words[4] = {kc[c].x, kc[c].y, kc[c].z, kc[c].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float2 a = e4m3x2_to_float2(words[w]), b = e4m3x2_to_float2(words[w] >> 16);
          kf[4 * w] = a.x, kf[4 * w + 1] = a.y, kf[4 * w + 2] = b.x, kf[4 * w + 3] = b.y;
        }
      } else {
        unpack8<T>(kc[c], kf);
      }
      const float* qc = q + ((c + lane) % kChunks) * kChunkDims;
#pragma unroll
      for (int j = 0; j < kChunkDims; ++j) dot += qc[j] * kf[j];
    }
    if (has_new && lane == it.old) dot = new_dot;
    [[maybe_unused]] float v_scale = 1.f;
    if constexpr (KV8) {  // this item's kv head's scales: the key's on the dot product, the value's on the output below
      const int hk = GQA ? it.head / group : it.head;
      dot *= kv_scale[hk];
      v_scale = kv_scale[(GQA ? p.heads / group : p.heads) + hk];
    }
    const float score = valid ? dot * p.scale_log2 : -INFINITY;
    mx = warp_max(score);
    const float prob = mx == -INFINITY ? 0.f : exp2f(score - mx);
    sum = warp_sum(prob);
    const VLoad* vs = reinterpret_cast<const VLoad*>(kv + kSlice * S::kRowBytes) + lane;
#pragma unroll
    for (int j = 0; j < kSlice; ++j) {
      const float pj = __shfl_sync(0xffffffffu, prob, j);  // 0 for keys past the slice's end
      const VLoad vz = {};
      const VLoad v = j < it.old ? vs[j * (D / kPerLane)] : (j < it.keys ? v_new : vz);  // (stale rows: never read)
      if constexpr (KV8) {
#pragma unroll
        for (int d = 0; d < kPerLane; d += 2) {
          const float2 f = e4m3x2_to_float2(static_cast<uint32_t>(v) >> (8 * d));
          o[d] += pj * f.x;
          o[d + 1] += pj * f.y;
        }
      } else {
        const T* ve = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int d = 0; d < kPerLane; ++d) o[d] += pj * to_float(ve[d]);
      }
    }
    if constexpr (KV8) {
#pragma unroll
      for (int d = 0; d < kPerLane; ++d) o[d] *= v_scale;
    }
    __syncwarp();  // q is rewritten by this warp's next item
  }
  float* part = p.attn_part + (static_cast<int64_t>(mh) * p.slices_cap + it.first / kSlice) * (D + 2);
  if (lane == 0) {
    part[0] = mx;
    part[1] = sum;
  }
#pragma unroll
  for (int d = 0; d < kPerLane; ++d) part[2 + lane * kPerLane + d] = o[d];
}

// One warp, after the item's partial is stored and fenced: counts it in, and if it is the last of its (row, head)
// merges all slices' partials into p.attn (tagged with `epoch`). Slices go in groups of kGroup, each in one L2
// round trip (every load of the group, its o rows and in lane j slice j's max and sum, is issued before any is
// used: one trip for contexts up to 32 kGroup keys), folded into the running sums with the online-softmax rescale.
template <typename T, int D>
__device__ void attention_merge(const StepParams& p, int slices, int item, uint32_t epoch, int layer) {
  constexpr int kPerLane = D / 32;
  constexpr int kGroup = 64 / kPerLane;  // slices per round trip: 64 o values per lane in registers
  static_assert(kGroup <= 32, "a group's max and sum sit one per lane");
  const int lane = threadIdx.x & 31;
  const int m = item / (p.heads * slices), head = (item / slices) % p.heads, mh = m * p.heads + head;
  int done = 0;
  if (lane == 0) done = atomicAdd(&p.attn_count[mh], 1) + 1;
  done = __shfl_sync(0xffffffffu, done, 0);
  if (done != slices * (layer + 1)) return;  // (the counts are reset by the last layer's merges)
  __threadfence();
  const float* parts = p.attn_part + static_cast<int64_t>(mh) * p.slices_cap * (D + 2);
  float gmax = -INFINITY, total = 0.f, acc[kPerLane] = {};
  for (int j0 = 0; j0 < slices; j0 += kGroup) {
    const int n = min(kGroup, slices - j0);
    float ov[kGroup][kPerLane];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
#pragma unroll
      for (int d = 0; d < kPerLane; ++d) {
        ov[j][d] = j < n ? __ldcg(parts + (j0 + j) * (D + 2) + 2 + lane * kPerLane + d) : 0.f;
      }
    }
    const float smax = lane < n ? __ldcg(parts + (j0 + lane) * (D + 2)) : -INFINITY;
    const float ssum = lane < n ? __ldcg(parts + (j0 + lane) * (D + 2) + 1) : 0.f;
    const float gmax_new = fmaxf(gmax, warp_max(smax));
    const float rescale = gmax == -INFINITY ? 0.f : exp2f(gmax - gmax_new);  // the earlier groups' sums
    gmax = gmax_new;
    const float c = smax == -INFINITY ? 0.f : exp2f(smax - gmax);  // slice j0 + lane's scale
    total = total * rescale + c * ssum;
#pragma unroll
    for (int d = 0; d < kPerLane; ++d) acc[d] *= rescale;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const float cj = __shfl_sync(0xffffffffu, c, j);
#pragma unroll
      for (int d = 0; d < kPerLane; ++d) acc[d] += cj * ov[j][d];
    }
  }
  total = warp_sum(total);
  const float inv = total > 0.f ? 1.f / total : 0.f;  // no key: 0, as the attention op
  uint64_t* out = p.attn + (m * p.e + head * D + lane * kPerLane) / 2;
#pragma unroll
  for (int d = 0; d < kPerLane; d += 2) st_tagged(out + d / 2, pack2<T>(acc[d] * inv, acc[d + 1] * inv), epoch);
  if (lane == 0 && layer + 1 == p.layers) p.attn_count[mh] = 0;  // ready for the next launch
}

// Consumers: this block's items, as their keys and values arrive through the ring, then the merges. KV8: e4m3
// caches with the layer's scales kv_scale (shared memory).
template <typename T, int D, bool GQA = false, bool KV8 = false>
__device__ void attention(Ring& ring, const StepParams& p, int slices, uint32_t epoch, int layer, float* scratch,
                          int group = 1, const float* kv_scale = nullptr) {
  using S = AttnStage<D, KV8>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = block_items(p.m * p.heads * slices);
  for (int j0 = 0; j0 < n; j0 += S::kItemsPerStage) {
    ring.wait(&ring.full[ring.index], ring.phase);
    const char* stage = ring.stages + ring.index * kStageBytes;
    for (int s = 0; s < S::kItemsPerStage; ++s) {
      const int j = j0 + s;
      if (j < n && j % kConsumerWarps == warp) {
        attention_partial<T, D, GQA, KV8>(p, slices, blockIdx.x + j * gridDim.x, epoch, stage + s * S::kItemBytes,
                                          scratch + warp * D, group, kv_scale);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&ring.empty[ring.index]);
    ring.advance();
  }
  if (warp >= n) return;
  __threadfence();  // this warp's partials, before its counts
  for (int j = warp; j < n; j += kConsumerWarps) {
    attention_merge<T, D>(p, slices, blockIdx.x + j * gridDim.x, epoch, layer);
  }
}

__host__ __device__ constexpr int ln_params_bytes(int e) { return 2 * e * 2; }  // weight and bias, 16-bit

// Bytes of StepParams up to and including `layers` layers (a multiple of 16).
__host__ __device__ constexpr int params_bytes(int layers) {
  return (static_cast<int>(offsetof(StepParams, layer)) + layers * static_cast<int>(sizeof(LayerWeights)) + 15) /
         16 * 16;
}

// GEMV epilogues (see consume): pre(token, n, j, bias) is what the tile's sums start from, keep(j, sum) sees
// every sum, store(token, n, sum) or, kPairs, store(token, n, sum_n, sum_n+1) writes them.
// KV8: the caches are e4m3 (the T pointers hold bytes); k and v go to kv_new and the caches as e4m3_pair of the
// head's scale (kv_scale: the layer's (2, H) in shared memory), kv_new's words carrying the two bytes.
template <typename T, bool KV8 = false>
struct QkvEpilogue {  // q -> q, k and v -> kv_new (tagged, for this step) and the caches at slot q_start[token]
  static constexpr bool kPairs = true, kBias = true, kSwap = false;
  uint64_t *q, *kv_new;
  T *k_cache, *v_cache;
  const int* q_start;
  int e, heads, capacity, head_dim;
  uint32_t epoch;
  const float* kv_scale = nullptr;  // KV8
  __device__ float pre(int, int, int, float bias) const { return bias; }
  __device__ void keep(int, float) const {}
  __device__ void store(int m, int n, float s0, float s1) const {  // n, n + 1: the same head's
    if constexpr (KV8) {
      if (n < e) {
        st_tagged(q + (static_cast<int64_t>(m) * e + n) / 2, pack2<T>(s0, s1), epoch);
        return;
      }
      const bool is_v = n >= 2 * e;
      const int c = is_v ? n - 2 * e : n - e;
      const uint32_t pair = e4m3_pair<T>(s0, s1, kv_scale[(is_v ? heads : 0) + c / head_dim]);
      st_tagged(kv_new + (static_cast<int64_t>(m) * 2 * e + n - e) / 2, pair, epoch);
      const int slot = q_start[m];
      if (slot < 0 || slot >= capacity) return;
      uint8_t* cache = reinterpret_cast<uint8_t*>(is_v ? v_cache : k_cache);
      *reinterpret_cast<uint16_t*>(cache + ((static_cast<int64_t>(m) * heads + c / head_dim) * capacity + slot) *
                                               head_dim + c % head_dim) = static_cast<uint16_t>(pair);
      return;
    }
    const uint32_t pair = pack2<T>(s0, s1);
    if (n < e) {
      st_tagged(q + (static_cast<int64_t>(m) * e + n) / 2, pair, epoch);
      return;
    }
    st_tagged(kv_new + (static_cast<int64_t>(m) * 2 * e + n - e) / 2, pair, epoch);
    const int slot = q_start[m];
    if (slot < 0 || slot >= capacity) return;
    const int c = n < 2 * e ? n - e : n - 2 * e;
    T* cache = n < 2 * e ? k_cache : v_cache;
    *reinterpret_cast<uint32_t*>(
        cache + ((static_cast<int64_t>(m) * heads + c / head_dim) * capacity + slot) * head_dim + c % head_dim) = pair;
  }
};

// The residual stream's values in the columns of this block's first kKeptTiles tiles of out_proj and fc2 (the same
// tiles), as this block last stored them: each is the other's residual. resid[j][o]: thread o's output of tile j.
constexpr int kKeptTiles = 4;
using KeptResidual = float[kKeptTiles][kTileRows * kMaxTokens];

template <typename T, bool kBiasT = true>
struct ResidualEpilogue {  // h_out = h_in + acc + bias (out_proj, fc2), tagged; h_in's epoch was polled before
  static constexpr bool kPairs = true, kBias = kBiasT, kSwap = false;  // (the Llama family: no bias)
  const uint64_t* h_in;
  uint64_t* h_out;
  int e;
  uint32_t epoch;
  KeptResidual* kept;
  bool kept_is_h_in;  // kept holds h_in (after this block's first out_proj, which reads the embeddings)
  __device__ float pre(int m, int n, int j, float bias) const {
    return bias + (kept_is_h_in && j < kKeptTiles ? (*kept)[j][threadIdx.x]
                                                   : ld_tagged_elem<T>(h_in, static_cast<int64_t>(m) * e + n));
  }
  __device__ void keep(int j, float s) const {
    if (j < kKeptTiles) (*kept)[j][threadIdx.x] = to_float(from_float<T>(s));  // as stored
  }
  __device__ void store(int m, int n, float s0, float s1) const {
    st_tagged(h_out + (static_cast<int64_t>(m) * e + n) / 2, pack2<T>(s0, s1), epoch);
  }
};

template <typename T>
struct ReluEpilogue {  // out = relu(acc + bias) (fc1), tagged; NaN passes through, like torch.relu
  static constexpr bool kPairs = true, kBias = true, kSwap = false;
  uint64_t* out;
  int n_out;
  uint32_t epoch;
  __device__ float pre(int, int, int, float bias) const { return bias; }
  __device__ void keep(int, float) const {}
  __device__ void store(int m, int n, float s0, float s1) const {
    st_tagged(out + (static_cast<int64_t>(m) * n_out + n) / 2, pack2<T>(s0 < 0.f ? 0.f : s0, s1 < 0.f ? 0.f : s1),
              epoch);
  }
};

// The Llama family's q/k/v over the PERM tiles of produce (rows (H + Hkv) D of q and k pair dims d and d + D/2 of a
// head; v's tiles are plain): bias (Qwen2) when has_bias, then q and k rotated as linear_rope.cu does (the projection
// rounded to the model dtype, x cos + rotate_half(x) sin in fp32, one rounding), stored like QkvEpilogue's: q -> q,
// k and v -> kv_new (Hkv D keys, then Hkv D values, in a row of 2 E) and the caches (B, Hkv, T, D) at q_start[token].
// KV8: k and v stored as QkvEpilogue's KV8 stores them (kv_scale: the layer's (2, Hkv)).
template <typename T, int D, bool KV8 = false>
struct LlamaQkvEpilogue {
  static constexpr bool kPairs = true, kBias = true, kSwap = true;
  uint64_t *q, *kv_new;
  T *k_cache, *v_cache;
  const int* q_start;
  const T *cos, *sin;  // (B, D) in shared memory (the kernel's rope_table)
  int e, kv_heads, capacity, rope_rows;  // rope_rows: (H + Hkv) D
  bool has_bias;
  uint32_t epoch;
  const float* kv_scale = nullptr;  // KV8
  __device__ int row_of(int n) const {  // the weight row of tile output n
    const int r0 = n - n % kTileRows, r = n % kTileRows;
    if (r0 >= rope_rows) return n;
    const int head0 = r0 - r0 % D;
    return head0 + (r0 - head0) / 2 + (r < kTileRows / 2 ? r : D / 2 + r - kTileRows / 2);
  }
  __device__ float pre(int, int, int, float bias) const { return has_bias ? bias : 0.f; }
  __device__ void keep(int, float) const {}
  __device__ float swap(int m, int n, float s, float other) const {
    const int row = row_of(n);
    if (row >= rope_rows) return s;  // v
    const int d = row % D;
    const float a = to_float(from_float<T>(s)), b = to_float(from_float<T>(other));  // as the projection is stored
    const float c = to_float(cos[m * D + d]), sn = to_float(sin[m * D + d]);
    return d < D / 2 ? fmaf(a, c, -b * sn) : fmaf(a, c, b * sn);  // rotate_half(x) = cat(-x2, x1)
  }
  __device__ void store(int m, int n, float s0, float s1) const {  // n, n + 1: dims d, d + 1 of one head
    const int row = row_of(n);
    if constexpr (KV8) {
      if (row < e) {
        st_tagged(q + (static_cast<int64_t>(m) * e + row) / 2, pack2<T>(s0, s1), epoch);
        return;
      }
      const int c = row - e, kvd = kv_heads * D;  // keys, then values
      const bool is_v = c >= kvd;
      const int cc = is_v ? c - kvd : c;
      const uint32_t pair = e4m3_pair<T>(s0, s1, kv_scale[(is_v ? kv_heads : 0) + cc / D]);
      st_tagged(kv_new + (static_cast<int64_t>(m) * 2 * e + c) / 2, pair, epoch);
      const int slot = q_start[m];
      if (slot < 0 || slot >= capacity) return;
      uint8_t* cache = reinterpret_cast<uint8_t*>(is_v ? v_cache : k_cache);
      *reinterpret_cast<uint16_t*>(cache + ((static_cast<int64_t>(m) * kv_heads + cc / D) * capacity + slot) * D +
                                   cc % D) = static_cast<uint16_t>(pair);
      return;
    }
    const uint32_t pair = pack2<T>(s0, s1);
    if (row < e) {
      st_tagged(q + (static_cast<int64_t>(m) * e + row) / 2, pair, epoch);
      return;
    }
    const int c = row - e;  // keys, then values
    st_tagged(kv_new + (static_cast<int64_t>(m) * 2 * e + c) / 2, pair, epoch);
    const int slot = q_start[m];
    if (slot < 0 || slot >= capacity) return;
    const int kvd = kv_heads * D, cc = c < kvd ? c : c - kvd;
    T* cache = c < kvd ? k_cache : v_cache;
    *reinterpret_cast<uint32_t*>(cache + ((static_cast<int64_t>(m) * kv_heads + cc / D) * capacity + slot) * D +
                                 cc % D) = pair;
  }
};

// The Llama family's gate/up over the PERM tiles of the (2F, E) gate/up weight (tile t: gate rows 8t .. 8t + 7, then
// the same up rows): f = silu(gate) * up rounded as linear + silu_mul do (gate and up rounded to the model dtype,
// silu in fp32 rounded, the product rounded), tagged; tile rows 0-7 hold outputs 8t .. 8t + 7.
template <typename T>
struct SiluMulEpilogue {
  static constexpr bool kPairs = true, kBias = false, kSwap = true;
  uint64_t* out;
  int n_out;  // F
  uint32_t epoch;
  __device__ float pre(int, int, int, float) const { return 0.f; }
  __device__ void keep(int, float) const {}
  __device__ float swap(int, int n, float s, float other) const {
    if (n % kTileRows >= kTileRows / 2) return s;  // an up row: its gate's thread finishes the output
    const float g = to_float(from_float<T>(s)), u = to_float(from_float<T>(other));
    return to_float(from_float<T>(g / (1.f + expf(-g)))) * u;
  }
  __device__ void store(int m, int n, float s0, float s1) const {
    const int r = n % kTileRows;
    if (r >= kTileRows / 2) return;
    st_tagged(out + (static_cast<int64_t>(m) * n_out + n / kTileRows * (kTileRows / 2) + r) / 2, pack2<T>(s0, s1),
              epoch);
  }
};

template <typename T>
struct LogitsEpilogue {  // fp32 logits, rounded to the model dtype first like the LM head's output
  static constexpr bool kPairs = false, kBias = false, kSwap = false;
  float* logits;
  int vocab;
  __device__ float pre(int, int, int, float) const { return 0.f; }
  __device__ void keep(int, float) const {}
  __device__ void store(int m, int n, float s) const {
    logits[static_cast<int64_t>(m) * vocab + n] = to_float(from_float<T>(s));
  }
};

// LLAMA: the Llama family's step (Llama, Mistral, Qwen2; fp16/bf16 weights): RMSNorms, the fused q/k/v (+ bias) with
// the rotary in its epilogue, grouped-query attention, gate/up with SiLU * up in its epilogue, no other biases, no
// position table; the same phases, ring and hand-offs otherwise (see the header).
// KV8: float8 e4m3 caches with per-(layer, kv head) scales (either family, fp16/bf16 weights): the attention streams
// and reads e4m3 keys and values, the q/k/v epilogue quantizes the new ones (see the header).
template <typename T, int D, bool Q8, bool E4M3 = false, bool LLAMA = false, bool KV8 = false>
__global__ void __launch_bounds__(kThreads, 1) decode_step_kernel(const __grid_constant__ StepParams params) {
  static_assert(!(LLAMA && Q8), "the Llama family's step streams fp16/bf16 weights only");
  static_assert(!(KV8 && Q8), "e4m3 caches with fp16/bf16 weights only");
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[32], empty[32];
  // the GEMVs' partial sums, by tile parity; attention's scratch is the buffer that qkv's last tile did not use
  // (its readers passed that tile's consumers_sync) until the sync ending stage_rows, before out_proj
  __shared__ float partial[2][kConsumerWarps][kTileRows][kMaxTokens + 1];
  static_assert(sizeof(partial[0]) >= kConsumerWarps * D * sizeof(float), "attention scratch (q)");
  __shared__ float ln_stat[kMaxTokens][2];  // mean, rstd per row
  __shared__ KeptResidual kept;

  // The parameters (scalars and the used layers' pointers) are read from a shared-memory copy. Read in place they
  // are generic loads of the parameter buffer, cached in L1; when the kernel had grid barriers, each barrier's
  // acquire invalidated L1, so each phase started with a chain of dependent L2 round trips (trace 1499 -> 1464 us
  // with the copy; not re-measured without barriers).
  char* x = smem + params.stages * kStageBytes;
  char* lnp = x + params.m * params.x_stride;  // LayerNorm weight and bias, 2 E elements
  StepParams* copy = reinterpret_cast<StepParams*>(lnp + ln_params_bytes(params.e));
  // LLAMA: cos, then sin, (M, D) each, after the parameters' copy (rope_table_bytes)
  [[maybe_unused]] T* rope_table = reinterpret_cast<T*>(reinterpret_cast<char*>(copy) + params_bytes(params.layers));
  // KV8: every layer's (2, Hkv) cache scales, after the rotary tables (kv_scale_table_bytes)
  [[maybe_unused]] float* kv_scale_table =
      reinterpret_cast<float*>(reinterpret_cast<char*>(rope_table) + (LLAMA ? 2 * params.m * D * sizeof(T) : 0));
  {
    const int bytes = params_bytes(params.layers);
    const uint4* src = reinterpret_cast<const uint4*>(&params);
    for (int i = threadIdx.x; i < bytes / 16; i += kThreads) reinterpret_cast<uint4*>(copy)[i] = src[i];
  }
  // The cache slots too (below, after pdl_wait): the producer reads them per attention item, and a global load
  // behind the weight stream's queue costs microseconds.
  __shared__ int slots[kMaxTokens];
  const StepParams& p = *copy;
  Ring ring{smem, full, empty, params.stages};
  ring.timed = params.trace != nullptr;
  if (threadIdx.x == 0) {  // (the copy is complete only after the __syncthreads below: read params here)
    for (int s = 0; s < params.stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) copy->q_start = slots;
  __syncthreads();

  // Launched with PDL, the step may start while the kernel before it (the previous step's token choice) still
  // runs: until pdl_wait() returns, only weights (which no kernel writes) are read, and nothing is written. The
  // producer streams layer 0's qkv weights, then waits, and takes the slots from the consumers (barrier 2).
  int64_t* trace = p.trace == nullptr ? nullptr : p.trace + blockIdx.x * trace_events(p.layers);
  // LLAMA: q/k/v rows (q, k, v heads), the rotated ones (q, k), and q heads per kv head
  const int qkv_rows = LLAMA ? (p.heads + 2 * params.kv_heads) * D : 3 * p.e;
  const int rope_rows = LLAMA ? (p.heads + params.kv_heads) * D : 0;
  const int group = LLAMA ? p.heads / params.kv_heads : 1;
  if (threadIdx.x >= kConsumers) {  // producer warp: lane r issues row r's copies
    const uint64_t policy = evict_first_policy();
    int slices = 0;
    for (int l = 0; l < p.layers; ++l) {
      const LayerWeights& L = p.layer[l];
      if constexpr (LLAMA) {
        produce<false, true>(ring, L.wqkv, L.bqkv, qkv_rows, p.e, policy, nullptr, rope_rows, D / 2);
      } else {
        produce<Q8>(ring, L.wqkv, L.bqkv, 3 * p.e, p.e, policy, params.wscale[l][0]);
      }
      if (l == 0) {
        pdl_wait();
        asm volatile("bar.sync 2, %0;\n" ::"n"(kThreads) : "memory");  // the consumers have stored the slots
        slices = attention_slices(p);
      }
      produce_attention<D, LLAMA, KV8>(ring, p, L, slices, policy, group);
      produce<Q8>(ring, L.wo, L.bo, p.e, p.e, policy, params.wscale[l][1]);
      if constexpr (LLAMA) {  // gate/up: (2F, E)
        produce<false, true>(ring, L.w1, nullptr, 2 * p.f, p.e, policy, nullptr, 2 * p.f, p.f);
      } else {
        produce<Q8>(ring, L.w1, L.b1, p.f, p.e, policy, params.wscale[l][2]);
      }
      produce<Q8>(ring, L.w2, L.b2, p.e, p.f, policy, params.wscale[l][3]);
      if (trace != nullptr && threadIdx.x == kConsumers) trace[2 + kTracePhases * p.layers + 2 * l] = ring.wait_ns;
    }
    produce(ring, p.lm_head, nullptr, p.vocab, p.e, policy);
    return;
  }

  // Consumers. Tag of layer l's outputs: epoch0 + l + 1 (epoch0 itself: the embeddings), unique to this launch
  // (every block counts its own launches), so a word left by an earlier layer or launch never passes for a new one.
  __shared__ uint32_t epoch0_s;
  pdl_wait();
  if (threadIdx.x < p.m) slots[threadIdx.x] = params.q_start[threadIdx.x];
  if (threadIdx.x == 0) epoch0_s = p.launches[blockIdx.x] * static_cast<uint32_t>(p.layers + 1);
  if constexpr (LLAMA) {  // this step's rotary tables, once: the q/k/v epilogues of every layer read them
    for (int i = threadIdx.x; i < p.m * D; i += kConsumers) {
      rope_table[i] = ld_dep_as(static_cast<const T*>(params.cos) + i);
      rope_table[p.m * D + i] = ld_dep_as(static_cast<const T*>(params.sin) + i);
    }
  }
  // KV8: the caches' scales (the prefill's calibration wrote them), once: every layer's epilogue and attention read
  // them
  const int kv_heads = LLAMA ? params.kv_heads : p.heads;
  if constexpr (KV8) {
    for (int i = threadIdx.x; i < p.layers * 2 * kv_heads; i += kConsumers) {
      kv_scale_table[i] = ld_dep(params.kv_scale[i / (2 * kv_heads)] + i % (2 * kv_heads));
    }
  }
  consumers_sync();
  asm volatile("bar.arrive 2, %0;\n" ::"n"(kThreads) : "memory");  // slots stored: the producer may read them
  const uint32_t epoch0 = epoch0_s;
  const int slices = attention_slices(p);
  auto mark = [&](int event) {  // trace: block-local timestamp at a phase end
    if (trace != nullptr && threadIdx.x == 0) trace[event] = now_ns();
  };
  mark(0);
  int pbuf = 0;
  layer_norm_rows<T, LLAMA>(p, x, lnp, static_cast<const T*>(p.layer[0].ln1_w),
                            static_cast<const T*>(p.layer[0].ln1_b), nullptr, p.h[1], epoch0, ln_stat);
  // One copy of each tagged buffer is enough: a block overwrites one only after it has waited for words that
  // every block writes after its last read of the old contents. Layer l + 1's q and kv_new (read by layer l's
  // attention) are written after LN1 has read all of h[1] (every block's fc2, after its attention); attn, after
  // h[1] too (every block's fc2, after its out_proj); h[0] (read by LN2 and as fc2's residual), after h[1] too;
  // ffn (read by fc2), after LN2 has read all of h[0] (every block's out_proj, after its fc2 of layer l); h[1]
  // (read by LN1 and as out_proj's residual), after the fc2 rows have read all of ffn (every block's fc1, after
  // its out_proj). Each reader's value feeds what it writes next, so no read sees a later write. out_proj reads
  // its residual column by column from h[1], which only the same block rewrites (in fc2: both have E outputs,
  // so tile i belongs to the same block in both). The attention counts grow by `slices` per layer.
  for (int l = 0; l < p.layers; ++l) {
    const LayerWeights& L = p.layer[l];
    const uint32_t epoch = epoch0 + l + 1;
    const int ev = 1 + kTracePhases * l;
    [[maybe_unused]] const float* kv_scale = kv_scale_table + l * 2 * kv_heads;  // KV8: this layer's
    if constexpr (LLAMA && KV8) {
      consume<T>(ring, x, p.x_stride, p.m, qkv_rows, p.e, partial, pbuf,
                 LlamaQkvEpilogue<T, D, true>{p.q, p.kv_new, static_cast<T*>(L.k_cache), static_cast<T*>(L.v_cache),
                                              p.q_start, rope_table, rope_table + p.m * D, p.e, params.kv_heads,
                                              p.capacity, rope_rows, params.qkv_bias, epoch, kv_scale});
    } else if constexpr (LLAMA) {
      consume<T>(ring, x, p.x_stride, p.m, qkv_rows, p.e, partial, pbuf,
                 LlamaQkvEpilogue<T, D>{p.q, p.kv_new, static_cast<T*>(L.k_cache), static_cast<T*>(L.v_cache),
                                        p.q_start, rope_table, rope_table + p.m * D, p.e, params.kv_heads, p.capacity,
                                        rope_rows, params.qkv_bias, epoch});
    } else if constexpr (KV8) {
      consume<T>(ring, x, p.x_stride, p.m, 3 * p.e, p.e, partial, pbuf,
                 QkvEpilogue<T, true>{p.q, p.kv_new, static_cast<T*>(L.k_cache), static_cast<T*>(L.v_cache),
                                      p.q_start, p.e, p.heads, p.capacity, D, epoch, kv_scale});
    } else {
      consume<T, Q8, E4M3>(ring, x, p.x_stride, p.m, 3 * p.e, p.e, partial, pbuf,
                 QkvEpilogue<T>{p.q, p.kv_new, static_cast<T*>(L.k_cache),
                                static_cast<T*>(L.v_cache), p.q_start, p.e, p.heads, p.capacity, D, epoch});
    }
    mark(ev);
    if constexpr (KV8) {
      attention<T, D, LLAMA, true>(ring, p, slices, epoch, l, &partial[pbuf][0][0][0], group, kv_scale);
    } else {
      attention<T, D, LLAMA>(ring, p, slices, epoch, l, &partial[pbuf][0][0][0], group);
    }
    mark(ev + 1);
    stage_rows(p, x, p.attn, p.e, epoch);
    consume<T, Q8, E4M3>(ring, x, p.x_stride, p.m, p.e, p.e, partial, pbuf,
               ResidualEpilogue<T, !LLAMA>{p.h[1], p.h[0], p.e, epoch, &kept, l > 0});
    mark(ev + 2);
    layer_norm_rows<T, LLAMA>(p, x, lnp, static_cast<const T*>(L.ln2_w), static_cast<const T*>(L.ln2_b), p.h[0],
                              nullptr, epoch, ln_stat);
    if constexpr (LLAMA) {
      consume<T>(ring, x, p.x_stride, p.m, 2 * p.f, p.e, partial, pbuf, SiluMulEpilogue<T>{p.ffn, p.f, epoch});
    } else {
      consume<T, Q8, E4M3>(ring, x, p.x_stride, p.m, p.f, p.e, partial, pbuf,
                 ReluEpilogue<T>{p.ffn, p.f, epoch});
    }
    mark(ev + 3);
    stage_rows(p, x, p.ffn, p.f, epoch);
    consume<T, Q8, E4M3>(ring, x, p.x_stride, p.m, p.e, p.f, partial, pbuf,
               ResidualEpilogue<T, !LLAMA>{p.h[0], p.h[1], p.e, epoch, &kept, true});
    mark(ev + 4);
    const bool last = l + 1 == p.layers;
    layer_norm_rows<T, LLAMA>(p, x, lnp, static_cast<const T*>(last ? p.lnf_w : p.layer[l + 1].ln1_w),
                              static_cast<const T*>(last ? p.lnf_b : p.layer[l + 1].ln1_b), p.h[1], nullptr, epoch,
                              ln_stat);
    mark(ev + 5);
    if (trace != nullptr && threadIdx.x == 0) trace[3 + kTracePhases * p.layers + 2 * l] = ring.wait_ns;
  }
  if (threadIdx.x == 0) p.launches[blockIdx.x] += 1;
  // The next kernel (the token choice, launched with PDL) may become resident now: it waits in pdl_wait() for this
  // grid to finish, but its launch is off the critical path.
  pdl_launch_dependents();
  consume<T>(ring, x, p.x_stride, p.m, p.vocab, p.e, partial, pbuf, LogitsEpilogue<T>{p.logits, p.vocab});
  mark(1 + kTracePhases * p.layers);
}

// Byte offsets of the workspace's parts, each 256-aligned; the last entry is the total size.
std::vector<int64_t> workspace_layout(int64_t m, int64_t e, int64_t f, int64_t heads, int64_t head_dim,
                                      int64_t capacity) {
  const int64_t slices_cap = (capacity + kSlice - 1) / kSlice;
  // launches, attn_count, attn_part, then the tagged buffers (4 bytes per element): h[0], h[1], q, kv_new, attn,
  // ffn
  const int64_t sizes[] = {kMaxBlocks * 4, m * heads * 4, m * heads * slices_cap * (head_dim + 2) * 4,
                           m * e * 4,      m * e * 4,     m * e * 4,
                           m * 2 * e * 4,  m * e * 4,     m * f * 4};
  std::vector<int64_t> offsets;
  int64_t at = 0;
  for (int64_t s : sizes) {
    offsets.push_back(at);
    at += (s + 255) / 256 * 256;
  }
  offsets.push_back(at);
  return offsets;
}

int64_t x_stride_bytes(int64_t k) { return (2 * k + 127) / 128 * 128 + 64; }

int max_smem_optin() { return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin; }

// Static shared memory of the kernel (ring mbarriers, partial sums, LayerNorm statistics, kept residuals, and
// 256 bytes for the small rest): everything but the ring, x, the LayerNorm parameters and the parameters' copy.
constexpr int kStaticSmem = 2 * 32 * 8 + 2 * kConsumerWarps * kTileRows * (kMaxTokens + 1) * 4 +
                            kMaxTokens * 2 * 4 + static_cast<int>(sizeof(KeptResidual)) + 256;

// extra: more dynamic shared memory (the Llama step's rotary tables, rope_table_bytes)
int ring_stages(int64_t m, int64_t e, int64_t f, int64_t layers, int64_t extra = 0) {
  const int64_t free_bytes =
      max_smem_optin() - kStaticSmem - m * x_stride_bytes(std::max(e, f)) - ln_params_bytes(static_cast<int>(e)) -
      params_bytes(static_cast<int>(layers)) - extra;
  return static_cast<int>(std::min<int64_t>(32, free_bytes / kStageBytes));
}

// FUSEINFER_DECODE_TRACE=1: every launch writes phase timestamps into one buffer kept here (the last
// launch's are read back with decode_step_trace()); otherwise none are written.
at::Tensor& trace_tensor() {
  static at::Tensor t;
  return t;
}

int64_t* trace_buffer(const at::Device& device, int64_t blocks, int64_t events) {
  if (knob(Knob::kDecodeTrace) == 0) return nullptr;
  at::Tensor& t = trace_tensor();
  if (!t.defined() || t.device() != device || t.size(0) != blocks || t.size(1) != events) {
    t = at::zeros({blocks, events}, at::TensorOptions().dtype(at::kLong).device(device));
  }
  return t.data_ptr<int64_t>();
}

// The Llama step's rotary tables in shared memory: cos and sin, (M, D) each, 16-bit.
int rope_table_bytes(int64_t m, int64_t head_dim) { return static_cast<int>(2 * m * head_dim * 2); }

// KV8: the e4m3 caches' scales in shared memory, `count` fp32 (layers x 2 x kv heads), in whole 16-byte units.
int kv_scale_table_bytes(int64_t count) { return static_cast<int>((count * 4 + 15) / 16 * 16); }

// The workspace's parts (workspace_layout) into p.
void set_workspace(StepParams& p, at::Tensor& workspace, const std::vector<int64_t>& layout) {
  char* ws = static_cast<char*>(workspace.data_ptr());
  p.launches = reinterpret_cast<unsigned*>(ws + layout[0]);
  p.attn_count = reinterpret_cast<int*>(ws + layout[1]);
  p.attn_part = reinterpret_cast<float*>(ws + layout[2]);
  p.h[0] = reinterpret_cast<uint64_t*>(ws + layout[3]);
  p.h[1] = reinterpret_cast<uint64_t*>(ws + layout[4]);
  p.q = reinterpret_cast<uint64_t*>(ws + layout[5]);
  p.kv_new = reinterpret_cast<uint64_t*>(ws + layout[6]);
  p.attn = reinterpret_cast<uint64_t*>(ws + layout[7]);
  p.ffn = reinterpret_cast<uint64_t*>(ws + layout[8]);
}

// The step kernel of one weight/cache format (the flags as decode_step_kernel's), by dtype and head dim (64/128), to
// launch(kernel).
template <bool Q8, bool E4M3, bool LLAMA, bool KV8, typename Launch>
void dispatch_step(at::ScalarType dtype, int64_t head_dim, Launch&& launch) {
  if (dtype == at::kHalf) {
    head_dim == 64 ? launch(decode_step_kernel<__half, 64, Q8, E4M3, LLAMA, KV8>)
                   : launch(decode_step_kernel<__half, 128, Q8, E4M3, LLAMA, KV8>);
  } else {
    head_dim == 64 ? launch(decode_step_kernel<__nv_bfloat16, 64, Q8, E4M3, LLAMA, KV8>)
                   : launch(decode_step_kernel<__nv_bfloat16, 128, Q8, E4M3, LLAMA, KV8>);
  }
}

// One launch of a step kernel over p (its m rows), one block per SM. extra: the dynamic shared memory after the
// parameters' copy (the rotary tables, the KV8 scales: what ring_stages was given).
template <typename Kernel>
void launch_step(Kernel kernel, const StepParams& p, int extra) {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major >= 9, "decode_step: needs an sm_90 GPU (TMA bulk copies), got sm_", props->major,
              props->minor);
  TORCH_CHECK(props->multiProcessorCount <= kMaxBlocks, "decode_step: more than ", kMaxBlocks, " SMs");
  const int smem = p.stages * kStageBytes + p.m * p.x_stride + ln_params_bytes(p.e) + params_bytes(p.layers) + extra;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int resident = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, smem));
  TORCH_CHECK(resident >= 1, "decode_step: the kernel does not fit on an SM");
  // Cooperative: all blocks resident at once (a block waiting for another's tagged words needs it), or the
  // launch fails. Programmatic (PDL) where enabled: the weight stream starts while the kernel before still runs.
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = 1;
  attrs[1] = pdl_attribute();
  launch_kernel_with(attrs, pdl_enabled() ? 2 : 1, kernel, props->multiProcessorCount, kThreads, smem,
                     at::cuda::getCurrentCUDAStream(), p);
}

}  // namespace

c10::optional<at::Tensor> decode_step_trace() {
  return trace_tensor().defined() ? c10::optional<at::Tensor>(trace_tensor()) : c10::nullopt;
}

int64_t decode_step_workspace_bytes(int64_t m, int64_t e, int64_t f, int64_t heads, int64_t head_dim,
                                    int64_t capacity) {
  return workspace_layout(m, e, f, heads, head_dim, capacity).back();
}

// rope_dim: 0 (OPT), or the Llama step's head dim (its rotary tables take shared memory too); kv_scales: 0, or
// (e4m3 caches) the number of their fp32 scales, layers x 2 x kv heads (staged in shared memory as well).
bool decode_step_fits(int64_t m, int64_t e, int64_t f, int64_t rope_dim, int64_t kv_scales) {
  const int64_t extra =
      (rope_dim > 0 ? rope_table_bytes(m, rope_dim) : 0) + (kv_scales > 0 ? kv_scale_table_bytes(kv_scales) : 0);
  return m >= 1 && m <= kMaxTokens && ring_stages(m, e, f, kMaxLayers, extra) >= kMinStages;
}

// KV8: the e4m3 caches' scales (one (2, kv heads) fp32 tensor per layer) into p, checked; empty for caches in the
// model dtype. Returns the bytes they take in shared memory.
int set_kv_scales(StepParams& p, const std::vector<at::Tensor>& kv_scales, bool kv8, int64_t layers, int64_t kv_heads,
                  const at::Device& device, const char* op) {
  if (!kv8) {
    TORCH_CHECK(kv_scales.empty(), op, ": kv_scales are for float8_e4m3fn caches only (pass none for caches in the "
                "model dtype)");
    return 0;
  }
  TORCH_CHECK(static_cast<int64_t>(kv_scales.size()) == layers, op, ": float8_e4m3fn caches need one kv_scales "
              "tensor per layer, got ", kv_scales.size(), " for ", layers, " layers");
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& t = kv_scales[l];
    TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.sizes().equals({2, kv_heads}),
                op, ": kv_scales[", l, "] must be a contiguous [2, ", kv_heads, "] float32 tensor on ", device,
                " (the keys' and the values' scale per kv head), got ", t.scalar_type(), " ", t.sizes(), " on ",
                t.device());
    p.kv_scale[l] = t.data_ptr<float>();
  }
  return kv_scale_table_bytes(layers * 2 * kv_heads);
}

// A step's weight or input tensor: contiguous, 16-byte aligned, `shape`, of the model dtype on the model's device.
static void check_step_tensor(const at::Tensor& t, at::ScalarType dtype, c10::IntArrayRef shape,
                              const at::Device& device, const char* op, const char* what) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == dtype && t.is_contiguous() && t.sizes().equals(shape) &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              op, ": ", what, " must be a contiguous, 16-byte aligned ", shape,
              " tensor of the model dtype on the model's device");
}

// A cache: (B, kv heads, T, D) in the model dtype, or float8_e4m3fn (kv8, every cache).
static void check_step_cache(const at::Tensor& t, bool kv8, at::ScalarType dtype, c10::IntArrayRef shape,
                             const at::Device& device, const char* op, const char* what) {
  if (!kv8) return check_step_tensor(t, dtype, shape, device, op, what);
  TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat8_e4m3fn && t.is_contiguous() &&
                  t.sizes().equals(shape) && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              op, ": ", what, " must be a contiguous, 16-byte aligned ", shape,
              " float8_e4m3fn tensor on the model's device (one cache dtype for all layers)");
}

// The sizes both families' steps set in p (the ring's stages come after the shared memory's extra parts are known).
static void set_step_sizes(StepParams& p, int64_t m, int64_t e, int64_t f, int64_t heads, int64_t vocab,
                           int64_t layers, int64_t capacity, double eps, double scale) {
  p.m = static_cast<int>(m);
  p.e = static_cast<int>(e);
  p.f = static_cast<int>(f);
  p.heads = static_cast<int>(heads);
  p.vocab = static_cast<int>(vocab);
  p.layers = static_cast<int>(layers);
  p.capacity = static_cast<int>(capacity);
  p.slices_cap = static_cast<int>((capacity + kSlice - 1) / kSlice);
  p.x_stride = static_cast<int>(x_stride_bytes(std::max(e, f)));
  p.eps = static_cast<float>(eps);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
}

// The workspace checked against its layout and set in p, the trace buffer, and the logits (m, vocab) fp32 the
// step writes (returned).
static at::Tensor set_step_outputs(StepParams& p, at::Tensor& workspace, const std::vector<int64_t>& layout,
                                   const at::Tensor& embed, int64_t m, int64_t vocab, int64_t layers,
                                   const char* op) {
  TORCH_CHECK(workspace.device() == embed.device() && workspace.is_contiguous() &&
                  workspace.nbytes() >= static_cast<size_t>(layout.back()),
              op, ": workspace too small");
  auto logits = at::empty({m, vocab}, embed.options().dtype(at::kFloat));
  p.trace = trace_buffer(embed.device(), at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                         trace_events(static_cast<int>(layers)));
  p.logits = logits.data_ptr<float>();
  set_workspace(p, workspace, layout);
  return logits;
}

at::Tensor decode_step_cuda(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& q_start,
                            const at::Tensor& key_mask, const at::Tensor& embed, const at::Tensor& pos_embed,
                            const std::vector<at::Tensor>& layer_params, std::vector<at::Tensor> k_caches,
                            std::vector<at::Tensor> v_caches, const at::Tensor& lnf_w, const at::Tensor& lnf_b,
                            const at::Tensor& lm_head, at::Tensor& workspace, double eps, double scale,
                            const std::vector<at::Tensor>& weight_scales, const std::vector<at::Tensor>& kv_scales) {
  const c10::cuda::CUDAGuard guard(embed.device());
  // 8-bit weights: int8 weight-only or FP8 (e4m3) models, the format of the first qkv weight; 4 fp32 scale vectors
  // per layer
  const bool q8 = !weight_scales.empty();
  const bool e4m3 = q8 && layer_params.size() > 2 && layer_params[2].scalar_type() == at::kFloat8_e4m3fn;
  const auto w8_type = e4m3 ? at::kFloat8_e4m3fn : at::kChar;
  const auto dtype = embed.scalar_type();
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers >= 1 && layers <= kMaxLayers && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(layer_params.size()) == 12 * layers,
              "decode_step: expected 1..", kMaxLayers, " layers with 12 parameters and a k and v cache each");
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "decode_step: fp16 or bf16 only");
  // e4m3 caches (KV8) with their scales, or caches in the model dtype
  const bool kv8 = k_caches[0].scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(!(kv8 && q8), "decode_step: float8_e4m3fn caches take fp16/bf16 weights (8-bit weights need caches in "
              "the model dtype)");
  const int64_t m = tokens.numel(), e = embed.size(1), vocab = lm_head.size(0);
  const int64_t f = layer_params[8].size(0);  // fc1 weight (F, E)
  const int64_t heads = k_caches[0].size(1), capacity = k_caches[0].size(2), head_dim = k_caches[0].size(3);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "decode_step: head dim 64 or 128 only");
  TORCH_CHECK(heads * head_dim == e && e % 32 == 0 && f % 32 == 0, "decode_step: unsupported hidden sizes");
  TORCH_CHECK(!q8 || (static_cast<int64_t>(weight_scales.size()) == 4 * layers && e % 64 == 0 && f % 64 == 0),
              "decode_step: int8 weights need 4 scale vectors per layer and hidden / ffn sizes multiple of 64");
  TORCH_CHECK(decode_step_fits(m, e, f, 0, kv8 ? layers * 2 * heads : 0), "decode_step: ", m, " rows of hidden ", e,
              " / ffn ", f, " do not fit in shared memory");
  TORCH_CHECK(positions.numel() == m && q_start.numel() == m && q_start.scalar_type() == at::kInt &&
                  tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  key_mask.scalar_type() == at::kBool && key_mask.size(0) >= m && key_mask.size(1) == capacity,
              "decode_step: bad tokens / positions / q_start / key_mask");
  auto check = [&](const at::Tensor& t, std::initializer_list<int64_t> shape, const char* what) {
    check_step_tensor(t, dtype, shape, embed.device(), "decode_step", what);
  };
  for (const at::Tensor* t : {&tokens, &positions, &q_start, &key_mask}) {
    TORCH_CHECK(t->device() == embed.device() && t->is_contiguous(), "decode_step: inputs must be contiguous, on ",
                embed.device());
  }
  check(embed, {vocab, e}, "embed_tokens");
  TORCH_CHECK(pos_embed.size(1) == e, "decode_step: position embedding width");
  check(pos_embed, {pos_embed.size(0), e}, "embed_positions");
  check(lnf_w, {e}, "final LayerNorm weight");
  check(lnf_b, {e}, "final LayerNorm bias");
  check(lm_head, {vocab, e}, "lm_head");
  // a layer weight: the model dtype, or int8 with its (N,) fp32 scales (q8)
  auto check_weight = [&](const at::Tensor& w, int64_t rows, int64_t cols, int64_t layer, int which, const char* what) {
    if (!q8) return check(w, {rows, cols}, what);
    const at::Tensor& sc = weight_scales[4 * layer + which];
    TORCH_CHECK(w.device() == embed.device() && w.scalar_type() == w8_type && w.is_contiguous() &&
                    w.sizes().equals({rows, cols}) && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
                "decode_step: ", what, " must be a contiguous, 16-byte aligned [", rows, ", ", cols, "] ",
                e4m3 ? "float8_e4m3fn" : "int8", " tensor on the model's device (one 8-bit format for all layers)");
    TORCH_CHECK(sc.device() == embed.device() && sc.scalar_type() == at::kFloat && sc.is_contiguous() &&
                    sc.sizes().equals({rows}) && reinterpret_cast<uintptr_t>(sc.data_ptr()) % 16 == 0,
                "decode_step: the scales of ", what, " must be a contiguous, 16-byte aligned [", rows,
                "] float32 tensor on the model's device");
  };
  const std::vector<int64_t> cache_shape{k_caches[0].size(0), heads, capacity, head_dim};
  auto check_cache = [&](const at::Tensor& t, const char* what) {
    check_step_cache(t, kv8, dtype, cache_shape, embed.device(), "decode_step", what);
  };

  StepParams p{};
  set_step_sizes(p, m, e, f, heads, vocab, layers, capacity, eps, scale);
  const int extra = set_kv_scales(p, kv_scales, kv8, layers, heads, embed.device(), "decode_step");
  p.stages = ring_stages(m, e, f, layers, extra);
  p.tokens = tokens.data_ptr<int64_t>();
  p.positions = positions.data_ptr<int64_t>();
  p.q_start = q_start.data_ptr<int>();
  p.key_mask = key_mask.data_ptr<bool>();
  p.embed = embed.data_ptr();
  p.pos_embed = pos_embed.data_ptr();
  p.lnf_w = lnf_w.data_ptr();
  p.lnf_b = lnf_b.data_ptr();
  p.lm_head = lm_head.data_ptr();
  const auto logits = set_step_outputs(p, workspace, workspace_layout(m, e, f, heads, head_dim, capacity), embed, m,
                                       vocab, layers, "decode_step");
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &layer_params[12 * l];
    check(w[0], {e}, "self_attn_layer_norm.weight");
    check(w[1], {e}, "self_attn_layer_norm.bias");
    check_weight(w[2], 3 * e, e, l, 0, "qkv weight");
    check(w[3], {3 * e}, "qkv bias");
    check_weight(w[4], e, e, l, 1, "out_proj.weight");
    check(w[5], {e}, "out_proj.bias");
    check(w[6], {e}, "final_layer_norm.weight");
    check(w[7], {e}, "final_layer_norm.bias");
    check_weight(w[8], f, e, l, 2, "fc1.weight");
    check(w[9], {f}, "fc1.bias");
    check_weight(w[10], e, f, l, 3, "fc2.weight");
    check(w[11], {e}, "fc2.bias");
    check_cache(k_caches[l], "k cache");
    check_cache(v_caches[l], "v cache");
    TORCH_CHECK(k_caches[l].size(0) >= m, "decode_step: cache batch smaller than the step's rows");
    p.layer[l] = LayerWeights{w[0].data_ptr(), w[1].data_ptr(), w[2].data_ptr(),  w[3].data_ptr(),
                              w[4].data_ptr(), w[5].data_ptr(), w[6].data_ptr(),  w[7].data_ptr(),
                              w[8].data_ptr(), w[9].data_ptr(), w[10].data_ptr(), w[11].data_ptr(),
                              k_caches[l].data_ptr(), v_caches[l].data_ptr()};
    for (int i = 0; i < 4; ++i) {
      p.wscale[l][i] = q8 ? weight_scales[4 * l + i].data_ptr<float>() : nullptr;
    }
  }

  auto launch = [&](auto kernel) { launch_step(kernel, p, extra); };
  if (kv8) {
    dispatch_step<false, false, false, true>(dtype, head_dim, launch);
  } else if (e4m3) {
    dispatch_step<true, true, false, false>(dtype, head_dim, launch);
  } else if (q8) {
    dispatch_step<true, false, false, false>(dtype, head_dim, launch);
  } else {
    dispatch_step<false, false, false, false>(dtype, head_dim, launch);
  }
  return logits;
}


// The Llama family's step (see llama_decode_step below the schema).
at::Tensor llama_decode_step_cuda(const at::Tensor& tokens, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& q_start, const at::Tensor& key_mask, const at::Tensor& embed,
                                  const std::vector<at::Tensor>& layer_params,
                                  const std::vector<at::Tensor>& qkv_biases, std::vector<at::Tensor> k_caches,
                                  std::vector<at::Tensor> v_caches, const at::Tensor& norm_w, const at::Tensor& lm_head,
                                  at::Tensor& workspace, double eps, double scale,
                                  const std::vector<at::Tensor>& kv_scales) {
  const c10::cuda::CUDAGuard guard(embed.device());
  const auto dtype = embed.scalar_type();
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers >= 1 && layers <= kMaxLayers && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(layer_params.size()) == 6 * layers &&
                  (qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == layers),
              "llama_decode_step: expected 1..", kMaxLayers, " layers with 6 parameters, a k and v cache each and "
              "no q/k/v bias or one per layer");
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "llama_decode_step: fp16 or bf16 only");
  TORCH_CHECK(embed.dim() == 2 && lm_head.dim() == 2 && layer_params[4].dim() == 2 && k_caches[0].dim() == 4 &&
                  key_mask.dim() == 2,
              "llama_decode_step: expected embed, lm_head and the gate/up weight 2-D, caches (B, Hkv, T, D) and "
              "key_mask (B, T)");
  const int64_t m = tokens.numel(), e = embed.size(1), vocab = lm_head.size(0);
  const int64_t f = layer_params[4].size(0) / 2;  // gate/up weight (2F, E)
  const int64_t kv_heads = k_caches[0].size(1), capacity = k_caches[0].size(2), head_dim = k_caches[0].size(3);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "llama_decode_step: head dim 64 or 128 only");
  const int64_t heads = e / head_dim;
  const bool kv8 = k_caches[0].scalar_type() == at::kFloat8_e4m3fn;  // e4m3 caches with their scales
  TORCH_CHECK(e % head_dim == 0 && kv_heads >= 1 && heads % kv_heads == 0 && e % 32 == 0 && f % 32 == 0,
              "llama_decode_step: unsupported sizes (hidden = heads x head dim, heads a multiple of the kv heads, "
              "hidden and ffn multiples of 32)");
  TORCH_CHECK(decode_step_fits(m, e, f, head_dim, kv8 ? layers * 2 * kv_heads : 0), "llama_decode_step: ", m,
              " rows of hidden ", e, " / ffn ", f, " do not fit in shared memory");
  TORCH_CHECK(q_start.numel() == m && q_start.scalar_type() == at::kInt && tokens.scalar_type() == at::kLong &&
                  key_mask.scalar_type() == at::kBool && key_mask.size(0) >= m && key_mask.size(1) == capacity,
              "llama_decode_step: bad tokens / q_start / key_mask");
  auto check = [&](const at::Tensor& t, std::initializer_list<int64_t> shape, const char* what) {
    check_step_tensor(t, dtype, shape, embed.device(), "llama_decode_step", what);
  };
  for (const at::Tensor* t : {&tokens, &q_start, &key_mask}) {
    TORCH_CHECK(t->device() == embed.device() && t->is_contiguous(), "llama_decode_step: inputs must be contiguous, "
                "on ", embed.device());
  }
  check(embed, {embed.size(0), e}, "embed_tokens");
  check(cos, {m, head_dim}, "cos");
  check(sin, {m, head_dim}, "sin");
  check(norm_w, {e}, "final norm weight");
  check(lm_head, {vocab, e}, "lm_head");
  const std::vector<int64_t> cache_shape{k_caches[0].size(0), kv_heads, capacity, head_dim};
  auto check_cache = [&](const at::Tensor& t, const char* what) {
    check_step_cache(t, kv8, dtype, cache_shape, embed.device(), "llama_decode_step", what);
  };

  StepParams p{};
  set_step_sizes(p, m, e, f, heads, vocab, layers, capacity, eps, scale);
  const int extra = rope_table_bytes(m, head_dim) +
                    set_kv_scales(p, kv_scales, kv8, layers, kv_heads, embed.device(), "llama_decode_step");
  p.stages = ring_stages(m, e, f, layers, extra);
  TORCH_CHECK(p.stages >= kMinStages, "llama_decode_step: ", m, " rows of hidden ", e, " / ffn ", f, " and ", layers,
              " layers do not fit in shared memory");
  p.tokens = tokens.data_ptr<int64_t>();
  p.q_start = q_start.data_ptr<int>();
  p.key_mask = key_mask.data_ptr<bool>();
  p.embed = embed.data_ptr();
  p.lnf_w = norm_w.data_ptr();
  p.lm_head = lm_head.data_ptr();
  p.kv_heads = static_cast<int>(kv_heads);
  p.qkv_bias = !qkv_biases.empty();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  const auto logits = set_step_outputs(p, workspace, workspace_layout(m, e, f, heads, head_dim, capacity), embed, m,
                                       vocab, layers, "llama_decode_step");
  const int64_t qkv_rows = (heads + 2 * kv_heads) * head_dim;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &layer_params[6 * l];
    check(w[0], {e}, "input_layernorm.weight");
    check(w[1], {qkv_rows, e}, "qkv weight");
    check(w[2], {e, e}, "o_proj.weight");
    check(w[3], {e}, "post_attention_layernorm.weight");
    check(w[4], {2 * f, e}, "gate/up weight");
    check(w[5], {e, f}, "down_proj.weight");
    if (p.qkv_bias) check(qkv_biases[l], {qkv_rows}, "qkv bias");
    check_cache(k_caches[l], "k cache");
    check_cache(v_caches[l], "v cache");
    TORCH_CHECK(k_caches[l].size(0) >= m, "llama_decode_step: cache batch smaller than the step's rows");
    // (the OPT slots the family has no tensor for: null)
    p.layer[l] = LayerWeights{w[0].data_ptr(), nullptr, w[1].data_ptr(),
                              p.qkv_bias ? qkv_biases[l].data_ptr() : nullptr,
                              w[2].data_ptr(), nullptr, w[3].data_ptr(), nullptr, w[4].data_ptr(), nullptr,
                              w[5].data_ptr(), nullptr, k_caches[l].data_ptr(), v_caches[l].data_ptr()};
  }
  auto launch = [&](auto kernel) { launch_step(kernel, p, extra); };
  kv8 ? dispatch_step<false, false, true, true>(dtype, head_dim, launch)
      : dispatch_step<false, false, true, false>(dtype, head_dim, launch);
  return logits;
}

// decode_step: one decode step of a pre-LN OPT: tokens, positions (B,) int64, q_start (B,) int32 (the cache slot each
// row writes and attends up to), key_mask (B, T) bool; layer_params: 12 per layer (LN1 w, b, qkv w (3E, E), b,
// out_proj w, b, LN2 w, b, fc1 w, b, fc2 w, b); k_caches, v_caches: (B, H, T, D) per layer, written at q_start.
// workspace: decode_step_workspace_bytes() bytes, zeroed once, kept between calls. Returns fp32 logits (B, V),
// rounded to the model dtype first like the LM head's output. weight_scales: empty, or (8-bit weights) 4 fp32 (N,)
// per layer for the int8 or float8_e4m3fn qkv, out_proj, fc1 and fc2 weights of layer_params. kv_scales: empty, or
// (float8_e4m3fn caches, fp16/bf16 weights only) one (2, H) fp32 per layer, the keys' and the values' scale per head
// (ops/kv_cache.py): the new keys and values are stored as kv_cache_append_fp8 stores them and attended to as stored.
// decode_step_fits(m, e, f, rope_dim, kv_scales): whether m rows of hidden e / ffn f fit the kernel's shared memory on
// the current device (rope_dim: the Llama step's head dim, whose rotary tables it stages too, 0 for OPT; kv_scales:
// e4m3 caches' scales, layers x 2 x kv heads, staged too, 0 for caches in the model dtype).
// decode_step_trace(): with FUSEINFER_DECODE_TRACE=1, the (blocks, 2 + 8 * layers) trace of the last launch:
// globaltimer stamps (ns) of the start, per layer the ends of qkv, attention, out_proj, LN2 + fc1, fc2, next LN, then
// the LM head's end; then per layer the cumulative ns the producer waited for a free ring stage and consumer thread 0
// for a full one. None otherwise.
// llama_decode_step: one decode step of a Llama / Mistral / Qwen2 model (fp16/bf16 weights): tokens (B,) int64, cos,
// sin (B, D) the rotary tables of this step's positions (model dtype), q_start, key_mask as decode_step's;
// layer_params: 6 per layer (input RMSNorm w, q/k/v w ((H + 2 Hkv) D, E), o_proj w, post-attention RMSNorm w, gate/up
// w (2F, E: gate rows, then up rows), down w); qkv_biases: empty or one ((H + 2 Hkv) D,) per layer; k_caches,
// v_caches: (B, Hkv, T, D) per layer; norm_w: the final RMSNorm's weight; lm_head (V, E) (the embedding when tied).
// The workspace, the trace, the logits and kv_scales ((2, Hkv) per layer) as decode_step's (the same workspace size
// for hidden E, ffn F, H heads).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("decode_step(Tensor tokens, Tensor positions, Tensor q_start, Tensor key_mask, Tensor embed, "
        "Tensor pos_embed, Tensor[] layer_params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor lnf_w, "
        "Tensor lnf_b, Tensor lm_head, Tensor(c!) workspace, float eps, float scale, Tensor[] weight_scales, "
        "Tensor[] kv_scales) -> Tensor");
  m.def("llama_decode_step(Tensor tokens, Tensor cos, Tensor sin, Tensor q_start, Tensor key_mask, Tensor embed, "
        "Tensor[] layer_params, Tensor[] qkv_biases, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor norm_w, "
        "Tensor lm_head, Tensor(c!) workspace, float eps, float scale, Tensor[] kv_scales) -> Tensor");
  m.def("decode_step_workspace_bytes(int m, int e, int f, int heads, int head_dim, int capacity) -> int",
        &decode_step_workspace_bytes);
  m.def("decode_step_fits(int m, int e, int f, int rope_dim=0, int kv_scales=0) -> bool", &decode_step_fits);
  m.def("decode_step_trace() -> Tensor?", &decode_step_trace);
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("decode_step", &decode_step_cuda);
  m.impl("llama_decode_step", &llama_decode_step_cuda);
}

}  // namespace fuseinfer
