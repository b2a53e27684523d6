// cuBLASLt's configuration space for one GEMM problem, for bench/bench_cublaslt_sweep.py (loaded with ctypes;
// the script builds it with nvcc). Not part of the package: it asks whether any configuration of the vendor
// library makes a fused epilogue free, which the heuristic's short list (csrc/linear.cu tunes over its first 8)
// cannot answer.
//
// The problem is the one csrc/linear.cu's cuBLASLt path sets up: column-major A = w (K x N), B = x (K x M),
// C and D (N x M), fp16 or bf16 in and out, fp32 compute, epilogue none / BIAS / RELU_BIAS, beta 1 when C is a
// residual. One problem at a time (lt_setup); lt_enumerate lists every (algorithm id, tile, stages, custom
// option, CTA swizzle, one of 7 cluster shapes, split-K <= 2 with each reduction scheme; the inner shape left at its
// default) that cublasLtMatmulAlgoCheck accepts within the workspace limit; lt_run runs one of them.
#include <cublasLt.h>

#include <array>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Problem {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cudaDataType_t dtype = CUDA_R_16F;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  float beta = 0.f;

  void release() {
    if (op) cublasLtMatmulDescDestroy(op);
    for (auto l : {a, b, c, d}) {
      if (l) cublasLtMatrixLayoutDestroy(l);
    }
    op = nullptr;
    a = b = c = d = nullptr;
  }
};
Problem g;

constexpr int kConfigWords = 8;  // a cublasLtMatmulAlgo_t is 8 uint64 words
static_assert(sizeof(cublasLtMatmulAlgo_t) == kConfigWords * sizeof(uint64_t), "cublasLtMatmulAlgo_t layout");

template <typename V>
std::vector<V> cap_list(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0, written = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes);
  std::vector<V> out(bytes / sizeof(V));
  if (!out.empty()) cublasLtMatmulAlgoCapGetAttribute(&algo, attr, out.data(), bytes, &written);
  return out;
}

// One scalar attribute of an algo: a capability or a configuration field (the attribute's enum type picks which).
template <typename V, typename Attr>
V attribute(const cublasLtMatmulAlgo_t& algo, Attr attr) {
  V v{};
  size_t written = 0;
  if constexpr (std::is_same_v<Attr, cublasLtMatmulAlgoCapAttributes_t>) {
    cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &v, sizeof(v), &written);
  } else {
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
  }
  return v;
}

template <typename V>
void set_config(cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, V v) {
  cublasLtMatmulAlgoConfigSetAttribute(&algo, attr, &v, sizeof(v));
}

}  // namespace

extern "C" {

size_t lt_version() { return cublasLtGetVersion(); }

// bf16: 0 fp16, 1 bf16. epilogue: 0 none, 1 bias, 2 relu + bias. residual: C is a residual (beta = 1).
// Returns 0, or the failing cuBLAS status.
int lt_setup(int m, int n, int k, int bf16, int epilogue, int residual) {
  if (!g.handle) {
    const cublasStatus_t s = cublasLtCreate(&g.handle);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
  }
  g.release();
  g.dtype = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  g.epilogue = epilogue == 0 ? CUBLASLT_EPILOGUE_DEFAULT
               : epilogue == 1 ? CUBLASLT_EPILOGUE_BIAS
                               : CUBLASLT_EPILOGUE_RELU_BIAS;
  g.beta = residual ? 1.f : 0.f;
  cublasStatus_t s = cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a));
  cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b));
  cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue, sizeof(g.epilogue));
  if (epilogue) {  // an aligned placeholder until lt_run sets the real bias (AlgoCheck does not read it)
    const void* placeholder = reinterpret_cast<const void*>(uintptr_t{1} << 20);
    cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &placeholder, sizeof(placeholder));
  }
  const int64_t shapes[4][2] = {{k, n}, {k, m}, {n, m}, {n, m}};  // A, B, C, D: rows, columns (ld = rows)
  cublasLtMatrixLayout_t* layouts[4] = {&g.a, &g.b, &g.c, &g.d};
  for (int i = 0; i < 4; ++i) {
    s = cublasLtMatrixLayoutCreate(layouts[i], g.dtype, shapes[i][0], shapes[i][1], shapes[i][0]);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
  }
  return 0;
}

// The heuristic's list (best first), at most max_out configs into out (8 words each) and their workspace sizes
// into workspace_out. Returns the count.
int lt_heuristic(size_t workspace_limit, uint64_t* out, uint64_t* workspace_out, int max_out) {
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_limit,
                                       sizeof(workspace_limit));
  std::vector<cublasLtMatmulHeuristicResult_t> results(max_out);
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(g.handle, g.op, g.a, g.b, g.c, g.d, pref, max_out, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  int count = 0;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    memcpy(out + kConfigWords * count, &results[i].algo, 64);
    workspace_out[count++] = results[i].workspaceSize;
  }
  return count;
}

