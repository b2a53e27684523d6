// The sm90 scaled GEMM (w8a8_linear_sm90.cuh) for FP8 (e4m3) operands, bf16 output; the entry point is w8a8_linear in
// w8a8_linear_sm90.cu.
#include "sm90_gemm_instance.cuh"

FUSEINFER_SM90_GEMM(fp8_bf16, cutlass::float_e4m3_t, cutlass::bfloat16_t, Epilogue)
