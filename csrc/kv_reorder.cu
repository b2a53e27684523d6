// KV-cache beam reorder: the op fuseinfer_C::kv_reorder.
//
// A beam-search step makes every row r whose parent beam is another row continue from that row's cache:
// kv[l, c, r, h, j] = kv[l, c, parent[r], h, j] for every layer l, k/v c, head h and slot j in
// [start, start + min(count, max_count)) clipped to [0, T), with "all reads before any write" semantics (beams may
// swap: a row can be a source and a destination in one step). start and count are DEVICE tensors (the prompt
// length and the step counter of a beam search), so the op runs inside a CUDA graph and never syncs the host;
// max_count (a host int) only sizes the grid. Rows whose parent is themselves (or outside [0, R)) are left alone.
//
// One launch, no scratch buffer, and still "all reads first": a block owns one tile, the same (layer, k/v, head,
// run of units of the slot span) of EVERY row. It loads the tile of every moving row's parent into shared memory,
// __syncthreads(), then writes every moving row's tile. No other block reads or writes any element of that tile
// (tiles of different blocks are disjoint sets of (layer, k/v, head, element) positions, and a copy only moves
// data between rows at one position), so the block-level barrier orders every read of a position before every
// write of it. Units are 16-byte vectors when the head dim's bytes and the base pointer allow (else 8, 4, 2).
// Launched with PDL (launch.h): the cache, parent, start and count come from earlier kernels, so everything is
// read after pdl_wait() with coherent loads (ld_dep_as).

#include "launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>

namespace fuseinfer {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTileBytes = 32 * 1024;  // shared memory for the tile's data (every row), below the 48 KB default
constexpr int64_t kMaxRows = 2048;         // kTileBytes + the parents stay below 48 KB at one 16-byte unit per row
constexpr int kMaxGridY = 65535;

struct ReorderParams {
  char* kv;               // (L, 2, R, H, T, D) contiguous
  const int64_t* parent;  // (R,)
  const int64_t* start;   // (1,) first slot
  const int64_t* count;   // (1,) slots to copy (at most max_count)
  int64_t parent_stride;
  int64_t R, H, T;
  int64_t max_count;
  int64_t slot_units;  // units per slot (D * element size / unit size)
  int64_t tile_units;  // units of one row in one tile
};

// Shared memory: the parents (R int32, rounded up to 16 bytes), then the tile (R, tile_units) units.
__host__ __device__ constexpr int64_t tile_offset(int64_t rows) { return (rows * 4 + 15) / 16 * 16; }

// grid (L * 2 * H, y), block kThreads, dynamic smem tile_offset(R) + R * tile_units * sizeof(U): block (x, y) serves
// the tiles x (layer-k/v-head) and y, y + gridDim.y, ... of the slot span. U: the unit one thread moves.
template <typename U>
__global__ void __launch_bounds__(kThreads) kv_reorder_kernel(const ReorderParams p) {
  extern __shared__ uint4 smem_raw[];
  int* par = reinterpret_cast<int*>(smem_raw);                                              // (R,)
  U* tile = reinterpret_cast<U*>(reinterpret_cast<char*>(smem_raw) + tile_offset(p.R));  // (R, tile_units)
  pdl_launch_dependents();
  pdl_wait();  // the cache, parent, start and count are written by earlier kernels
  const int64_t start = ld_dep_as(p.start), count = std::min(ld_dep_as(p.count), p.max_count);
  const int64_t lo = std::max<int64_t>(start, 0), hi = std::min(start + std::max<int64_t>(count, 0), p.T);
  if (hi <= lo) return;
  const int64_t span = (hi - lo) * p.slot_units;  // units of one row to copy
  for (int64_t r = threadIdx.x; r < p.R; r += kThreads) {
    const int64_t src = ld_dep_as(p.parent + r * p.parent_stride);
    par[r] = (src == r || src < 0 || src >= p.R) ? -1 : static_cast<int>(src);  // -1: the row stays
  }
  __syncthreads();
  // row r of this (layer, k/v, head): kv + ((o * R + r) * H + h) * T * D, o = layer * 2 + k/v; x = o * H + h
  const int64_t o = blockIdx.x / p.H, h = blockIdx.x % p.H;
  const int64_t row_units = p.T * p.slot_units;
  U* base = reinterpret_cast<U*>(p.kv) + (o * p.R * p.H + h) * row_units + lo * p.slot_units;  // row 0
  const int64_t row_step = p.H * row_units;  // units from row r to row r + 1
  const int64_t n = p.R * p.tile_units;
  for (int64_t first = int64_t(blockIdx.y) * p.tile_units; first < span; first += int64_t(gridDim.y) * p.tile_units) {
    const int64_t width = std::min(p.tile_units, span - first);
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {  // every read of the tile ...
      const int64_t r = i / p.tile_units, u = i % p.tile_units;
      if (u < width && par[r] >= 0) tile[i] = ld_dep_as(base + par[r] * row_step + first + u);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {  // ... before any write of it
      const int64_t r = i / p.tile_units, u = i % p.tile_units;
      if (u < width && par[r] >= 0) base[r * row_step + first + u] = tile[i];
    }
    __syncthreads();  // (the next tile reuses the shared memory)
  }
}

template <typename U>
void launch(ReorderParams p, int64_t outer, cudaStream_t stream) {
  p.slot_units /= sizeof(U);  // (slot_units came in bytes)
  // a tile: as many units per row as fit kTileBytes over all rows, at most the longest span (max_count or T slots)
  const int64_t longest = std::min(p.max_count, p.T) * p.slot_units;
  p.tile_units = std::max<int64_t>(1, std::min(kTileBytes / (p.R * int64_t(sizeof(U))), longest));
  const int64_t tiles = (longest + p.tile_units - 1) / p.tile_units;
  const size_t smem = tile_offset(p.R) + p.R * p.tile_units * sizeof(U);
  TORCH_CHECK(outer <= INT32_MAX, "kv_reorder_cuda: too many layers x heads");
  const dim3 grid(static_cast<unsigned>(outer), static_cast<unsigned>(std::min<int64_t>(tiles, kMaxGridY)));
  launch_kernel(kv_reorder_kernel<U>, grid, kThreads, smem, stream, p);
}

}  // namespace

void kv_reorder_cuda(at::Tensor& kv, const at::Tensor& parent, const at::Tensor& start, const at::Tensor& count,
                     int64_t max_count) {
  TORCH_CHECK(kv.is_cuda() && parent.is_cuda() && start.is_cuda() && count.is_cuda(),
              "kv_reorder_cuda: all tensors must be CUDA tensors");
  TORCH_CHECK(parent.device() == kv.device() && start.device() == kv.device() && count.device() == kv.device(),
              "kv_reorder_cuda: all tensors must be on one device");
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2 && kv.is_contiguous(),
              "kv_reorder_cuda: the cache must be a contiguous (L, 2, R, H, T, D) tensor, got ", kv.sizes());
  const int64_t L = kv.size(0), R = kv.size(2), H = kv.size(3), T = kv.size(4), D = kv.size(5);
  TORCH_CHECK(parent.scalar_type() == at::kLong && parent.dim() == 1 && parent.size(0) == R,
              "kv_reorder_cuda: parent must be an (R,) = (", R, ",) int64 tensor, got ", parent.scalar_type(), " ",
              parent.sizes());
  TORCH_CHECK(start.scalar_type() == at::kLong && start.numel() == 1 && count.scalar_type() == at::kLong &&
                  count.numel() == 1,
              "kv_reorder_cuda: start and count must be one-element int64 tensors");
  TORCH_CHECK(max_count >= 0, "kv_reorder_cuda: max_count must be >= 0, got ", max_count);
  const int64_t esize = kv.element_size();
  TORCH_CHECK(esize >= 2 && esize <= 8, "kv_reorder_cuda: elements of 2 to 8 bytes, got ", esize);
  TORCH_CHECK(R <= kMaxRows, "kv_reorder_cuda: at most ", kMaxRows, " rows, got ", R);
  if (kv.numel() == 0 || max_count == 0 || R < 2) return;

