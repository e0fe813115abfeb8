#pragma once
// Static shapes at ep > 1: the capacity-padded rows of staticDispatch (padded
// layout, [E * C, H] in global expert order) exchanged over the ep group with
// equal splits, as GShard does. Every rank sends E_local * C rows to every ep
// rank (the block of that rank's experts) and receives as many from each, so
// the sizes are known on the host from (E, ep, C) alone: nothing is read back,
// and a CUDA graph captures the exchange through the backend's captured path.
// The padding travels too: that is the price of fixed shapes.
//
// Contract:
// - Every rank of the ep group has the same capacity C, hence (with the same
//   router options) the same number of tokens. check() verifies it eagerly,
//   once per capacity a rank sees: one all-gather of (tokens, capacity) and
//   one host read; a difference is a ConfigError on every rank naming each
//   rank's tokens and capacity. Under capture nothing is checked there: the
//   checked region around the capture pairs the rows each rank sends with
//   the rows its peer expects (runtime/diagnosis/checked_region.h).
// - toExperts: this rank's experts' rows, [E_local * ep * C, H], local expert
//   e's rows from source rank s at [(e * ep + s) * C, (e * ep + s + 1) * C):
//   every local expert gets ep * C rows (forwardPadded's layout).
// - fromExperts: the experts' output in that layout back to each source, in
//   the padded order it sent ([E * C, H]), for staticCombine.
// - Both are differentiable (moe/all_to_all_autograd.h: the backward is the
//   reverse exchange on the same group), forward and backward under the
//   layer's timeout. A group of one moves nothing.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "moe/all_to_all_autograd.h"
#include "runtime/communicator.h"

namespace bulkhead::moe {

class StaticExchange {
 public:
  StaticExchange(CommunicatorPtr ep, int localExperts, Timeout timeout, std::string layerName);

  void check(const at::Tensor& tokens, int64_t capacity, bool capturing);
  at::Tensor toExperts(const at::Tensor& padded, int64_t capacity) const;
  at::Tensor fromExperts(const at::Tensor& expertOutput, int64_t capacity) const;

 private:
  // E_local * C rows to and from every ep rank.
  std::vector<int64_t> splits(int64_t capacity) const;
  // [a, b, C, H] rows -> [b, a, C, H] rows, flattened again.
  static at::Tensor swapBlocks(const at::Tensor& rows, int64_t a, int64_t b, int64_t capacity);

  CommunicatorPtr ep_;
  int64_t localExperts_;
  Timeout timeout_;
  std::string layerName_;
  std::set<int64_t> checked_;  // capacities every ep rank was seen to share
};

}  // namespace bulkhead::moe
