#include "moe/cuda/capacity_kernels.h"

#include <cub/device/device_radix_sort.cuh>

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

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The sort's scratch: keys and slots in, keys and slots sorted, cub's own.
struct Layout {
  size_t keys = 0, slots = 0, sortBytes = 0, total = 0;
};

Layout layout(int64_t slots, int64_t experts) {
  Layout l;
  if (slots == 0) return l;
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

size_t capacityScratchBytes(int64_t slots, int64_t experts) { return layout(slots, experts).total; }

void capacityPositions(const CapacityArgs& args) {
  if (args.slots < 0 || args.slots > kMaxCapacitySlots || args.experts <= 0 || args.experts > (int64_t{1} << 31))
    throw std::runtime_error("capacityPositions: slots in [0, 2^31) and experts in [1, 2^31]");
  if (args.slots == 0) return;
  sortAll(args, layout(args.slots, args.experts));
}

}  // namespace bulkhead::moe::cuda
