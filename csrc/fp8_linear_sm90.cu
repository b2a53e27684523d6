// The sm90 scaled GEMM (w8a8_linear_sm90.cuh) for FP8 (e4m3) operands, fp16 output; the entry point, which takes int8
// or float8_e4m3fn operands, is w8a8_linear in w8a8_linear_sm90.cu.
#include "sm90_gemm_instance.cuh"

FUSEINFER_SM90_GEMM(fp8_f16, cutlass::float_e4m3_t, cutlass::half_t, Epilogue)
