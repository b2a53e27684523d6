// The sm90 scaled GEMM (w8a8_linear_sm90.cuh) for int8 operands, bf16 output; the entry point and the fp16
// instantiation are in w8a8_linear_sm90.cu.
#include "sm90_gemm_instance.cuh"

FUSEINFER_SM90_GEMM(bf16, int8_t, cutlass::bfloat16_t, Epilogue)
