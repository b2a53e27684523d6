// sm_90 primitives shared by the kernels: mbarriers, TMA tensor loads and warpgroup MMA (wgmma).
//
// mbarrier and TMA helpers need sm_90; the wgmma wrappers need sm_90a (the "a" target: build with
// FUSEINFER_CUDA_ARCH containing 9.0a, see setup.py) and are only instantiated by code that is compiled for it.
//
// wgmma operands in shared memory are described by 64-bit descriptors (wgmma_desc). Every tile here uses the
// 128-byte swizzle: rows of 64 16-bit elements (128 bytes), grouped in 8-row atoms of 1024 bytes whose 16-byte
// chunk c of row r sits at chunk c ^ (r % 8), which is what a TMA load with CU_TENSOR_MAP_SWIZZLE_128B writes
// into a 1024-byte-aligned destination. For a K-major operand (rows = M or N, 64 K-columns per row) the
// descriptor's stride byte offset is the 1024 bytes between 8-row atoms and a k16 step advances the start
// address by 32 bytes; for an MN-major operand (rows = K, 64 M/N-columns per row; wgmma's transpose flag) the
// stride byte offset is the 1024 bytes between 8-row K groups, the leading byte offset the distance between
// 64-column blocks of M/N, and a k16 step advances the start address by 16 rows (2048 bytes).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fuseinfer {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers ----

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the mbarrier initialisations of this thread visible to the other threads and to the async proxy (TMA);
// a __syncthreads() must follow before anyone uses the barriers.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ----

// The box at coordinates (c0 innermost, c1, c2, c3) of the 4-D tensor map *map -> shared dst, completing on bar's
// transaction count (the whole box's bytes, out-of-bounds parts zero-filled). map: a __grid_constant__ parameter.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

// Orders this thread's earlier generic-proxy shared-memory writes before later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- register reallocation between warpgroups (sm_90a) ----

// Every thread of the warpgroup executes these: lower its register budget to N (giving registers back to the SM)
// or raise it to N (waiting until enough are free). N: a multiple of 8 in [24, 256].
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- wgmma (sm_90a) ----

// Descriptor of a 128-byte-swizzled shared-memory operand starting at shared address addr (see the top).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lead_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (uint64_t{1} << 62);
}
// The same for an 8-bit K-major tile with 64-byte rows (64 e4m3 per row, TMA's CU_TENSOR_MAP_SWIZZLE_64B): 8-row
// atoms of 512 bytes whose 16-byte chunk c of row r sits at chunk c ^ ((r / 2) % 4); a k32 step advances 32 bytes.
__device__ __forceinline__ uint64_t wgmma_desc_sw64(uint32_t addr, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (uint64_t{2} << 62);
}
// desc moved by units16 * 16 bytes in shared memory. Only the start-address field (the low 14 bits) changes, and
// it cannot carry while the address stays in shared memory (below 2^18), so a 32-bit add of the low word does:
// a 64-bit add would cost an extra instruction per wgmma, in the consumers' issue-bound loops.
__device__ __forceinline__ uint64_t wgmma_desc_add(uint64_t desc, uint32_t units16) {
  return (desc & 0xFFFFFFFF00000000ull) | (static_cast<uint32_t>(desc) + units16);
}

// Before the first wgmma that reads registers written by ordinary instructions (accumulators, A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of r across an asynchronous wgmma region, or reusing its registers
// while a wgmma may still read them: call right before the issue and right after the wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// The instructions, one macro per shape, instantiated for f16 and bf16 below. Accumulator layout (m64nN, fp32):
// warp w of the warpgroup holds rows 16w..16w+15; register 4i + e of lane l is row 16w + l/4 + 8 * (e / 2),
// column 8i + 2 * (l % 4) + e % 2. A in registers (RS): the m16n8k16 A fragment of warp w's 16 rows.

// The accumulator operands d[0..31], d[0..35], d[0..63] and d[0..67], and their placeholders %0..%31 / %0..%35 /
// %0..%63 / %0..%67.
#define WGMMA_D32                                                                                         \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define WGMMA_D64                                                                                         \
  WGMMA_D32,                                                                                              \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define WGMMA_D36 WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define WGMMA_D68 WGMMA_D64, "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])

#define WGMMA_R32                                                                  \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

#define WGMMA_R36 WGMMA_R32 ", %32, %33, %34, %35"

#define WGMMA_R64                                                                    \
  WGMMA_R32 ", "                                                                     \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

