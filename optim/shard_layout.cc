#include "optim/shard_layout.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/errors.h"

namespace bulkhead::optim {

namespace {

int64_t product(const std::vector<int64_t>& extents, size_t from, size_t to) {
  int64_t result = 1;
  for (size_t d = from; d < to; ++d) result *= extents[d];
  return result;
}

// The row boundary nearest to `target` (0 < target < total; the lower one on
// a tie): one end of the row of the parameter that holds it.
int64_t nearestRowBoundary(const std::vector<ShardLayout::Param>& params, int64_t target) {
  // The last parameter starting at or before the target holds it (those
  // after it start later; a zero-size one there starts at the target).
  auto after = std::upper_bound(params.begin(), params.end(), target,
                                [](int64_t t, const ShardLayout::Param& p) { return t < p.offset; });
  const ShardLayout::Param& p = *(after - 1);
  if (p.rowElems == 0) return p.offset;
  const int64_t lower = p.offset + (target - p.offset) / p.rowElems * p.rowElems, upper = lower + p.rowElems;
  return target - lower <= upper - target ? lower : upper;
}

// Boxes of rows [begin, end) of `rowShape` (the extents the rows run over)
// from dimension `axis` on, the dimensions before it fixed at `prefix`; the
// last dimension (`rowElems` >= 0) is whole in every box.
void coverRows(const std::vector<int64_t>& rowShape, size_t axis, std::vector<int64_t>& prefix, int64_t begin,
               int64_t end, int64_t rowElems, std::vector<Box>& boxes) {
  if (begin >= end) return;
  const int64_t inner = product(rowShape, axis + 1, rowShape.size());
  // Inside one block of this dimension: fix its index, go one dimension in.
  auto within = [&](int64_t block, int64_t from, int64_t to) {
    prefix.push_back(block);
    coverRows(rowShape, axis + 1, prefix, from - block * inner, to - block * inner, rowElems, boxes);
    prefix.pop_back();
  };
  const int64_t headEnd = (begin + inner - 1) / inner * inner, tailBegin = end / inner * inner;
  if (headEnd > tailBegin) return within(begin / inner, begin, end);
  if (begin < headEnd) within(begin / inner, begin, headEnd);
  if (headEnd < tailBegin) {  // whole blocks of this dimension: one box
    Box box{prefix, std::vector<int64_t>(prefix.size(), 1)};
    box.offsets.push_back(headEnd / inner);
    box.extents.push_back((tailBegin - headEnd) / inner);
    for (size_t d = axis + 1; d < rowShape.size(); ++d) {
      box.offsets.push_back(0);
      box.extents.push_back(rowShape[d]);
    }
    if (rowElems >= 0) {
      box.offsets.push_back(0);
      box.extents.push_back(rowElems);
    }
    boxes.push_back(std::move(box));
  }
  if (tailBegin < end) within(tailBegin / inner, tailBegin, end);
}

}  // namespace

ShardLayout ShardLayout::create(const std::vector<std::vector<int64_t>>& shapes, int ranks) {
  if (ranks < 1) throw ConfigError(fmt::format("ShardLayout: {} ranks; need at least one", ranks));
  ShardLayout layout;
  for (const auto& shape : shapes) {
    const int64_t numel = product(shape, 0, shape.size());
    Param param{.offset = layout.total,
                .rows = shape.size() < 2 ? (shape.empty() ? 1 : shape[0]) : product(shape, 0, shape.size() - 1)};
    param.rowElems = param.rows == 0 ? 0 : numel / param.rows;
    layout.params.push_back(param);
    layout.total += numel;
  }
  layout.cuts.assign(static_cast<size_t>(ranks) + 1, 0);
  layout.cuts[ranks] = layout.total;
  for (int k = 1; k < ranks; ++k) {
    const int64_t target = static_cast<int64_t>((static_cast<__int128>(k) * layout.total) / ranks);
    const int64_t cut = target <= 0 || target >= layout.total ? target : nearestRowBoundary(layout.params, target);
    layout.cuts[k] = std::max(cut, layout.cuts[k - 1]);  // never before the previous cut
  }
  for (int r = 0; r < ranks; ++r) layout.shardMax = std::max(layout.shardMax, layout.shardLength(r));
  return layout;
}

std::vector<Box> rowBoxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> boxes;
  std::vector<int64_t> prefix;
  if (shape.empty()) {
    if (begin < end) boxes.push_back({});
    return boxes;
  }
  if (shape.size() == 1) {
    coverRows(shape, 0, prefix, begin, end, -1, boxes);
  } else {
    coverRows(std::vector<int64_t>(shape.begin(), shape.end() - 1), 0, prefix, begin, end, shape.back(), boxes);
  }
  return boxes;
}

std::vector<ShardLayout::Piece> ShardLayout::pieces(int rank) const {
  std::vector<Piece> result;
  int64_t begin = cuts[rank], end = cuts[rank + 1];
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    int64_t pEnd = p.offset + p.rows * p.rowElems;
    int64_t from = std::max(begin, p.offset), to = std::min(end, pEnd);
    if (from >= to) continue;
    // Cuts lie on row boundaries, so from and to are whole rows of p.
    result.push_back({.param = i,
                      .rowBegin = (from - p.offset) / p.rowElems,
                      .rows = (to - from) / p.rowElems,
                      .shardOffset = from - begin,
                      .numel = to - from});
  }
  return result;
}

}  // namespace bulkhead::optim
