#include "moe/dispatch_routes.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "moe/gather_sum.h"
#include "runtime/errors.h"

#if BULKHEAD_MOE_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "moe/cuda/route_kernels.h"
#endif

namespace bulkhead::moe {
namespace {

RoutePlan emptyPlan(const Routing& routing, const RouteShape& shape) {
  RoutePlan plan;
  plan.counts = at::zeros({2, shape.ranks, shape.localExperts + 2}, routing.indices.options().dtype(at::kLong));
  return plan;
}

// Kept slots with an expert id in [0, R * L), and the ids with every other
// one replaced by 0, so that index arithmetic on them stays in range.
std::pair<at::Tensor, at::Tensor> validSlots(const Routing& routing, const RouteShape& shape) {
  const at::Tensor valid =
      routing.indices.ge(0).logical_and(routing.indices.lt(static_cast<int64_t>(shape.ranks) * shape.localExperts));
  return {routing.keep.logical_and(valid), at::where(valid, routing.indices, 0)};
}

void planWithAten(const Routing& routing, const RouteShape& shape, RoutePlan& plan) {
  const int L = shape.localExperts, R = shape.ranks;
  const auto [sent, expert] = validSlots(routing, shape);
  at::Tensor destination = expert.div(L, "floor");
  // Entry (r, e) of row 0 is flat position r * (L + 2) + e = global expert + 2r.
  at::Tensor outgoing = plan.counts.select(0, 0);
  outgoing.view(-1).scatter_add_(0, (expert + 2 * destination).reshape(-1), sent.to(at::kLong).reshape(-1));
  outgoing.select(1, L + 1).fill_(routing.keep.sum() - sent.sum());  // the invalid slots, for every rank
  at::Tensor rankOrNone = at::where(sent, destination, R);           // [T, k]
  at::Tensor rowsColumn = outgoing.select(1, L);
  if (shape.perSlot) {
    rowsColumn.copy_(outgoing.narrow(1, 0, L).sum(1));  // a row per kept slot
    plan.key = rankOrNone;
    return;
  }
  at::Tensor rankIds = at::arange(R, destination.options());
  at::Tensor paired = rankOrNone.unsqueeze(1).eq(rankIds.view({1, R, 1})).any(2);  // [T, R]
  at::sum_out(rowsColumn, paired, at::IntArrayRef{0});
  plan.key = at::where(paired, rankIds, R);
}

// For a grouping of an [N, m] key: the row (of N) each listed entry lies in.
at::Tensor rowsOf(const at::Tensor& order, int64_t columns) {
  return columns == 1 ? order : order.div(columns, "floor");
}

// Local expert ids of every candidate row, [T * m, side columns].
at::Tensor candidateIds(const Routing& routing, const RouteShape& shape, at::ScalarType sideType) {
  const int L = shape.localExperts, R = shape.ranks;
  const auto [sent, expert] = validSlots(routing, shape);
  at::Tensor local = expert.remainder(L).to(sideType);
  if (shape.perSlot) return local.reshape({-1, 1});
  const int64_t tokens = routing.indices.size(0), k = routing.indices.size(1);
  at::Tensor rankOrNone = at::where(sent, expert.div(L, "floor"), R);
  at::Tensor atRank = rankOrNone.unsqueeze(1).eq(at::arange(R, rankOrNone.options()).view({1, R, 1}));  // [T, R, k]
  return at::where(atRank, local.unsqueeze(1), -1.0).view({tokens * R, k});
}

// The kernels write where the layout says: a layout that does not fit the
// inputs would write past the rows, so it is refused here.
void checkPackInputs(const RoutedLayout& layout, const at::Tensor& tokens, const at::Tensor& weights,
                     const Routing& routing, const RouteShape& shape, const RoutePlan& plan) {
  const int64_t slots = routing.indices.size(1), columns = shape.perSlot ? slots : shape.ranks;
  const at::Device device = routing.indices.device();
  const bool together = tokens.device() == device && weights.device() == device && routing.keep.device() == device &&
                        plan.key.device() == device;
  const bool fits = together && plan.key.dim() == 2 && plan.key.size(0) == routing.indices.size(0) &&
                    plan.key.size(1) == columns && tokens.dim() == 2 && tokens.size(0) == routing.indices.size(0) &&
                    tokens.scalar_type() == layout.tokenType &&
                    tokens.size(1) * tokens.element_size() == layout.rowBytes &&
                    weights.sizes() == routing.indices.sizes() && weights.scalar_type() == layout.sideType &&
                    routing.keep.sizes() == routing.indices.sizes() && layout.columns == (shape.perSlot ? 1 : slots);
  if (fits) return;
  throw ConfigError(
      fmt::format("packing send rows: tokens [{}] ({}, {}), weights [{}] ({}, {}), indices [{}] and keys [{}] ({}) "
                  "do not fit a layout of {}-byte tokens ({}) with {} side columns ({})",
                  fmt::join(tokens.sizes(), ", "), c10::toString(tokens.scalar_type()), tokens.device().str(),
                  fmt::join(weights.sizes(), ", "), c10::toString(weights.scalar_type()), weights.device().str(),
                  fmt::join(routing.indices.sizes(), ", "), fmt::join(plan.key.sizes(), ", "), plan.key.device().str(),
                  layout.rowBytes, c10::toString(layout.tokenType), layout.columns, c10::toString(layout.sideType)),
      {.expected = "tokens [T, H], weights [T, k] of the layout's dtypes and keys [T, m] on the routing's device; "
                   "k side columns once per rank, 1 per slot"});
}

#if BULKHEAD_MOE_KERNELS
int64_t columnsOf(const Routing& routing, const RouteShape& shape) {
  return shape.perSlot ? routing.indices.size(1) : shape.ranks;
}

cuda::RouteArgs kernelArgs(const Routing& routing, const RouteShape& shape, const at::Tensor& indices,
                           const at::Tensor& keep) {
  return {.tokens = indices.size(0),
          .topK = indices.size(1),
          .localExperts = shape.localExperts,
          .ranks = shape.ranks,
          .perSlot = shape.perSlot,
          .indices = indices.data_ptr<int64_t>(),
          .keep = keep.data_ptr<bool>(),
          .stream = c10::cuda::getCurrentCUDAStream(routing.indices.device().index()).stream()};
}

bool kernelsTake(const Routing& routing, const RouteShape& shape) {
  return routing.indices.is_cuda() && (shape.perSlot || shape.ranks <= cuda::kMaxRouteRanks) &&
         columnsOf(routing, shape) <= cuda::kMaxRouteColumns;
}
#endif

}  // namespace

RoutePlan planRoutes(const Routing& routing, const RouteShape& shape) {
  const c10::NoGradGuard metadata;
  RoutePlan plan = emptyPlan(routing, shape);
#if BULKHEAD_MOE_KERNELS
  if (kernelsTake(routing, shape)) {
    const c10::cuda::CUDAGuard device(routing.indices.device());
    at::Tensor indices = routing.indices.contiguous(), keep = routing.keep.contiguous();
    plan.key = at::empty({indices.size(0), columnsOf(routing, shape)}, indices.options());
    cuda::planRoutes(kernelArgs(routing, shape, indices, keep), plan.counts.select(0, 0).data_ptr<int64_t>(),
                     plan.key.data_ptr<int64_t>());
    return plan;
  }
#endif
  planWithAten(routing, shape, plan);
  return plan;
}

Grouping groupByKey(const at::Tensor& key, int64_t groups, int64_t count) {
  Grouping grouping;
  if (groupByKeyKernels(key, groups, count, grouping.order, grouping.table)) return grouping;
  at::Tensor sorted = std::get<1>(at::sort(key.reshape(-1), /*stable=*/true, 0, false));
  at::TensorOptions longs = key.options().dtype(at::kLong);
  grouping.order = sorted.narrow(0, 0, count);
  grouping.table =
      at::full({key.numel()}, -1, longs).scatter_(0, grouping.order, at::arange(count, longs)).view(key.sizes());
  return grouping;
}

SendRows packSendRows(const RoutedLayout& layout, const at::Tensor& tokens, const at::Tensor& weights,
                      const Routing& routing, const RouteShape& shape, const RoutePlan& plan) {
  const c10::NoGradGuard untracked;
  checkPackInputs(layout, tokens, weights, routing, shape, plan);
  const int64_t columns = plan.key.size(1);
#if BULKHEAD_MOE_KERNELS
  Grouping candidates;
  // The kernels need no count: order has room for every candidate (unused here).
  if (kernelsTake(routing, shape) && tokens.is_cuda() &&
      groupByKeyKernels(plan.key, shape.ranks, plan.key.numel(), candidates.order, candidates.table)) {
    const c10::cuda::CUDAGuard device(tokens.device());
    const int64_t capacity = plan.key.size(0) * std::min(columns, routing.indices.size(1));
    at::Tensor bytes = at::empty({capacity, layout.width}, tokens.options().dtype(at::kByte));
    at::Tensor source = tokens.contiguous(), side = weights.contiguous();
    at::Tensor indices = routing.indices.contiguous(), keep = routing.keep.contiguous();
    cuda::packRoutes({.route = kernelArgs(routing, shape, indices, keep),
                      .tokens = source.data_ptr(),
                      .rowBytes = layout.rowBytes,
                      .weights = side.data_ptr(),
                      .sideBytes = static_cast<int>(side.element_size()),
                      .table = candidates.table.data_ptr<int64_t>(),
                      .rows = bytes.data_ptr(),
                      .width = layout.width,
                      .sideOffset = layout.sideOffset});
    return {.bytes = bytes, .table = candidates.table};
  }
#endif
  // Counted here. On a GPU without the kernels this is a device sync behind
  // the counts exchange, with no deadline of its own: it relies on the
  // communicator's watchdog to end that exchange at its deadline.
  const int64_t rows = plan.key.lt(shape.ranks).sum().item<int64_t>();
  const Grouping grouping = groupByKey(plan.key, shape.ranks, rows);
  at::Tensor bytes = at::empty({rows, layout.width}, tokens.options().dtype(at::kByte));
  RoutedRows outgoing = layout.parts(bytes);
  at::Tensor rowToken = rowsOf(grouping.order, columns);
  at::index_select_out(outgoing.rows, tokens, 0, rowToken);  // gathered straight into the send buffer
  outgoing.weights.copy_(shape.perSlot ? weights.reshape({-1, 1}).index_select(0, grouping.order)
                                       : weights.index_select(0, rowToken));
  outgoing.ids.copy_(candidateIds(routing, shape, layout.sideType).index_select(0, grouping.order));
  return {.bytes = bytes, .table = grouping.table};
}

}  // namespace bulkhead::moe
