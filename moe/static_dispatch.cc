#include "moe/static_dispatch.h"

#include <ATen/ATen.h>

#include <cmath>

namespace bulkhead::moe {

int64_t staticCapacity(const RouterOptions& router, int64_t tokens) {
  return static_cast<int64_t>(
      std::ceil(router.capacityFactor * static_cast<double>(tokens * router.topK) / router.numExperts));
}

StaticPlan staticDispatch(const at::Tensor& tokens, const Routing& routing, int numExperts, int64_t capacity) {
  const int64_t numTokens = tokens.size(0), topK = routing.indices.size(1), hidden = tokens.size(1);
  const int64_t rows = numExperts * capacity, slots = numTokens * topK;
  StaticPlan plan{.capacity = capacity};
  // Each slot's row, or the sentinel row `rows` where capacity dropped it.
  const at::Tensor flatExperts = routing.indices.reshape(-1);
  plan.slotRow = at::where(routing.keep.reshape(-1), flatExperts * capacity + routing.position.reshape(-1),
                           at::full({}, rows, flatExperts.options()));
  // Each row's token, or the sentinel token `numTokens` (a zero row) where no slot fills it.
  at::Tensor rowToken = at::full({rows + 1}, numTokens, flatExperts.options());
  rowToken.index_put_({plan.slotRow}, at::arange(slots, flatExperts.options()).floor_divide(topK));
  at::Tensor padded = at::cat({tokens, at::zeros({1, hidden}, tokens.options())});
  plan.expertInput = padded.index_select(0, rowToken.narrow(0, 0, rows));
  plan.rowsPerExpert.assign(static_cast<size_t>(numExperts), capacity);
  plan.rowEnds = at::arange(1, numExperts + 1, tokens.options().dtype(at::kInt)) * static_cast<int>(capacity);
  return plan;
}

at::Tensor staticCombine(const StaticPlan& plan, const Routing& routing, const at::Tensor& expertOutput) {
  const int64_t numTokens = routing.indices.size(0), topK = routing.indices.size(1);
  const int64_t hidden = expertOutput.size(1);
  at::Tensor padded = at::cat({expertOutput, at::zeros({1, hidden}, expertOutput.options())});
  at::Tensor gathered = padded.index_select(0, plan.slotRow).view({numTokens, topK, hidden});
  at::Tensor weights = (routing.weights * routing.keep.to(routing.weights.scalar_type())).to(expertOutput.scalar_type());
  return (gathered * weights.unsqueeze(-1)).sum(1);
}

}  // namespace bulkhead::moe
