#pragma once
// The MoE kernels take the shared element helpers (runtime/cuda/elements.cuh)
// under their own namespace.

#include "runtime/cuda/elements.cuh"

namespace bulkhead::moe::cuda {
using namespace ::bulkhead::cuda;  // NOLINT(google-build-using-namespace)
}  // namespace bulkhead::moe::cuda
