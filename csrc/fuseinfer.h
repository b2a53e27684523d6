// fuseinfer CUDA extension: declarations shared by the kernels and the Python bindings.
//
// Every function here is called from Python through fuseinfer._C (see bindings.cpp) by the CUDA
// implementation of a torch.library custom op in fuseinfer/ops/. The Python side has already checked
// device, dtype and shapes; kernels still TORCH_CHECK what they rely on (contiguity, alignment).
#pragma once
#include <torch/extension.h>
#include <map>
#include <string>
#include <tuple>

#include "knobs.h"

namespace fuseinfer {

// y = LayerNorm(s) * weight + bias, where s = x + residual rounded to x's dtype (s = x when residual is
// undefined). Statistics in fp32. x, residual: (..., N) contiguous, same dtype (fp16/bf16/fp32);
// weight, bias: (N,) or undefined. Returns (y, s); s is an empty tensor when store_sum is false.
std::tuple<at::Tensor, at::Tensor> add_layer_norm_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, bool store_sum);

// y = act(x @ w^T + bias + residual). x: (M, K), w: (N, K), bias: (N,), residual: (M, N);
// activation is "none" or "relu" (relu only without residual). Same dtype throughout.
at::Tensor linear_epilogue_cuda(
    const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, const std::string& activation);

// Causal attention over a KV cache with per-row key masks.
// q: (B, H, Sq, D); k, v: (B, H, Skv, D); last dim contiguous, other strides arbitrary.
// key_mask: (B, Skv) bool, true = real token (undefined: all real).
// q_start: (B,) int32, key index of query 0 (undefined: Skv - Sq for every row).
// Query i of row b attends key j iff key_mask[b, j] and j <= q_start[b] + i; a query with no key
// gets 0. Returns (B, Sq, H, D) contiguous, q's dtype.
at::Tensor attention_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& key_mask, const c10::optional<at::Tensor>& q_start, double scale);

// The kernel attention_cuda runs for prefill (fp16/bf16, Sq > 16) on the current device: "wgmma" (sm_90a build on an
// sm_90 GPU, FUSEINFER_ATTN_SM90 not 0; a call still falls back when a tensor does not fit a TMA map,
// there are more than 2^31 work items or scale <= 0) or "mma.sync".
std::string attention_prefill_kernel();

// k_cache[:, :, slots[s]] = k[:, :, s] and v_cache[:, :, slots[s]] = v[:, :, s], in one launch.
// k_cache, v_cache: (B, H, T, D) contiguous; k, v: (B, H, S, D), last dim contiguous, other strides arbitrary;
// slots: (S,) int64. Same dtype (fp16/bf16/fp32) throughout. Slots outside [0, T) are skipped (no host sync).
void kv_cache_append_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& slots);

// One decode step of a pre-LN OPT (see decode_step.cu): tokens, positions (B,) int64, q_start (B,) int32 (the
// cache slot each row writes and attends up to), key_mask (B, T) bool; layer_params: 12 per layer (LN1 w, b,
// qkv w (3E, E), b, out_proj w, b, LN2 w, b, fc1 w, b, fc2 w, b); k_caches, v_caches: (B, H, T, D) per layer,
// written at q_start. workspace: decode_step_workspace_bytes() bytes, zeroed once, kept between calls.
// Returns fp32 logits (B, V), rounded to the model dtype first like the LM head's output. weight_scales: empty, or
// (int8 weight-only) 4 fp32 (N,) per layer for the int8 qkv, out_proj, fc1 and fc2 weights of layer_params.
at::Tensor decode_step_cuda(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& q_start,
                            const at::Tensor& key_mask, const at::Tensor& embed, const at::Tensor& pos_embed,
                            const std::vector<at::Tensor>& layer_params, std::vector<at::Tensor> k_caches,
                            std::vector<at::Tensor> v_caches, const at::Tensor& lnf_w, const at::Tensor& lnf_b,
                            const at::Tensor& lm_head, at::Tensor& workspace, double eps, double scale,
                            const std::vector<at::Tensor>& weight_scales);
int64_t decode_step_workspace_bytes(int64_t m, int64_t e, int64_t f, int64_t heads, int64_t head_dim,
                                    int64_t capacity);
