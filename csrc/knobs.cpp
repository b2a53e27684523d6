// Storage of the extension's run-time switches (see knobs.h).
#include "knobs.h"

#include <atomic>

#include <c10/util/Exception.h>

namespace fuseinfer {
namespace {
std::atomic<int> values[static_cast<int>(Knob::kCount)] = {{1}, {1}, {1}, {0}, {0}};
const std::map<std::string, Knob> names = {{"FUSEINFER_PDL", Knob::kPdl},
                                           {"FUSEINFER_ATTN_SM90", Knob::kAttnSm90},
                                           {"FUSEINFER_GEMM_TUNE", Knob::kGemmTune},
                                           {"FUSEINFER_DECODE_TRACE", Knob::kDecodeTrace},
                                           {"FUSEINFER_W8A8_TILE", Knob::kW8A8Tile}};
}  // namespace

int knob(Knob k) { return values[static_cast<int>(k)].load(std::memory_order_relaxed); }

void set_knobs(const std::map<std::string, int64_t>& v) {
  for (const auto& [name, value] : v) {
    auto it = names.find(name);
    TORCH_CHECK(it != names.end(), "fuseinfer: unknown knob ", name);
    values[static_cast<int>(it->second)].store(static_cast<int>(value), std::memory_order_relaxed);
  }
}

}  // namespace fuseinfer
