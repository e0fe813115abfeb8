#include "moe/kernel_support.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "runtime/errors.h"

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

void refuseDoubleBackward(const char* node) {
  // The engine runs a backward node with grad mode on exactly when the
  // caller asked for a graph of the gradients.
  if (c10::GradMode::is_enabled()) {
    throw ConfigError(fmt::format("{}: no double backward (create_graph): this node's gradients carry no graph, so "
                                  "second-order terms would be silently left out",
                                  node),
                      {.expected = "a first-order backward through the MoE layer (its exchanges and kernels)"});
  }
}

}  // namespace bulkhead::moe
