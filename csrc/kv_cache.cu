// KV-cache append: the op fuseinfer_C::kv_cache_append.
//
// k_cache[:, :, slots[s]] = k[:, :, s] and v_cache[:, :, slots[s]] = v[:, :, s] in ONE launch (the decode step
// writes k and v of every layer, so two index_copy_ launches per layer become one). The grid runs over the
// rows of k and v together: a flat index covers (tensor, b, h, s, chunk of the head dim); each thread moves
// one 16-byte vector, or one element on the scalar path (head dim, strides or base pointers not 16-byte
// aligned). k, v are strided views (e.g. of a fused (B, S, 3, H, D) QKV output); caches are contiguous.
// A slot outside [0, T) is skipped on the device: nothing is written for it and the host never syncs.
// The FP8 form, fuseinfer_C::kv_cache_append_fp8, writes fp16/bf16 k, v into float8_e4m3fn caches: each value
// divided by its key/value head's scale (kv_scale (2, Hkv) fp32: keys' row, values' row; read after the wait, as a
// prefill's calibration writes it) and rounded to e4m3, saturating at +-448 (as ops/kv_cache.py's quantize_kv); a
// thread reads 8 elements (16 bytes) and writes 8 bytes where D and the pointers allow, else one element.
// Launched with PDL (launch.h).

#include "fp8_convert.cuh"
#include "launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>

namespace fuseinfer {
namespace {

constexpr int kThreads = 256;

struct AppendParams {
  const char* src[2];  // k, v: (B, H, S, D), last dim contiguous
  char* dst[2];        // k_cache, v_cache: (B, H, T, D) contiguous
  const int64_t* slots;  // (S,)
  int64_t s_sb[2], s_sh[2], s_ss[2];  // source strides in elements (b, h, s)
  int64_t slots_stride;
  int64_t H, S, T;
  int64_t chunks;  // vectors (or elements) per row of D
  int64_t rows;    // B * H * S rows per tensor
};

// grid ceil(2 * rows * chunks / kThreads), block kThreads; one thread per (tensor, b, h, s, chunk), flat index
// (tensor * B*H*S + (b*H + h)*S + s) * chunks + chunk. Elem: the element's bits (uint16_t / uint32_t); E: the
// unit one thread moves (uint4 = 16 bytes, or Elem), VPE = elements per unit.
template <typename E, int VPE, typename Elem>
__global__ void __launch_bounds__(kThreads) kv_append_kernel(const AppendParams p) {
  pdl_launch_dependents();
  pdl_wait();  // k, v and slots come from earlier kernels
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= 2 * p.rows * p.chunks) return;
  const int64_t chunk = idx % p.chunks;
  const int64_t r = idx / p.chunks;  // (tensor, bh, s) row
  const int t = r >= p.rows;
  const int64_t rr = r - t * p.rows;
  const int64_t s = rr % p.S, bh = rr / p.S, h = bh % p.H, b = bh / p.H;
  const int64_t slot = p.slots[s * p.slots_stride];
  if (slot < 0 || slot >= p.T) return;
  const Elem* src = reinterpret_cast<const Elem*>(p.src[t]) + b * p.s_sb[t] + h * p.s_sh[t] + s * p.s_ss[t];
  Elem* dst = reinterpret_cast<Elem*>(p.dst[t]) + (bh * p.T + slot) * (p.chunks * VPE);
  reinterpret_cast<E*>(dst)[chunk] = reinterpret_cast<const E*>(src)[chunk];
}

// V elements of type E moved as one load / store.
template <typename E, int V>
struct alignas(sizeof(E) * V) Pack {
  E x[V];
};

// The FP8 form: grid ceil(2 * rows * chunks / kThreads), block kThreads, flat index as kv_append_kernel's; a thread
// converts VPE source elements (Src: __half / __nv_bfloat16) into VPE e4m3 bytes. p.chunks = D / VPE.
template <typename Src, int VPE>
__global__ void __launch_bounds__(kThreads) kv_append_fp8_kernel(const AppendParams p, const float* kv_scale) {
  pdl_launch_dependents();
  pdl_wait();  // k, v, slots and the scales come from earlier kernels
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= 2 * p.rows * p.chunks) return;
  const int64_t chunk = idx % p.chunks;
  const int64_t r = idx / p.chunks;  // (tensor, bh, s) row
  const int t = r >= p.rows;
  const int64_t rr = r - t * p.rows;
  const int64_t s = rr % p.S, bh = rr / p.S, h = bh % p.H, b = bh / p.H;
  const int64_t slot = ld_dep_as(p.slots + s * p.slots_stride);
  if (slot < 0 || slot >= p.T) return;
  const float scale = ld_dep(kv_scale + t * p.H + h);
  const Src* src = reinterpret_cast<const Src*>(p.src[t]) + b * p.s_sb[t] + h * p.s_sh[t] + s * p.s_ss[t];
  const Pack<Src, VPE> x = ld_dep_as(reinterpret_cast<const Pack<Src, VPE>*>(src) + chunk);
  Pack<uint8_t, VPE> y;
#pragma unroll
  for (int e = 0; e < VPE; ++e) y.x[e] = fp8::e4m3_from_float(__fdiv_rn(to_float(x.x[e]), scale));
  uint8_t* dst = reinterpret_cast<uint8_t*>(p.dst[t]) + (bh * p.T + slot) * (p.chunks * VPE);
  reinterpret_cast<Pack<uint8_t, VPE>*>(dst)[chunk] = y;
}

