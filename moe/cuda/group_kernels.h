#pragma once
// CUDA kernels behind moe::groupByKey (moe/dispatch_routes.h), on raw pointers so
// this header and its .cu need no libtorch. Launched on `stream`; they never
// synchronize.
//
// keys[e] is entry e's group (0 <= key < groups); any other value is none. The entries
// are listed group by group, in entry order within a group (a stable sort by
// key, done as counts and per-warp ranks: no atomics on positions, so the
// result never depends on timing):
//   order[position] = e          for the `count` assigned entries
//   table[e] = position, or -1 for the entries of no group
//   ends[g] = the entries of groups 0..g (at::_grouped_mm's group ends), where asked

#include <cstdint>

namespace bulkhead::moe::cuda {

struct GroupArgs {
  int64_t entries = 0;
  int64_t groups = 0;
  const int64_t* keys = nullptr;
  int64_t* order = nullptr;
  int64_t* table = nullptr;
  int32_t* ends = nullptr;     // [groups], or null
  int32_t* scratch = nullptr;  // groupScratchInts(entries, groups) ints of device memory
  void* stream = nullptr;      // cudaStream_t
};

// The most groups the kernels take (their per-warp counters live in shared memory).
constexpr int64_t kMaxGroups = 512;
int64_t groupScratchInts(int64_t entries, int64_t groups);
void groupEntries(const GroupArgs& args);

}  // namespace bulkhead::moe::cuda
