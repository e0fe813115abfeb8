#include "moe/dispatcher.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <utility>

#include "moe/differentiable.h"
#include "runtime/errors.h"

namespace bulkhead::moe {
namespace {

// What this rank sends: one row per (token, destination) pair or per slot.
// meta[row, c] is the local expert (at the destination) of column c, -1 for
// none; weight[row, c] its combine weight (0 for none).
struct SendRows {
  at::Tensor rowToken;  // [S] int64
  at::Tensor meta;      // [S, m] int64
  at::Tensor weight;    // [S, m] (autograd)
  std::vector<int64_t> splits;
};

std::vector<int64_t> toHost(const at::Tensor& counts) {
  at::Tensor host = counts.to(at::kCPU, at::kLong).contiguous();
  return {host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()};
}

// One row per kept slot, grouped by destination rank (slots keep token order).
SendRows perSlotRows(const Routing& routing, int localExperts, int ranks) {
  const int64_t k = routing.indices.size(1);
  at::Tensor experts = routing.indices.reshape(-1);
  at::Tensor slots = routing.keep.reshape(-1).nonzero().squeeze(1);
  at::Tensor destination = experts.index_select(0, slots).div(localExperts, "floor");
  at::Tensor order = std::get<1>(at::sort(destination, /*stable=*/true, 0, false));
  at::Tensor sorted = slots.index_select(0, order);
  SendRows rows;
  rows.rowToken = sorted.div(k, "floor");
  rows.meta = experts.index_select(0, sorted).remainder(localExperts).unsqueeze(1);
  rows.weight = routing.weights.reshape(-1).index_select(0, sorted).unsqueeze(1);
  rows.splits = toHost(at::bincount(destination, {}, ranks));
  return rows;
}

// One row per (token, destination rank) that has any kept slot, grouped by
// rank; each row lists the token's local experts at that rank.
SendRows perRankRows(const Routing& routing, int localExperts, int ranks) {
  const int64_t numTokens = routing.indices.size(0);
  at::Tensor destination = routing.indices.div(localExperts, "floor");  // [T, k]
  at::Tensor keptToRank = at::zeros({numTokens, ranks}, destination.options());
  keptToRank.scatter_add_(1, destination, routing.keep.to(at::kLong));
  at::Tensor pairs = keptToRank.t().gt(0).nonzero();  // (rank, token), by rank then token
  at::Tensor rowRank = pairs.select(1, 0);
  SendRows rows;
  rows.rowToken = pairs.select(1, 1).contiguous();
  at::Tensor valid = destination.index_select(0, rows.rowToken).eq(rowRank.unsqueeze(1)) &
                     routing.keep.index_select(0, rows.rowToken);
  at::Tensor local = routing.indices.index_select(0, rows.rowToken).remainder(localExperts);
  rows.meta = at::where(valid, local, at::full_like(local, -1));
  at::Tensor weights = routing.weights.index_select(0, rows.rowToken);
  rows.weight = weights * valid.to(weights.scalar_type());
  rows.splits = toHost(at::bincount(rowRank, {}, ranks));
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
  plan.sendRowToken = rows.rowToken;
  plan.sendSplits = rows.splits;

  // Counts first: every other exchange's splits depend on them.
  at::Tensor sendCounts = at::tensor(rows.splits, at::TensorOptions(at::kLong)).to(tokens.device());
  at::Tensor recvCounts = at::empty_like(sendCounts);
  ep_->allToAll(sendCounts, recvCounts, {}, {})->wait();
  plan.recvSplits = toHost(recvCounts);

  at::Tensor meta = exchangeRows(*ep_, rows.meta, plan.sendSplits, plan.recvSplits);
  at::Tensor weight = allToAll(ep_, rows.weight, plan.sendSplits, plan.recvSplits);
  at::Tensor received = allToAll(ep_, permuteTokens(tokens, rows.rowToken), plan.sendSplits, plan.recvSplits);
  plan.receivedRows = received.size(0);

  // Expand received rows into one row per (row, local expert), ordered by
  // local expert (stable: rows keep their arrival order within an expert).
  const int64_t columns = meta.size(1);
  at::Tensor flatMeta = meta.reshape(-1);
  at::Tensor entries = flatMeta.ge(0).nonzero().squeeze(1);  // flat (row, column) positions
  at::Tensor expertOf = flatMeta.index_select(0, entries);
  at::Tensor order = std::get<1>(at::sort(expertOf, /*stable=*/true, 0, false));
  at::Tensor chosen = entries.index_select(0, order);
  plan.expertRow = chosen.div(columns, "floor");
  plan.expertWeight = weight.reshape(-1).index_select(0, chosen);
  plan.expertInput = received.index_select(0, plan.expertRow);
  plan.tokensPerLocalExpertDevice = at::bincount(expertOf, {}, localExperts_);
  plan.tokensPerLocalExpert = toHost(plan.tokensPerLocalExpertDevice);
  return plan;
}

at::Tensor TokenDispatcher::combine(const DispatchPlan& plan, const at::Tensor& expertOutput) const {
  at::Tensor weighted = expertOutput * plan.expertWeight.to(expertOutput.scalar_type()).unsqueeze(1);
  at::Tensor rowsOut = unpermuteTokens(weighted, plan.expertRow, plan.receivedRows);
  at::Tensor returned = allToAll(ep_, rowsOut, plan.recvSplits, plan.sendSplits);
  return unpermuteTokens(returned, plan.sendRowToken, plan.numTokens);
}

at::Tensor permuteTokens(const at::Tensor& tokens, const at::Tensor& rowToken) {
  return tokens.index_select(0, rowToken);
}

at::Tensor unpermuteTokens(const at::Tensor& rows, const at::Tensor& rowToken, int64_t numTokens) {
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = numTokens;
  return at::zeros(shape, rows.options()).index_add(0, rowToken, rows);
}

}  // namespace bulkhead::moe
