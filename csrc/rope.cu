// Rotary position embedding fused with the q/k/v split: the ops fuseinfer_C::qkv_rope and
// fuseinfer_C::qkv_rope_append (contracts at the registration, end of file).
//
// One kernel serves both. qkv (B, S, (H + 2 Hkv) D) is the fused projection GEMM's output; each thread owns one
// (token, head, pair of chunks): V elements at columns [jV, jV + V) of the head's first half and the V at
// [D/2 + jV, D/2 + jV + V) of its second half, the elements rotate_half pairs, so the rotation needs no exchange
// between threads. It loads both chunks once (vectors of up to 16 bytes), rotates q and k heads in fp32 with
// cos / sin (B, S, D) as transformers' apply_rotary_pos_emb does (x * cos + rotate_half(x) * sin), rounds once and
// stores q (B, H, S, D) and k, v (B, Hkv, S, D) head-major, or, in the append form, k and v straight into the
// caches (B, Hkv, T, D) at slots[s] (a slot outside [0, T) is skipped, as kv_cache_append does: no host sync).
// V is the widest of 16 / sizeof(T), 8 / sizeof(T), ... elements that divides D / 2 (and keeps every pointer
// aligned), so any even head dim runs, the common ones (64, 128, 80, 96, ...) with 16-byte vectors in 16-bit types.
// qkv, cos, sin and slots come from earlier kernels: read after pdl_wait() with coherent loads (ld_dep_as).
// Launched with PDL (launch.h).

#include "device_utils.cuh"
#include "launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <tuple>

