#include "moe/dispatcher.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "moe/all_to_all_autograd.h"
#include "moe/dispatch_routes.h"
#include "moe/gather_sum.h"
#include "parallel/tensor_parallel.h"
#include "runtime/cuda/host_copy.h"
#include "runtime/errors.h"

namespace bulkhead::moe {
namespace {

int64_t sum(const std::vector<int64_t>& values) { return std::accumulate(values.begin(), values.end(), int64_t{0}); }

// The running sum of host counts as int32 on `device` (where the grouping
// kernels did not write it), by one copy from pinned memory. The caller has
// checked that the sum fits.
at::Tensor runningSum(const std::vector<int64_t>& counts, at::Device device) {
  const auto size = static_cast<int64_t>(counts.size());
  at::Tensor host = at::empty({size}, at::TensorOptions(at::kInt).pinned_memory(device.is_cuda()));
  int64_t running = 0;
  for (int64_t i = 0; i < size; ++i) host.data_ptr<int32_t>()[i] = static_cast<int32_t>(running += counts[i]);
  return host.to(device, /*non_blocking=*/true);  // the host allocator keeps `host` until the copy is done
}

}  // namespace

TokenDispatcher::TokenDispatcher(CommunicatorPtr ep, DispatcherOptions options)
    : ep_(std::move(ep)), options_(options), localExperts_(0) {
  if (options_.numExperts < 1 || options_.numExperts % ep_->size() != 0) {
    throw ConfigError(fmt::format("dispatcher: {} experts do not divide over the {} ranks of {}", options_.numExperts,
                                  ep_->size(), ep_->name()),
                      {.rank = ep_->rank(), .group = ep_->name(), .expected = "numExperts a positive multiple of ep"});
  }
  localExperts_ = options_.numExperts / ep_->size();
}

DispatchPlan TokenDispatcher::dispatch(const at::Tensor& tokens, const Routing& routing) const {
  const int ranks = ep_->size(), experts = localExperts_;
  if (tokens.dim() != 2 || routing.indices.dim() != 2 || routing.indices.size(0) != tokens.size(0) ||
      routing.weights.sizes() != routing.indices.sizes() || routing.keep.sizes() != routing.indices.sizes() ||
      routing.indices.scalar_type() != at::kLong || routing.keep.scalar_type() != at::kBool) {
    throw ConfigError(
        fmt::format("dispatch on {}: tokens [{}] with routing indices [{}] ({}), weights [{}], keep [{}] ({})",
                    ep_->name(), fmt::join(tokens.sizes(), ", "), fmt::join(routing.indices.sizes(), ", "),
                    c10::toString(routing.indices.scalar_type()), fmt::join(routing.weights.sizes(), ", "),
                    fmt::join(routing.keep.sizes(), ", "), c10::toString(routing.keep.scalar_type())),
        {.rank = ep_->rank(),
         .group = ep_->name(),
         .expected = "tokens [T, H]; indices (int64), weights, keep (bool) [T, k]"});
  }
  // Before any collective, so a misplaced tensor fails on its own rank at once
  // (a kernel would read a host pointer, or the packing raise between exchanges).
  for (const auto& [what, tensor] : {std::pair<const char*, const at::Tensor&>{"indices", routing.indices},
                                     {"weights", routing.weights},
                                     {"keep", routing.keep}}) {
    if (tensor.device() != tokens.device()) {
      throw ConfigError(fmt::format("dispatch on {}: routing {} on {}, tokens on {}", ep_->name(), what,
                                    tensor.device().str(), tokens.device().str()),
                        {.rank = ep_->rank(), .group = ep_->name(), .expected = "routing on the tokens' device"});
    }
  }
  const RouteShape shape{.localExperts = experts, .ranks = ranks, .perSlot = !options_.oncePerRank};
  // Metadata travels in the combine weights' dtype, at least float32: local
  // expert ids are small integers, exact there.
  const at::ScalarType packType = at::promote_types(routing.weights.scalar_type(), at::kFloat);
  const RoutePlan routes = planRoutes(routing, shape);
  at::Tensor weights = routing.weights.to(packType);  // with autograd

  // Counts first (equal splits: one row per rank) and on their way to the
  // host. The packing queued behind them runs while the host waits for the
  // counts alone: the one device sync of a dispatch.
  const Deadline deadline = parallel::collectiveDeadline(options_.timeout);
  WorkPtr work = ep_->allToAll(routes.counts.select(0, 0), routes.counts.select(0, 1), {}, {}, {.deadline = deadline});
  const HostCopy counts(routes.counts, "the dispatch's token counts");
  const RoutedLayout layout(tokens, packType, shape.perSlot ? 1 : routing.indices.size(1));
  const SendRows outgoing = packSendRows(layout, tokens.detach(), weights.detach(), routing, shape, routes);
  const at::Tensor host = counts.get(deadline, work.get());
  const auto hostCounts = host.accessor<int64_t, 3>();
  // Every rank learns of every rank's invalid slots from the exchange, so all
  // raise together rather than leave the others waiting in the next one.
  std::vector<std::string> invalid;
  for (int rank = 0; rank < ranks; ++rank) {
    if (const int64_t slots = hostCounts[1][rank][experts + 1]; slots > 0)
      invalid.push_back(fmt::format("{} on rank {}", slots, rank));
  }
  if (!invalid.empty()) {
    throw ConfigError(fmt::format("dispatch on {}: kept slots name an expert outside [0, {}): {}", ep_->name(),
                                  options_.numExperts, fmt::join(invalid, ", ")),
                      {.rank = ep_->rank(), .group = ep_->name(), .expected = "routing indices in [0, numExperts)"});
  }
  DispatchPlan plan;
  plan.numTokens = tokens.size(0);
  plan.tokensPerLocalExpert.assign(experts, 0);
  for (int rank = 0; rank < ranks; ++rank) {
    plan.sendSplits.push_back(hostCounts[0][rank][experts]);
    plan.recvSplits.push_back(hostCounts[1][rank][experts]);
    for (int expert = 0; expert < experts; ++expert) plan.tokensPerLocalExpert[expert] += hostCounts[1][rank][expert];
  }

  // The rows, each with its combine weights and local expert ids, in one exchange.
  plan.sendTable = outgoing.table;
  const RoutedSend send{.bytes = outgoing.bytes.narrow(0, 0, sum(plan.sendSplits)),
                        .layout = layout,
                        .tokens = tokens,
                        .tokenTable = outgoing.table,
                        // Per slot, weight row t * k + j travels in the row of slot (t, j).
                        .weights = shape.perSlot ? weights.reshape({-1, 1}) : weights,
                        .weightTable = shape.perSlot ? outgoing.table.view({-1, 1}) : outgoing.table};
  const RoutedRows arrived = exchangeRouted(ep_, send, plan.sendSplits, plan.recvSplits, options_.timeout);
  const int64_t expertRows = sum(plan.tokensPerLocalExpert);
  if (expertRows > std::numeric_limits<int32_t>::max()) {
    throw ConfigError(fmt::format("dispatch: {} expert rows on one rank, more than int32 group ends hold", expertRows),
                      {.expected = "fewer than 2^31 expert rows per rank: fewer tokens per step or more ep ranks"});
  }

  // A copy, so the plan does not keep the whole receive buffer (token rows
  // included) alive until the combine.
  plan.recvWeights = arrived.weights.contiguous();
  // One expert row per (received row, local expert), ordered by local expert.
  Grouping byExpert;
  {
    const c10::NoGradGuard metadata;
    // The ids are small integers (-1: none), exact in the side's floating
    // type. The kernels also write the group ends. (The copy is cheaper than
    // reading the ids in place: rows of the receive buffer lie kilobytes apart,
    // and each warp reads its segment's keys one dependent load at a time.)
    byExpert = groupEntries(arrived.ids.to(at::kLong), experts, expertRows, &plan.expertRowEnds);
  }
  if (!plan.expertRowEnds.defined()) plan.expertRowEnds = runningSum(plan.tokensPerLocalExpert, tokens.device());
  plan.recvTable = byExpert.table;
  plan.expertInput = gatherRows(arrived.rows, byExpert.table, byExpert.order.size(0));
  return plan;
}

at::Tensor TokenDispatcher::combine(const DispatchPlan& plan, const at::Tensor& expertOutput) const {
  if (expertOutput.dim() != 2 || expertOutput.size(0) != plan.expertInput.size(0)) {
    throw ConfigError(fmt::format("combine on {}: expert output [{}] for a dispatch of {} expert rows", ep_->name(),
                                  fmt::join(expertOutput.sizes(), ", "), plan.expertInput.size(0)),
                      {.rank = ep_->rank(), .group = ep_->name(), .expected = "expert output [N, H], N as dispatched"});
  }
  // Both tables name every row of their source once: each expert row feeds
  // one received row, and each returned row one token.
  at::Tensor rowsOut = gatherSum(expertOutput, plan.recvTable, plan.recvWeights, SourceRows::Every);
  at::Tensor returned = allToAll(ep_, rowsOut, plan.recvSplits, plan.sendSplits, options_.timeout);
  return gatherSum(returned, plan.sendTable, at::Tensor(), SourceRows::Every);
}

Grouping groupEntries(const at::Tensor& group, int groups, int64_t count, at::Tensor* ends) {
  Grouping grouping;
  // The kernels take any key outside [0, groups) as none; the sort needs
  // none as the largest key.
  if (groupByKeyKernels(group, groups, count, grouping.order, grouping.table, ends)) return grouping;
  if (ends != nullptr) *ends = at::Tensor();
  return groupByKey(at::where(group.ge(0).logical_and(group.lt(groups)), group, groups), groups, count);
}

at::Tensor permuteTokens(const at::Tensor& tokens, const Grouping& grouping) {
  return gatherRows(tokens, grouping.table, grouping.order.size(0));
}

at::Tensor unpermuteTokens(const at::Tensor& rows, const Grouping& grouping) {
  return gatherSum(rows, grouping.table, at::Tensor());
}

}  // namespace bulkhead::moe
