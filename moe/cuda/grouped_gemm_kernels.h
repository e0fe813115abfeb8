#pragma once
// Hopper (sm_90a) grouped matrix products behind moe::groupedLinear's bf16
// path, on raw pointers so this header and its .cu need no libtorch. Each
// block is persistent over the tiles of every group: one producer thread feeds
// shared memory through the tensor copy engine (TMA), two consumer warpgroups
// multiply from it with wgmma, float32 accumulators, one rounding to bf16 per
// output. Queued on `stream`; never synchronizes.
//
// Rows are grouped by `ends`: int32 running counts on the device, group g
// holding rows [ends[g-1], ends[g]) (ends[-1] = 0), each end clamped to
// [previous end, rows]. With g row r's group:
//   Forward: out[r, n]    = sum_k a[r, k] * b[g][n, k]       a [rows, k], b [groups, n, k], out [rows, n]
//   Dgrad:   out[r, n]    = sum_k a[r, k] * b[g][k, n]       a [rows, k], b [groups, k, n], out [rows, n]
//   Wgrad:   out[g][m, n] = sum_{r in g} a[r, m] * b[r, n]   a [rows, m], b [rows, n], out [groups, m, n]
// Forward and Dgrad write zeros in the rows past the last end; Wgrad writes
// zeros for a group with no rows. Every tensor is contiguous.

#include <cstdint>

namespace bulkhead::moe::cuda {

enum class GroupedProduct { Forward, Dgrad, Wgrad };

constexpr int kMaxProductGroups = 1024;

struct GroupedGemmArgs {
  GroupedProduct product = GroupedProduct::Forward;
  int64_t rows = 0;
  int groups = 0;
  int64_t m = 0;  // Wgrad's output rows
  int64_t n = 0;  // the output's columns
  int64_t k = 0;  // Forward and Dgrad: the reduced dimension
  const int32_t* ends = nullptr;
  void* stream = nullptr;  // cudaStream_t
};

// A call's arguments from its operands' sizes, a [rows, aColumns] and b
// (Forward, Dgrad: [groups, b1, b2]; Wgrad: [rows, b1]), and the output's
// shape: [rows, n], or Wgrad's [groups, m, n].
struct GroupedGemmCall {
  GroupedGemmArgs args;
  int64_t outShape[3] = {};
  int outDims = 0;
};

inline GroupedGemmCall groupedGemmCall(GroupedProduct product, int64_t rows, int64_t aColumns, int64_t b1, int64_t b2,
                                       int groups, const int32_t* ends, void* stream) {
  GroupedGemmCall call;
  call.args = {.product = product, .rows = rows, .groups = groups, .ends = ends, .stream = stream};
  if (product == GroupedProduct::Wgrad) {
    call.args.m = aColumns, call.args.n = b1;
    call.outShape[0] = groups, call.outShape[1] = aColumns, call.outShape[2] = b1, call.outDims = 3;
  } else {
    call.args.k = aColumns, call.args.n = product == GroupedProduct::Forward ? b1 : b2;
    call.outShape[0] = rows, call.outShape[1] = call.args.n, call.outDims = 2;
  }
  return call;
}

// Whether groupedGemm serves these shapes on the current device: this build
// has the sm_90a kernels, the device is a Hopper GPU (compute capability 9.0),
// every dimension is a multiple of 8 and at least 64 (rows: at least 1, below
// 2^31), and groups is in [1, kMaxProductGroups].
bool groupedGemmApplies(const GroupedGemmArgs& args);

// Raises ConfigError where groupedGemmApplies is false, bulkhead::Error where
// the launch fails.
void groupedGemm(const GroupedGemmArgs& args, const void* a, const void* b, void* out);

}  // namespace bulkhead::moe::cuda
