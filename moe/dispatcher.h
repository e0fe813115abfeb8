#pragma once
// The token dispatcher (docs/design.md#the-moe-layer): moves each token to the ep ranks
// that hold its selected experts and brings the weighted results back.
//
// Contract:
// - Experts are laid out in contiguous blocks: ep rank r holds global experts
//   [r * E/ep, (r+1) * E/ep), local index = global % (E/ep).
// - dispatch() and combine() issue the same collectives on every rank of the
//   ep group, in the same order, whatever the rank holds (zero tokens, zero
//   selected slots): dispatch exchanges row counts (read to the host in the
//   dispatch's one device sync), then the tokens with their routing (combine
//   weights, local expert ids) in one exchange; combine exchanges the results.
//   Backward (via autograd) sends the results' gradients out, then the
//   tokens' and the weights' gradients back (two exchanges), on every rank.
// - Once per rank (the default): a token goes once to each rank that holds
//   any of its selected experts and is expanded there into one row per
//   selected local expert; the weighted sum over those experts is formed there
//   and one row comes back. Per slot: one row each way for every selected
//   (token, expert) slot, as common dispatchers do. Both give the same result
//   up to the order of floating-point additions.
// - Dropped slots (Routing::keep false) are neither sent nor counted. Kept
//   slots naming no expert (outside [0, numExperts)) travel as counts in the
//   counts exchange, and every rank of the group raises ConfigError there.
//   Inputs of the wrong shape, dtype or device raise ConfigError on their own rank
//   before any collective; the others then time out in the counts exchange.
// - Expert inputs are ordered by local expert, tokensPerLocalExpert[e] rows
//   each (experts with no rows included).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "moe/dispatch_routes.h"
#include "moe/router.h"
#include "runtime/communicator.h"

namespace bulkhead::moe {

struct DispatcherOptions {
  int numExperts = 8;
  bool oncePerRank = true;
  // Each exchange, forward and backward; unset: BULKHEAD_COLLECTIVE_TIMEOUT.
  std::optional<std::chrono::milliseconds> timeout;
};

// What one dispatch leaves for its combine. Holds autograd state: combine it
// in the same step.
struct DispatchPlan {
  at::Tensor expertInput;                     // [N, H] ordered by local expert
  std::vector<int64_t> tokensPerLocalExpert;  // host copy, E/ep entries
  // Their running sum as int32 on the tokens' device: at::_grouped_mm's group ends.
  at::Tensor expertRowEnds;
  std::vector<int64_t> sendSplits, recvSplits;  // rows to / from each ep rank
  // How results come back: received row p sums expert rows recvTable[p, c]
  // (weights recvWeights[p, c]); token t sums returned rows sendTable[t, c].
  at::Tensor recvTable, recvWeights, sendTable;
  int64_t numTokens = 0;
};

class TokenDispatcher {
 public:
  TokenDispatcher(CommunicatorPtr ep, DispatcherOptions options);

  DispatchPlan dispatch(const at::Tensor& tokens, const Routing& routing) const;
  // expertOutput: [N, H] in the plan's expert order, N the dispatched expert
  // rows (others raise ConfigError on this rank before the exchange). Returns [T, H].
  at::Tensor combine(const DispatchPlan& plan, const at::Tensor& expertOutput) const;

  int localExperts() const { return localExperts_; }
  int firstExpert() const { return ep_->rank() * localExperts_; }

 private:
  CommunicatorPtr ep_;
  DispatcherOptions options_;
  int localExperts_;
};

// Entries of a [P, m] grid assigned to groups 0..groups-1 (-1: none), listed
// group by group and, within a group, in grid order (Grouping, moe/dispatch_routes.h);
// `count` is the number of assigned entries (known on the host, so no device
// sync is needed). Where the kernels run and `ends` is given, it gets the
// running count per group (int32 [groups], at::_grouped_mm's group ends);
// elsewhere it is set undefined.
Grouping groupEntries(const at::Tensor& group, int groups, int64_t count, at::Tensor* ends = nullptr);

// Rows of `tokens` in grouping order (row i is token order[i] / m), and back:
// unpermute sums each token's rows (exact when every token has one). The
// permutation's backward is a gatherSum over the table (no atomics).
at::Tensor permuteTokens(const at::Tensor& tokens, const Grouping& grouping);
at::Tensor unpermuteTokens(const at::Tensor& rows, const Grouping& grouping);

}  // namespace bulkhead::moe
