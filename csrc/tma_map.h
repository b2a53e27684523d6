// TMA tensor maps (cuTensorMapEncodeTiled) for the sm_90 kernels (the wgmma attention prefills, the fused-epilogue
// GEMMs): the driver entry point taken at run time (the extension does not link libcuda), one encoder for 4-D (B, H,
// S, D) 16-bit tensors with 64-column boxes and the 128-byte swizzle that sm90.cuh's wgmma descriptors expect, and
// one for 4-D byte (e4m3) tensors with the 64- or 128-byte swizzle.
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

// TMA map of a 4-D tensor of bytes (e4m3) with extents dims (innermost first, dims[0] contiguous) and byte strides
// strides[0..2] of dims 1..3: boxes of box0 x box1 bytes (dims 0 and 1) of one index of dims 2 and 3, the 64- or
// 128-byte swizzle (box0 its width), out-of-bounds parts zero-filled. False when the strides or the driver do not
// allow it.
inline bool make_tensor_map_u8(CUtensorMap* map, const void* base, const int64_t (&dims)[4],
                               const int64_t (&strides)[3], int box0, int box1) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || (box0 != 64 && box0 != 128)) return false;
  const cuuint64_t d[4] = {cuuint64_t(dims[0]), cuuint64_t(dims[1]), cuuint64_t(dims[2]), cuuint64_t(dims[3])};
  cuuint64_t st[3];
  for (int i = 0; i < 3; ++i) {
    st[i] = cuuint64_t(strides[i]);
    if (st[i] % 16 != 0 || st[i] >= (cuuint64_t{1} << 40)) return false;
  }
  const cuuint32_t box[4] = {cuuint32_t(box0), cuuint32_t(box1), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), d, st, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, box0 == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace fuseinfer
