// The sm90 scaled GEMM (w8a8_linear_sm90.cuh) for FP8 (e4m3) operands and output (EpilogueFp8Out), bf16 bias; the entry
// point is linear_8bit_out in linear_8bit_out_sm90.cu.
#include "sm90_gemm_instance.cuh"

FUSEINFER_SM90_GEMM(fp8out_bf16, cutlass::float_e4m3_t, cutlass::bfloat16_t, EpilogueFp8Out)
