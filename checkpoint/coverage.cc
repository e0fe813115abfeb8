// checkCoverage (manifest.h): every tensor covered exactly once by its slices.
//
// The slices' start and end offsets cut each dimension into intervals; the
// cuts of all dimensions cut the tensor into cells. Slices that form a grid
// (every layout's do) give as many cells as slices, so marking each cell with
// the slice that covers it takes time linear in the slices: a cell marked
// twice is an overlap, a cell left unmarked a gap. Irregular slicings, with
// many more cells than slices, fall back to a sweep along dimension 0.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "checkpoint/manifest.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

struct Box {
  const std::vector<int64_t>* offsets;
  const std::vector<int64_t>* shape;
  int rank;
};

std::string region(const std::vector<int64_t>& offsets, const std::vector<int64_t>& shape) {
  return fmt::format("offsets [{}] shape [{}]", fmt::join(offsets, ", "), fmt::join(shape, ", "));
}

[[noreturn]] void overlap(const TensorRecord& tensor, const Box& a, const Box& b, int rank) {
  throw CheckpointError(
      fmt::format("key '{}': the slices written by rank {} ({}) and rank {} ({}) overlap; exactly one replica of "
                  "each slice must have replicaId 0: check the ShardInfo of this key on those ranks",
                  tensor.key, a.rank, region(*a.offsets, *a.shape), b.rank, region(*b.offsets, *b.shape)),
      {.rank = rank, .expected = "every element of every tensor written exactly once"});
}

[[noreturn]] void gap(const TensorRecord& tensor, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& shape, int rank) {
  throw CheckpointError(
      fmt::format("key '{}' (global shape [{}]): the region at {} was written by no rank; every part of a tensor "
                  "needs one slice with replicaId 0 (a rank may hold it with another replica id, or leave it out)",
                  tensor.key, fmt::join(tensor.globalShape, ", "), region(offsets, shape)),
      {.rank = rank, .expected = "every element of every tensor written exactly once"});
}

bool intersects(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.offsets->size(); ++d) {
    int64_t lo = std::max((*a.offsets)[d], (*b.offsets)[d]);
    int64_t hi = std::min((*a.offsets)[d] + (*a.shape)[d], (*b.offsets)[d] + (*b.shape)[d]);
    if (lo >= hi) return false;
  }
  return true;
}

// Irregular slicings: sorted by their start in dimension 0, each slice is
// compared with those that start before it ends there.
void sweep(const TensorRecord& tensor, std::vector<Box>& boxes, __int128 covered, int rank) {
  std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) { return (*a.offsets)[0] < (*b.offsets)[0]; });
  for (size_t i = 0; i < boxes.size(); ++i) {
    int64_t end = (*boxes[i].offsets)[0] + (*boxes[i].shape)[0];
    for (size_t j = i + 1; j < boxes.size() && (*boxes[j].offsets)[0] < end; ++j)
      if (intersects(boxes[i], boxes[j])) overlap(tensor, boxes[i], boxes[j], rank);
  }
  if (covered != volume(tensor.globalShape))
    gap(tensor, std::vector<int64_t>(tensor.globalShape.size(), 0), tensor.globalShape, rank);
}

void checkTensor(const Manifest& manifest, const TensorRecord& tensor, const std::vector<int>& indices, int rank) {
  const auto& global = tensor.globalShape;
  size_t dims = global.size();
  std::vector<Box> boxes;
  boxes.reserve(indices.size());
  __int128 covered = 0;
  for (int index : indices) {
    const SliceRecord& slice = manifest.slices[index];
    Box box{&slice.offsets, &slice.shape, slice.rank};
    if (slice.offsets.size() != dims || slice.shape.size() != dims)
      throw CheckpointError(fmt::format("key '{}': rank {} wrote a slice with {} dimensions, but the tensor has {} "
                                        "(global shape [{}])",
                                        tensor.key, slice.rank, slice.shape.size(), dims, fmt::join(global, ", ")),
                            {.rank = rank, .expected = "one global shape per key on every rank"});
    for (size_t d = 0; d < dims; ++d)
      if (slice.offsets[d] < 0 || slice.offsets[d] + slice.shape[d] > global[d])
        throw CheckpointError(
            fmt::format("key '{}': rank {} wrote a slice at {} outside the global shape [{}]", tensor.key, slice.rank,
                        region(slice.offsets, slice.shape), fmt::join(global, ", ")),
            {.rank = rank, .expected = "slices inside their global shape"});
    int64_t elements = volume(slice.shape);
    if (elements == 0) continue;  // an empty slice covers nothing
    covered += elements;
    boxes.push_back(box);
  }
  int64_t total = volume(global);
  if (total == 0) return;
  if (boxes.empty()) gap(tensor, std::vector<int64_t>(dims, 0), global, rank);
  if (dims == 0) {  // a scalar: one slice, or two overlapping
    if (boxes.size() > 1) overlap(tensor, boxes[0], boxes[1], rank);
    return;
  }

  std::vector<std::vector<int64_t>> cuts(dims);
  for (size_t d = 0; d < dims; ++d) {
    cuts[d].reserve(2 * boxes.size() + 2);
    cuts[d].push_back(0);
    cuts[d].push_back(global[d]);
    for (const Box& box : boxes) {
      cuts[d].push_back((*box.offsets)[d]);
      cuts[d].push_back((*box.offsets)[d] + (*box.shape)[d]);
    }
    std::sort(cuts[d].begin(), cuts[d].end());
    cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
  }
  __int128 cells = 1;
  for (const auto& c : cuts) cells *= static_cast<__int128>(c.size() - 1);
  if (cells > 4 * static_cast<__int128>(boxes.size()) + 64) return sweep(tensor, boxes, covered, rank);

  std::vector<int> owner(static_cast<size_t>(cells), -1);
  std::vector<int64_t> first(dims), last(dims), at(dims);
  for (size_t b = 0; b < boxes.size(); ++b) {
    const Box& box = boxes[b];
    for (size_t d = 0; d < dims; ++d) {
      first[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), (*box.offsets)[d]) - cuts[d].begin();
      last[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), (*box.offsets)[d] + (*box.shape)[d]) - cuts[d].begin();
    }
    at = first;
    for (;;) {
      int64_t cell = 0;
      for (size_t d = 0; d < dims; ++d) cell = cell * static_cast<int64_t>(cuts[d].size() - 1) + at[d];
      if (owner[cell] >= 0) overlap(tensor, boxes[owner[cell]], box, rank);
      owner[cell] = static_cast<int>(b);
      size_t d = dims;
      while (d > 0 && ++at[d - 1] == last[d - 1]) {
        at[d - 1] = first[d - 1];
        --d;
      }
      if (d == 0) break;
    }
  }
  for (size_t cell = 0; cell < owner.size(); ++cell) {
    if (owner[cell] >= 0) continue;
    std::vector<int64_t> offsets(dims), shape(dims);
    size_t rest = cell;
    for (size_t d = dims; d-- > 0;) {
      size_t count = cuts[d].size() - 1, index = rest % count;
      rest /= count;
      offsets[d] = cuts[d][index];
      shape[d] = cuts[d][index + 1] - cuts[d][index];
    }
    gap(tensor, offsets, shape, rank);
  }
}

}  // namespace

void checkCoverage(const Manifest& manifest, int rank) {
  const auto& byTensor = manifest.slicesByTensor();
  for (size_t t = 0; t < manifest.tensors.size(); ++t) checkTensor(manifest, manifest.tensors[t], byTensor[t], rank);
}

}  // namespace bulkhead::checkpoint