#define WGMMA_R68 WGMMA_R64 ", %64, %65, %66, %67"

// A (shared, K-major) x B (shared) -> the m64nN accumulators: D and R list them (operands and placeholders), IDA /
// IDB / IP are the placeholders of A's and B's descriptors and the accumulate flag that follow them.
#define WGMMA_SS(TY, N, D, R, IDA, IDB, IP)                                                                      \
  asm volatile(                                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                                                            \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" R "}, " IDA ", " IDB ", p, 1, 1, 0, 0;\n}\n" \
      : D                                                                                                        \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
#define WGMMA_SS_N128(TY) WGMMA_SS(TY, 128, WGMMA_D64, WGMMA_R64, "%64", "%65", "%66")

// A (registers) x B (shared, MN-major) -> the m64nN accumulators: D and R list them (operands and placeholders),
// IA / IDESC / IP are the placeholders of the A fragment, B's descriptor and the accumulate flag that follow them.
#define WGMMA_RS(TY, N, D, R, IA, IDESC, IP)                                                                         \
  asm volatile(                                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                                                                \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" R "}, {" IA "}, " IDESC ", p, 1, 1, 1;\n}\n"  \
      : D                                                                                                            \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
#define WGMMA_RS_N72(TY) WGMMA_RS(TY, 72, WGMMA_D36, WGMMA_R36, "%36, %37, %38, %39", "%40", "%41")
#define WGMMA_RS_N128(TY) WGMMA_RS(TY, 128, WGMMA_D64, WGMMA_R64, "%64, %65, %66, %67", "%68", "%69")

// A (registers, e4m3) x B (shared, e4m3, K-major) -> the m64nN accumulators, k32 (8-bit operands are K-major only:
// no transpose flags). The A fragment of warp w: register j holds 4 e4m3 (low byte first) of row 16w + l/4 + 8 * (j % 2),
// columns 4 * (l % 4) + 16 * (j / 2) + 0..3 (the m16n8k32 A fragment).
#define WGMMA_RS_E4M3(N, D, R, IA, IDESC, IP)                                                                     \
  asm volatile(                                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                                                            \
      "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" R "}, {" IA "}, " IDESC ", p, 1, 1;\n}\n"       \
      : D                                                                                                        \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

// d (64 x N, fp32) {=, +=} A (64 x 32, registers, e4m3) * B (32 x N, shared, e4m3, K-major), N = 72, 128 or 136.
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[36], const uint32_t (&a)[4], uint64_t desc_b,
                                              int accumulate) {
  WGMMA_RS_E4M3(72, WGMMA_D36, WGMMA_R36, "%36, %37, %38, %39", "%40", "%41");
}
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[68], const uint32_t (&a)[4], uint64_t desc_b,
                                              int accumulate) {
  WGMMA_RS_E4M3(136, WGMMA_D68, WGMMA_R68, "%68, %69, %70, %71", "%72", "%73");
}
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                              int accumulate) {
  WGMMA_RS_E4M3(128, WGMMA_D64, WGMMA_R64, "%64, %65, %66, %67", "%68", "%69");
}

// MACRO with T's PTX type name.
#define WGMMA_FOR_TYPE(MACRO)                  \
  if constexpr (std::is_same_v<T, __half>) {  \
    MACRO("f16");                              \
  } else {                                     \
    MACRO("bf16");                             \
  }

// d (64 x 128, fp32) {=, +=} A (64 x 16, shared, K-major) * B (16 x 128, shared, K-major: 128 rows of K).
template <typename T>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  WGMMA_FOR_TYPE(WGMMA_SS_N128)
}

// d (64 x N, fp32) {=, +=} A (64 x 16, registers) * B (16 x N, shared, MN-major), N = 72 (head dim 64 and the
// row-sum column) or 128.
template <typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[36], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  WGMMA_FOR_TYPE(WGMMA_RS_N72)
}
template <typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  WGMMA_FOR_TYPE(WGMMA_RS_N128)
}

#undef WGMMA_FOR_TYPE
#undef WGMMA_D32
#undef WGMMA_D36
#undef WGMMA_D64
#undef WGMMA_D68
#undef WGMMA_R32
#undef WGMMA_R36
#undef WGMMA_R64
#undef WGMMA_R68
#undef WGMMA_SS
#undef WGMMA_SS_N128
#undef WGMMA_RS
#undef WGMMA_RS_N72
#undef WGMMA_RS_N128
#undef WGMMA_RS_E4M3

}  // namespace fuseinfer
