// The op fuseinfer_C::new_stream(device) -> int: a CUDA stream of its own (non-blocking, as a raw cudaStream_t
// address) for one CUDA graph's capture (fuseinfer/runtime/graphs.py says why). Never destroyed: graphs.py keeps it in
// a free list for the next capture.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

namespace fuseinfer {
namespace {

int64_t new_stream(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaStream_t stream;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return reinterpret_cast<int64_t>(stream);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) { m.def("new_stream(int device) -> int", &new_stream); }

}  // namespace fuseinfer
