// FP8-output instantiations of the sm90 scaled GEMM (w8a8_linear_sm90.cuh, EpilogueFp8Out) with a bf16 bias; the
// entry point is fp8_linear_fp8out in fp8_linear_fp8out_sm90.cu. A file per instantiation so that nvcc compiles them
// in parallel. CUTLASS's device asserts are compiled out (see w8a8_linear_sm90.cu).
#ifndef NDEBUG
#define NDEBUG
#endif
#if defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A)
#include "w8a8_linear_sm90.cuh"

namespace fuseinfer {
namespace w8a8 {
size_t workspace_bytes_fp8out_bf16(GemmParams const& p) {
  return workspace_bytes<cutlass::float_e4m3_t, cutlass::bfloat16_t, EpilogueFp8Out>(p);
}
const char* run_fp8out_bf16(GemmParams const& p, cudaStream_t s) {
  return run<cutlass::float_e4m3_t, cutlass::bfloat16_t, EpilogueFp8Out>(p, s);
}
}  // namespace w8a8
}  // namespace fuseinfer
#endif
