#include "moe/cuda/route_kernels.h"

#include <cstdint>
#include <initializer_list>
#include <stdexcept>

#include "moe/cuda/elements.cuh"

namespace bulkhead::moe::cuda {
namespace {

constexpr int kThreads = 256;
// Counters a block keeps in shared memory before adding them to the global
// ones (one global atomic per counter and block, not per slot).
constexpr int64_t kMaxSharedCounters = 8192;

// One thread per token. Counters per rank: L local experts, rows, invalid.
template <bool kPerSlot>
__global__ void planKernel(RouteArgs a, int64_t* counts, int64_t* key, bool sharedCounters) {
  extern __shared__ unsigned int blockCounts[];
  const int64_t perRank = a.localExperts + 2, counters = a.ranks * perRank, experts = a.ranks * a.localExperts;
  if (sharedCounters) {
    for (int64_t i = threadIdx.x; i < counters; i += blockDim.x) blockCounts[i] = 0;
    __syncthreads();
  }
  auto add = [&](int64_t counter) {
    if (sharedCounters)
      atomicAdd(blockCounts + counter, 1u);
    else
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + counter), 1ull);
  };
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < a.tokens) {
    uint64_t ranksHit = 0;
    for (int64_t j = 0; j < a.topK; ++j) {
      const int64_t slot = t * a.topK + j, expert = a.indices[slot];
      const bool valid = expert >= 0 && expert < experts;
      if (a.keep[slot] && !valid)
        for (int64_t rank = 0; rank < a.ranks; ++rank) add(rank * perRank + a.localExperts + 1);
      const bool sent = a.keep[slot] && valid;
      const int64_t rank = sent ? expert / a.localExperts : a.ranks;
      if (sent) add(rank * perRank + expert % a.localExperts);
      if constexpr (kPerSlot) {
        key[slot] = rank;
        if (sent) add(rank * perRank + a.localExperts);
      } else if (sent) {
        ranksHit |= 1ull << rank;
      }
    }
    if constexpr (!kPerSlot) {
      for (int64_t rank = 0; rank < a.ranks; ++rank) {
        const bool hit = (ranksHit >> rank) & 1ull;
        key[t * a.ranks + rank] = hit ? rank : a.ranks;
        if (hit) add(rank * perRank + a.localExperts);
      }
    }
  }
  if (sharedCounters) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < counters; i += blockDim.x)
      if (blockCounts[i] != 0) atomicAdd(reinterpret_cast<unsigned long long*>(counts + i), blockCounts[i]);
  }
}

// One block per token: its row is read once and written to every send row
// that carries it.
template <typename Chunk, typename Side, bool kPerSlot>
__global__ void packKernel(PackArgs p) {
  __shared__ int64_t rowAt[kMaxRouteColumns];
  const RouteArgs& a = p.route;
  const int64_t t = blockIdx.x, columns = kPerSlot ? a.topK : a.ranks;
  for (int64_t c = threadIdx.x; c < columns; c += blockDim.x) rowAt[c] = p.table[t * columns + c];
  __syncthreads();
  auto* rows = static_cast<char*>(p.rows);
  const auto* token = reinterpret_cast<const Chunk*>(static_cast<const char*>(p.tokens) + t * p.rowBytes);
  for (int64_t i = threadIdx.x; i < p.rowBytes / static_cast<int64_t>(sizeof(Chunk)); i += blockDim.x) {
    const Chunk value = token[i];
    for (int64_t c = 0; c < columns; ++c)
      if (rowAt[c] >= 0) reinterpret_cast<Chunk*>(rows + rowAt[c] * p.width)[i] = value;
  }
  const auto* weights = static_cast<const Side*>(p.weights);
  const int64_t sides = kPerSlot ? columns : columns * a.topK;
  for (int64_t i = threadIdx.x; i < sides; i += blockDim.x) {
    const int64_t c = kPerSlot ? i : i / a.topK, j = kPerSlot ? 0 : i % a.topK;
    if (rowAt[c] < 0) continue;
    auto* side = reinterpret_cast<Side*>(rows + rowAt[c] * p.width + p.sideOffset);
    const int64_t slot = t * a.topK + (kPerSlot ? c : j), expert = a.indices[slot];
    const bool here =
        kPerSlot || (a.keep[slot] && expert >= 0 && expert < a.ranks * a.localExperts && expert / a.localExperts == c);
    const int64_t m = kPerSlot ? 1 : a.topK;
    side[j] = weights[slot];
    side[m + j] = here ? static_cast<Side>(expert % a.localExperts) : Side(-1);
  }
}

// One block per source row.
template <typename Chunk>
__global__ void expandKernel(ExpandArgs e) {
  __shared__ int64_t rowAt[kMaxRouteColumns];
  const int64_t p = blockIdx.x;
  for (int64_t c = threadIdx.x; c < e.columns; c += blockDim.x) rowAt[c] = e.table[p * e.columns + c];
  __syncthreads();
  const auto* source = reinterpret_cast<const Chunk*>(static_cast<const char*>(e.source) + p * e.sourceStride);
  auto* out = static_cast<char*>(e.out);
  for (int64_t i = threadIdx.x; i < e.rowBytes / static_cast<int64_t>(sizeof(Chunk)); i += blockDim.x) {
    const Chunk value = source[i];
    for (int64_t c = 0; c < e.columns; ++c)
      if (rowAt[c] >= 0) reinterpret_cast<Chunk*>(out + rowAt[c] * e.rowBytes)[i] = value;
  }
}

