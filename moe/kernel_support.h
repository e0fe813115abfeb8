#pragma once
// What the C++ side of the MoE kernels (moe/cuda) shares: the kernels' names
// for dtypes. (Their nodes refuse a double backward with
// parallel::refuseDoubleBackward, as the exchanges' do.)

#include <c10/core/ScalarType.h>

#include <optional>

#include "moe/cuda/dtype.h"

namespace bulkhead::moe {

// The kernels' name for `type`; nullopt for a dtype they do not take.
std::optional<cuda::Dtype> kernelDtype(c10::ScalarType type);

}  // namespace bulkhead::moe
