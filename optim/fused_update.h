#pragma once
// Multi-tensor kernels for the optimizer's step on a GPU: the squared norm of
// many gradient pieces in one pass, AdamW over every piece in few kernels
// (Bulkhead's own for float32 masters where built, ATen's otherwise; the clip
// scale and the skip of a step whose norm is not finite read from the
// device), and the copy of the updated master pieces into the parameters. The math is AdamW's as in
// adamwUpdate; the order of the float operations differs in the last bits.
// Used where available(): CUDA tensors with libtorch 2.2 or later. The CPU
// keeps the per-piece path, so float64 results do not move.

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <vector>

#include "optim/adamw.h"

namespace bulkhead::optim::fused {

bool available(const c10::Device& device);

// The sum of the squares of every element of `pieces` (any floating dtypes,
// each norm taken in at least float32), as a 1-element float64 tensor on
// their device; zeros({1}) for no pieces.
at::Tensor sumOfSquares(const std::vector<at::Tensor>& pieces, const at::TensorOptions& resultOptions);

// Matching pieces of the float32 master weights, their gradients and both
// moments (float32, or both bfloat16: updated in float32, rounded once).
// With kernels() the gradients may be bf16 or fp16 (read as they are, not
// converted first), and `params`, where not empty, holds for each piece the
// parameter rows (or an undefined tensor) that take the updated master,
// rounded to their dtype, in the same pass.
struct AdamWPieces {
  std::vector<at::Tensor> masters, grads, expAvg, expAvgSq, params;
};

// Whether adamw() runs Bulkhead's own kernel on `device` (built where libtorch
// has CUDA): half-precision gradients and parameters written in the update.
bool kernels(const c10::Device& device);

// What the update reads from the device, so that the host queues it without
// waiting for the gradient norm.
struct DeviceScalars {
  at::Tensor step;                    // float32, 0-D: the step count, this update counted
  std::optional<at::Tensor> unscale;  // float32, 0-D: each gradient is divided by it first
  std::optional<at::Tensor> skip;     // float32, 0-D: 1 leaves every piece as it was
};

// One AdamW update of every group, keyed by its weight decay.
void adamw(const std::map<double, AdamWPieces>& groups, double lr, const DeviceScalars& scalars,
           const AdamWOptions& options);

// dst[i].copy_(src[i]) for every i, converting dtypes, in few kernels.
void copy(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src);

}  // namespace bulkhead::optim::fused
