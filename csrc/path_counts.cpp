// Counts of the paths the ops' calls took (see fuseinfer.h, path_counts()): one relaxed atomic increment per call.
#include "fuseinfer.h"

#include <array>
#include <atomic>

namespace fuseinfer {
namespace {

constexpr int kPaths = static_cast<int>(Path::kCount);
// In Path's order (fuseinfer.h).
constexpr const char* kPathNames[] = {
    "attention.wgmma",     "attention.mma_sync", "attention.split_kv", "linear.skinny",
    "linear.lt_heuristic", "linear.lt_tuned",    "linear.lt_captured", "linear.lt_cached",
};
static_assert(sizeof(kPathNames) / sizeof(kPathNames[0]) == kPaths, "one name per Path");

std::array<std::atomic<int64_t>, kPaths>& counts() {
  static std::array<std::atomic<int64_t>, kPaths> c{};
  return c;
}

}  // namespace

void count_path(Path path) { counts()[static_cast<int>(path)].fetch_add(1, std::memory_order_relaxed); }

std::map<std::string, int64_t> path_counts() {
  std::map<std::string, int64_t> out;
  for (int i = 0; i < kPaths; ++i) out[kPathNames[i]] = counts()[i].load(std::memory_order_relaxed);
  return out;
}

}  // namespace fuseinfer
