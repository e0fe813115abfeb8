#pragma once
// runtime/parallel_for.h under the checkpoint library's namespace, where its
// readers and writers have long called it.

#include "runtime/parallel_for.h"

namespace bulkhead::checkpoint {
using ::bulkhead::parallelFor;
using ::bulkhead::parallelForWorkers;
}  // namespace bulkhead::checkpoint
