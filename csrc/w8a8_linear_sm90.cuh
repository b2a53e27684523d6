// W8A8 GEMM on sm_90a (Hopper wgmma, TMA, warp-specialized persistent kernels) built from CUTLASS 3.x/4.x sm90
// collectives, with the dequantisation in an epilogue visitor tree (EVT):
//
//   out[m, n] = act(acc[m, n] * a_scale[m] * w_scale[n] + bias[n] + residual[m, n])      (fp32 math, one rounding)
//
// or, the 8-bit-output variants (EpilogueFp8Out, EpilogueInt8Out: fc1 writing fc2's input with a static
// per-tensor scale),
//
//   out[m, n] = e4m3_satfinite(act(acc[m, n] * a_scale[m] * w_scale[n] + bias[n]) * (1 / out_scale))
//   out[m, n] = int8(clamp(act(acc[m, n] * a_scale[m] * w_scale[n] + bias[n]) * (1 / out_scale), -127, 127))
//
//   acc = x_q (M, K) int8 @ w_q (N, K)^T int8, exact in int32 (or, the FP8 instantiations, float8 e4m3 operands
//   accumulated by the tensor cores: CUTLASS's FP8 fast-accumulation mainloop, as TensorRT-LLM and vLLM run it);
//   a_scale (M,) fp32 per token (or one static value for every row), w_scale (N,) fp32 per output channel, bias
//   (N,) and residual (M, N) in the output dtype (fp16 / bf16), each optional at run time; act = ReLU or identity,
//   chosen at run time (max with 0 or -inf).
//
// The approach (CollectiveBuilder mainloop on int8 row-major A / column-major B, int32 accumulators, a
// per-row x per-column scale EVT) follows vLLM's csrc/quantization/cutlass_w8a8/scaled_mm_c3x*.cu
// (Apache-2.0, (c) the vLLM project), whose ScaledEpilogueBias is the tree below without residual and ReLU.
//
// Optional operands without extra template instantiations: bias is a row broadcast whose null pointer reads as 0
// (CUTLASS's EnableNullptr); the residual is the epilogue's C operand fetched by TMA, and ResidualFetch (below)
// turns that load off at run time when there is no residual (C's pointer is then D's, so the TMA descriptor stays
// valid; nothing is read through it).
//
// This header is included (only when FUSEINFER_CUTLASS is defined) by the host entry points, w8a8_linear_sm90.cu and
// linear_8bit_out_sm90.cu, and by sm90_gemm_instance.cuh, through which a .cu file per instantiation compiles it.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/functional.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/util/packed_stride.hpp>
#include <cute/tensor.hpp>

#include <cstdint>
#include <type_traits>

namespace fuseinfer {
namespace w8a8 {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// What one call needs; pointers are device pointers, rows are contiguous.
struct GemmParams {
  const void* a;           // (M, K) activations, int8 or float8 e4m3 (the instantiation's ElementAB)
  const void* b;           // (N, K) weights, the same type (nn.Linear layout)
  const float* a_scale;    // (M,) per token, or one value for every row (a_per_row false)
  bool a_per_row;          // a_scale holds M values (else 1)
  const float* w_scale;    // (N,)
  const void* bias;        // (N,) output dtype, or null
  const void* residual;    // (M, N) output dtype, or null
  void* out;               // (M, N) output dtype (the 8-bit-output trees: float8 e4m3 or int8)
  const float* out_scale;  // 8-bit output only: one fp32 value (device), out = 8bit(y / out_scale); else unused
  int m, n, k;
  bool relu;
  int sm_count;
  int config;              // 0: by M; 1, 2, 3: force the small / medium / large tile configuration (below)
  void* workspace;         // workspace_bytes() bytes (may be null when that is 0)
};

// The residual as the epilogue's C operand (Sm90SrcFetch), except that whether C is loaded at all is a run-time
// argument: with `enabled` false the collective epilogue skips C's TMA loads and this node yields zeros.
template <class Element>
struct ResidualFetch {
  struct SharedStorage {};
  struct Arguments {
    bool enabled = false;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE ResidualFetch() {}
  CUTLASS_HOST_DEVICE ResidualFetch(Params const& params, SharedStorage const&) : enabled(params.enabled) {}

