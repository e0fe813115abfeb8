#pragma once
// SwiGLU on a fused gate-and-up projection, as the experts compute it:
// gateUp [N, 2F] holds x W1^T in its first F columns and x W3^T in the last
// F; the result [N, F] is silu(x W1^T) * x W3^T, with autograd to gateUp.
//
// Fusing both projections into one matrix product makes one gradient for the
// experts' input where two would be summed. On CUDA tensors (where the
// kernels are built, see moe/CMakeLists.txt) the activation is one kernel each
// way, computed in float and rounded once (a strided input is copied first);
// elsewhere ATen ops. On CUDA a double backward raises (ConfigError).

#include <ATen/core/Tensor.h>

namespace bulkhead::moe {

// liveRows (optional): int32 [G] on gateUp's device, G dividing N: the rows are
// G equal groups and only the first liveRows[g] of group g are computed; the
// rest of each group is zero in the result and gets a zero gradient, and the
// kernels do not read it (the zero tails of padded experts' rows).
at::Tensor swiglu(const at::Tensor& gateUp, const at::Tensor& liveRows = {});

// The same, always as ATen ops (the reference the kernels are tested against).
at::Tensor swigluReference(const at::Tensor& gateUp);

}  // namespace bulkhead::moe
