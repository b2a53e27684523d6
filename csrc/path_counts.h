// Which kernel, or which way of choosing a cuBLASLt algorithm, each call of attention and linear_epilogue took,
// counted since the process started; the op path_counts() (path_counts.cpp) maps each name to its count. A GPU test
// that means to exercise one path asserts that its count, and no other, went up: a silent fallback (a tensor map
// that does not encode, a misaligned pointer) would otherwise pass the numerical checks on the other path.
//   attention: wgmma (16-bit or FP8) or mma.sync prefill, split-KV (Sq <= 16 or fp32);
//   linear: the skinny kernel (M <= 16), or cuBLASLt with the algorithm cached for the problem, its heuristic's
//   first choice (then cached), the fastest of its candidates timed at this call (then cached), or its first
//   choice under CUDA-graph capture (not cached); the gate/up GEMM with SiLU(gate) * up in its epilogue (sm_90); ATen
//   in fp32 for outputs of a few elements; the q/k/v GEMM with the rotary, the split and the cache write in its
//   epilogue (linear_rope_append at prefill sizes, sm_90).
#pragma once

namespace fuseinfer {

enum class Path : int {
  kAttentionWgmma, kAttentionMmaSync, kAttentionSplitKv, kLinearSkinny,
  kLinearLtHeuristic, kLinearLtTuned, kLinearLtCaptured, kLinearLtCached, kLinearSiluGemm, kLinearTiny, kLinearQkvRopeGemm, kAttentionWgmmaFp8, kCount
};
void count_path(Path path);

}  // namespace fuseinfer
