#pragma once
// The capacity-mode dispatch with fixed shapes (one ep rank): every expert
// gets exactly `capacity` rows, filled by its kept slots (best weight first, as
// the router ranked them) and padded with zeros, so the shapes of a step do not
// depend on the routing and nothing is read back to the host. That is what a
// CUDA graph needs to capture a whole MoE layer; dropless dispatch sizes its
// buffers from counts it reads on the host and cannot be captured.
//
// Contract:
// - routing: Router::select's, with a capacity (position and keep defined);
//   tokens [T, H]; capacity = the router's ceil(factor * T * k / E).
// - expertInput [E * capacity, H]: expert e's rows at [e * C, (e + 1) * C);
//   the slot of rank p < C of expert e sits at row e * C + p. Padding rows are
//   zero, so SwiGLU experts turn them into zeros.
// - combine: output[t] = sum over kept slots j of weights[t, j] x
//   expertOutput[row of (t, j)]; dropped slots add nothing and get no gradient.
// - Differentiable both ways through gatherRowsOrZero and gatherSum
//   (moe/gather_sum.h): no atomics, sums in a fixed order.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "moe/router.h"

namespace bulkhead::moe {

struct StaticPlan {
  int64_t capacity = 0;
  at::Tensor expertInput;               // [E * C, H]
  at::Tensor slotTable;                 // [T, k] int64: each slot's expert row, -1 where dropped
  std::vector<int64_t> rowsPerExpert;   // C each, on the host
  at::Tensor rowEnds;                   // int32 running sum of rowsPerExpert on the device
};

int64_t staticCapacity(const RouterOptions& router, int64_t tokens);

StaticPlan staticDispatch(const at::Tensor& tokens, const Routing& routing, int numExperts, int64_t capacity);

at::Tensor staticCombine(const StaticPlan& plan, const Routing& routing, const at::Tensor& expertOutput);

}  // namespace bulkhead::moe
