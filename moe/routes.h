#pragma once
// The dispatcher's index work (design section 7): where each token's selected
// slots go, and the send rows that carry them. On CUDA tensors where the
// kernels are built (moe/cuda/route_kernels.h) each function is one kernel
// launch; elsewhere ATen operations compute the same values. A dispatch
// waits for its counts on the host, so every launch saved before that sync
// is time the whole step waits.
//
// Slots: Routing::indices [T, k] and keep [T, k]; with L local experts per
// rank, slot (t, j) goes to rank indices / L as local expert indices % L.
// Candidate rows: per slot, one per slot (m = k columns); once per rank, one
// per (token, rank) (m = R columns). Kept slots make candidates real rows.

#include <ATen/core/Tensor.h>

#include "moe/differentiable.h"
#include "moe/router.h"

namespace bulkhead::moe {

// A stable grouping: entries listed group by group, in entry order within a
// group. table (the key's shape) gives each entry's position in that list,
// -1 for none.
struct Grouping {
  at::Tensor order;  // [count] flat entry positions
  at::Tensor table;  // int64, the key's shape
};
// Grouping by an int64 key in [0, groups], where `groups` (the largest key)
// marks entries outside every group; `count` entries are inside.
Grouping groupByKey(const at::Tensor& key, int64_t groups, int64_t count);

struct RouteShape {
  int localExperts = 1;
  int ranks = 1;
  bool perSlot = false;
};

struct RoutePlan {
  // One int64 buffer, read to the host in one copy:
  at::Tensor counters;  // [2 * R * (L + 1) + 1], the two views below
  at::Tensor counts;    // [2, R, L + 1]: row 0 what this rank sends (per rank: kept slots per
                        // local expert, then rows); row 1 is left for what it receives
  at::Tensor invalid;   // [1]: kept slots whose expert id is not in [0, R * L) (never sent)
  at::Tensor key;       // [T, m]: each candidate row's rank, R where it is not sent
};
RoutePlan planRoutes(const Routing& routing, const RouteShape& shape);

// The send rows of a dispatch, grouped by rank, packed before the host knows
// how many there are (so the GPU packs while the counts travel). Row table[t, c]
// carries token t, its combine weights (weights [T, k] of the side type: all k
// once per rank, weights[t, c] per slot) and the local expert ids of those
// weights (-1 where the slot is not at that row's rank), in `layout` (side
// columns: k once per rank, 1 per slot). No autograd: exchangeRouted attaches it.
struct SendRows {
  at::Tensor bytes;  // [rows, layout.width]: where the kernels run, room for the most rows a
                     // dispatch can send (T * min(m, k)); the rows sent come first
  at::Tensor table;  // [T, m]: each candidate's row, -1 where none is sent
};
SendRows packSendRows(const RoutedLayout& layout, const at::Tensor& tokens, const at::Tensor& weights,
                      const Routing& routing, const RouteShape& shape, const RoutePlan& plan);

}  // namespace bulkhead::moe
