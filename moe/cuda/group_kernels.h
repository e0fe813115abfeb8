#pragma once
// CUDA kernels behind moe::groupByKey (moe/routes.h), on raw pointers so
// this header and its .cu need no libtorch. Launched on `stream`; they never
// synchronize.
//
// Entry e's key is its group (0 <= key < groups); any other value is none.
// The keys may be integers or small integers held in floating point (the
// routing ids that travel beside the tokens), read where they lie: entry e at
// (e / columns) * rowStride + e % columns. The entries are listed group by
// group, in entry order within a group (a stable sort by key, done as counts
// and per-warp ranks: no atomics on positions, so the result never depends on
// timing):
//   order[position] = e          for the `count` assigned entries
//   table[e] = position, or -1 for the entries of no group
//   ends[g] = the entries of groups 0..g (at::_grouped_mm's group ends), where asked

#include <cstdint>

namespace bulkhead::moe::cuda {

enum class KeyType { Int64, Float32, Float64 };

struct GroupArgs {
  int64_t entries = 0;
  int64_t groups = 0;
  const void* keys = nullptr;
  KeyType keyType = KeyType::Int64;
  int64_t columns = 1, rowStride = 1;  // in elements; entries a multiple of columns
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
