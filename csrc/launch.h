// Kernel launches with programmatic dependent launch (PDL, sm_90+).
//
// A decode step is ~200 short kernels in a row; between two of them the GPU normally drains the first
// completely, then starts the second, whose first loads meet DRAM latency again. With PDL the next kernel is
// launched while the current one runs: its blocks become resident as SMs free up, do what does not depend on
// the previous kernel (the weight-streaming GEMV issues its first weight loads) and then wait in
// pdl_wait() until the previous kernel has finished and its writes are visible.
//
// Contract for every kernel launched with PDL (launch_kernel(), or launch_kernel_with() and pdl_attribute()):
//   * pdl_launch_dependents() may come anywhere (most kernels call it first: the next kernel may start as early
//     as possible, in resources the current grid, already fully resident, does not need; the LayerNorm calls it
//     after its statistics, since the next grid's blocks beside its own slowed it down, see layer_norm.cu; the
//     one-kernel decode step calls it as its LM head starts, since the next kernel needs the logits anyway);
//   * nothing written by an earlier kernel (activations, caches, counters, q_start...) is read, and nothing
//     is written at all, before pdl_wait(). One exception: the decode GEMV and the one-kernel decode step read
//     weights before the wait, so a weight must not be written by the kernel launched just before them. Model
//     parameters never are; a non-contiguous weight that the op copies with .contiguous() right before the call
//     would be (the patched OPT passes contiguous parameters; the fix is a prefetch-only first load);
//   * every block reaches pdl_wait() before it exits, so "kernel N finished" still implies "kernel N - 1
//     finished", as in plain stream order.
// Without PDL (FUSEINFER_PDL=0, a GPU below sm_90, or a launch not marked programmatic) both calls are no-ops
// and the launch is an ordinary one. Launches are captured into CUDA graphs as programmatic edges.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "device_utils.cuh"
#include "knobs.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace fuseinfer {

// PDL is used when the FUSEINFER_PDL knob is on (default; knobs.h) and the current device is sm_90 or newer.
inline bool pdl_enabled() {
  return knob(Knob::kPdl) != 0 && at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the launch attributes attrs[0, n).
template <typename... Params, typename... Args>
void launch_kernel_with(const cudaLaunchAttribute* attrs, int n, void (*kernel)(Params...), dim3 grid, dim3 block,
                        size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = const_cast<cudaLaunchAttribute*>(attrs);
  config.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// The launch attribute that marks a launch programmatic (PDL).
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

// kernel<<<grid, block, smem, stream>>>(args...), marked programmatic when pdl_enabled().
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  const cudaLaunchAttribute attr = pdl_attribute();
  launch_kernel_with(&attr, pdl_enabled() ? 1 : 0, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

// Resident blocks per SM (at least 1) of `kernel` at `threads` threads per block and `smem` bytes of dynamic shared
// memory, cached per (kernel, block size, shared memory, device): what sizing a one-wave grid needs.
inline int blocks_per_sm(const void* kernel, int threads, size_t smem = 0) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t, int>, int> cache;
  const auto key = std::make_tuple(kernel, threads, smem, static_cast<int>(at::cuda::current_device()));
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
    it = cache.emplace(key, std::max(1, blocks)).first;
  }
  return it->second;
}

// Lets `kernel` take `smem` bytes of dynamic shared memory (a kernel whose static and dynamic shared memory together
// pass 48 KiB must opt in, per device, to the dynamic part): once per (kernel, device) and size, so that the launches
// a CUDA graph captures after the first eager one make no call.
inline void allow_dynamic_smem(const void* kernel, size_t smem) {
  if (smem == 0) return;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> allowed;  // the largest size opted into
  const auto key = std::make_pair(kernel, static_cast<int>(at::cuda::current_device()));
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = allowed.find(key);
  if (it != allowed.end() && it->second >= smem) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  allowed[key] = smem;
}

}  // namespace fuseinfer
