// The sm90 scaled GEMM (w8a8_linear_sm90.cuh) for int8 operands and output (EpilogueInt8Out), fp16 bias; the entry
// point is linear_8bit_out in linear_8bit_out_sm90.cu.
#include "sm90_gemm_instance.cuh"

FUSEINFER_SM90_GEMM(int8out_f16, int8_t, cutlass::half_t, EpilogueInt8Out)