// Every configuration AlgoCheck accepts within workspace_limit; the first max_out go to out (8 words each) and
// their workspace sizes to workspace_out. Returns the total count (which may exceed max_out).
int lt_enumerate(size_t workspace_limit, uint64_t* out, uint64_t* workspace_out, int max_out) {
  constexpr int kMaxIds = 1024;
  std::array<int, kMaxIds> ids;
  int n_ids = 0;
  const cudaDataType_t t = g.dtype;
  cublasLtMatmulAlgoGetIds(g.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, t, t, t, t, kMaxIds, ids.data(), &n_ids);
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1,
                               CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1,
                               CUBLASLT_CLUSTER_SHAPE_2x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x4x1};
  int count = 0;
  for (int i = 0; i < n_ids; ++i) {
    cublasLtMatmulAlgo_t algo;
    if (cublasLtMatmulAlgoInit(g.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, t, t, t, t, ids[i], &algo) !=
        CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    const auto epilogues = attribute<uint32_t>(algo, CUBLASLT_ALGO_CAP_EPILOGUE_MASK);
    if ((epilogues & g.epilogue) != static_cast<uint32_t>(g.epilogue)) continue;
    auto tiles = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_TILE_IDS);
    if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
    auto stages = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_STAGES_IDS);
    if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
    const auto custom_max = attribute<int32_t>(algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX);
    const auto swizzle = attribute<uint32_t>(algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT);
    std::vector<std::array<uint32_t, 2>> splits = {{1, CUBLASLT_REDUCTION_SCHEME_NONE}};  // (split-K, scheme)
    if (attribute<int32_t>(algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT)) {
      const auto schemes = attribute<uint32_t>(algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
      for (uint32_t s : {CUBLASLT_REDUCTION_SCHEME_INPLACE, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                         CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE}) {
        if (schemes & s) splits.push_back({2, s});
      }
    }
    for (uint32_t tile : tiles) {
      for (uint32_t stage : stages) {
        for (int32_t custom = 0; custom <= custom_max; ++custom) {
          for (uint32_t swz = 0; swz <= (swizzle ? 1u : 0u); ++swz) {
            for (uint16_t cluster : clusters) {
              for (const auto& split : splits) {
                cublasLtMatmulAlgo_t cfg = algo;
                set_config(cfg, CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
                set_config(cfg, CUBLASLT_ALGO_CONFIG_STAGES_ID, stage);
                set_config(cfg, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, static_cast<uint32_t>(custom));
                set_config(cfg, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swz);
                set_config(cfg, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster);
                set_config(cfg, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, static_cast<int32_t>(split[0]));
                set_config(cfg, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, split[1]);
                cublasLtMatmulHeuristicResult_t check;
                memset(&check, 0, sizeof(check));
                if (cublasLtMatmulAlgoCheck(g.handle, g.op, g.a, g.b, g.c, g.d, &cfg, &check) !=
                        CUBLAS_STATUS_SUCCESS ||
                    check.workspaceSize > workspace_limit) {
                  continue;
                }
                if (count < max_out) {
                  memcpy(out + kConfigWords * count, &cfg, 64);
                  workspace_out[count] = check.workspaceSize;
                }
                ++count;
              }
            }
          }
        }
      }
    }
  }
  return count;
}

// A configuration's fields: algorithm id, tile, stages, split-K, reduction scheme, swizzle, custom option,
// cluster shape (cuBLASLt's enum values).
void lt_describe(const uint64_t* config, int* fields) {
  cublasLtMatmulAlgo_t cfg;
  memcpy(&cfg, config, 64);
  const int f[8] = {attribute<int32_t>(cfg, CUBLASLT_ALGO_CONFIG_ID),
                    static_cast<int>(attribute<uint32_t>(cfg, CUBLASLT_ALGO_CONFIG_TILE_ID)),
                    static_cast<int>(attribute<uint32_t>(cfg, CUBLASLT_ALGO_CONFIG_STAGES_ID)),
                    attribute<int32_t>(cfg, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                    static_cast<int>(attribute<uint32_t>(cfg, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)),
                    static_cast<int>(attribute<uint32_t>(cfg, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)),
                    static_cast<int>(attribute<uint32_t>(cfg, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)),
                    static_cast<int>(attribute<uint16_t>(cfg, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID))};
  memcpy(fields, f, sizeof(f));
}

// y = epilogue(w-view GEMM) (+ c) with one configuration on `stream`; c may be y (in place). Returns the status.
int lt_run(const uint64_t* config, const void* w, const void* x, const void* bias, const void* c, void* y,
           void* workspace, size_t workspace_size, void* stream) {
  cublasLtMatmulAlgo_t cfg;
  memcpy(&cfg, config, 64);
  if (bias) cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  const float alpha = 1.f;
  return cublasLtMatmul(g.handle, g.op, &alpha, w, g.a, x, g.b, &g.beta, g.beta != 0.f ? c : y, g.c, y, g.d, &cfg,
                        workspace, workspace_size, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
