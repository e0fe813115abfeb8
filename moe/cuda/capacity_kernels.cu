#include "moe/cuda/capacity_kernels.h"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "moe/cuda/elements.cuh"

namespace bulkhead::moe::cuda {
namespace {

constexpr int kThreads = 256;

// Bits that hold 0..experts-1.
int expertBits(int64_t experts) {
  int bits = 0;
  while ((int64_t{1} << bits) < experts) ++bits;
  return bits;
}

// A float's bits flipped so that, as unsigned integers, larger floats come
// first (-0.0 after +0.0, as the packed keys of the ATen form order them).
__device__ __forceinline__ uint32_t descendingBits(float weight) {
  const uint32_t bits = __float_as_uint(weight);
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return ~ascending;
}

__global__ void keyKernel(CapacityArgs a, uint64_t* keys, int32_t* slots) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= a.slots) return;
  keys[s] = (static_cast<uint64_t>(a.indices[s]) << 32) | descendingBits(a.weights[s]);
  slots[s] = static_cast<int32_t>(s);
}

// Sorted entry i's expert starts at the first sorted key of that expert (a
// binary search of the sorted keys); its distance from there is its position.
__global__ void positionKernel(CapacityArgs a, const uint64_t* sortedKeys, const int32_t* sortedSlots) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.slots) return;
  const uint64_t expert = sortedKeys[i] >> 32;
  int64_t low = 0, high = i;  // the first entry with this expert is in [low, high]
  while (low < high) {
    const int64_t middle = (low + high) / 2;
    if ((sortedKeys[middle] >> 32) < expert)
      low = middle + 1;
    else
      high = middle;
  }
  a.position[sortedSlots[i]] = i - low;
}

constexpr int kRankThreads = 1024;

// One block per expert: its slots (weight keys and slot numbers) gathered into
// shared memory in any order, then each counts those ranked before it (a
// smaller key, or the same key at an earlier slot). More slots than `entries`
// at one expert (a bound the caller's routing broke) are counted from global
// memory instead: the same ranks, slower.
__global__ void __launch_bounds__(kRankThreads) expertRankKernel(CapacityArgs a, int64_t entries) {
  extern __shared__ uint32_t gathered[];  // keys [entries], then slots [entries]
  __shared__ unsigned int count;
  uint32_t *keys = gathered, *slots = gathered + entries;
  const int64_t expert = blockIdx.x;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  for (int64_t s = threadIdx.x; s < a.slots; s += blockDim.x) {
    if (a.indices[s] != expert) continue;
    const unsigned int i = atomicAdd(&count, 1u);
    if (i < entries) {
      keys[i] = descendingBits(a.weights[s]);
      slots[i] = static_cast<uint32_t>(s);
    }
  }
  __syncthreads();
  const int64_t n = count;
  if (n <= entries) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const uint32_t key = keys[i], slot = slots[i];
      int64_t before = 0;
      for (int64_t j = 0; j < n; ++j) before += keys[j] < key || (keys[j] == key && slots[j] < slot);
      a.position[slot] = before;
    }
    return;
  }
  for (int64_t s = threadIdx.x; s < a.slots; s += blockDim.x) {
    if (a.indices[s] != expert) continue;
    const uint32_t key = descendingBits(a.weights[s]);
    int64_t before = 0;
    for (int64_t t = 0; t < a.slots; ++t) {
      if (a.indices[t] != expert) continue;
      const uint32_t other = descendingBits(a.weights[t]);
      before += other < key || (other == key && t < s);
    }
    a.position[s] = before;
  }
}

// The slots one block can hold in shared memory on the current device (8 bytes
// each), past the 48 KiB every launch gets only by opting in.
int64_t sharedEntries() {
  int device = 0, optIn = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optIn, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();  // not a fault: rank only what the default holds
    optIn = 48 * 1024;
  }
  return (optIn - 1024) / static_cast<int64_t>(2 * sizeof(uint32_t));
}

// Small batches, at most kRankMeanSlots slots an expert on average and an
// expert's bound in shared memory, rank at each expert (each block's work
// grows with the square of its expert's slots); the rest sort.
bool ranksPerExpert(const CapacityArgs& a) {
  const int64_t bound = a.expertBound > 0 ? a.expertBound : a.slots;
  return a.slots <= kRankSlots && a.experts <= kRankExperts && a.slots <= kRankMeanSlots * a.experts &&
         bound <= sharedEntries();
}

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The sort's scratch: keys and slots in, keys and slots sorted, cub's own.
struct Layout {
  size_t keys = 0, slots = 0, sortBytes = 0, total = 0;
};

