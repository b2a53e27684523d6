// bf16-output instantiations of the sm90 W8A8 GEMM (w8a8_linear_sm90.cuh); the entry point and the fp16 ones are in
// w8a8_linear_sm90.cu. A file of its own so nvcc compiles the two dtypes in parallel (each ~1 min).
// CUTLASS's device asserts are function calls, which make ptxas serialise the wgmma pipeline (warning C7510):
// compiled out here, before any header brings in <cassert>.
#ifndef NDEBUG
#define NDEBUG
#endif
#if defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A)
#include "w8a8_linear_sm90.cuh"

namespace fuseinfer {
namespace w8a8 {
size_t workspace_bytes_bf16(GemmParams const& p) { return workspace_bytes<int8_t, cutlass::bfloat16_t>(p); }
const char* run_bf16(GemmParams const& p, cudaStream_t s) { return run<int8_t, cutlass::bfloat16_t>(p, s); }
}  // namespace w8a8
}  // namespace fuseinfer
#endif
