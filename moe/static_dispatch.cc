#include "moe/static_dispatch.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "moe/gather_sum.h"

namespace bulkhead::moe {

int64_t staticCapacity(const RouterOptions& router, int64_t tokens) {
  return static_cast<int64_t>(
      std::ceil(router.capacityFactor * static_cast<double>(tokens * router.topK) / router.numExperts));
}

namespace {

// Each expert's kept slots, int64 [E] on the device (no host read).
at::Tensor keptPerExpert(const Routing& routing, int numExperts) {
  return at::zeros({numExperts}, routing.indices.options())
      .scatter_add_(0, routing.indices.reshape(-1), routing.keep.reshape(-1).to(at::kLong));
}

}  // namespace

StaticPlan staticDispatch(const at::Tensor& tokens, const Routing& routing, int numExperts, int64_t capacity,
                          bool packed) {
  StaticPlan plan{.capacity = capacity, .packed = packed};
  if (packed) {
    // Kept slots per expert (no host read), their running sums, and each kept
    // slot's row: its expert's first row plus its rank there.
    const int64_t slots = routing.indices.numel();
    at::Tensor kept = keptPerExpert(routing, numExperts);
    at::Tensor ends = kept.cumsum(0);
    at::Tensor starts = (ends - kept).index_select(0, routing.indices.reshape(-1)).view_as(routing.indices);
    plan.slotTable = at::where(routing.keep, starts + routing.position, at::full({}, -1, routing.indices.options()));
    plan.keptRows = ends.narrow(0, numExperts - 1, 1).to(at::kInt);
    plan.expertInput = gatherRowsOrZero(tokens, plan.slotTable, slots, plan.keptRows);
    plan.rowEnds = at::cat({ends.narrow(0, 0, numExperts - 1), at::full({1}, slots, ends.options())}).to(at::kInt);
    return plan;
  }
  // Each slot's expert row, -1 where capacity dropped it: a kept slot of rank
  // p < C at expert e reads into row e * C + p, so no two slots share a row.
  plan.slotTable = at::where(routing.keep, routing.indices * capacity + routing.position,
                             at::full({}, -1, routing.indices.options()));
  // Expert e's kept slots fill its first rows: only the rows after them are zeroed.
  if (tokens.is_cuda() && numExperts > 0) plan.keptRows = keptPerExpert(routing, numExperts).to(at::kInt);
  plan.expertInput = gatherRowsOrZero(tokens, plan.slotTable, numExperts * capacity, plan.keptRows);
  plan.rowsPerExpert.assign(static_cast<size_t>(numExperts), capacity);
  return plan;
}

bool droplessDispatchApplies(const at::Tensor& tokens, int numExperts, bool groupedExperts) {
  return groupedExperts && tokens.is_cuda() && tokens.dim() == 2 && tokens.size(0) > 0 &&
         numExperts <= groupByKeyKernelsMaxGroups();
}

std::optional<StaticPlan> droplessDispatch(const at::Tensor& tokens, const Routing& routing, int numExperts,
                                           bool groupedExperts) {
  if (!droplessDispatchApplies(tokens, numExperts, groupedExperts) || routing.position.defined() ||
      routing.indices.dim() != 2 || routing.indices.size(0) != tokens.size(0) ||
      routing.indices.numel() > std::numeric_limits<int32_t>::max())
    return std::nullopt;
  StaticPlan plan{.packed = true};
  const int64_t slots = routing.indices.numel();
  at::Tensor order;
  if (!groupByKeyKernels(routing.indices, numExperts, slots, order, plan.slotTable, &plan.rowEnds)) return std::nullopt;
  // Each token's row goes to its k slots' rows, which together are every row once.
  plan.expertInput = gatherRows(tokens, plan.slotTable, slots);
  return plan;
}

at::Tensor staticCombine(const StaticPlan& plan, const Routing& routing, const at::Tensor& expertOutput) {
  // Weights in at least float32, as the dispatcher's combine takes them; a
  // dropped slot's column is skipped and its weight gets no gradient.
  const at::ScalarType weightType = at::promote_types(routing.weights.scalar_type(), at::kFloat);
  if (plan.packed && !plan.keptRows.defined())  // dropless: every row is a slot's
    return gatherSum(expertOutput, plan.slotTable, routing.weights.to(weightType), SourceRows::Every);
  if (plan.keptRows.defined())  // the kept rows lead (each expert's, padded), once each: the rest is zeroed
    return gatherSum(expertOutput, plan.slotTable, routing.weights.to(weightType), SourceRows::Prefix, plan.keptRows);
  return gatherSum(expertOutput, plan.slotTable, routing.weights.to(weightType));
}

}  // namespace bulkhead::moe
