#pragma once
// Multi-tensor kernels for the optimizer's step on a GPU: the squared norm of
// many gradient pieces in one pass, AdamW over every piece in one kernel per
// weight-decay value (with the clip scale folded in), and the copy of the
// updated master pieces into the parameters. The math is AdamW's as in
// adamwUpdate; the order of the float operations differs in the last bits.
// Used where available(): CUDA tensors with libtorch 2.2 or later. The CPU
// keeps the per-piece path, so float64 results do not move.

#include <ATen/core/Tensor.h>

#include <map>
#include <vector>

#include "optim/adamw.h"

namespace bulkhead::optim::fused {

bool available(const c10::Device& device);

// The sum of the squares of every element of `pieces`, as a 1-element float64
// tensor on their device; zeros({1}) for no pieces.
at::Tensor sumOfSquares(const std::vector<at::Tensor>& pieces, const at::TensorOptions& resultOptions);

// Matching pieces of the float32 master weights, their gradients and both moments.
struct AdamWPieces {
  std::vector<at::Tensor> masters, grads, expAvg, expAvgSq;
};

// One AdamW update at `step` (already counted) of every group, keyed by its
// weight decay; the gradients are multiplied by `gradScale` first.
void adamw(const std::map<double, AdamWPieces>& groups, int64_t step, double lr, double gradScale,
           const AdamWOptions& options);

// dst[i].copy_(src[i]) for every i, converting dtypes, in few kernels.
void copy(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src);

}  // namespace bulkhead::optim::fused