  bool enabled = false;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return enabled; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return enabled; }
  CUTLASS_DEVICE bool is_zero() const { return !enabled; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::ProducerLoadArgs<Args...> const&) {
    return fusion::EmptyProducerLoadCallbacks{};
  }

  template <class SrcTensor>
  struct ConsumerStoreCallbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(SrcTensor const& tCrC, bool enabled) : tCrC(tCrC), enabled(enabled) {}
    SrcTensor const& tCrC;  // (CPY, CPY_M, CPY_N), filled by the collective only when enabled
    bool enabled;

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<typename SrcTensor::value_type, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int) {
      using Frag = cutlass::Array<typename SrcTensor::value_type, FragmentSize>;
      if (enabled) return recast<Frag>(tCrC)(epi_v);
      Frag zeros;
      zeros.fill(typename SrcTensor::value_type(0));
      return zeros;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    return ConsumerStoreCallbacks<cute::remove_cvref_t<decltype(args.tCrC)>>(args.tCrC, enabled);
  }
};

// The scaled prefix every epilogue tree starts with, t1 = a_scale * (w_scale[n] * acc) + bias[n] in fp32: w_scale
// per output channel, bias (N,) in ElementBias (the model's dtype; null reads as 0), and a_scale per token (a_scale[m])
// or one value for every row (a static per-tensor scale) as GemmParams::a_per_row says: a column broadcast with a
// run-time stride (0 or 1: CUTLASS's dynamic column-or-scalar broadcast), so one instantiation serves both.
template <class TileShape, class ElementBias>
struct ScaledPrefix {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using Acc = fusion::Sm90AccFetch;                                                               // int32 / fp32
  using WScale = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, _0>>;        // (N,)
  using AScale = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<bool, _0, _0>>;      // (M,) or (1,)
  using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementBias, float, Stride<_0, _1, _0>>;    // (N,), null = 0
  using Scalar = fusion::Sm90ScalarBroadcast<float>;                                              // floor, ceiling
  using InvScale = fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, _0>, 2, cutlass::divides>;   // 1 / out_scale
  template <template <class> class Fn, class Out = float>
  using Op = fusion::Sm90Compute<Fn, Out, float, kRound>;

  // t0 = w_scale[n] * acc
  using T0 = fusion::Sm90EVT<Op<cutlass::multiplies>, WScale, Acc>;
  // t1 = a_scale[m] * t0 + bias[n]
  using T1 = fusion::Sm90EVT<Op<cutlass::multiply_add>, AScale, T0, Bias>;

  static typename T1::Arguments t1(GemmParams const& p) {
    typename WScale::Arguments w_scale{p.w_scale, 0.f, {}};
    typename AScale::Arguments a_scale{p.a_scale, 0.f, {p.a_per_row, _0{}, _0{}}};
    typename Bias::Arguments bias{static_cast<ElementBias const*>(p.bias), ElementBias(0), {}};
    typename T0::Arguments t0{w_scale, {}, {}};
    return typename T1::Arguments{a_scale, t0, bias, {}};
  }
  static typename Scalar::Arguments scalar(float value) {
    typename Scalar::Arguments a{};
    a.scalars[0] = value;
    return a;
  }
  static typename InvScale::Arguments inv_scale(GemmParams const& p) {
    typename InvScale::Arguments inv{};
    inv.scalars[0] = 1.f;                // the "reduction" 1.0 / *scalar_ptrs[1]
    inv.scalar_ptrs[1] = p.out_scale;
    return inv;
  }
};

// The epilogue tree for a CTA tile shape; ElementD_ is cutlass::half_t or cutlass::bfloat16_t (the output, bias and
// residual dtype): out = max(t1 + residual[m, n], floor) rounded once to ElementD, floor 0 (ReLU) or -inf.
template <class TileShape, class ElementD_>
struct Epilogue {
  using ElementD = ElementD_;
  using ElementC = ElementD;  // the residual
  using P = ScaledPrefix<TileShape, ElementD>;
  using Residual = ResidualFetch<ElementD>;                                                       // (M, N) via C