  const at::cuda::CUDAGuard guard(kv.device());
  ReorderParams p{};
  p.kv = static_cast<char*>(kv.data_ptr());
  p.parent = parent.data_ptr<int64_t>();
  p.parent_stride = parent.stride(0);
  p.start = start.data_ptr<int64_t>();
  p.count = count.data_ptr<int64_t>();
  p.R = R, p.H = H, p.T = T;
  p.max_count = max_count;
  const int64_t slot_bytes = D * esize;
  p.slot_units = slot_bytes;  // bytes here; launch divides by the unit
  const auto addr = reinterpret_cast<uintptr_t>(p.kv);
  const auto fits = [&](int64_t unit) { return slot_bytes % unit == 0 && addr % unit == 0; };
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t outer = L * 2 * H;
  if (fits(16))
    launch<uint4>(p, outer, stream);
  else if (fits(8))
    launch<uint2>(p, outer, stream);
  else if (fits(4))
    launch<unsigned>(p, outer, stream);
  else
    launch<unsigned short>(p, outer, stream);
}


// For every row r with parent[r] != r: kv[:, :, r, :, j] = kv[:, :, parent[r], :, j] for the slots j in
// [start, start + min(count, max_count)) clipped to [0, T), all reads before any write (beams may swap).
// kv: (L, 2, R, H, T, D) contiguous, elements of 2-8 bytes; parent: (R,) int64; start, count: (1,) int64 device
// tensors (no host sync).
TORCH_LIBRARY_FRAGMENT(fuseinfer_C, m) {
  m.def("kv_reorder(Tensor(a!) kv, Tensor parent, Tensor start, Tensor count, int max_count) -> ()");
}

TORCH_LIBRARY_IMPL(fuseinfer_C, CUDA, m) { m.impl("kv_reorder", &kv_reorder_cuda); }

}  // namespace fuseinfer
