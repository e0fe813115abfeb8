#pragma once
// The dispatcher's index work (docs/design.md#the-moe-layer): where each token's selected
// slots go, and the send rows that carry them. On CUDA tensors where the
// kernels are built (moe/cuda/route_kernels.h), planning is one kernel and
// packing three (a stable grouping in two, then the packing); elsewhere ATen
// operations compute the same values. A dispatch waits for its counts on the
// host, so every launch saved before that wait is time the whole step waits.
//
// Slots: Routing::indices [T, k] and keep [T, k]; with L local experts per
// rank, slot (t, j) goes to rank indices / L as local expert indices % L.
// Candidate rows: per slot, one per slot (m = k columns); once per rank, one
// per (token, rank) (m = R columns). Kept slots with a valid expert id (in
// [0, R * L)) make candidates real rows; kept slots with any other id are
// invalid: counted, never sent.

#include <ATen/core/Tensor.h>

#include "moe/all_to_all_autograd.h"
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
  // counts [2, R, L + 2] int64, read to the host in one copy. Row 0, what this
  // rank sends: per rank, the kept slots per local expert, the rows, and this
  // rank's invalid slots (the same in every rank's entry, so the counts
  // exchange tells every rank). Row 1 is left for what it receives.
  at::Tensor counts;
  at::Tensor key;  // [T, m]: each candidate row's rank, R where it is not sent
};
RoutePlan planRoutes(const Routing& routing, const RouteShape& shape);

// The send rows of a dispatch, grouped by rank. The dispatcher queues this
// behind the counts exchange, before the host knows how many rows there are,
// so the GPU packs while the host reads the counts. Row table[t, c] carries
// token t, its combine weights (weights [T, k] of the side type: all k once
// per rank, weights[t, c] per slot) and the local expert ids of those weights
// (-1 where the slot is dropped, invalid or at another rank), in `layout`
// (side columns: k once per rank, 1 per slot). No autograd: exchangeRouted
// attaches it.
struct SendRows {
  // [rows, layout.width]. Where the kernels run, sized for the most rows a
  // dispatch can send, T * min(m, k), with the rows sent first. Once per rank
  // that is min(R, k) / (mean ranks per token) times the rows sent (about 1.0
  // at ep 2, 1.5 at ep 8, top-8 of 64); per slot, the rows sent. The caller's narrowed
  // view keeps it whole until the exchange has read it.
  at::Tensor bytes;
  at::Tensor table;  // [T, m]: each candidate's row, -1 where none is sent
};
SendRows packSendRows(const RoutedLayout& layout, const at::Tensor& tokens, const at::Tensor& weights,
                      const Routing& routing, const RouteShape& shape, const RoutePlan& plan);

}  // namespace bulkhead::moe
