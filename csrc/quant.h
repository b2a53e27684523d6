// fuseinfer CUDA extension: declarations of the int8 quantization ops (int8_linear.cu, quant.cu), bound in
// bindings.cpp. The Python side (fuseinfer/ops/int8_linear.py, fuseinfer/ops/quant.py) has checked shapes and dtypes.
#pragma once
#include <torch/extension.h>

#include <map>
#include <string>
#include <tuple>

namespace fuseinfer {

// y = act(x @ (qweight * scale[:, None])^T + bias + residual). x: (M, K) fp16/bf16/fp32 contiguous; qweight: (N, K)
// int8 contiguous; scale: (N,) fp32; bias: (N,) and residual: (M, N) in x's dtype. M <= 16 with fp16/bf16, K % 16 == 0
// and 16-byte aligned x and qweight: the int8 GEMV; otherwise qweight is dequantized to x's dtype and the
// linear_epilogue GEMM runs.
at::Tensor int8_linear_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                            const std::string& activation);

// (N, K) int8 * scale (N,) fp32 -> (N, K) in dtype (fp16, bf16 or fp32), rounded once.
at::Tensor int8_dequantize_cuda(const at::Tensor& qweight, const at::Tensor& scale, at::ScalarType dtype);

// x (R, K) contiguous fp16/bf16/fp32 -> (q (R, K) int8, scale (R,) fp32): symmetric, per row, round half to even.
std::tuple<at::Tensor, at::Tensor> quantize_int8_rows_cuda(const at::Tensor& x);

// Calls of int8_linear_cuda per path since the process started: "gemv" (M <= 16 kernel), "dequant_gemm".
std::map<std::string, int64_t> int8_path_counts();

}  // namespace fuseinfer
