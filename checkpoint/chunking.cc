#include "checkpoint/chunking.h"

#include <algorithm>

namespace bulkhead::checkpoint {

ChunkPlan ChunkPlan::make(const std::vector<int64_t>& shape, int64_t elementSize, int64_t targetBytes) {
  ChunkPlan plan;
  plan.dims = shape.empty() ? std::vector<int64_t>{1} : shape;
  plan.elementSize = elementSize;
  int64_t elements = 1;
  for (int64_t d : plan.dims) elements *= d;
  if (elements == 0) return plan;
  int64_t target = std::max<int64_t>(1, targetBytes / elementSize);
  // The outermost dimension whose inner block still fits the target.
  int rank = static_cast<int>(plan.dims.size());
  plan.split = rank - 1;
  plan.inner = 1;
  while (plan.split > 0 && plan.inner * plan.dims[plan.split] <= target) {
    plan.inner *= plan.dims[plan.split];
    --plan.split;
  }
  int64_t extent = plan.dims[plan.split];
  int64_t run = std::clamp<int64_t>(target / plan.inner, 1, extent);
  plan.perSplit = (extent + run - 1) / run;
  run = (extent + plan.perSplit - 1) / plan.perSplit;  // even chunks: the last pads less than one step per chunk
  plan.chunk.assign(rank, 1);
  plan.chunk[plan.split] = run;
  for (int d = plan.split + 1; d < rank; ++d) plan.chunk[d] = plan.dims[d];
  plan.count = plan.perSplit;
  for (int d = 0; d < plan.split; ++d) plan.count *= plan.dims[d];
  return plan;
}

bool ChunkPlan::fromFile(const std::vector<int64_t>& dims, const std::vector<int64_t>& chunk, int64_t elementSize,
                         ChunkPlan& plan) {
  plan = ChunkPlan{};
  plan.dims = dims;
  plan.elementSize = elementSize;
  int rank = static_cast<int>(dims.size());
  if (rank == 0) return false;
  int64_t elements = 1;
  for (int64_t d : dims) elements *= d;
  if (elements == 0) return chunk.empty();
  if (static_cast<int>(chunk.size()) != rank) return false;
  // The split is the last dimension whose chunk is not the full extent, or 0.
  int split = 0;
  for (int d = rank - 1; d >= 0; --d)
    if (chunk[d] != dims[d]) {
      split = d;
      break;
    }
  for (int d = 0; d < split; ++d)
    if (chunk[d] != 1) return false;
  if (chunk[split] < 1 || chunk[split] > dims[split]) return false;
  plan.chunk = chunk;
  plan.split = split;
  plan.inner = 1;
  for (int d = split + 1; d < rank; ++d) plan.inner *= dims[d];
  plan.perSplit = (dims[split] + chunk[split] - 1) / chunk[split];
  plan.count = plan.perSplit;
  for (int d = 0; d < split; ++d) plan.count *= dims[d];
  return true;
}

int64_t ChunkPlan::chunkElements() const { return chunk.empty() ? 0 : chunk[split] * inner; }

int64_t ChunkPlan::firstElement(int64_t i) const {
  return (i / perSplit) * dims[split] * inner + (i % perSplit) * chunk[split] * inner;
}

int64_t ChunkPlan::validElements(int64_t i) const {
  int64_t start = (i % perSplit) * chunk[split];
  return std::min(chunk[split], dims[split] - start) * inner;
}

std::vector<int64_t> ChunkPlan::offsets(int64_t i) const {
  std::vector<int64_t> at(dims.size(), 0);
  at[split] = (i % perSplit) * chunk[split];
  int64_t outer = i / perSplit;
  for (int d = split - 1; d >= 0; --d) {
    at[d] = outer % dims[d];
    outer /= dims[d];
  }
  return at;
}

void ChunkPlan::forEachOverlapping(const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
                                   const std::function<void(int64_t)>& visit) const {
  if (count == 0) return;
  for (size_t d = 0; d < dims.size(); ++d)
    if (lo[d] >= hi[d]) return;
  // An odometer over the outer dimensions (one chunk thick each), then the run along split.
  std::vector<int64_t> at(lo.begin(), lo.begin() + split);
  int64_t first = lo[split] / chunk[split], last = (hi[split] - 1) / chunk[split];
  for (;;) {
    int64_t outer = 0;
    for (int d = 0; d < split; ++d) outer = outer * dims[d] + at[d];
    for (int64_t c = first; c <= last; ++c) visit(outer * perSplit + c);
    int d = split - 1;
    while (d >= 0 && ++at[d] == hi[d]) {
      at[d] = lo[d];
      --d;
    }
    if (d < 0) return;
  }
}

}  // namespace bulkhead::checkpoint
