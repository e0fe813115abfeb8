#pragma once
// The capacity-mode dispatch with fixed shapes (one ep rank): every expert
// gets exactly `capacity` rows, filled by its kept slots (best weight first, as
// the router ranked them) and padded with zeros, so the shapes of a step do not
// depend on the routing and nothing is read back to the host. That is what a
// CUDA graph needs to capture a whole MoE layer; dropless dispatch sizes its
// buffers from counts it reads on the host and cannot be captured.
//
// Two layouts of the expert rows, both of shapes fixed by (T, k, E, C):
// - padded: expertInput [E * C, H], expert e's rows at [e * C, (e + 1) * C);
//   the slot of rank p < C of expert e at row e * C + p. Its group sizes are
//   known on the host (C each): for batched GEMMs (GroupedExperts::
//   forwardPadded), which add each weight gradient in place.
// - packed: expertInput [T * k, H], the kept slots of each expert one after
//   the other (expert e's from the running sum of the kept counts before it,
//   in rank order), then zero rows up to T * k, which the last expert's group
//   takes in. Its group ends exist only on the device: for at::_grouped_mm,
//   which then multiplies the rows the routing kept (plus the dropped slots'
//   worth of zero rows) instead of every expert's full capacity.
//
// Contract:
// - routing: Router::select's, with a capacity (position and keep defined);
//   tokens [T, H]; capacity = the router's ceil(factor * T * k / E).
// - Padding rows are zero, so SwiGLU experts turn them into zeros.
// - combine: output[t] = sum over kept slots j of weights[t, j] x
//   expertOutput[row of (t, j)]; dropped slots add nothing and get no gradient.
// - Differentiable both ways through gatherRowsOrZero and gatherSum
//   (moe/gather_sum.h): no atomics, sums in a fixed order.
//
// Dropless with every expert on this rank (ep 1), the packed layout needs no
// capacity: each slot is kept, so the buffer is exactly [T * k, H], the slots
// of each expert in slot order (as the dispatcher orders them at ep 1), and
// the group ends stay on the device. droplessDispatch builds it without a
// read back to the host or an exchange; its results equal the dispatcher's
// once-per-rank results at ep 1 bit for bit (the same rows in the same order,
// the same sums). Per slot, the dispatcher rounds each weighted slot to the
// tokens' dtype before the sum; here each token's sum is rounded once.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "moe/router.h"

namespace bulkhead::moe {

struct StaticPlan {
  int64_t capacity = 0;
  bool packed = false;
  at::Tensor expertInput;              // [E * C, H] padded, [T * k, H] packed
  at::Tensor slotTable;                // [T, k] int64: each slot's expert row, -1 where dropped
  std::vector<int64_t> rowsPerExpert;  // padded: C each, on the host; packed: empty
  at::Tensor rowEnds;                  // packed: int32 group ends on the device, the last T * k
  at::Tensor keptRows;  // int32 on the device: packed, the kept rows [1]; padded on a GPU, each expert's [E]
};

int64_t staticCapacity(const RouterOptions& router, int64_t tokens);

StaticPlan staticDispatch(const at::Tensor& tokens, const Routing& routing, int numExperts, int64_t capacity,
                          bool packed = false);

// The dropless packed plan (capacity 0, keptRows undefined: every row is a
// slot's), or nothing where it does not apply: the routing has a capacity
// (routing.position defined), there are no tokens, T * k rows overflow int32
// group ends, or the grouping kernels or at::_grouped_mm do not run on these
// tokens (`groupedExperts` false: the experts need their counts on the
// host); the dispatcher runs there (and raises what it raises).
// Contract: a dropless Router::select's routing: every slot kept, every id
// in [0, numExperts). It is not checked here (that would read the device).
bool droplessDispatchApplies(const at::Tensor& tokens, int numExperts, bool groupedExperts);
std::optional<StaticPlan> droplessDispatch(const at::Tensor& tokens, const Routing& routing, int numExperts,
                                           bool groupedExperts);

at::Tensor staticCombine(const StaticPlan& plan, const Routing& routing, const at::Tensor& expertOutput);

}  // namespace bulkhead::moe