Layout layout(const CapacityArgs& a) {
  Layout l;
  const int64_t slots = a.slots, experts = a.experts;
  if (slots == 0 || ranksPerExpert(a)) return l;
  l.keys = aligned(sizeof(uint64_t) * static_cast<size_t>(slots));
  l.slots = aligned(sizeof(int32_t) * static_cast<size_t>(slots));
  cub::DoubleBuffer<uint64_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> values(nullptr, nullptr);
  if (cub::DeviceRadixSort::SortPairs(nullptr, l.sortBytes, keys, values, static_cast<int>(slots), 0,
                                      32 + expertBits(experts)) != cudaSuccess)
    throw std::runtime_error("capacityPositions: cub could not size its sort");
  l.total = 2 * l.keys + 2 * l.slots + aligned(l.sortBytes);
  return l;
}

void rankPerExpert(const CapacityArgs& args) {
  const int64_t entries = std::min(args.slots, args.expertBound > 0 ? args.expertBound : args.slots);
  const size_t bytes = 2 * sizeof(uint32_t) * static_cast<size_t>(entries);
  if (bytes > 48 * 1024) {
    const cudaError_t status =
        cudaFuncSetAttribute(expertRankKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw ConfigError(std::string("capacity ranks: ") + std::to_string(bytes) +
                            " bytes of shared memory refused: " + cudaGetErrorString(status),
                        {.expected = "a GPU whose blocks may opt in to that much shared memory"});
    }
  }
  expertRankKernel<<<static_cast<unsigned>(args.experts), kRankThreads, bytes,
                     static_cast<cudaStream_t>(args.stream)>>>(args, entries);
  checkLaunch("capacity rank kernel launch");
}

void sortAll(const CapacityArgs& args, const Layout& l) {
  auto* base = static_cast<char*>(args.scratch);
  auto* keysIn = reinterpret_cast<uint64_t*>(base);
  auto* keysOut = reinterpret_cast<uint64_t*>(base + l.keys);
  auto* slotsIn = reinterpret_cast<int32_t*>(base + 2 * l.keys);
  auto* slotsOut = reinterpret_cast<int32_t*>(base + 2 * l.keys + l.slots);
  void* sortScratch = base + 2 * l.keys + 2 * l.slots;
  auto stream = static_cast<cudaStream_t>(args.stream);
  const auto blocks = static_cast<unsigned>((args.slots + kThreads - 1) / kThreads);
  keyKernel<<<blocks, kThreads, 0, stream>>>(args, keysIn, slotsIn);
  checkLaunch("capacity key kernel launch");
  cub::DoubleBuffer<uint64_t> keys(keysIn, keysOut);
  cub::DoubleBuffer<int32_t> values(slotsIn, slotsOut);
  size_t sortBytes = l.sortBytes;
  const cudaError_t sorted = cub::DeviceRadixSort::SortPairs(
      sortScratch, sortBytes, keys, values, static_cast<int>(args.slots), 0, 32 + expertBits(args.experts), stream);
  if (sorted != cudaSuccess)
    throw Error(std::string("capacity sort failed: ") + cudaGetErrorString(sorted),
                {.expected = "no fault on the device; restart the job from its last checkpoint"});
  checkLaunch("capacity sort launch");
  positionKernel<<<blocks, kThreads, 0, stream>>>(args, keys.Current(), values.Current());
  checkLaunch("capacity position kernel launch");
}

}  // namespace

size_t capacityScratchBytes(const CapacityArgs& args) { return layout(args).total; }

void capacityPositions(const CapacityArgs& args) {
  if (args.slots < 0 || args.slots > kMaxCapacitySlots || args.experts <= 0 || args.experts > (int64_t{1} << 31))
    throw std::runtime_error("capacityPositions: slots in [0, 2^31) and experts in [1, 2^31]");
  if (args.slots == 0) return;
  if (ranksPerExpert(args))
    rankPerExpert(args);
  else
    sortAll(args, layout(args));
}

}  // namespace bulkhead::moe::cuda
