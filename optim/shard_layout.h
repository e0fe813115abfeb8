#pragma once
// How the distributed optimizer cuts one bucket of parameters (one group, one
// dtype) across the ranks of its data-parallel group. Pure arithmetic: every
// rank computes the same layout from the same shapes.
//
// The parameters lie end to end in a flat buffer, in bucket order. The buffer
// is cut into one contiguous shard per rank, each cut on a row boundary of
// some parameter (the boundary nearest to the balanced cut k * total /
// ranks). A parameter's rows run over all its dimensions but the last (an
// expert weight [E, H, F] has E * H rows of F), so shards stay balanced when a
// rank holds a single expert; the rows of a parameter a rank holds export as
// a few boxes (rowBoxes). Shards may be empty (fewer rows than ranks).
// Collectives use equal sizes: every rank's region of the padded buffer is
// shardMax elements long, its shard at the start of it.
// A 1-D parameter's rows are its elements; a 0-D parameter is one row.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bulkhead::optim {

struct ShardLayout {
  struct Param {
    int64_t offset = 0;    // in the flat buffer
    int64_t rows = 0;      // the product of all extents but the last (1 for a 0-D parameter)
    int64_t rowElems = 0;  // elements per row: the last extent
  };
  // Rows [rowBegin, rowBegin + rows) of parameter `param`, at `shardOffset` in
  // its rank's shard.
  struct Piece {
    size_t param = 0;
    int64_t rowBegin = 0;
    int64_t rows = 0;
    int64_t shardOffset = 0;
    int64_t numel = 0;
  };

  static ShardLayout create(const std::vector<std::vector<int64_t>>& shapes, int ranks);

  std::vector<Param> params;
  std::vector<int64_t> cuts;  // ranks + 1 offsets: rank r holds [cuts[r], cuts[r + 1])
  int64_t total = 0;
  int64_t shardMax = 0;

  int ranks() const { return static_cast<int>(cuts.size()) - 1; }
  int64_t shardLength(int rank) const { return cuts[rank + 1] - cuts[rank]; }
  // The pieces of rank `rank`'s shard, in flat order (no empty pieces).
  std::vector<Piece> pieces(int rank) const;
};

// A rectangle of a tensor: where it starts and its extent in each dimension.
struct Box {
  std::vector<int64_t> offsets, extents;
};

// The boxes that cover rows [begin, end) of a tensor of `shape` (rows as in
// ShardLayout): each contiguous in row-major order, in order; at most 2k - 1
// for rows over k dimensions. A 0-D tensor's one row is one box with no
// dimensions.
std::vector<Box> rowBoxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

}  // namespace bulkhead::optim
