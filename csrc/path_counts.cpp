// Counts of the paths the ops' calls took (see path_counts.h): one relaxed atomic increment per call; the op
// fuseinfer_C::path_counts() reads them.
#include "path_counts.h"

#include <ATen/core/Dict.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

namespace fuseinfer {
namespace {

constexpr int kPaths = static_cast<int>(Path::kCount);
// In Path's order (path_counts.h).
constexpr const char* kPathNames[] = {
    "attention.wgmma",     "attention.mma_sync", "attention.split_kv", "linear.skinny",
    "linear.lt_heuristic", "linear.lt_tuned",    "linear.lt_captured", "linear.lt_cached",
    "linear.silu_gemm",    "linear.tiny",        "linear.qkv_rope_gemm", "attention.wgmma_fp8",
};
static_assert(sizeof(kPathNames) / sizeof(kPathNames[0]) == kPaths, "one name per Path");

std::array<std::atomic<int64_t>, kPaths>& counts() {
  static std::array<std::atomic<int64_t>, kPaths> c{};
  return c;
}

c10::Dict<std::string, int64_t> path_counts() {
  c10::Dict<std::string, int64_t> out;
  for (int i = 0; i < kPaths; ++i) out.insert(kPathNames[i], counts()[i].load(std::memory_order_relaxed));
  return out;
}

}  // namespace

void count_path(Path path) { counts()[static_cast<int>(path)].fetch_add(1, std::memory_order_relaxed); }

TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) { m.def("path_counts() -> Dict(str, int)", &path_counts); }

}  // namespace fuseinfer
