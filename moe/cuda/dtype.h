#pragma once
// The element types the MoE kernels take, named without CUDA or libtorch
// headers so that the C++ side can pass them.

namespace bulkhead::moe::cuda {

enum class Dtype { Float32, Float64, BFloat16, Float16 };

}  // namespace bulkhead::moe::cuda