namespace fuseinfer {
namespace {

constexpr int kRopeThreads = 256;

struct RopeParams {
  const void* qkv;   // (B, S, (H + 2 Hkv) D) contiguous
  const void* cos;   // (B, S, D) contiguous
  const void* sin;   // (B, S, D) contiguous
  void* q;           // (B, H, S, D) contiguous
  void* k;           // (B, Hkv, S, D) contiguous, or the k cache (B, Hkv, T, D)
  void* v;           // likewise
  const int64_t* slots;  // (S,) or nullptr: k, v are (B, Hkv, S, D) outputs
  int64_t slots_stride;
  int64_t S, T;      // T: the caches' slots (append form)
  int H, Hkv, D;
  int pairs;         // D / 2 / V chunk pairs per head
  int64_t total;     // B * S * (H + 2 Hkv) * pairs
};

// V elements of type T moved as one load / store (V * sizeof(T) = 2, 4, 8 or 16 bytes).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T x[V];
};

// grid-stride over flat index ((token * (H + 2 Hkv) + head) * pairs + j), token = b * S + s; block kRopeThreads.
template <typename T, int V>
__global__ void __launch_bounds__(kRopeThreads) qkv_rope_kernel(const RopeParams p) {
  using P = Pack<T, V>;
  pdl_launch_dependents();
  pdl_wait();  // qkv, cos, sin and slots come from earlier kernels
  const int heads = p.H + 2 * p.Hkv, half = p.D / 2;
  const int64_t stride = int64_t(gridDim.x) * kRopeThreads;
  for (int64_t idx = int64_t(blockIdx.x) * kRopeThreads + threadIdx.x; idx < p.total; idx += stride) {
    const int j = static_cast<int>(idx % p.pairs);
    const int64_t th = idx / p.pairs;  // token * heads + head
    const int head = static_cast<int>(th % heads);
    const int64_t token = th / heads;
    const int64_t s = token % p.S, b = token / p.S;
    const int c0 = j * V;  // first column of the pair's first chunk; the second starts at half + c0

    const T* src = static_cast<const T*>(p.qkv) + th * p.D + c0;
    const P x1 = ld_dep_as(reinterpret_cast<const P*>(src));
    const P x2 = ld_dep_as(reinterpret_cast<const P*>(src + half));
    P y1, y2;
    if (head < p.H + p.Hkv) {  // q or k: rotate in fp32, round once
      const T* cg = static_cast<const T*>(p.cos) + token * p.D + c0;
      const T* sg = static_cast<const T*>(p.sin) + token * p.D + c0;
      const P c1 = ld_dep_as(reinterpret_cast<const P*>(cg)), c2 = ld_dep_as(reinterpret_cast<const P*>(cg + half));
      const P s1 = ld_dep_as(reinterpret_cast<const P*>(sg)), s2 = ld_dep_as(reinterpret_cast<const P*>(sg + half));
#pragma unroll
      for (int e = 0; e < V; ++e) {
        rope_pair(to_float(x1.x[e]), to_float(x2.x[e]), to_float(c1.x[e]), to_float(s1.x[e]), to_float(c2.x[e]),
                  to_float(s2.x[e]), y1.x[e], y2.x[e]);
      }
    } else {  // v: copied
      y1 = x1;
      y2 = x2;
    }

    T* dst;
    if (head < p.H) {
      dst = static_cast<T*>(p.q) + ((b * p.H + head) * p.S + s) * p.D;
    } else {
      const bool is_k = head < p.H + p.Hkv;
      const int hk = head - p.H - (is_k ? 0 : p.Hkv);
      T* base = static_cast<T*>(is_k ? p.k : p.v);
      if (p.slots != nullptr) {
        const int64_t slot = ld_dep_as(p.slots + s * p.slots_stride);
        if (slot < 0 || slot >= p.T) continue;  // skipped, as kv_cache_append does
        dst = base + ((b * p.Hkv + hk) * p.T + slot) * p.D;
      } else {
        dst = base + ((b * p.Hkv + hk) * p.S + s) * p.D;
      }
    }
    *reinterpret_cast<P*>(dst + c0) = y1;
    *reinterpret_cast<P*>(dst + half + c0) = y2;
  }
}

template <typename T, int V>
void launch_v(const RopeParams& p, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((p.total + kRopeThreads - 1) / kRopeThreads, int64_t(1) << 20);
  launch_kernel(qkv_rope_kernel<T, V>, dim3(static_cast<unsigned>(blocks)), kRopeThreads, 0, stream, p);
}

// The widest V (elements per chunk) that divides D / 2 and keeps every base pointer aligned to V * sizeof(T).
template <typename T>
void launch(RopeParams& p, uintptr_t ptr_bits, cudaStream_t stream) {
  constexpr int kMax = 16 / sizeof(T);
  int v = kMax;
  while (v > 1 && ((p.D / 2) % v != 0 || ptr_bits % (v * sizeof(T)) != 0)) v /= 2;
  p.pairs = p.D / 2 / v;
  p.total = p.total * p.pairs;
  switch (v) {
    case 8: if constexpr (kMax >= 8) { launch_v<T, 8>(p, stream); return; } break;
    case 4: launch_v<T, 4>(p, stream); return;
    case 2: launch_v<T, 2>(p, stream); return;
    default: launch_v<T, 1>(p, stream); return;
  }
}

// Checks shared by both ops; fills p (all but the outputs and the cache fields).
void check_and_fill(RopeParams& p, const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t kv_heads, const char* op) {
  TORCH_CHECK(qkv.is_cuda() && cos.is_cuda() && sin.is_cuda(), op, ": qkv, cos, sin must be CUDA tensors");
  TORCH_CHECK(cos.device() == qkv.device() && sin.device() == qkv.device(), op,
              ": qkv, cos, sin must be on one device");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, op, ": heads (", heads,
              ") must be a positive multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(qkv.dim() == 3, op, ": qkv must be (B, S, (H + 2 Hkv) D), got ", qkv.sizes());
  const int64_t B = qkv.size(0), S = qkv.size(1), W = qkv.size(2), D = W / (heads + 2 * kv_heads);
  TORCH_CHECK(D * (heads + 2 * kv_heads) == W && D > 0 && D % 2 == 0, op, ": qkv's last dim ", W,
              " is not (H + 2 Hkv) D for an even head dim D > 0 (H = ", heads, ", Hkv = ", kv_heads, ")");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op,
              ": dtype must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, op, ": cos and sin must be in qkv's dtype");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == B && cos.size(1) == S && cos.size(2) == D && sin.sizes() == cos.sizes(),
              op, ": cos and sin must be (B, S, D) = (", B, ", ", S, ", ", D, "), got ", cos.sizes(), " and ",
              sin.sizes());
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), op,
              ": qkv, cos and sin must be contiguous");
  TORCH_CHECK(B * S * (heads + 2 * kv_heads) <= INT64_MAX / D, op, ": sizes too large");
  p.qkv = qkv.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.S = S;
  p.H = static_cast<int>(heads);
  p.Hkv = static_cast<int>(kv_heads);
  p.D = static_cast<int>(D);
  p.total = B * S * (heads + 2 * kv_heads);  // times the chunk pairs per head, in launch()
}

