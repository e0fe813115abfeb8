#pragma once
// CUDA kernels behind the dispatcher's planning and packing (moe/dispatch_routes.h),
// on raw pointers so this header and its .cu need no libtorch. Launched on
// `stream`; they never synchronize. Their results equal the ATen forms' in
// moe/dispatch_routes.cc bit for bit.
//
// Slots: indices [T, k] (global expert ids) and keep [T, k]. With L local
// experts per rank, slot (t, j) goes to rank indices / L as local expert
// indices % L. Rows: per slot, one per kept slot (m = k columns); once per
// rank, one per (token, rank) holding any kept slot (m = R columns). A kept
// slot whose id is outside [0, R * L) is invalid: counted, never sent.

#include <cstdint>

namespace bulkhead::moe::cuda {

struct RouteArgs {
  int64_t tokens = 0, topK = 0, localExperts = 0, ranks = 0;
  bool perSlot = false;
  const int64_t* indices = nullptr;  // [T, k]
  const bool* keep = nullptr;        // [T, k]
  void* stream = nullptr;            // cudaStream_t
};

// Most ranks once-per-rank planning takes (a token's ranks are one 64-bit mask).
constexpr int64_t kMaxRouteRanks = 64;
// Most columns a row of the send table has (m).
constexpr int64_t kMaxRouteColumns = 64;

// counts [R, L + 2] (zeroed by the caller), per rank: the kept slots per local
// expert, the rows sent, and this rank's invalid slots (the same in every
// rank's entry, so the counts exchange tells every rank). key [T, m]: the
// row's rank, R where none is sent.
void planRoutes(const RouteArgs& args, int64_t* counts, int64_t* key);

// Fills the send rows (`width` bytes each): row table[t, c] (-1: none) gets
// token t's `rowBytes` bytes, then at `sideOffset` its combine weights and,
// after them, its local expert ids, both of the side type (4 or 8 bytes):
// per slot one weight (weights[t, c]) and one id; once per rank all k weights
// of the token and k ids (-1 where the slot is dropped, invalid or at another
// rank than c).
struct PackArgs {
  RouteArgs route;
  const void* tokens = nullptr;  // [T, rowBytes] contiguous
  int64_t rowBytes = 0;
  const void* weights = nullptr;   // [T, k] contiguous, side type
  int sideBytes = 4;               // 4: float32, 8: float64
  const int64_t* table = nullptr;  // [T, m]
  void* rows = nullptr;            // [rows, width] bytes
  int64_t width = 0, sideOffset = 0;
};
void packRoutes(const PackArgs& args);

// out[table[p, c]] = source[p] for every table entry >= 0: each source row
// (rowBytes bytes, sourceStride bytes apart) is read once and written to
// every row that reads it; out is contiguous.
struct ExpandArgs {
  const void* source = nullptr;
  int64_t sourceRows = 0, sourceStride = 0, rowBytes = 0;
  const int64_t* table = nullptr;  // [sourceRows, columns]
  int64_t columns = 0;
  void* out = nullptr;
  void* stream = nullptr;
};
void expandRows(const ExpandArgs& args);

// Zeroes the tail of each of `groups` equal groups of `rows` (count rows of
// rowBytes bytes, contiguous; count a multiple of groups): in group g, rows
// [first[g], count / groups) of it, where `first` (int32 [groups] on the
// device) is known only there: the tails of buffers whose leading rows
// something else wrote (one group: a packed buffer; one per expert: a padded one).
struct ZeroTailArgs {
  void* rows = nullptr;
  int64_t count = 0, rowBytes = 0;
  const int32_t* first = nullptr;
  int64_t groups = 1;
  void* stream = nullptr;
};
void zeroTail(const ZeroTailArgs& args);

}  // namespace bulkhead::moe::cuda
