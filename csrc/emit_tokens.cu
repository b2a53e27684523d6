// The tail of a fast-decode step as one launch: the op fuseinfer_C::emit_tokens.
//
// Why: the tail as PyTorch ops (a two-stage argmax over the vocabulary, the padding select, the EOS update, the
// writes to out / alive / tokens and four counter increments) is ~13 kernels of ~2 µs each inside the decode
// graph, ~2% of an OPT-1.3b step at batch 1. Here it is one kernel:
//   * grid (kChunks, B): block (c, b) finds the first maximum of chunk c of row b's scores and stores it in
//     `scratch`;
//   * the last block to finish (an atomic ticket, reset by that block for the next launch) merges each row's
//     chunk maxima (a tie goes to the lower index, so the first maximum overall wins, as torch.argmax) and does the
//     bookkeeping of fuseinfer/ops/emit_tokens.py's reference, row r by thread r.
// NaN counts as the largest value (torch.argmax's rule). With `chosen` (B,) int64 (sampling: fuseinfer::sample_tokens
// chose the tokens already), a second kernel of one block does the bookkeeping alone with those tokens; the greedy
// kernel is unchanged. Launched with PDL (launch.h).
#include "launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>

namespace fuseinfer {
namespace {

constexpr int kThreads = 256;
constexpr int kChunks = 16;  // blocks per row: a 50k vocabulary is ~3k scores (12 per thread) per block

struct EmitParams {
  const float* scores;  // (B, V)
  int64_t v;
  int b;
  const int64_t* eos;  // (n_eos,)
  int n_eos;
  int64_t pad;
  int64_t *tokens, *positions;  // (B,) each (contiguous (B, 1))
  int* q_start;                 // (B,)
  int64_t *decode_idx, *step;   // (1,)
  bool* unfinished;             // (B,)
  int64_t* out;                 // (B, max_new)
  bool* alive;                  // (max_new,)
  int64_t max_new;
  float* chunk_max;   // scratch: (B, kChunks)
  int* chunk_arg;     // scratch: (B, kChunks)
  unsigned* ticket;   // scratch: blocks finished so far
  const int64_t* chosen;  // (B,) or null: emit_chosen_kernel's tokens
};

// Whether (v, i) comes before (best, best_i) in torch.argmax's order: larger value (NaN largest), then lower index.
__device__ __forceinline__ bool better(float v, int i, float best, int best_i) {
  if (isnan(v)) return !isnan(best) || i < best_i;
  if (isnan(best)) return false;
  return v > best || (v == best && i < best_i);
}

__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
}

// The bookkeeping of the reference, row r by thread r, with row r's token token_of(r); one block.
template <typename TokenOf>
__device__ __forceinline__ void finish_rows(const EmitParams& p, const TokenOf& token_of) {
  const int64_t at = *p.step;
  bool running = false;
  for (int r = threadIdx.x; r < p.b; r += kThreads) {
    int64_t token = token_of(r);
    bool live = p.unfinished[r];
    if (!live) token = p.pad;
    for (int e = 0; live && e < p.n_eos; ++e) live = token != p.eos[e];
    p.unfinished[r] = live;
    running |= live;
    if (at >= 0 && at < p.max_new) p.out[r * p.max_new + at] = token;  // a step outside [0, max_new) writes no slot
    p.tokens[r] = token;
    p.positions[r] += 1;
    p.q_start[r] += 1;
  }
  running = __syncthreads_or(running);
  if (threadIdx.x == 0) {
    if (at >= 0 && at < p.max_new) p.alive[at] = running;
    *p.step = at + 1;
    *p.decode_idx += 1;
    *p.ticket = 0;  // ready for the next launch
  }
}

// grid (kChunks, B), block kThreads.
__global__ void __launch_bounds__(kThreads) emit_tokens_kernel(const EmitParams p) {
  pdl_launch_dependents();
  pdl_wait();  // scores and every counter come from earlier kernels
  const int row = blockIdx.y, chunk = blockIdx.x;
  const int64_t per = (p.v + kChunks - 1) / kChunks;
  const int64_t lo = chunk * per, hi = min(p.v, lo + per);
  const float* s = p.scores + row * p.v;
  float best = -INFINITY;
  int best_i = INT_MAX;  // "none": any element is better
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float v = ld_dep(s + i);  // (written by the previous kernel)
    if (better(v, static_cast<int>(i), best, best_i)) best = v, best_i = static_cast<int>(i);
  }
  warp_best(best, best_i);
  __shared__ float wv[kThreads / 32];
  __shared__ int wi[kThreads / 32];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) wv[warp] = best, wi[warp] = best_i;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      if (better(wv[w], wi[w], best, best_i)) best = wv[w], best_i = wi[w];
    }
    p.chunk_max[row * kChunks + chunk] = best;
    p.chunk_arg[row * kChunks + chunk] = best_i;
    __threadfence();  // the chunk's result, before its ticket
    last = atomicAdd(p.ticket, 1u) + 1 == gridDim.x * gridDim.y;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // every block's result, after all tickets
  finish_rows(p, [&](int r) {
    float v = -INFINITY;
    int nxt = INT_MAX;
    for (int c = 0; c < kChunks; ++c) {
      const float cv = __ldcg(p.chunk_max + r * kChunks + c);
      const int ci = __ldcg(p.chunk_arg + r * kChunks + c);
      if (better(cv, ci, v, nxt)) v = cv, nxt = ci;
    }
    return static_cast<int64_t>(nxt);
  });
}

