// FP8 (e4m3) instantiations of the sm90 scaled GEMM (w8a8_linear_sm90.cuh) with fp16 output; the entry point, which
// takes int8 or float8_e4m3fn operands, is w8a8_linear in w8a8_linear_sm90.cu. A file per instantiation so that nvcc
// compiles them in parallel. CUTLASS's device asserts are compiled out (see w8a8_linear_sm90.cu).
#ifndef NDEBUG
#define NDEBUG
#endif
#if defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A)
#include "w8a8_linear_sm90.cuh"

namespace fuseinfer {
namespace w8a8 {
size_t workspace_bytes_fp8_f16(GemmParams const& p) { return workspace_bytes<cutlass::float_e4m3_t, cutlass::half_t>(p); }
const char* run_fp8_f16(GemmParams const& p, cudaStream_t s) { return run<cutlass::float_e4m3_t, cutlass::half_t>(p, s); }
}  // namespace w8a8
}  // namespace fuseinfer
#endif
