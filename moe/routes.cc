#include "moe/routes.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "moe/gather_sum.h"

#if BULKHEAD_MOE_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "moe/cuda/route_kernels.h"
#endif

namespace bulkhead::moe {
namespace {

RoutePlan emptyPlan(const Routing& routing, const RouteShape& shape) {
  const int64_t perRow = shape.ranks * (shape.localExperts + 1);
  RoutePlan plan;
  plan.counters = at::zeros({2 * perRow + 1}, routing.indices.options().dtype(at::kLong));
  plan.counts = plan.counters.narrow(0, 0, 2 * perRow).view({2, shape.ranks, shape.localExperts + 1});
  plan.invalid = plan.counters.narrow(0, 2 * perRow, 1);
  return plan;
}

// The ATen form. Out-of-range expert ids fail in scatter_add_ (on a GPU, as a
// device-side assert), which the kernel form reports through `invalid`.
void planWithAten(const Routing& routing, const RouteShape& shape, RoutePlan& plan) {
  const int L = shape.localExperts, R = shape.ranks;
  at::Tensor destination = routing.indices.div(L, "floor");
  // Entry (r, e) of row 0 is flat position r * (L + 1) + e = global expert + r.
  at::Tensor sent = plan.counts.select(0, 0);
  sent.view(-1).scatter_add_(0, (routing.indices + destination).reshape(-1), routing.keep.to(at::kLong).reshape(-1));
  at::Tensor rankOrNone = at::where(routing.keep, destination, R);  // [T, k]
  at::Tensor rowsColumn = sent.select(1, L);
  if (shape.perSlot) {
    rowsColumn.copy_(sent.narrow(1, 0, L).sum(1));  // a row per kept slot
    plan.key = rankOrNone;
    return;
  }
  at::Tensor rankIds = at::arange(R, destination.options());
  at::Tensor paired = rankOrNone.unsqueeze(1).eq(rankIds.view({1, R, 1})).any(2);  // [T, R]
  at::sum_out(rowsColumn, paired, at::IntArrayRef{0});
  plan.key = at::where(paired, rankIds, R);
}

// Local expert ids of every candidate row, [T * m, side columns].
at::Tensor candidateIds(const Routing& routing, const RouteShape& shape, at::ScalarType sideType) {
  const int L = shape.localExperts, R = shape.ranks;
  at::Tensor local = routing.indices.remainder(L).to(sideType);
  if (shape.perSlot) return local.reshape({-1, 1});
  const int64_t tokens = routing.indices.size(0), k = routing.indices.size(1);
  at::Tensor rankOrNone = at::where(routing.keep, routing.indices.div(L, "floor"), R);
  at::Tensor atRank = rankOrNone.unsqueeze(1).eq(at::arange(R, rankOrNone.options()).view({1, R, 1}));  // [T, R, k]
  return at::where(atRank, local.unsqueeze(1), -1.0).view({tokens * R, k});
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
  return routing.indices.is_cuda() && shape.ranks <= cuda::kMaxRouteRanks &&
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
                     plan.key.data_ptr<int64_t>(), plan.invalid.data_ptr<int64_t>());
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
  grouping.table = at::full({key.numel()}, -1, longs)
                       .scatter_(0, grouping.order, at::arange(count, longs))
                       .view(key.sizes());
  return grouping;
}

SendRows packSendRows(const RoutedLayout& layout, const at::Tensor& tokens, const at::Tensor& weights,
                      const Routing& routing, const RouteShape& shape, const RoutePlan& plan) {
  const c10::NoGradGuard untracked;
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
  // Counted here (on a GPU without the kernels, a device sync of its own).
  const int64_t rows = plan.key.lt(shape.ranks).sum().item<int64_t>();
  const Grouping grouping = groupByKey(plan.key, shape.ranks, rows);
  at::Tensor bytes = at::empty({rows, layout.width}, tokens.options().dtype(at::kByte));
  RoutedRows outgoing = layout.parts(bytes);
  at::Tensor rowToken = columns == 1 ? grouping.order : grouping.order.div(columns, "floor");
  at::index_select_out(outgoing.rows, tokens, 0, rowToken);  // gathered straight into the send buffer
  outgoing.weights.copy_(shape.perSlot ? weights.reshape({-1, 1}).index_select(0, grouping.order)
                                       : weights.index_select(0, rowToken));
  outgoing.ids.copy_(candidateIds(routing, shape, layout.sideType).index_select(0, grouping.order));
  return {.bytes = bytes, .table = grouping.table};
}

}  // namespace bulkhead::moe