// With FUSEINFER_DECODE_TRACE=1 in the environment, the (blocks, 2 + 8 * layers) trace of the last
// decode_step launch: globaltimer stamps (ns) of the start, per layer the ends of qkv, attention, out_proj,
// LN2 + fc1, fc2, next LN, then the LM head's end; then per layer the cumulative ns the producer
// waited for a free ring stage and consumer thread 0 for a full one.
// Undefined otherwise.
at::Tensor decode_step_trace();
// The tail of a fast-decode step (see emit_tokens.cu and fuseinfer/ops/emit_tokens.py): tokens = first argmax of
// each row of scores (B, V) fp32, padded where a row has finished; unfinished, out[:, step], alive[step] updated;
// positions, q_start, decode_idx, step advanced by one. scratch: emit_tokens_scratch_ints(B) int32, zeroed once.
void emit_tokens_cuda(const at::Tensor& scores, const at::Tensor& eos, int64_t pad, at::Tensor& tokens,
                      at::Tensor& positions, at::Tensor& q_start, at::Tensor& decode_idx, at::Tensor& step,
                      at::Tensor& unfinished, at::Tensor& out, at::Tensor& alive, at::Tensor& scratch);
int64_t emit_tokens_scratch_ints(int64_t rows);
// Whether m rows of hidden e / ffn f fit the kernel's shared memory on the current device.
bool decode_step_fits(int64_t m, int64_t e, int64_t f);

// "" when this build's kernels run on CUDA device `device`, else the CUDA error that says why not (e.g. the build
// left out its architecture, see FUSEINFER_CUDA_ARCH in setup.py).
std::string kernels_run_on(int64_t device);

// Which kernel, or which way of choosing a cuBLASLt algorithm, each call of attention_cuda and linear_epilogue_cuda
// took, counted since the process started; path_counts() maps each name (path_counts.cpp) to its count. A GPU test
// that means to exercise one path asserts that its count, and no other, went up: a silent fallback (a tensor map
// that does not encode, a misaligned pointer) would otherwise pass the numerical checks on the other path.
//   attention: wgmma or mma.sync prefill, split-KV (Sq <= 16 or fp32);
//   linear: the skinny kernel (M <= 16), or cuBLASLt with the algorithm cached for the problem, its heuristic's
//   first choice (then cached), the fastest of its candidates timed at this call (then cached), or its first
//   choice under CUDA-graph capture (not cached).
enum class Path : int {
  kAttentionWgmma, kAttentionMmaSync, kAttentionSplitKv, kLinearSkinny,
  kLinearLtHeuristic, kLinearLtTuned, kLinearLtCaptured, kLinearLtCached, kCount
};
void count_path(Path path);
std::map<std::string, int64_t> path_counts();

// --- W8A8 (issue 36) ---
// s = x + residual (rounded to x's dtype; s = x when residual is undefined), y = LayerNorm(s) * weight + bias rounded
// to x's dtype, then per-token symmetric int8: scale = max(amax|y| / 127, FLT_MIN), q = clamp(rint(y / scale), ±127).
// x, residual: (..., N) contiguous fp16/bf16/fp32; weight, bias: (N,) or undefined. Returns (q int8 (..., N),
// scale fp32 (..., 1), s (..., N) or empty when store_sum is false). See layer_norm_quant.cu.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_quant_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, bool store_sum);

// out = act(x_q @ w_q^T * x_scale[m] * w_scale[n] + bias[n] + residual[m, n]) on sm_90a (CUTLASS int8 wgmma, the
// dequantisation in the epilogue; w8a8_gemm_sm90.cu). x_q: (M, K) int8, w_q: (N, K) int8, x_scale: M fp32,
// w_scale: N fp32, bias: (N,), residual: (M, N), out: (M, N) preallocated, fp16 or bf16 (bias and residual in out's
// dtype); all contiguous, K % 16 == 0, N % 8 == 0; act = ReLU when relu.
void w8a8_linear_cuda(const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& w_q,
                      const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                      const c10::optional<at::Tensor>& residual, bool relu, at::Tensor& out);
// "" when w8a8_linear_cuda runs on CUDA device `device`, else why not (built without CUTLASS or sm_90a, not sm_90).
std::string w8a8_gemm_unavailable(int64_t device);

}  // namespace fuseinfer
