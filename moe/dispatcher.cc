#include "moe/dispatcher.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <numeric>
#include <utility>

#include "moe/differentiable.h"
#include "moe/gather_sum.h"
#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::moe {
namespace {

// What this rank sends: one row per (token, destination) pair or per slot.
// meta[row, c] is the local expert (at the destination) of column c, -1 for
// none; weight[row, c] its combine weight.
struct SendRows {
  Grouping grouping;  // over the [T, m'] grid of (token, rank) pairs or (token, slot)
  at::Tensor rowToken, meta, weight;
  std::vector<int64_t> splits;
  at::Tensor counts;  // [ranks, 1 + localExperts]: rows, then entries per local expert
};

std::vector<int64_t> toHost(const at::Tensor& values) {
  at::Tensor host = values.to(at::kCPU, at::kLong).contiguous();
  return {host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()};
}

int64_t sum(const std::vector<int64_t>& values) { return std::accumulate(values.begin(), values.end(), int64_t{0}); }

// Rows per destination and entries per (destination, local expert), read to
// the host in one copy: the one device sync on the sending side. `rowRank`
// and `slotExpert` hold -1 for entries that are not sent.
void countRows(SendRows& rows, const at::Tensor& rowRank, const at::Tensor& slotExpert, int localExperts, int ranks) {
  at::Tensor perRank = countValues(rowRank, ranks).view({ranks, 1});
  at::Tensor perExpert = countValues(slotExpert, int64_t{ranks} * localExperts).view({ranks, localExperts});
  rows.counts = at::cat({perRank, perExpert}, 1);
  std::vector<int64_t> host = toHost(rows.counts);
  for (int rank = 0; rank < ranks; ++rank) rows.splits.push_back(host[rank * (1 + localExperts)]);
}

at::Tensor keptExperts(const Routing& routing) {
  return at::where(routing.keep, routing.indices, at::full_like(routing.indices, -1));
}

// One row per kept slot, grouped by destination rank (slots keep token order).
SendRows perSlotRows(const Routing& routing, int localExperts, int ranks) {
  const int64_t k = routing.indices.size(1);
  at::Tensor destination = routing.indices.div(localExperts, "floor");
  at::Tensor group = at::where(routing.keep, destination, at::full_like(destination, -1));
  SendRows rows;
  countRows(rows, group, keptExperts(routing), localExperts, ranks);
  rows.grouping = groupEntries(group, ranks, sum(rows.splits));
  rows.rowToken = rows.grouping.order.div(k, "floor");
  rows.meta = routing.indices.reshape(-1).index_select(0, rows.grouping.order).remainder(localExperts).unsqueeze(1);
  rows.weight = routing.weights.reshape(-1).index_select(0, rows.grouping.order).unsqueeze(1);
  return rows;
}

// One row per (token, destination rank) with any kept slot, grouped by rank;
// each row lists the token's local experts at that rank.
SendRows perRankRows(const Routing& routing, int localExperts, int ranks) {
  const int64_t numTokens = routing.indices.size(0);
  at::Tensor destination = routing.indices.div(localExperts, "floor");  // [T, k]
  at::Tensor keptToRank = at::zeros({numTokens, ranks}, destination.options());
  keptToRank.scatter_add_(1, destination, routing.keep.to(at::kLong));
  at::Tensor paired = keptToRank.gt(0);
  at::Tensor rankOf = at::arange(ranks, destination.options()).expand({numTokens, ranks});
  at::Tensor group = at::where(paired, rankOf, at::full_like(rankOf, -1));
  SendRows rows;
  countRows(rows, group, keptExperts(routing), localExperts, ranks);
  rows.grouping = groupEntries(group, ranks, sum(rows.splits));
  rows.rowToken = rows.grouping.order.div(ranks, "floor");
  at::Tensor rowRank = rows.grouping.order.remainder(ranks);
  at::Tensor valid = destination.index_select(0, rows.rowToken).eq(rowRank.unsqueeze(1)) &
                     routing.keep.index_select(0, rows.rowToken);
  at::Tensor local = routing.indices.index_select(0, rows.rowToken).remainder(localExperts);
  rows.meta = at::where(valid, local, at::full_like(local, -1));
  rows.weight = routing.weights.index_select(0, rows.rowToken);
  return rows;
}

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
  const int ranks = ep_->size();
  SendRows rows = options_.oncePerRank ? perRankRows(routing, localExperts_, ranks)
                                       : perSlotRows(routing, localExperts_, ranks);
  DispatchPlan plan;
  plan.numTokens = tokens.size(0);
  plan.sendTable = rows.grouping.table;
  plan.sendSplits = rows.splits;

