// The gated MLP's activation: out = silu(gate) * up from the one GEMM that computes gate and up together (the op
// fuseinfer_C::silu_mul). gate_up is (M, 2F): gate in its first F columns, up in its last F; out is (M, F).
//
// Rounds as eager transformers' `act_fn(gate) * up` in the input dtype T: silu in fp32 (g / (1 + exp(-g)), as
// torch's CUDA silu computes it) rounded to T, then the product of the two T values in fp32 rounded to T. Memory
// bound (reads 2F, writes F per row): each thread moves 16-byte packs (8 fp16/bf16 or 4 fp32 elements) when F is a
// multiple of a pack and both tensors are 16-byte aligned, single elements otherwise, in a grid-stride loop over
// the output's packs. Launched with PDL (launch.h): gate_up comes from the previous kernel, so it is read after
// pdl_wait() and with coherent loads.
#include "device_utils.cuh"
#include "launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace fuseinfer {
namespace {

constexpr int kThreads = 128;  // small blocks: a decode step's single row still spreads over many SMs

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// out[m, c] = T(T(silu(g)) * u) for g = gate_up[m, c], u = gate_up[m, F + c], over packs of VEC elements; Index is
// int32 when the output's pack count fits (cheaper division), else int64.
template <typename T, int VEC, typename Index>
__global__ void __launch_bounds__(kThreads) silu_mul_kernel(const T* __restrict__ gate_up, T* __restrict__ out,
                                                             Index total, Index fv) {
  using P = Pack<T, VEC>;
  pdl_wait();  // gate_up is the previous kernel's output
  pdl_launch_dependents();
  const P* __restrict__ in = reinterpret_cast<const P*>(gate_up);
  P* __restrict__ o = reinterpret_cast<P*>(out);
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  for (Index idx = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; idx < total; idx += stride) {
    const Index row = idx / fv;
    const Index col = idx - row * fv;
    const P* src = in + row * 2 * fv + col;  // the row's gate pack; its up pack is fv packs further
    const P g = ld_dep_as(src);
    const P u = ld_dep_as(src + fv);
    P r;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = to_float(g.v[j]);
      const T act = from_float<T>(gf / (1.f + expf(-gf)));
      r.v[j] = from_float<T>(to_float(act) * to_float(u.v[j]));
    }
    o[idx] = r;
  }
}

template <typename T, int VEC>
void launch(const at::Tensor& gate_up, at::Tensor& out, int64_t rows, int64_t f, cudaStream_t stream) {
  const int64_t fv = f / VEC;
  const int64_t total = rows * fv;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // enough blocks to fill every SM (2048 threads each), no more: the loop strides over the rest
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 16);
  const T* in = static_cast<const T*>(gate_up.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  // int32 indices where the largest one reached, total + stride, fits
  if (2 * total + static_cast<int64_t>(sms) * 16 * kThreads < INT32_MAX) {
    launch_kernel(silu_mul_kernel<T, VEC, int32_t>, static_cast<unsigned>(blocks), kThreads, 0, stream, in, o,
                  static_cast<int32_t>(total), static_cast<int32_t>(fv));
  } else {
    launch_kernel(silu_mul_kernel<T, VEC, int64_t>, static_cast<unsigned>(blocks), kThreads, 0, stream, in, o,
                  total, fv);
  }
}

template <typename T>
void dispatch(const at::Tensor& gate_up, at::Tensor& out, int64_t rows, int64_t f) {
  constexpr int kVec = 16 / sizeof(T);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool vectorized = f % kVec == 0 && reinterpret_cast<uintptr_t>(gate_up.data_ptr()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  if (vectorized) {
    launch<T, kVec>(gate_up, out, rows, f, stream);
  } else {
    launch<T, 1>(gate_up, out, rows, f, stream);
  }
}

at::Tensor silu_mul_cuda(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_cuda(), "silu_mul: gate_up must be a CUDA tensor");
  TORCH_CHECK(gate_up.dim() >= 1, "silu_mul: gate_up must have at least one dimension");
  TORCH_CHECK(gate_up.is_contiguous(), "silu_mul: gate_up must be contiguous");
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "silu_mul: dtype must be float16, bfloat16 or float32, got ", dtype);
  const int64_t two_f = gate_up.size(-1);
  TORCH_CHECK(two_f % 2 == 0, "silu_mul: gate_up's last dimension must be even (gate and up, F each), got ", two_f);
  const int64_t f = two_f / 2;

  const at::cuda::CUDAGuard guard(gate_up.device());
  auto sizes = gate_up.sizes().vec();
  sizes.back() = f;
  at::Tensor out = at::empty(sizes, gate_up.options());
  if (out.numel() == 0) return out;
  const int64_t rows = gate_up.numel() / two_f;
  switch (dtype) {
    case at::kHalf: dispatch<__half>(gate_up, out, rows, f); break;
    case at::kBFloat16: dispatch<__nv_bfloat16>(gate_up, out, rows, f); break;
    default: dispatch<float>(gate_up, out, rows, f); break;
  }
  return out;
}

}  // namespace

// silu(gate_up[..., :F]) * gate_up[..., F:], rounded as eager PyTorch in the input dtype (silu in fp32 rounded,
// then the product rounded). gate_up: (..., 2F) contiguous fp16/bf16/fp32. Returns (..., F), contiguous.
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) { m.def("silu_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("silu_mul", &silu_mul_cuda); }

}  // namespace fuseinfer
