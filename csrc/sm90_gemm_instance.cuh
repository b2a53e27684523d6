// One instantiation of the sm90 scaled GEMM (w8a8_linear_sm90.cuh) per .cu file, so that nvcc compiles them in
// parallel (each most of a minute). A file holds
//
//   // what it instantiates
//   #include "sm90_gemm_instance.cuh"
//   FUSEINFER_SM90_GEMM(suffix, ElementAB, ElementT, EpilogueT)
//
// which defines w8a8::workspace_bytes_<suffix> and w8a8::run_<suffix>, the functions the host entry points
// (w8a8_linear_sm90.cu, linear_8bit_out_sm90.cu) declare and pick by operand and output type; nothing without CUTLASS
// and sm_90a. CUTLASS's device asserts are function calls, which make ptxas serialise the wgmma pipeline (warning
// C7510): compiled out here, before any header brings in <cassert>, so this header comes first.
#pragma once
#ifndef NDEBUG
#define NDEBUG
#endif

#if defined(FUSEINFER_CUTLASS) && defined(FUSEINFER_SM90A)
#include "w8a8_linear_sm90.cuh"

#define FUSEINFER_SM90_GEMM(suffix, AB, T, TREE)                                                                     \
  namespace fuseinfer {                                                                                              \
  namespace w8a8 {                                                                                                   \
  size_t workspace_bytes_##suffix(GemmParams const& p) { return workspace_bytes<AB, T, TREE>(p); }                  \
  const char* run_##suffix(GemmParams const& p, cudaStream_t s) { return run<AB, T, TREE>(p, s); }                   \
  }                                                                                                                  \
  }
#else
#define FUSEINFER_SM90_GEMM(suffix, AB, T, TREE)
#endif