  // Counts first: every other exchange's splits depend on them. The second
  // and last device sync of a dispatch.
  at::Tensor received = at::empty_like(rows.counts);
  const Deadline deadline = parallel::collectiveDeadline(options_.timeout);
  ep_->allToAll(rows.counts, received, {}, {}, {.deadline = deadline})->wait(deadline);
  std::vector<int64_t> counts = toHost(received);
  plan.tokensPerLocalExpert.assign(localExperts_, 0);
  for (int rank = 0; rank < ranks; ++rank) {
    plan.recvSplits.push_back(counts[rank * (1 + localExperts_)]);
    for (int expert = 0; expert < localExperts_; ++expert)
      plan.tokensPerLocalExpert[expert] += counts[rank * (1 + localExperts_) + 1 + expert];
  }
  plan.tokensPerLocalExpertDevice = at::tensor(plan.tokensPerLocalExpert, at::kLong).to(tokens.device());

  const auto timeout = options_.timeout;
  at::Tensor meta = exchangeRows(*ep_, rows.meta, plan.sendSplits, plan.recvSplits, timeout);
  plan.recvWeights = allToAll(ep_, rows.weight, plan.sendSplits, plan.recvSplits, timeout);
  at::Tensor arrived = allToAll(ep_, permuteTokens(tokens, rows.grouping), plan.sendSplits, plan.recvSplits, timeout);

  // One expert row per (received row, local expert), ordered by local expert.
  Grouping byExpert = groupEntries(meta, localExperts_, sum(plan.tokensPerLocalExpert));
  plan.recvTable = byExpert.table;
  plan.expertInput = arrived.index_select(0, byExpert.order.div(meta.size(1), "floor"));
  return plan;
}

at::Tensor TokenDispatcher::combine(const DispatchPlan& plan, const at::Tensor& expertOutput) const {
  at::Tensor rowsOut = gatherSum(expertOutput, plan.recvTable, plan.recvWeights);
  at::Tensor returned = allToAll(ep_, rowsOut, plan.recvSplits, plan.sendSplits, options_.timeout);
  return gatherSum(returned, plan.sendTable, at::Tensor());
}

Grouping groupEntries(const at::Tensor& group, int groups, int64_t count) {
  at::Tensor flat = group.reshape(-1);
  at::Tensor key = at::where(flat.ge(0), flat, at::full_like(flat, groups));
  at::Tensor sorted = std::get<1>(at::sort(key, /*stable=*/true, 0, false));
  Grouping grouping;
  grouping.order = sorted.narrow(0, 0, count);
  grouping.table = at::full_like(flat, -1)
                       .index_put_({grouping.order}, at::arange(count, flat.options()))
                       .view(group.sizes());
  return grouping;
}

at::Tensor permuteTokens(const at::Tensor& tokens, const Grouping& grouping) {
  return tokens.index_select(0, grouping.order.div(grouping.table.size(1), "floor"));
}

at::Tensor unpermuteTokens(const at::Tensor& rows, const Grouping& grouping) {
  return gatherSum(rows, grouping.table, at::Tensor());
}

}  // namespace bulkhead::moe