// One warp per row, a block's warps on consecutive rows, striding over them: a
// row before its group's first to clear is skipped whole (one group: the walk
// starts at the first), so short tails cost little more than the launch.
template <typename Chunk>
__global__ void zeroTailKernel(ZeroTailArgs z) {
  const int64_t groupRows = z.count / z.groups;
  const int64_t chunks = z.rowBytes / static_cast<int64_t>(sizeof(Chunk));
  const int64_t start = z.groups == 1 && *z.first > 0 ? *z.first : 0;
  const int64_t warps = blockDim.x / 32, lane = threadIdx.x % 32;
  for (int64_t row = start + blockIdx.x * warps + threadIdx.x / 32; row < z.count; row += gridDim.x * warps) {
    if (row % groupRows < z.first[row / groupRows]) continue;
    auto* out = reinterpret_cast<Chunk*>(static_cast<char*>(z.rows) + row * z.rowBytes);
    for (int64_t i = lane; i < chunks; i += 32) out[i] = Chunk{};
  }
}

// The widest of 16, 4 or 1 bytes that divides every size and address.
int chunkBytes(std::initializer_list<int64_t> sizes, std::initializer_list<const void*> bases) {
  for (int bytes : {16, 4}) {
    bool fits = true;
    for (int64_t size : sizes) fits = fits && size % bytes == 0;
    for (const void* base : bases) fits = fits && reinterpret_cast<uintptr_t>(base) % bytes == 0;
    if (fits) return bytes;
  }
  return 1;
}

template <typename Side, bool kPerSlot>
void launchPack(const PackArgs& p, int chunk, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(p.route.tokens);
  if (chunk == 16)
    packKernel<uint4, Side, kPerSlot><<<blocks, kThreads, 0, stream>>>(p);
  else if (chunk == 4)
    packKernel<uint32_t, Side, kPerSlot><<<blocks, kThreads, 0, stream>>>(p);
  else
    packKernel<uint8_t, Side, kPerSlot><<<blocks, kThreads, 0, stream>>>(p);
}

}  // namespace

void planRoutes(const RouteArgs& args, int64_t* counts, int64_t* key) {
  if (!args.perSlot && args.ranks > kMaxRouteRanks) throw std::runtime_error("planRoutes: more than 64 ranks");
  if (args.tokens == 0) return;
  const auto blocks = static_cast<unsigned>((args.tokens + kThreads - 1) / kThreads);
  const int64_t counters = args.ranks * (args.localExperts + 2);
  const bool shared = counters <= kMaxSharedCounters;
  const size_t sharedBytes = shared ? counters * sizeof(unsigned int) : 0;
  auto stream = static_cast<cudaStream_t>(args.stream);
  if (args.perSlot)
    planKernel<true><<<blocks, kThreads, sharedBytes, stream>>>(args, counts, key, shared);
  else
    planKernel<false><<<blocks, kThreads, sharedBytes, stream>>>(args, counts, key, shared);
  checkLaunch("route planning kernel launch");
}

void packRoutes(const PackArgs& args) {
  const int64_t columns = args.route.perSlot ? args.route.topK : args.route.ranks;
  if (columns > kMaxRouteColumns) throw std::runtime_error("packRoutes: more than 64 columns");
  if (args.sideBytes != 4 && args.sideBytes != 8) throw std::runtime_error("packRoutes: side type of 4 or 8 bytes");
  if (args.route.tokens == 0) return;
  const int chunk = chunkBytes({args.rowBytes, args.width}, {args.tokens, args.rows});
  auto stream = static_cast<cudaStream_t>(args.route.stream);
  if (args.sideBytes == 4) {
    args.route.perSlot ? launchPack<float, true>(args, chunk, stream) : launchPack<float, false>(args, chunk, stream);
  } else {
    args.route.perSlot ? launchPack<double, true>(args, chunk, stream) : launchPack<double, false>(args, chunk, stream);
  }
  checkLaunch("route packing kernel launch");
}

void expandRows(const ExpandArgs& args) {
  if (args.columns > kMaxRouteColumns) throw std::runtime_error("expandRows: more than 64 columns");
  if (args.sourceRows == 0) return;
  const int chunk = chunkBytes({args.rowBytes, args.sourceStride}, {args.source, args.out});
  const auto blocks = static_cast<unsigned>(args.sourceRows);
  auto stream = static_cast<cudaStream_t>(args.stream);
  if (chunk == 16)
    expandKernel<uint4><<<blocks, kThreads, 0, stream>>>(args);
  else if (chunk == 4)
    expandKernel<uint32_t><<<blocks, kThreads, 0, stream>>>(args);
  else
    expandKernel<uint8_t><<<blocks, kThreads, 0, stream>>>(args);
  checkLaunch("row expansion kernel launch");
}

void zeroTail(const ZeroTailArgs& args) {
  if (args.groups <= 0 || args.count % args.groups != 0)
    throw std::runtime_error("zeroTail: the rows must be a whole number of groups, at least one");
  if (args.count == 0 || args.rowBytes == 0) return;
  const int chunk = chunkBytes({args.rowBytes}, {args.rows});
  const int64_t warpsPerBlock = kThreads / 32, rowBlocks = (args.count + warpsPerBlock - 1) / warpsPerBlock;
  const auto blocks = static_cast<unsigned>(rowBlocks < 8192 ? rowBlocks : 8192);
  auto stream = static_cast<cudaStream_t>(args.stream);
  if (chunk == 16)
    zeroTailKernel<uint4><<<blocks, kThreads, 0, stream>>>(args);
  else if (chunk == 4)
    zeroTailKernel<uint32_t><<<blocks, kThreads, 0, stream>>>(args);
  else
    zeroTailKernel<uint8_t><<<blocks, kThreads, 0, stream>>>(args);
  checkLaunch("tail zeroing kernel launch");
}

}  // namespace bulkhead::moe::cuda