  // t2 = t1 + residual[m, n]
  using T2 = fusion::Sm90EVT<typename P::template Op<cutlass::plus>, typename P::T1, Residual>;
  // out = max(t2, floor) rounded to ElementD
  using Tree = fusion::Sm90EVT<typename P::template Op<cutlass::maximum, ElementD>, T2, typename P::Scalar>;

  static typename Tree::Arguments arguments(GemmParams const& p) {
    typename Residual::Arguments residual{p.residual != nullptr};
    typename T2::Arguments t2{P::t1(p), residual, {}};
    const float floor = p.relu ? 0.f : -cutlass::platform::numeric_limits<float>::infinity();
    return typename Tree::Arguments{t2, P::scalar(floor), {}};
  }
};

// The 8-bit-output epilogue trees (fc1 writing fc2's input with a static per-tensor scale): D float8 e4m3
// (EpilogueFp8Out) or int8 (EpilogueInt8Out), no C (no residual), bias in ElementBias (cutlass::half_t or
// cutlass::bfloat16_t, the model's dtype). The scale is 1 / out_scale, formed once per CTA from the device scalar (a
// scalar broadcast whose two-value "reduction" is 1.0 / *out_scale), so the tree multiplies and the scale stays on
// the device (no host sync, graph-capturable). After the scaled prefix t1:
//   e4m3: out = e4m3(max(t1, floor) * inv), CUTLASS's cvt.rn.satfinite (round to nearest even, saturating at
//         +-448; NaN stays NaN); floor 0 (ReLU) or -inf;
//   int8: out = int8(max(min(t1 * inv, 127), floor)), floor 0 (ReLU) or -127: clamped to +-127 in fp32 first
//         (CUTLASS's fp32 -> int8 array conversion goes through int32 and does not saturate), then rounded to
//         nearest even (cvt.rni); ReLU after the positive scale is ReLU before it.
template <class TileShape, class ElementBias>
struct EpilogueFp8Out {
  using ElementD = cutlass::float_e4m3_t;
  using ElementC = void;
  using P = ScaledPrefix<TileShape, ElementBias>;
  // t2 = max(t1, floor)
  using T2 = fusion::Sm90EVT<typename P::template Op<cutlass::maximum>, typename P::T1, typename P::Scalar>;
  // out = t2 * (1 / out_scale) rounded to e4m3 (satfinite)
  using Tree = fusion::Sm90EVT<typename P::template Op<cutlass::multiplies, ElementD>, T2, typename P::InvScale>;

  static typename Tree::Arguments arguments(GemmParams const& p) {
    const float floor = p.relu ? 0.f : -cutlass::platform::numeric_limits<float>::infinity();
    typename T2::Arguments t2{P::t1(p), P::scalar(floor), {}};
    return typename Tree::Arguments{t2, P::inv_scale(p), {}};
  }
};

template <class TileShape, class ElementBias>
struct EpilogueInt8Out {
  using ElementD = int8_t;
  using ElementC = void;
  using P = ScaledPrefix<TileShape, ElementBias>;
  // t2 = t1 * (1 / out_scale)
  using T2 = fusion::Sm90EVT<typename P::template Op<cutlass::multiplies>, typename P::T1, typename P::InvScale>;
  // t3 = min(t2, 127)
  using T3 = fusion::Sm90EVT<typename P::template Op<cutlass::minimum>, T2, typename P::Scalar>;
  // out = max(t3, floor) rounded to int8 (nearest even; in range by now)
  using Tree = fusion::Sm90EVT<typename P::template Op<cutlass::maximum, ElementD>, T3, typename P::Scalar>;

