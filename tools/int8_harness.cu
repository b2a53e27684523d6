// Standalone check of the int8 device code (csrc/skinny_gemv.cuh, csrc/int8_convert.cuh) without PyTorch: builds
// with plain nvcc
//   nvcc -arch=sm_90a -std=c++17 -O3 -DFUSEINFER_KERNEL_HARNESS -Icsrc tools/int8_harness.cu -o int8_harness
// and, on a GPU, runs the decode GEMV (fp16 and bf16, M = 1, 5, 9, 16, K with and without a tail, bias / ReLU /
// residual), the dequantize and the row-quantize kernels against a CPU double-precision reference; exit 1 on a
// mismatch. Small sizes: also the compute-sanitizer target (memcheck / racecheck) of tools/gpu_stage_int8.sh.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <random>
#include <vector>

#include "int8_convert.cuh"
#include "skinny_gemv.cuh"

using namespace fuseinfer;

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)

template <typename T> float host_to_float(T v);
template <> float host_to_float(__half v) { return __half2float(v); }
template <> float host_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> T host_from_float(float v);
template <> __half host_from_float(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 host_from_float(float v) { return __float2bfloat16_rn(v); }

template <typename T, int NT, bool TAIL>
void launch(const skinny::Params& p, int warps, int blocks) {
  skinny::skinny_kernel<skinny::Int8Weights, T, NT, TAIL><<<blocks, 32 * warps>>>(p, skinny::RopeParams{},
                                                                                 skinny::NormParams{});
}

template <typename T>
int run_gemv(int m, int n, int k, bool with_bias, bool with_residual, bool relu, int warps, int blocks,
             std::mt19937& rng) {
  std::uniform_int_distribution<int> qd(-127, 127);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<int8_t> q(static_cast<size_t>(n) * k);
  std::vector<float> scale(n);
  std::vector<T> x(static_cast<size_t>(m) * k), bias(n), res(static_cast<size_t>(m) * n), y(static_cast<size_t>(m) * n);
  for (auto& v : q) v = static_cast<int8_t>(qd(rng));
  for (auto& v : scale) v = 0.01f * (1.f + std::fabs(nd(rng)));
  for (auto& v : x) v = host_from_float<T>(nd(rng));
  for (auto& v : bias) v = host_from_float<T>(nd(rng));
  for (auto& v : res) v = host_from_float<T>(nd(rng));
  int8_t* dq; float* ds; T *dx, *db, *dr, *dy;
  CHECK(cudaMalloc(&dq, q.size())); CHECK(cudaMalloc(&ds, n * 4)); CHECK(cudaMalloc(&dx, x.size() * sizeof(T)));
  CHECK(cudaMalloc(&db, n * sizeof(T))); CHECK(cudaMalloc(&dr, res.size() * sizeof(T)));
  CHECK(cudaMalloc(&dy, y.size() * sizeof(T)));
  CHECK(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(ds, scale.data(), n * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, bias.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dr, res.data(), res.size() * sizeof(T), cudaMemcpyHostToDevice));
  skinny::Params p{dx, dq, ds, with_bias ? db : nullptr, with_residual ? dr : nullptr, dy, m, n, k, relu};
  const int chunks_per_block = 4 * (m <= 8 ? 2 : 1);
  const bool tail = (k / 16) % chunks_per_block != 0;
  // the host's contract (skinny::launch, skinny_gemv.cuh): at most k-blocks warps and at most `tiles` blocks
  warps = std::max(1, std::min(warps, (k / 16 + chunks_per_block - 1) / chunks_per_block));
  blocks = std::max(1, std::min(blocks, (n + 15) / 16));
  if (m <= 8) {
    tail ? launch<T, 1, true>(p, warps, blocks) : launch<T, 1, false>(p, warps, blocks);
  } else {
    tail ? launch<T, 2, true>(p, warps, blocks) : launch<T, 2, false>(p, warps, blocks);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(y.data(), dy, y.size() * sizeof(T), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int c = 0; c < k; ++c) s += static_cast<double>(q[static_cast<size_t>(j) * k + c]) * host_to_float(x[static_cast<size_t>(i) * k + c]);
      s *= scale[j];
      if (with_bias) s += host_to_float(bias[j]);
      if (with_residual) s += host_to_float(res[static_cast<size_t>(i) * n + j]);
      if (relu && s < 0) s = 0;
      const double got = host_to_float(y[static_cast<size_t>(i) * n + j]);
      const double tol = 1e-2 * std::fabs(s) + 2e-2 + (sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16> ? 2e-2 * std::fabs(s) : 0);
      if (std::fabs(got - s) > tol && bad++ < 5) std::printf("  gemv mismatch m=%d n=%d: got %f want %f\n", i, j, got, s);
    }
  }
  std::printf("gemv %s M=%d N=%d K=%d bias=%d res=%d relu=%d warps=%d blocks=%d: %s\n",
              std::is_same_v<T, __half> ? "fp16" : "bf16", m, n, k, with_bias, with_residual, relu, warps, blocks,
              bad ? "FAIL" : "ok");
  cudaFree(dq); cudaFree(ds); cudaFree(dx); cudaFree(db); cudaFree(dr); cudaFree(dy);
  return bad != 0;
}