template <typename Elem>
void launch(const AppendParams& p, bool vec16, cudaStream_t stream) {
  static_assert(16 % sizeof(Elem) == 0, "elements must tile a 16-byte vector");
  const int64_t n = 2 * p.rows * p.chunks;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= INT32_MAX, "kv_cache_append_cuda: too many elements");
  const auto kernel = vec16 ? kv_append_kernel<uint4, 16 / sizeof(Elem), Elem> : kv_append_kernel<Elem, 1, Elem>;
  launch_kernel(kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, p);
}

}  // namespace

void kv_cache_append_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& slots) {
  TORCH_CHECK(k_cache.is_cuda() && v_cache.is_cuda() && k.is_cuda() && v.is_cuda() && slots.is_cuda(),
              "kv_cache_append_cuda: all tensors must be CUDA tensors");
  TORCH_CHECK(k_cache.device() == k.device() && v_cache.device() == k.device() && v.device() == k.device() &&
                  slots.device() == k.device(),
              "kv_cache_append_cuda: all tensors must be on one device");
  TORCH_CHECK(k_cache.dim() == 4 && k.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k.sizes() == v.sizes(),
              "kv_cache_append_cuda: caches must be (B, H, T, D) and k, v (B, H, S, D), got caches ",
              k_cache.sizes(), ", ", v_cache.sizes(), " and k, v ", k.sizes(), ", ", v.sizes());
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), D = k.size(3), T = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(1) == H && k_cache.size(3) == D,
              "kv_cache_append_cuda: cache ", k_cache.sizes(), " does not match k ", k.sizes());
  const auto dtype = k.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "kv_cache_append_cuda: dtype must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(v.scalar_type() == dtype && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "kv_cache_append_cuda: caches and k, v must share one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "kv_cache_append_cuda: caches must be contiguous");
  TORCH_CHECK(D == 1 || (k.stride(3) == 1 && v.stride(3) == 1),
              "kv_cache_append_cuda: the last dim of k and v must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == S,
              "kv_cache_append_cuda: slots must be an (S,) = (", S, ",) int64 tensor, got ", slots.scalar_type(),
              " ", slots.sizes());
  if (k.numel() == 0) return;

  const at::cuda::CUDAGuard guard(k.device());
  const int64_t esize = k.element_size(), vpe = 16 / esize;
  AppendParams p{};
  const at::Tensor* srcs[2] = {&k, &v};
  at::Tensor* dsts[2] = {&k_cache, &v_cache};
  bool vec16 = D % vpe == 0;
  for (int t = 0; t < 2; ++t) {
    const at::Tensor& s = *srcs[t];
    p.src[t] = static_cast<const char*>(s.data_ptr());
    p.dst[t] = static_cast<char*>(dsts[t]->data_ptr());
    p.s_sb[t] = s.stride(0), p.s_sh[t] = s.stride(1), p.s_ss[t] = s.stride(2);
    vec16 = vec16 && reinterpret_cast<uintptr_t>(p.src[t]) % 16 == 0 && reinterpret_cast<uintptr_t>(p.dst[t]) % 16 == 0;
    for (int d = 0; d < 3; ++d) vec16 = vec16 && (s.size(d) == 1 || s.stride(d) % vpe == 0);
  }
  p.slots = slots.data_ptr<int64_t>();
  p.slots_stride = slots.stride(0);
  p.H = H, p.S = S, p.T = T;
  p.chunks = vec16 ? D / vpe : D;
  p.rows = B * H * S;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (esize == 2)  // fp16, bf16: a copy only moves bits
    launch<uint16_t>(p, vec16, stream);
  else
    launch<uint32_t>(p, vec16, stream);
}


