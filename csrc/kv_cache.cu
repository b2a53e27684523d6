// KV-cache append: the op fuseinfer_C::kv_cache_append.
//
// k_cache[:, :, slots[s]] = k[:, :, s] and v_cache[:, :, slots[s]] = v[:, :, s] in ONE launch (the decode step
// writes k and v of every layer, so two index_copy_ launches per layer become one). The grid runs over the
// rows of k and v together: a flat index covers (tensor, b, h, s, chunk of the head dim); each thread moves
// one 16-byte vector, or one element on the scalar path (head dim, strides or base pointers not 16-byte
// aligned). k, v are strided views (e.g. of a fused (B, S, 3, H, D) QKV output); caches are contiguous.
// A slot outside [0, T) is skipped on the device: nothing is written for it and the host never syncs.
// Launched with PDL (launch.h).

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


// k_cache[:, :, slots[s]] = k[:, :, s] and v_cache[:, :, slots[s]] = v[:, :, s], in one launch.
// k_cache, v_cache: (B, H, T, D) contiguous; k, v: (B, H, S, D), last dim contiguous, other strides arbitrary;
// slots: (S,) int64. Same dtype (fp16/bf16/fp32) throughout. Slots outside [0, T) are skipped (no host sync).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("kv_cache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("kv_cache_append", &kv_cache_append_cuda); }

}  // namespace fuseinfer
