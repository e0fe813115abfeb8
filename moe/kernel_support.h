#pragma once
// What the C++ side of the MoE kernels (moe/cuda) shares: the kernels' names
// for dtypes, and the refusal of a double backward through a custom node
// (the kernels' and the exchanges').

#include <c10/core/ScalarType.h>

#include <optional>

#include "moe/cuda/dtype.h"

namespace bulkhead::moe {

// The kernels' name for `type`; nullopt for a dtype they do not take.
std::optional<cuda::Dtype> kernelDtype(c10::ScalarType type);

// Called by a custom backward node whose gradients carry no graph (they come
// from kernels or collectives): raises ConfigError where autograd asks for one
// (create_graph), instead of leaving the second-order terms silently out.
void refuseDoubleBackward(const char* node);

}  // namespace bulkhead::moe
