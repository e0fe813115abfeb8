#include "moe/dispatcher.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>

#include <numeric>
#include <utility>

#include "moe/differentiable.h"
#include "moe/gather_sum.h"
#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::moe {
namespace {

// Candidate rows, before the counts are read: one per (token, rank) pair or
// per (token, slot). Candidate (t, j) is flat grid position t * m + j.
struct Candidates {
  at::Tensor key;      // [T, m] int64: the row's destination rank, `ranks` where no row is sent
  at::Tensor meta;     // [T * m, m']: local expert ids at the destination, -1 for none (pack dtype)
  bool perSlot = false;
};

// The counts of a dispatch live in one [2, ranks, localExperts + 1] tensor:
// row 0 what this rank sends, row 1 what it receives, both read to the host
// in one copy. Per destination: the entries per local expert, then the rows.
at::Tensor countEntries(const Routing& routing, const at::Tensor& destination, int localExperts, int ranks) {
  at::Tensor counts = at::zeros({2, ranks, localExperts + 1}, routing.indices.options().dtype(at::kLong));
  // Entry (r, e) of row 0 is flat position r * (L + 1) + e = global expert + r.
  at::Tensor entry = routing.indices + destination;
  counts.view(-1).scatter_add_(0, entry.reshape(-1), routing.keep.to(at::kLong).reshape(-1));
  return counts;
}

// One row per kept slot, grouped by destination rank (slots keep token order).
Candidates perSlotCandidates(const Routing& routing, at::Tensor& counts, int localExperts, int ranks,
                             at::ScalarType packType) {
  at::Tensor destination = routing.indices.div(localExperts, "floor");
  counts = countEntries(routing, destination, localExperts, ranks);
  at::Tensor sent = counts.select(0, 0);
  sent.select(1, localExperts).copy_(sent.narrow(1, 0, localExperts).sum(1));  // a row per kept slot
  Candidates candidates;
  candidates.key = at::where(routing.keep, destination, ranks);
  candidates.meta = routing.indices.remainder(localExperts).to(packType).reshape({-1, 1});
  candidates.perSlot = true;
  return candidates;
}

// One row per (token, destination rank) with any kept slot, grouped by rank;
// each row lists the token's local experts at that rank (-1 in other columns).
Candidates perRankCandidates(const Routing& routing, at::Tensor& counts, int localExperts, int ranks,
                             at::ScalarType packType) {
  const int64_t numTokens = routing.indices.size(0), k = routing.indices.size(1);
  at::Tensor destination = routing.indices.div(localExperts, "floor");
  counts = countEntries(routing, destination, localExperts, ranks);
  at::Tensor rankOrNone = at::where(routing.keep, destination, ranks);                 // [T, k]
  at::Tensor rankIds = at::arange(ranks, destination.options());
  at::Tensor atRank = rankOrNone.unsqueeze(1).eq(rankIds.view({1, ranks, 1}));        // [T, R, k]
  at::Tensor paired = atRank.any(2);                                                   // [T, R]
  at::Tensor rowsColumn = counts.select(0, 0).select(1, localExperts);
  at::sum_out(rowsColumn, paired, at::IntArrayRef{0});
  Candidates candidates;
  candidates.key = at::where(paired, rankIds, ranks);
  at::Tensor local = routing.indices.remainder(localExperts).to(packType).unsqueeze(1);  // [T, 1, k]
  candidates.meta = at::where(atRank, local, -1.0).view({numTokens * ranks, k});
  return candidates;
}

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
  // Metadata travels in the combine weights' dtype, at least float32: local
  // expert ids are small integers, exact there.
  const at::ScalarType packType = at::promote_types(routing.weights.scalar_type(), at::kFloat);
  at::Tensor counts;
  Candidates candidates;
  {
    const c10::NoGradGuard metadata;
    candidates = options_.oncePerRank ? perRankCandidates(routing, counts, experts, ranks, packType)
                                      : perSlotCandidates(routing, counts, experts, ranks, packType);
  }
  at::Tensor weights = routing.weights.to(packType);  // with autograd

  // Counts first (equal splits: one row per rank), then both rows to the host
  // in one copy: the one device sync of a dispatch.
  const Deadline deadline = parallel::collectiveDeadline(options_.timeout);
  WorkPtr work = ep_->allToAll(counts.select(0, 0), counts.select(0, 1), {}, {}, {.deadline = deadline});
  at::Tensor host;
  if (counts.is_cuda()) {
    host = counts.to(at::kCPU);  // ordered after the exchange on the stream
    // Already complete, so no second sync: this only raises the exchange's
    // error (a timed-out, aborted exchange leaves no counts to trust).
    work->wait(deadline);
  } else {
    work->wait(deadline);
    host = counts;
  }
  const auto hostCounts = host.accessor<int64_t, 3>();
  DispatchPlan plan;
  plan.numTokens = tokens.size(0);
  plan.tokensPerLocalExpert.assign(experts, 0);
  for (int rank = 0; rank < ranks; ++rank) {
    plan.sendSplits.push_back(hostCounts[0][rank][experts]);
    plan.recvSplits.push_back(hostCounts[1][rank][experts]);
    for (int expert = 0; expert < experts; ++expert) plan.tokensPerLocalExpert[expert] += hostCounts[1][rank][expert];
  }
  plan.tokensPerLocalExpertDevice = counts.select(0, 1).narrow(1, 0, experts).sum(0);

  // Rows to send, grouped by rank, each with its combine weights and local
  // expert ids, in one exchange.
  RoutedRows arrived;
  {
    Grouping grouping;
    at::Tensor rowToken, metaRows;
    {
      const c10::NoGradGuard metadata;
      grouping = groupByKey(candidates.key, ranks, sum(plan.sendSplits));
      rowToken = rowsOf(grouping.order, candidates.key.size(1));
      metaRows = candidates.meta.index_select(0, grouping.order);
    }
    plan.sendTable = grouping.table;
    at::Tensor weightRows =
        candidates.perSlot
            ? gatherRows(weights.reshape({-1, 1}), grouping.order, grouping.table.view({-1, 1}))
            : gatherRows(weights, rowToken, grouping.table);
    arrived = exchangeRouted(ep_, tokens, rowToken, grouping.table, weightRows, metaRows, plan.sendSplits,
                             plan.recvSplits, options_.timeout);
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
