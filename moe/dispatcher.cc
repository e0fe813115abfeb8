#include "moe/dispatcher.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>

#include <numeric>
#include <utility>

#include "moe/differentiable.h"
#include "moe/gather_sum.h"
#include "moe/routes.h"
#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::moe {
namespace {

// Stable grouping by a key in [0, groups], where `groups` (the largest key)
// marks entries outside every group; `count` entries are inside.
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

at::Tensor rowsOf(const at::Tensor& order, int64_t columns) {
  return columns == 1 ? order : order.div(columns, "floor");
}

int64_t sum(const std::vector<int64_t>& values) { return std::accumulate(values.begin(), values.end(), int64_t{0}); }

}  // namespace

TokenDispatcher::TokenDispatcher(CommunicatorPtr ep, DispatcherOptions options)
    : ep_(std::move(ep)), options_(options), localExperts_(0) {
  if (options_.numExperts % ep_->size() != 0) {
    throw ConfigError(fmt::format("dispatcher: {} experts do not divide over the {} ranks of {}", options_.numExperts,
                                  ep_->size(), ep_->name()),
                      {.rank = ep_->rank(), .group = ep_->name(), .expected = "numExperts a multiple of ep"});
  }
  localExperts_ = options_.numExperts / ep_->size();
}

DispatchPlan TokenDispatcher::dispatch(const at::Tensor& tokens, const Routing& routing) const {
  const int ranks = ep_->size(), experts = localExperts_;
  const RouteShape shape{.localExperts = experts, .ranks = ranks, .perSlot = !options_.oncePerRank};
  // Metadata travels in the combine weights' dtype, at least float32: local
  // expert ids are small integers, exact there.
  const at::ScalarType packType = at::promote_types(routing.weights.scalar_type(), at::kFloat);
  RoutePlan routes = planRoutes(routing, shape);
  at::Tensor weights = routing.weights.to(packType);  // with autograd

  // Counts first (equal splits: one row per rank), then both rows to the host
  // in one copy: the one device sync of a dispatch.
  const Deadline deadline = parallel::collectiveDeadline(options_.timeout);
  WorkPtr work = ep_->allToAll(routes.counts.select(0, 0), routes.counts.select(0, 1), {}, {}, {.deadline = deadline});
  at::Tensor host;
  if (routes.counters.is_cuda()) {
    host = routes.counters.to(at::kCPU);  // ordered after the exchange on the stream
    // Already complete, so no second sync: this only raises the exchange's
    // error (a timed-out, aborted exchange leaves no counts to trust).
    work->wait(deadline);
  } else {
    work->wait(deadline);
    host = routes.counters;
  }
  if (const int64_t invalid = host[-1].item<int64_t>(); invalid > 0) {
    throw ConfigError(fmt::format("dispatch on {}: {} kept slots name an expert outside [0, {})", ep_->name(), invalid,
                                  options_.numExperts),
                      {.rank = ep_->rank(), .group = ep_->name(), .expected = "routing indices in [0, numExperts)"});
  }
  const at::Tensor hostCountsTensor = host.narrow(0, 0, routes.counts.numel()).view(routes.counts.sizes());
  const auto hostCounts = hostCountsTensor.accessor<int64_t, 3>();
  DispatchPlan plan;
  plan.numTokens = tokens.size(0);
  plan.tokensPerLocalExpert.assign(experts, 0);
  for (int rank = 0; rank < ranks; ++rank) {
    plan.sendSplits.push_back(hostCounts[0][rank][experts]);
    plan.recvSplits.push_back(hostCounts[1][rank][experts]);
    for (int expert = 0; expert < experts; ++expert) plan.tokensPerLocalExpert[expert] += hostCounts[1][rank][expert];
  }
  plan.tokensPerLocalExpertDevice = routes.counts.select(0, 1).narrow(1, 0, experts).sum(0);

  // Rows to send, grouped by rank, each with its combine weights and local
  // expert ids, in one exchange.
  RoutedRows arrived;
  {
    Grouping grouping;
    {
      const c10::NoGradGuard metadata;
      grouping = groupByKey(routes.key, ranks, sum(plan.sendSplits));
    }
    plan.sendTable = grouping.table;
    const RoutedLayout layout(tokens, packType, shape.perSlot ? 1 : routing.indices.size(1));
    RoutedSend send{.bytes = packRoutes(layout, tokens.detach(), weights.detach(), routing, shape, grouping.order,
                                        grouping.table),
                    .layout = layout,
                    .tokens = tokens,
                    .tokenTable = grouping.table,
                    // Per slot, weight row t * k + j travels in the row of slot (t, j).
                    .weights = shape.perSlot ? weights.reshape({-1, 1}) : weights,
                    .weightTable = shape.perSlot ? grouping.table.view({-1, 1}) : grouping.table};
    arrived = exchangeRouted(ep_, send, plan.sendSplits, plan.recvSplits, options_.timeout);
  }

  // One expert row per (received row, local expert), ordered by local expert.
  const int64_t columns = arrived.ids.size(1);
  // A copy, so the plan does not keep the whole receive buffer (token rows
  // included) alive until the combine.
  plan.recvWeights = arrived.weights.contiguous();
  Grouping byExpert;
  at::Tensor arrivedRow;
  {
    const c10::NoGradGuard metadata;
    // -1 (none) becomes `experts`, the key past every group (exact in floating point).
    at::Tensor key = arrived.ids.remainder(experts + 1).to(at::kLong);
    byExpert = groupByKey(key, experts, sum(plan.tokensPerLocalExpert));
    arrivedRow = rowsOf(byExpert.order, columns);
  }
  plan.recvTable = byExpert.table;
  plan.expertInput = gatherRows(arrived.rows, arrivedRow, byExpert.table);
  return plan;
}

at::Tensor TokenDispatcher::combine(const DispatchPlan& plan, const at::Tensor& expertOutput) const {
  at::Tensor rowsOut = gatherSum(expertOutput, plan.recvTable, plan.recvWeights);
  at::Tensor returned = allToAll(ep_, rowsOut, plan.recvSplits, plan.sendSplits, options_.timeout);
  return gatherSum(returned, plan.sendTable, at::Tensor());
}

Grouping groupEntries(const at::Tensor& group, int groups, int64_t count) {
  return groupByKey(group.remainder(groups + 1), groups, count);  // -1 (none) becomes `groups`
}

at::Tensor permuteTokens(const at::Tensor& tokens, const Grouping& grouping) {
  return gatherRows(tokens, rowsOf(grouping.order, grouping.table.size(1)), grouping.table);
}

at::Tensor unpermuteTokens(const at::Tensor& rows, const Grouping& grouping) {
  return gatherSum(rows, grouping.table, at::Tensor());
}

}  // namespace bulkhead::moe
