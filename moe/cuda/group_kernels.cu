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
__device__ __forceinline__ long long groupOf(const int64_t* keys, int64_t e, int64_t end, int64_t groups) {
  const long long key = e < end ? keys[e] : -1;
  return key < groups ? key : -1;
}

// counts[s * groups + g]: entries of group g in segment s.
__global__ void countKernel(const int64_t* keys, int64_t entries, int64_t groups, int64_t segment, int64_t segments,
                            int32_t* counts) {
  extern __shared__ int32_t histograms[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (s >= segments) return;  // whole warps only: no block-wide barrier follows
  int32_t* histogram = histograms + warp * groups;
  for (int64_t g = lane; g < groups; g += 32) histogram[g] = 0;
  __syncwarp();
  const int64_t end = min(entries, (s + 1) * segment);
  for (int64_t base = s * segment; base < end; base += 32) {
    const long long key = groupOf(keys, base + lane, end, groups);
    const unsigned same = __match_any_sync(0xffffffffu, key);
    if (key >= 0 && lane == __ffs(same) - 1) histogram[key] += __popc(same);
    __syncwarp();
  }
  for (int64_t g = lane; g < groups; g += 32) counts[s * groups + g] = histogram[g];
}

// Positions: group start (all earlier groups' entries) + this group's entries
// in earlier segments + the rank among the same group's entries before it in
// this segment. The first warp also writes the group ends, where asked.
__global__ void assignKernel(const int64_t* keys, int64_t entries, int64_t groups, int64_t segment, int64_t segments,
                             const int32_t* counts, int64_t* order, int64_t* table, int32_t* ends) {
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
    if (g < groups && s == 0 && ends != nullptr) ends[g] = static_cast<int32_t>(carry + inclusive);
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  __syncwarp();
  const int64_t end = min(entries, (s + 1) * segment);
  for (int64_t base = s * segment; base < end; base += 32) {
    const int64_t e = base + lane;
    const long long key = groupOf(keys, e, end, groups);
    const unsigned same = __match_any_sync(0xffffffffu, key);
    if (e < end) {
      if (key >= 0) {
        const int64_t at = position[key] + __popc(same & ((1u << lane) - 1u));
        table[e] = at;
        order[at] = e;
      } else {
        table[e] = -1;
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

}  // namespace

int64_t groupScratchInts(int64_t entries, int64_t groups) {
  const int64_t segment = segmentOf(entries);
  return std::max<int64_t>(1, (entries + segment - 1) / segment * groups);
}

void groupEntries(const GroupArgs& args) {
  if (args.groups < 1 || args.groups > kMaxGroups) throw std::runtime_error("groupEntries: groups out of range");
  if (args.entries == 0) {
    if (args.ends != nullptr) {
      cudaMemsetAsync(args.ends, 0, args.groups * sizeof(int32_t), static_cast<cudaStream_t>(args.stream));
      checkLaunch("groupEntries zeroing the group ends");
    }
    return;
  }
  const int64_t segment = segmentOf(args.entries);
  const int64_t segments = (args.entries + segment - 1) / segment;
  const auto blocks = static_cast<unsigned>((segments + kWarps - 1) / kWarps);
  auto stream = static_cast<cudaStream_t>(args.stream);
  countKernel<<<blocks, kThreads, kWarps * args.groups * sizeof(int32_t), stream>>>(
      args.keys, args.entries, args.groups, segment, segments, args.scratch);
  checkLaunch("groupEntries count kernel launch");
  assignKernel<<<blocks, kThreads, kWarps * args.groups * sizeof(int64_t), stream>>>(
      args.keys, args.entries, args.groups, segment, segments, args.scratch, args.order, args.table, args.ends);
  checkLaunch("groupEntries assign kernel launch");
}

}  // namespace bulkhead::moe::cuda