  static typename Tree::Arguments arguments(GemmParams const& p) {
    typename T2::Arguments t2{P::t1(p), P::inv_scale(p), {}};
    typename T3::Arguments t3{t2, P::scalar(127.f), {}};
    return typename Tree::Arguments{t3, P::scalar(p.relu ? 0.f : -127.f), {}};
  }
};

// One CUTLASS kernel: operand type (int8_t or cutlass::float_e4m3_t), model dtype ElementT (cutlass::half_t or
// cutlass::bfloat16_t), CTA tile, cluster shape and schedule (a handful of these, chosen by M on the host), and the
// epilogue tree (Epilogue: ElementT output with the residual as C; EpilogueFp8Out / EpilogueInt8Out: 8-bit output,
// no C).
template <class ElementAB, class ElementT, class TileShape, class ClusterShape, class KernelSchedule,
          class EpilogueSchedule, template <class, class> class EpilogueT = Epilogue>
struct Sm90Gemm {
  using ElementAcc = std::conditional_t<std::is_same_v<ElementAB, int8_t>, int32_t, float>;
  using EpilogueTree = EpilogueT<TileShape, ElementT>;
  using ElementD = typename EpilogueTree::ElementD;
  using ElementC = typename EpilogueTree::ElementC;  // the residual, or void (none)
  static constexpr bool kHasC = !std::is_void_v<ElementC>;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // (K, N) column-major = (N, K) row-major
  using LayoutCD = cutlass::layout::RowMajor;    // (M, N)
  static constexpr int kAlignAB = 16;            // 16 one-byte values = 16 bytes (TMA)
  static constexpr int kAlignCD = 16 / static_cast<int>(sizeof(ElementD));  // 16 bytes: 8 x 16-bit, 16 x e4m3

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float,
      ElementC, LayoutCD, kAlignCD, ElementD, LayoutCD, kAlignCD,
      EpilogueSchedule, typename EpilogueTree::Tree>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB, LayoutB,
      kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(GemmParams const& p) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideC = typename Gemm::GemmKernel::StrideC;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    const StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(p.m, p.k, 1));
    const StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(p.n, p.k, 1));
    const StrideC stride_c = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(p.m, p.n, 1));
    const StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(p.m, p.n, 1));
    // without a residual C points at D (same shape, dtype and strides: a valid TMA descriptor, never read); no C
    // at all (the 8-bit outputs): null
    auto c = [&] {
      if constexpr (kHasC) return static_cast<ElementC const*>(p.residual ? p.residual : p.out);
      else return static_cast<void const*>(nullptr);
    }();
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = p.sm_count;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {p.m, p.n, p.k, 1},
        {static_cast<ElementAB const*>(p.a), stride_a, static_cast<ElementAB const*>(p.b), stride_b},
        {EpilogueTree::arguments(p), c, stride_c, static_cast<ElementD*>(p.out), stride_d},
        hw};
    return args;
  }

  static size_t workspace_bytes(GemmParams const& p) { return Gemm::get_workspace_size(arguments(p)); }

  // "" on success, else what CUTLASS said.
  static const char* run(GemmParams const& p, cudaStream_t stream) {
    Gemm gemm;
    const auto args = arguments(p);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS can_implement failed";
    if (gemm.initialize(args, p.workspace, stream) != cutlass::Status::kSuccess) return "CUTLASS initialize failed";
    if (gemm.run(stream) != cutlass::Status::kSuccess) return "CUTLASS kernel launch failed";
    return "";
  }
};

