#include "moe/kernel_support.h"

namespace bulkhead::moe {

std::optional<cuda::Dtype> kernelDtype(c10::ScalarType type) {
  switch (type) {
    case c10::kFloat: return cuda::Dtype::Float32;
    case c10::kDouble: return cuda::Dtype::Float64;
    case c10::kBFloat16: return cuda::Dtype::BFloat16;
    case c10::kHalf: return cuda::Dtype::Float16;
    default: return std::nullopt;
  }
}

}  // namespace bulkhead::moe
