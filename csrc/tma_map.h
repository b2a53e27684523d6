// TMA tensor maps (cuTensorMapEncodeTiled) of 16-bit tensors for the sm_90 kernels (the wgmma attention prefill,
// the gated gate/up GEMM): the driver entry point taken at run time (the extension does not link libcuda) and one
// encoder for 4-D (B, H, S, D) tensors with 64-column boxes and the 128-byte swizzle that sm90.cuh's wgmma
// descriptors expect.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fuseinfer {

// cuTensorMapEncodeTiled, taken from the driver at run time (the extension does not link libcuda); null if absent.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status);
    return err == cudaSuccess && status == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f)
               : nullptr;
  }();
  return fn;
}

// TMA map of a (B, H, S, D) 16-bit tensor with element strides (sb, sh, ss, 1): boxes of 64 columns x `rows` rows
// of one (b, h), 128-byte swizzle, rows past S zero-filled. False when the strides or the driver do not allow it.
inline bool make_tensor_map(CUtensorMap* map, const void* base, bool bf16, int64_t B, int64_t H, int64_t S, int D,
                            int64_t sb, int64_t sh, int64_t ss, int rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(S), cuuint64_t(H), cuuint64_t(B)};
  // Byte strides of dims S, H, B; a dim of extent 1 is never stepped over and gets a packed stride instead.
  cuuint64_t strides[3] = {cuuint64_t(ss) * 2, cuuint64_t(sh) * 2, cuuint64_t(sb) * 2};
  cuuint64_t packed = cuuint64_t(D) * 2;
  for (int i = 0; i < 3; ++i) {
    if (dims[i + 1] == 1) strides[i] = packed;
    if (strides[i] % 16 != 0 || strides[i] >= (cuuint64_t{1} << 40)) return false;
    packed = strides[i] * dims[i + 1];
  }
  const cuuint32_t box[4] = {64, cuuint32_t(rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace fuseinfer
