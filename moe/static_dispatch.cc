#include "moe/static_dispatch.h"

#include <ATen/ATen.h>

#include <cmath>

#include "moe/gather_sum.h"

namespace bulkhead::moe {

int64_t staticCapacity(const RouterOptions& router, int64_t tokens) {
  return static_cast<int64_t>(
      std::ceil(router.capacityFactor * static_cast<double>(tokens * router.topK) / router.numExperts));
}

StaticPlan staticDispatch(const at::Tensor& tokens, const Routing& routing, int numExperts, int64_t capacity) {
  StaticPlan plan{.capacity = capacity};
  // Each slot's expert row, -1 where capacity dropped it: a kept slot of rank
  // p < C at expert e reads into row e * C + p, so no two slots share a row.
  plan.slotTable = at::where(routing.keep, routing.indices * capacity + routing.position,
                             at::full({}, -1, routing.indices.options()));
  plan.expertInput = gatherRowsOrZero(tokens, plan.slotTable, numExperts * capacity);
  plan.rowsPerExpert.assign(static_cast<size_t>(numExperts), capacity);
  plan.rowEnds = at::arange(1, numExperts + 1, tokens.options().dtype(at::kInt)) * static_cast<int>(capacity);
  return plan;
}

at::Tensor staticCombine(const StaticPlan& plan, const Routing& routing, const at::Tensor& expertOutput) {
  // Weights in at least float32, as the dispatcher's combine takes them; a
  // dropped slot's column is skipped and its weight gets no gradient.
  const at::ScalarType weightType = at::promote_types(routing.weights.scalar_type(), at::kFloat);
  return gatherSum(expertOutput, plan.slotTable, routing.weights.to(weightType));
}

}  // namespace bulkhead::moe