void kv_cache_append_fp8_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& slots, const at::Tensor& kv_scale) {
  TORCH_CHECK(k_cache.is_cuda() && v_cache.is_cuda() && k.is_cuda() && v.is_cuda() && slots.is_cuda() &&
                  kv_scale.is_cuda(),
              "kv_cache_append_fp8_cuda: all tensors must be CUDA tensors");
  TORCH_CHECK(k_cache.device() == k.device() && v_cache.device() == k.device() && v.device() == k.device() &&
                  slots.device() == k.device() && kv_scale.device() == k.device(),
              "kv_cache_append_fp8_cuda: all tensors must be on one device");
  TORCH_CHECK(k_cache.dim() == 4 && k.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k.sizes() == v.sizes(),
              "kv_cache_append_fp8_cuda: caches must be (B, H, T, D) and k, v (B, H, S, D), got caches ",
              k_cache.sizes(), ", ", v_cache.sizes(), " and k, v ", k.sizes(), ", ", v.sizes());
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), D = k.size(3), T = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(1) == H && k_cache.size(3) == D,
              "kv_cache_append_fp8_cuda: cache ", k_cache.sizes(), " does not match k ", k.sizes());
  const auto dtype = k.scalar_type();
  TORCH_CHECK((dtype == at::kHalf || dtype == at::kBFloat16) && v.scalar_type() == dtype,
              "kv_cache_append_fp8_cuda: k and v must be float16 or bfloat16 (one dtype), got ", dtype, " and ",
              v.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat8_e4m3fn && v_cache.scalar_type() == at::kFloat8_e4m3fn,
              "kv_cache_append_fp8_cuda: caches must be float8_e4m3fn");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "kv_cache_append_fp8_cuda: caches must be contiguous");
  TORCH_CHECK(D == 1 || (k.stride(3) == 1 && v.stride(3) == 1),
              "kv_cache_append_fp8_cuda: the last dim of k and v must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == S,
              "kv_cache_append_fp8_cuda: slots must be an (S,) = (", S, ",) int64 tensor, got ",
              slots.scalar_type(), " ", slots.sizes());
  TORCH_CHECK(kv_scale.scalar_type() == at::kFloat && kv_scale.dim() == 2 && kv_scale.size(0) == 2 &&
                  kv_scale.size(1) == H && kv_scale.is_contiguous(),
              "kv_cache_append_fp8_cuda: kv_scale must be a contiguous (2, ", H, ") float32 tensor, got ",
              kv_scale.scalar_type(), " ", kv_scale.sizes());
  if (k.numel() == 0) return;

  const at::cuda::CUDAGuard guard(k.device());
  constexpr int64_t vpe = 8;  // 16 source bytes -> 8 cache bytes
  AppendParams p{};
  const at::Tensor* srcs[2] = {&k, &v};
  at::Tensor* dsts[2] = {&k_cache, &v_cache};
  bool vec = D % vpe == 0;
  for (int t = 0; t < 2; ++t) {
    const at::Tensor& s = *srcs[t];
    p.src[t] = static_cast<const char*>(s.data_ptr());
    p.dst[t] = static_cast<char*>(dsts[t]->data_ptr());
    p.s_sb[t] = s.stride(0), p.s_sh[t] = s.stride(1), p.s_ss[t] = s.stride(2);
    vec = vec && reinterpret_cast<uintptr_t>(p.src[t]) % 16 == 0 && reinterpret_cast<uintptr_t>(p.dst[t]) % 8 == 0;
    for (int d = 0; d < 3; ++d) vec = vec && (s.size(d) == 1 || s.stride(d) % vpe == 0);
  }
  p.slots = slots.data_ptr<int64_t>();
  p.slots_stride = slots.stride(0);
  p.H = H, p.S = S, p.T = T;
  p.chunks = vec ? D / vpe : D;
  p.rows = B * H * S;
  const int64_t blocks = (2 * p.rows * p.chunks + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= INT32_MAX, "kv_cache_append_fp8_cuda: too many elements");
  const float* scales = kv_scale.data_ptr<float>();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto grid = static_cast<unsigned>(blocks);
  if (dtype == at::kHalf)
    launch_kernel(vec ? kv_append_fp8_kernel<__half, 8> : kv_append_fp8_kernel<__half, 1>, grid, kThreads, 0, stream,
                  p, scales);
  else
    launch_kernel(vec ? kv_append_fp8_kernel<__nv_bfloat16, 8> : kv_append_fp8_kernel<__nv_bfloat16, 1>, grid,
                  kThreads, 0, stream, p, scales);
}


// k_cache[:, :, slots[s]] = k[:, :, s] and v_cache[:, :, slots[s]] = v[:, :, s], in one launch.
// k_cache, v_cache: (B, H, T, D) contiguous; k, v: (B, H, S, D), last dim contiguous, other strides arbitrary;
// slots: (S,) int64. Same dtype (fp16/bf16/fp32) throughout. Slots outside [0, T) are skipped (no host sync).
// kv_cache_append_fp8(k_cache, v_cache, k, v, slots, kv_scale): the same into float8_e4m3fn caches, k / v (fp16 or
// bf16) divided by kv_scale (2, H) fp32 contiguous (row 0 keys, row 1 values), rounded to nearest even and saturated
// at +-448.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("kv_cache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("kv_cache_append_fp8(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots, "
        "Tensor kv_scale) -> ()");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) {
  m.impl("kv_cache_append", &kv_cache_append_cuda);
  m.impl("kv_cache_append_fp8", &kv_cache_append_fp8_cuda);
}

}  // namespace fuseinfer
