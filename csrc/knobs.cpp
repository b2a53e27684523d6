// Storage of the extension's run-time switches (see knobs.h) and the op fuseinfer_C::set_knobs that fills them.
#include "knobs.h"

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <string>

namespace fuseinfer {
namespace {
std::atomic<int> values[static_cast<int>(Knob::kCount)] = {{1}, {1}, {1}, {0}, {0}, {1}, {0}, {0}, {0}, {0}};
const std::map<std::string, Knob> names = {{"FUSEINFER_PDL", Knob::kPdl},
                                           {"FUSEINFER_ATTN_SM90", Knob::kAttnSm90},
                                           {"FUSEINFER_GEMM_TUNE", Knob::kGemmTune},
                                           {"FUSEINFER_DECODE_TRACE", Knob::kDecodeTrace},
                                           {"FUSEINFER_W8A8_TILE", Knob::kW8A8Tile},
                                           {"FUSEINFER_GEMV_EPILOGUES", Knob::kGemvEpilogues},
                                           {"FUSEINFER_SPLITKV_SPLITS", Knob::kSplitKvSplits},
                                           {"FUSEINFER_SILU_GEMM", Knob::kSiluGemm},
                                           {"FUSEINFER_QKV_GEMM", Knob::kQkvGemm},
                                           {"FUSEINFER_ATTN_FP8", Knob::kAttnFp8}};

// Sets the knobs named in `v`; an unknown name is an error.
void set_knobs(const c10::Dict<std::string, int64_t>& v) {
  for (const auto& item : v) {
    auto it = names.find(item.key());
    TORCH_CHECK(it != names.end(), "fuseinfer: unknown knob ", item.key());
    values[static_cast<int>(it->second)].store(static_cast<int>(item.value()), std::memory_order_relaxed);
  }
}
}  // namespace

int knob(Knob k) { return values[static_cast<int>(k)].load(std::memory_order_relaxed); }

TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) { m.def("set_knobs(Dict(str, int) values) -> ()", &set_knobs); }

}  // namespace fuseinfer