// grid 1, block kThreads: the bookkeeping with the tokens in p.chosen (written by the kernel before).
__global__ void __launch_bounds__(kThreads) emit_chosen_kernel(const EmitParams p) {
  pdl_launch_dependents();
  pdl_wait();
  finish_rows(p, [&](int r) {
    return static_cast<int64_t>(ld_dep_as(reinterpret_cast<const unsigned long long*>(p.chosen + r)));
  });
}

}  // namespace

int64_t emit_tokens_scratch_ints(int64_t rows) { return 1 + 2 * rows * kChunks; }

void emit_tokens_cuda(const at::Tensor& scores, const at::Tensor& eos, int64_t pad, at::Tensor& tokens,
                      at::Tensor& positions, at::Tensor& q_start, at::Tensor& decode_idx, at::Tensor& step,
                      at::Tensor& unfinished, at::Tensor& out, at::Tensor& alive, at::Tensor& scratch,
                      const std::optional<at::Tensor>& chosen) {
  const int64_t b = scores.size(0), v = scores.size(1);
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == at::kFloat && scores.dim() == 2 && scores.is_contiguous(),
              "emit_tokens_cuda: scores must be a contiguous (B, V) float32 CUDA tensor");
  TORCH_CHECK(v >= 1 && v <= INT_MAX && b >= 1 && b <= 65535, "emit_tokens_cuda: unsupported scores shape ",
              scores.sizes());
  auto check = [&](const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* what) {
    TORCH_CHECK(t.device() == scores.device() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel,
                "emit_tokens_cuda: ", what, " must be a contiguous ", dtype, " tensor of ", numel,
                " elements on the scores' device");
  };
  TORCH_CHECK(out.dim() == 2 && out.size(0) == b, "emit_tokens_cuda: out must be (B, max_new) with B = ", b);
  const int64_t max_new = out.size(1);
  check(tokens, at::kLong, b, "tokens");
  check(positions, at::kLong, b, "positions");
  check(q_start, at::kInt, b, "q_start");
  check(decode_idx, at::kLong, 1, "decode_idx");
  check(step, at::kLong, 1, "step");
  check(unfinished, at::kBool, b, "unfinished");
  check(out, at::kLong, b * max_new, "out");
  check(alive, at::kBool, max_new, "alive");
  check(eos, at::kLong, eos.numel(), "eos");
  check(scratch, at::kInt, emit_tokens_scratch_ints(b), "scratch");
  if (chosen.has_value()) check(*chosen, at::kLong, b, "chosen");
  const at::cuda::CUDAGuard guard(scores.device());
  EmitParams p{};
  p.scores = scores.data_ptr<float>();
  p.v = v;
  p.b = static_cast<int>(b);
  p.eos = eos.numel() > 0 ? eos.data_ptr<int64_t>() : nullptr;
  p.n_eos = static_cast<int>(eos.numel());
  p.pad = pad;
  p.tokens = tokens.data_ptr<int64_t>();
  p.positions = positions.data_ptr<int64_t>();
  p.q_start = q_start.data_ptr<int>();
  p.decode_idx = decode_idx.data_ptr<int64_t>();
  p.step = step.data_ptr<int64_t>();
  p.unfinished = unfinished.data_ptr<bool>();
  p.out = out.data_ptr<int64_t>();
  p.alive = alive.data_ptr<bool>();
  p.max_new = max_new;
  int* s = scratch.data_ptr<int>();
  p.ticket = reinterpret_cast<unsigned*>(s);
  p.chunk_max = reinterpret_cast<float*>(s + 1);
  p.chunk_arg = s + 1 + b * kChunks;
  if (chosen.has_value()) {  // (the ticket stays 0: this kernel takes none)
    p.chosen = chosen->data_ptr<int64_t>();
    launch_kernel(emit_chosen_kernel, dim3(1), kThreads, 0, at::cuda::getCurrentCUDAStream(), p);
    return;
  }
  launch_kernel(emit_tokens_kernel, dim3(kChunks, static_cast<unsigned>(b)), kThreads, 0,
                at::cuda::getCurrentCUDAStream(), p);
}


// emit_tokens (fuseinfer/ops/emit_tokens.py has the reference): tokens = first argmax of each row of scores (B, V)
// fp32, padded where a row has finished; unfinished, out[:, step], alive[step] updated; positions, q_start,
// decode_idx, step advanced by one. scratch: emit_tokens_scratch_ints(B) int32, zeroed once. chosen: (B,) int64
// tokens to record instead of the argmax (scores then unread).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("emit_tokens(Tensor scores, Tensor eos, int pad, Tensor(a!) tokens, Tensor(b!) positions, "
        "Tensor(c!) q_start, Tensor(d!) decode_idx, Tensor(e!) step, Tensor(f!) unfinished, Tensor(g!) out, "
        "Tensor(h!) alive, Tensor(i!) scratch, Tensor? chosen=None) -> ()");
  m.def("emit_tokens_scratch_ints(int rows) -> int", &emit_tokens_scratch_ints);
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("emit_tokens", &emit_tokens_cuda); }

}  // namespace fuseinfer
