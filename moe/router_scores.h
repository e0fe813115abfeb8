#pragma once
// The router's scores, selection and loss sums in one CUDA kernel forward
// (plus two small sums) and one backward (moe/cuda/score_kernels.h), where the
// ATen form in router.cc launches about twenty operations each way.
//
// The ATen form's contract (moe/router.h): the selection is the top-k of
// scores + bias; the weights are the selected unbiased scores, renormalised if
// asked; probSum and lseSquaredSum are what meanProb and the z-loss are made
// of. Here exact ties go to the lower expert id (at::topk leaves their order
// open). A double backward raises (ConfigError).

#include <ATen/core/Tensor.h>

#include <optional>

#include "moe/router.h"

namespace bulkhead::moe {

struct FusedScores {
  at::Tensor indices;          // [T, k] int64, descending by score + bias
  at::Tensor weights;          // [T, k] in the logits' dtype (autograd)
  at::Tensor tokensPerExpert;  // [E] int64: slots selected per expert
  at::Tensor probSum;          // [E]: per-token normalised scores summed over tokens (autograd)
  at::Tensor lseSquaredSum;    // []: logsumexp(logits)^2 summed over tokens (autograd)
};

// logits [T, E] float32 or float64; bias [E] (float32) or undefined. nullopt
// where the kernels do not apply (not built, CPU tensors, no tokens, more
// than 1024 experts, top-k above 32, another dtype): the caller takes the
// ATen form then.
std::optional<FusedScores> fusedScores(const at::Tensor& logits, const RouterOptions& options, const at::Tensor& bias);

}  // namespace bulkhead::moe
