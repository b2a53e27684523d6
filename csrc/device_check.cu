// Whether the extension's kernels can run on a device: the driver has no image of them for a GPU whose
// architecture the build left out (FUSEINFER_CUDA_ARCH), and every kernel here is compiled for the same list, so
// one empty kernel answers for all. fuseinfer._ext asks once per device and runs the references where not.
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <string>

namespace fuseinfer {
namespace {

__global__ void probe_kernel() {}

}  // namespace

std::string kernels_run_on(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, probe_kernel);
  if (status == cudaSuccess) return "";
  (void)cudaGetLastError();  // (not sticky: clear it so later calls do not see it)
  return cudaGetErrorString(status);
}


// kernels_run_on(device): "" when this build's kernels run on CUDA device `device`, else the CUDA error that says
// why not (e.g. the build left out its architecture, see FUSEINFER_CUDA_ARCH in setup.py).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) { m.def("kernels_run_on(int device) -> str", &kernels_run_on); }

}  // namespace fuseinfer