void run(RopeParams& p, at::ScalarType dtype) {
  uintptr_t bits = 0;
  for (const void* ptr : {p.qkv, p.cos, p.sin, static_cast<const void*>(p.q), static_cast<const void*>(p.k),
                          static_cast<const void*>(p.v)})
    bits |= reinterpret_cast<uintptr_t>(ptr);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dtype == at::kHalf)
    launch<__half>(p, bits, stream);
  else if (dtype == at::kBFloat16)
    launch<__nv_bfloat16>(p, bits, stream);
  else
    launch<float>(p, bits, stream);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope_cuda(const at::Tensor& qkv, const at::Tensor& cos,
                                                             const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  RopeParams p{};
  check_and_fill(p, qkv, cos, sin, heads, kv_heads, "qkv_rope_cuda");
  const at::cuda::CUDAGuard guard(qkv.device());
  const int64_t B = qkv.size(0), S = qkv.size(1);
  at::Tensor q = at::empty({B, heads, S, p.D}, qkv.options());
  at::Tensor k = at::empty({B, kv_heads, S, p.D}, qkv.options());
  at::Tensor v = at::empty({B, kv_heads, S, p.D}, qkv.options());
  if (q.numel() == 0) return {q, k, v};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  run(p, qkv.scalar_type());
  return {q, k, v};
}

at::Tensor qkv_rope_append_cuda(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  RopeParams p{};
  check_and_fill(p, qkv, cos, sin, heads, kv_heads, "qkv_rope_append_cuda");
  const int64_t B = qkv.size(0), S = qkv.size(1);
  TORCH_CHECK(k_cache.is_cuda() && v_cache.is_cuda() && slots.is_cuda() && k_cache.device() == qkv.device() &&
                  v_cache.device() == qkv.device() && slots.device() == qkv.device(),
              "qkv_rope_append_cuda: caches and slots must be CUDA tensors on qkv's device");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B &&
                  k_cache.size(1) == kv_heads && k_cache.size(3) == p.D,
              "qkv_rope_append_cuda: caches must be (B, Hkv, T, D) = (", B, ", ", kv_heads, ", T, ", p.D, "), got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "qkv_rope_append_cuda: caches must be in qkv's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "qkv_rope_append_cuda: caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == S,
              "qkv_rope_append_cuda: slots must be an (S,) = (", S, ",) int64 tensor, got ", slots.scalar_type(), " ",
              slots.sizes());
  const at::cuda::CUDAGuard guard(qkv.device());
  at::Tensor q = at::empty({B, heads, S, p.D}, qkv.options());
  if (q.numel() == 0) return q;
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.slots = slots.data_ptr<int64_t>();
  p.slots_stride = slots.stride(0);
  p.T = k_cache.size(2);
  run(p, qkv.scalar_type());
  return q;
}

// qkv_rope(qkv, cos, sin, heads, kv_heads) -> (q, k, v): qkv (B, S, (H + 2 Hkv) D), cos / sin (B, S, D), all
// contiguous, one dtype (fp16/bf16/fp32), D even, H a multiple of Hkv. q (B, H, S, D), k and v (B, Hkv, S, D)
// contiguous; q and k rotated (x cos + rotate_half(x) sin, fp32 inside, rounded once), v copied.
// qkv_rope_append(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slots) -> q: the same, with k and v written into
// k_cache / v_cache (B, Hkv, T, D) contiguous at slots (S,) int64 instead of returned; slots outside [0, T) skipped.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("qkv_rope(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("qkv_rope_append(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("qkv_rope", &qkv_rope_cuda);
  m.impl("qkv_rope_append", &qkv_rope_append_cuda);
}

}  // namespace fuseinfer
