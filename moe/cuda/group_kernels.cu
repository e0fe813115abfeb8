#include "moe/cuda/group_kernels.h"

#include <algorithm>
#include <stdexcept>

#include "moe/cuda/elements.cuh"

namespace bulkhead::moe::cuda {
namespace {

// Each warp owns a segment of consecutive entries; segments are sized so that
// there are at most kMaxSegments (each warp sums the counts of the segments
// before its own).
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int64_t kMinSegment = 512;
constexpr int64_t kMaxSegments = 256;

// Entry e's group; -1 for none (a key outside [0, groups), or e past the end).
template <typename Key>
__device__ __forceinline__ long long groupOf(const GroupArgs& a, int64_t e, int64_t end) {
  if (e >= end) return -1;
  const Key value = static_cast<const Key*>(a.keys)[e / a.columns * a.rowStride + e % a.columns];
  if (!(value >= 0 && value < a.groups)) return -1;  // NaN included
  return static_cast<long long>(value);
}

// counts[s * groups + g]: entries of group g in segment s.
template <typename Key>
__global__ void countKernel(GroupArgs a, int64_t segment, int64_t segments) {
  const int64_t entries = a.entries, groups = a.groups;
  int32_t* counts = a.scratch;
  extern __shared__ int32_t histograms[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (s >= segments) return;  // whole warps only: no block-wide barrier follows
  int32_t* histogram = histograms + warp * groups;
  for (int64_t g = lane; g < groups; g += 32) histogram[g] = 0;
  __syncwarp();
  const int64_t end = min(entries, (s + 1) * segment);
  for (int64_t base = s * segment; base < end; base += 32) {
    const long long key = groupOf<Key>(a, base + lane, end);
    const unsigned same = __match_any_sync(0xffffffffu, key);
    if (key >= 0 && lane == __ffs(same) - 1) histogram[key] += __popc(same);
    __syncwarp();
  }
  for (int64_t g = lane; g < groups; g += 32) counts[s * groups + g] = histogram[g];
}

// Positions: group start (all earlier groups' entries) + this group's entries
// in earlier segments + the rank among the same group's entries before it in
// this segment. The first warp also writes the group ends.
template <typename Key>
__global__ void assignKernel(GroupArgs a, int64_t segment, int64_t segments) {
  const int64_t entries = a.entries, groups = a.groups;
  const int32_t* counts = a.scratch;
  extern __shared__ int64_t next[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (s >= segments) return;
  int64_t* position = next + warp * groups;
  int64_t carry = 0;  // entries of the groups before this chunk of 32
  for (int64_t chunk = 0; chunk < groups; chunk += 32) {
    const int64_t g = chunk + lane;
    int64_t before = 0, total = 0;
    if (g < groups) {
      for (int64_t t = 0; t < segments; ++t) {
        const int64_t n = counts[t * groups + g];
        total += n;
        if (t < s) before += n;
      }
    }
    int64_t inclusive = total;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (g < groups) position[g] = carry + inclusive - total + before;
    if (g < groups && s == 0 && a.ends != nullptr) a.ends[g] = static_cast<int32_t>(carry + inclusive);
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  __syncwarp();
  const int64_t end = min(entries, (s + 1) * segment);
  for (int64_t base = s * segment; base < end; base += 32) {
    const int64_t e = base + lane;
    const long long key = groupOf<Key>(a, e, end);
    const unsigned same = __match_any_sync(0xffffffffu, key);
    if (e < end) {
      if (key >= 0) {
        const int64_t at = position[key] + __popc(same & ((1u << lane) - 1u));
        a.table[e] = at;
        a.order[at] = e;
      } else {
        a.table[e] = -1;
      }
    }
    __syncwarp();
    if (key >= 0 && lane == __ffs(same) - 1) position[key] += __popc(same);
    __syncwarp();
  }
}

int64_t segmentOf(int64_t entries) {
  int64_t segment = std::max(kMinSegment, (entries + kMaxSegments - 1) / kMaxSegments);
  return (segment + 31) / 32 * 32;
}

template <typename Key>
void launchGrouping(const GroupArgs& args) {
  const int64_t segment = segmentOf(args.entries);
  const int64_t segments = (args.entries + segment - 1) / segment;
  const auto blocks = static_cast<unsigned>((segments + kWarps - 1) / kWarps);
  auto stream = static_cast<cudaStream_t>(args.stream);
  countKernel<Key><<<blocks, kThreads, kWarps * args.groups * sizeof(int32_t), stream>>>(args, segment, segments);
  checkLaunch("groupEntries count kernel launch");
  assignKernel<Key><<<blocks, kThreads, kWarps * args.groups * sizeof(int64_t), stream>>>(args, segment, segments);
  checkLaunch("groupEntries assign kernel launch");
}

}  // namespace

int64_t groupScratchInts(int64_t entries, int64_t groups) {
  const int64_t segment = segmentOf(entries);
  return std::max<int64_t>(1, (entries + segment - 1) / segment * groups);
}

void groupEntries(const GroupArgs& args) {
  if (args.groups < 1 || args.groups > kMaxGroups) throw std::runtime_error("groupEntries: groups out of range");
  if (args.columns < 1 || args.entries % args.columns != 0 || args.rowStride < args.columns)
    throw std::runtime_error("groupEntries: keys' columns and row stride do not describe the entries");
  if (args.entries == 0) {
    if (args.ends != nullptr) {
      cudaMemsetAsync(args.ends, 0, args.groups * sizeof(int32_t), static_cast<cudaStream_t>(args.stream));
      checkLaunch("groupEntries zeroing the group ends");
    }
    return;
  }
  switch (args.keyType) {
    case KeyType::Int64: launchGrouping<int64_t>(args); break;
    case KeyType::Float32: launchGrouping<float>(args); break;
    case KeyType::Float64: launchGrouping<double>(args); break;
  }
}

}  // namespace bulkhead::moe::cuda
