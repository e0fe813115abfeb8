#pragma once
// What the C++ side of the MoE kernels (moe/cuda) shares: the kernels' names
// for dtypes. (Their nodes refuse a double backward with
// parallel::refuseDoubleBackward, as the exchanges' do.)

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <optional>

#include "moe/cuda/dtype.h"

namespace bulkhead::moe {

// The kernels' name for `type`; nullopt for a dtype they do not take.
std::optional<cuda::Dtype> kernelDtype(c10::ScalarType type);

// Whether the current stream of `on`'s device is being captured into a CUDA
// graph (false on the CPU, and in builds without the kernels; a capture the
// query cannot read counts as none, and the work then fails in it).
bool streamCapturing(const at::Tensor& on);

}  // namespace bulkhead::moe
