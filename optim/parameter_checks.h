#pragma once
// Checks both optimizers run on the parameters they are given (internal).

#include <c10/core/Device.h>

#include <vector>

#include "parallel/parameter.h"

namespace bulkhead::optim::detail {

// ConfigError (naming `who` and the parameter) unless every parameter is a
// defined, contiguous tensor on `device` whose ShardInfo has one global
// extent and one offset per dimension, and names are unique.
void checkParameters(const std::vector<parallel::Parameter>& params, c10::Device device, int rank, const char* who);

}  // namespace bulkhead::optim::detail
