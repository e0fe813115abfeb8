#pragma once
// Internal to the checkpoint library: where the elements of one saved chunk
// land in a destination region, and the copy that moves them.

#include <cstdint>
#include <vector>

#include "checkpoint/chunking.h"
#include "checkpoint/manifest.h"

namespace bulkhead::checkpoint {

// A box of elements in two strided layouts (strides in elements), with
// adjacent dimensions merged where both sides are contiguous across them, so a
// box that spans whole rows is one run.
struct Box {
  int64_t source = 0, target = 0;  // first element, in each layout
  std::vector<int64_t> length, sourceStrides, targetStrides;

  void merge();
  // One contiguous run on both sides (after merge()).
  bool singleRun() const;
  int64_t elements() const;
};

// Copies the box's elements from `source` (a chunk) to `target`.
void copyBox(const uint8_t* source, uint8_t* target, const Box& box, int64_t elementSize);

// Row-major strides of `dims`, in elements.
std::vector<int64_t> contiguousStrides(const std::vector<int64_t>& dims);

// The region a destination covers: its offsets in the global tensor, its
// shape ([1] for a scalar) and its strides in elements.
struct Region {
  std::vector<int64_t> offsets, shape, strides;
};

// Where the overlap of chunk `chunk` of `slice` (stored as `plan`) and
// `region` lies in each.
Box boxOf(const ChunkPlan& plan, int64_t chunk, const SliceRecord& slice, const Region& region);

}  // namespace bulkhead::checkpoint