// The configurations (kept few: each is most of a minute of nvcc per output dtype), chosen by M, or forced through
// GemmParams::config (FUSEINFER_W8A8_TILE, read in w8a8_linear_sm90.cu) so the benchmark can time each:
//   kSmall  (M <= 128): 64x128x128 CTA tiles, ping-pong consumer warp groups, no cluster;
//   kMedium (default for M > 128): 128x128x128 tiles in clusters of 2 along M (B tiles multicast), ping-pong: vLLM's
//           default for int8 at M > 128;
//   kLarge  (alternative for large M, timed by bench/bench_w8a8.py): 256x128x128 tiles, cluster 2x1, cooperative
//           (both consumer warp groups on one tile, 128 rows each): half the B traffic per output of kMedium.
// FP8 operands take CUTLASS's FP8 fast-accumulation schedules (the tensor cores' own accumulator, not promoted to
// fp32 registers every few k-blocks), as TensorRT-LLM and vLLM run FP8 GEMMs: on an H200 the promoting mainloop ran
// these shapes at about a quarter of the speed (0.47x cuBLAS fp16 against 1.9x). The accumulator keeps fewer bits
// than fp32, so the error scales with the sum of |products| (tests/quant/test_fp8_ops.py bounds it; perplexity is
// the model-level check).
template <class ElementAB>
constexpr bool kFp8 = !std::is_same_v<ElementAB, int8_t>;
template <class ElementAB>
using KPingpong = std::conditional_t<kFp8<ElementAB>, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                                     cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
template <class ElementAB>
using KCooperative =
    std::conditional_t<kFp8<ElementAB>, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                       cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
using EPingpong = cutlass::epilogue::TmaWarpSpecialized;
using ECooperative = cutlass::epilogue::TmaWarpSpecializedCooperative;
template <class ElementAB, class ElementT, template <class, class> class EpilogueT = Epilogue>
using GemmSmall = Sm90Gemm<ElementAB, ElementT, Shape<_64, _128, _128>, Shape<_1, _1, _1>, KPingpong<ElementAB>,
                           EPingpong, EpilogueT>;
template <class ElementAB, class ElementT, template <class, class> class EpilogueT = Epilogue>
using GemmMedium = Sm90Gemm<ElementAB, ElementT, Shape<_128, _128, _128>, Shape<_2, _1, _1>, KPingpong<ElementAB>,
                            EPingpong, EpilogueT>;
template <class ElementAB, class ElementT, template <class, class> class EpilogueT = Epilogue>
using GemmLarge = Sm90Gemm<ElementAB, ElementT, Shape<_256, _128, _128>, Shape<_2, _1, _1>, KCooperative<ElementAB>,
                           ECooperative, EpilogueT>;

constexpr int kSmallM = 128;  // M <= kSmallM takes GemmSmall by default

// 0: auto (by M); 1, 2, 3: small, medium, large
inline int pick_config(GemmParams const& p) {
  if (p.config >= 1 && p.config <= 3) return p.config;
  return p.m <= kSmallM ? 1 : 2;
}

// Entry points, instantiated per operand type and output dtype in w8a8_linear_sm90.cu (int8, fp16),
// w8a8_linear_sm90_bf16.cu (int8, bf16), fp8_linear_sm90.cu (e4m3, fp16) and fp8_linear_sm90_bf16.cu (e4m3, bf16),
// and with the 8-bit-output trees (fp16 / bf16 bias) in fp8_linear_fp8out_sm90{,_bf16}.cu (e4m3) and
// w8a8_linear_int8out_sm90{,_bf16}.cu (int8), so that they compile in parallel.
template <class ElementAB, class ElementT, template <class, class> class EpilogueT = Epilogue>
size_t workspace_bytes(GemmParams const& p) {
  switch (pick_config(p)) {
    case 1: return GemmSmall<ElementAB, ElementT, EpilogueT>::workspace_bytes(p);
    case 3: return GemmLarge<ElementAB, ElementT, EpilogueT>::workspace_bytes(p);
    default: return GemmMedium<ElementAB, ElementT, EpilogueT>::workspace_bytes(p);
  }
}
template <class ElementAB, class ElementT, template <class, class> class EpilogueT = Epilogue>
const char* run(GemmParams const& p, cudaStream_t stream) {
  switch (pick_config(p)) {
    case 1: return GemmSmall<ElementAB, ElementT, EpilogueT>::run(p, stream);
    case 3: return GemmLarge<ElementAB, ElementT, EpilogueT>::run(p, stream);
    default: return GemmMedium<ElementAB, ElementT, EpilogueT>::run(p, stream);
  }
}

}  // namespace w8a8
}  // namespace fuseinfer
