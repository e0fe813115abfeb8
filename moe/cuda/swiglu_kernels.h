#pragma once
// CUDA kernels behind moe::swiglu (moe/swiglu.h), on raw pointers so this
// header and its .cu need no libtorch. Launched on `stream`; they never
// synchronize. Rows are contiguous; with g = gateUp[n, f], u = gateUp[n, F + f]:
//   forward:  out[n, f] = silu(g) * u
//   backward: gradGateUp[n, f]     = gradOut[n, f] * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
//             gradGateUp[n, F + f] = gradOut[n, f] * silu(g)
// computed in float (double for float64) and rounded once per output.
// With `live` set, the rows are `groups` equal groups and row i of group g is
// computed only where i < live[g]: the rest of each group is written zero and
// not read (the zero tails of padded experts' rows).

#include <cstdint>

#include "moe/cuda/dtype.h"

namespace bulkhead::moe::cuda {

struct SwigluArgs {
  Dtype type = Dtype::BFloat16;
  int64_t rows = 0;               // N
  int64_t width = 0;              // F: gateUp rows hold 2F elements, out rows F
  const int32_t* live = nullptr;  // [groups] on the device, or null: every row
  int64_t groups = 1;             // dividing rows
  void* stream = nullptr;         // cudaStream_t
};

void swigluForward(const SwigluArgs& args, const void* gateUp, void* out);
void swigluBackward(const SwigluArgs& args, const void* gateUp, const void* gradOut, void* gradGateUp);

}  // namespace bulkhead::moe::cuda