int run_quantize(int rows, int k, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<__half> x(static_cast<size_t>(rows) * k);
  for (auto& v : x) v = __float2half_rn(nd(rng));
  __half* dx; int8_t* dq; float* ds;
  CHECK(cudaMalloc(&dx, x.size() * 2)); CHECK(cudaMalloc(&dq, x.size())); CHECK(cudaMalloc(&ds, rows * 4));
  CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  if (k % 8 == 0) {
    int8::quantize_rows_kernel<__half, true><<<std::min(rows, 64), 128>>>(dx, dq, ds, rows, k);
  } else {
    int8::quantize_rows_kernel<__half, false><<<std::min(rows, 64), 128>>>(dx, dq, ds, rows, k);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<int8_t> q(x.size());
  std::vector<float> s(rows);
  CHECK(cudaMemcpy(q.data(), dq, q.size(), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(s.data(), ds, rows * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int r = 0; r < rows; ++r) {
    float amax = 0;
    for (int c = 0; c < k; ++c) amax = std::fmax(amax, std::fabs(__half2float(x[static_cast<size_t>(r) * k + c])));
    const float want_s = std::fmax(amax / 127.f, 1.17549435e-38f);
    if (s[r] != want_s && bad++ < 5) std::printf("  scale mismatch row %d: %g vs %g\n", r, s[r], want_s);
    for (int c = 0; c < k; ++c) {
      const float v = __half2float(x[static_cast<size_t>(r) * k + c]) / want_s;
      const int want = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(v))));
      if (q[static_cast<size_t>(r) * k + c] != want && bad++ < 5) std::printf("  q mismatch %d,%d\n", r, c);
    }
  }
  std::printf("quantize rows=%d K=%d: %s\n", rows, k, bad ? "FAIL" : "ok");
  cudaFree(dx); cudaFree(dq); cudaFree(ds);
  return bad != 0;
}

int run_dequantize(int rows, int k, std::mt19937& rng) {
  std::uniform_int_distribution<int> qd(-127, 127);
  std::vector<int8_t> q(static_cast<size_t>(rows) * k);
  std::vector<float> s(rows);
  for (auto& v : q) v = static_cast<int8_t>(qd(rng));
  for (int r = 0; r < rows; ++r) s[r] = 0.001f * (r + 1);
  int8_t* dq; float* ds; __half* dout;
  CHECK(cudaMalloc(&dq, q.size())); CHECK(cudaMalloc(&ds, rows * 4)); CHECK(cudaMalloc(&dout, q.size() * 2));
  CHECK(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(ds, s.data(), rows * 4, cudaMemcpyHostToDevice));
  if (k % 16 == 0) {
    int8::dequantize_kernel<__half, true><<<8, 256>>>(dq, ds, dout, rows, k);
  } else {
    int8::dequantize_kernel<__half, false><<<8, 256>>>(dq, ds, dout, rows, k);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<__half> out(q.size());
  CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (size_t e = 0; e < q.size(); ++e) {
    const float want = __half2float(__float2half_rn(static_cast<float>(q[e]) * s[e / k]));
    if (__half2float(out[e]) != want && bad++ < 5) std::printf("  dequant mismatch %zu\n", e);
  }
  std::printf("dequantize rows=%d K=%d: %s\n", rows, k, bad ? "FAIL" : "ok");
  cudaFree(dq); cudaFree(ds); cudaFree(dout);
  return bad != 0;
}

int main() {
  std::mt19937 rng(0);
  int fails = 0;
  const int shapes[][2] = {{40, 256}, {100, 192}, {33, 1040}, {512, 2048}};
  const int ms[] = {1, 5, 8, 9, 16};
  for (const auto& s : shapes) {
    for (int m : ms) {
      fails += run_gemv<__half>(m, s[0], s[1], true, false, m % 2 == 1, 4, 3, rng);
      fails += run_gemv<__half>(m, s[0], s[1], true, true, false, 16, 2, rng);
      fails += run_gemv<__nv_bfloat16>(m, s[0], s[1], false, true, false, 8, 5, rng);
    }
  }
  fails += run_quantize(7, 2048, rng) + run_quantize(5, 100, rng) + run_quantize(3, 24, rng);
  fails += run_dequantize(9, 256, rng) + run_dequantize(5, 100, rng);
  std::printf(fails ? "FAILED (%d)\n" : "all ok\n", fails);
  return fails ? 1 : 0;
}
