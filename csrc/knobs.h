// Run-time switches of the extension. Python (fuseinfer/knobs.py, the one owner of every FUSEINFER_* variable)
// hands their values over with set_knobs() when the extension loads and whenever one is overridden; the kernels'
// host code reads them here and never from the environment.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace fuseinfer {

enum class Knob : int { kPdl, kAttnSm90, kGemmTune, kDecodeTrace, kW8A8Tile, kCount };

// The knob's current value (defaults before set_knobs: PDL 1, ATTN_SM90 1, GEMM_TUNE 1, DECODE_TRACE 0, W8A8_TILE 0).
int knob(Knob k);
// Sets the knobs named in `values` (FUSEINFER_PDL, FUSEINFER_ATTN_SM90, FUSEINFER_GEMM_TUNE, FUSEINFER_DECODE_TRACE);
// an unknown name is an error.
void set_knobs(const std::map<std::string, int64_t>& values);

}  // namespace fuseinfer
