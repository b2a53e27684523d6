// Control for compute-sanitizer racecheck (tools/gpu_check.sh, stage sanitize): the smallest ring of shared-memory
// stages filled by TMA bulk copies, with the protocol of csrc/decode_step.cu's weight stream (and CUTLASS's
// PipelineTmaAsync): the producer lane waits on a stage's "empty" mbarrier, then copies into it, completing on its
// "full" mbarrier; the consumer warps wait on "full", read the stage, and one lane per warp arrives on "empty".
// The ring is correct (the consumers' reads complete before their arrive, which the producer's wait acquires),
// yet racecheck (CUDA 13.0) reports read/write hazards between the reads and the next copy into the same stage,
// with or without a fence.proxy.async before the arrive (-DFENCE=1): it does not model that ordering (and on
// the decode step, --racecheck-memcpy-async no made it report more, not fewer). gpu_check runs this file next to
// the ring-wrapping decode steps, whose racecheck log passes only if every hazard in it involves a TMA write
// (tools/racecheck_tma.py).
//
//   nvcc -arch=sm_90 [-DFENCE=1] -o racecheck_ring tools/racecheck_ring.cu
//   compute-sanitizer --tool racecheck ./racecheck_ring
#include <cstdint>
#include <cstdio>

#ifndef FENCE
#define FENCE 0
#endif

constexpr int kStages = 4, kChunk = 1024, kChunks = 64, kConsumerWarps = 2;  // 64 chunks of 1 KB: 16 trips round

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n@P1 bra DONE;\nbra WAIT;\n"
      "DONE:\n}\n" ::"r"(smem(bar)), "r"(parity) : "memory");
}

// out = the sum of src (kChunks * kChunk bytes of floats), streamed through the ring.
__global__ void ring(const float* src, float* out) {
  __shared__ __align__(128) char stages[kStages][kChunk];
  __shared__ uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem(&full[s])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem(&empty[s])), "r"(kConsumerWarps) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int index = 0;
  uint32_t phase = 0;
  if (warp == kConsumerWarps) {  // producer warp
    for (int c = 0; c < kChunks; ++c) {
      wait(&empty[index], phase ^ 1);
      if (lane == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem(&full[index])), "r"(kChunk)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                smem(stages[index])),
            "l"(src + c * kChunk / 4), "r"(kChunk), "r"(smem(&full[index]))
            : "memory");
      }
      __syncwarp();
      if (++index == kStages) index = 0, phase ^= 1;
    }
    return;
  }
  float acc = 0.f;
  for (int c = 0; c < kChunks; ++c) {  // consumer warps
    wait(&full[index], phase);
    const float* f = reinterpret_cast<const float*>(stages[index]);
    for (int i = threadIdx.x; i < kChunk / 4; i += 32 * kConsumerWarps) acc += f[i];
    __syncwarp();
#if FENCE
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem(&empty[index])) : "memory");
    if (++index == kStages) index = 0, phase ^= 1;
  }
  atomicAdd(out, acc);
}

int main() {
  constexpr int n = kChunks * kChunk / 4;
  float *src, *out, host[n], sum = 0.f;
  for (float& v : host) v = 1.f;
  cudaMalloc(&src, sizeof(host));
  cudaMalloc(&out, sizeof(float));
  cudaMemcpy(src, host, sizeof(host), cudaMemcpyHostToDevice);
  cudaMemset(out, 0, sizeof(float));
  ring<<<1, 32 * (kConsumerWarps + 1)>>>(src, out);
  cudaMemcpy(&sum, out, sizeof(float), cudaMemcpyDeviceToHost);
  const cudaError_t err = cudaGetLastError();
  printf("racecheck_ring (FENCE=%d): sum %.0f, expected %d, %s\n", FENCE, sum, n, cudaGetErrorString(err));
  return err == cudaSuccess && sum == n ? 0 : 1;
}
