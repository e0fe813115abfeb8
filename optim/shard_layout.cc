#include "optim/shard_layout.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/errors.h"

namespace bulkhead::optim {

ShardLayout ShardLayout::create(const std::vector<std::vector<int64_t>>& shapes, int ranks) {
  if (ranks < 1) throw ConfigError(fmt::format("ShardLayout: {} ranks; need at least one", ranks));
  ShardLayout layout;
  std::vector<int64_t> boundaries{0};  // every row boundary of the flat buffer, ascending
  for (const auto& shape : shapes) {
    int64_t numel = 1;
    for (int64_t extent : shape) numel *= extent;
    Param param{.offset = layout.total, .rows = shape.empty() ? 1 : shape[0]};
    param.rowElems = param.rows == 0 ? 0 : numel / param.rows;
    for (int64_t row = 1; row <= param.rows && param.rowElems > 0; ++row)
      boundaries.push_back(param.offset + row * param.rowElems);
    layout.params.push_back(param);
    layout.total += numel;
  }
  boundaries.erase(std::unique(boundaries.begin(), boundaries.end()), boundaries.end());

  layout.cuts.assign(static_cast<size_t>(ranks) + 1, 0);
  layout.cuts[ranks] = layout.total;
  for (int k = 1; k < ranks; ++k) {
    // The row boundary nearest to the balanced cut (the lower one on a tie),
    // never before the previous cut.
    int64_t target = (static_cast<__int128>(k) * layout.total) / ranks;
    // (target <= total, the last boundary, so `above` is a boundary.)
    auto above = std::lower_bound(boundaries.begin(), boundaries.end(), target);
    int64_t cut = *above;
    if (above != boundaries.begin() && target - *(above - 1) <= *above - target) cut = *(above - 1);
    layout.cuts[k] = std::max(cut, layout.cuts[k - 1]);
  }
  for (int r = 0; r < ranks; ++r) layout.shardMax = std::max(layout.shardMax, layout.shardLength(r));
  return layout;
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
