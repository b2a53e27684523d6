// Run-time switches of the extension. Python (fuseinfer/knobs.py, the one owner of every FUSEINFER_* variable)
// hands their values over with the op fuseinfer_C::set_knobs (knobs.cpp) when the extension loads and whenever one
// is overridden; the kernels' host code reads them here and never from the environment.
#pragma once

namespace fuseinfer {

enum class Knob : int {
  kPdl, kAttnSm90, kGemmTune, kDecodeTrace, kW8A8Tile, kGemvEpilogues, kSplitKvSplits, kSiluGemm, kQkvGemm, kAttnFp8, kCount
};

// The knob's current value (defaults before set_knobs: PDL 1, ATTN_SM90 1, GEMM_TUNE 1, DECODE_TRACE 0, W8A8_TILE 0,
// GEMV_EPILOGUES 1, SPLITKV_SPLITS 0, SILU_GEMM 0, QKV_GEMM 0, ATTN_FP8 0).
int knob(Knob k);

}  // namespace fuseinfer
