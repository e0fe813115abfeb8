#pragma once
// The tensor dtypes a checkpoint stores: the ten of runtime/dtype.h's
// vocabulary, by the same names in the manifest, the attributes and
// `bulkhead-ckpt inspect`.

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "runtime/dtype.h"

namespace bulkhead::checkpoint {

// ConfigError for a dtype checkpoints do not store (complex, quantized, ...).
void requireStored(c10::ScalarType dtype);
int64_t dtypeSize(c10::ScalarType dtype);

}  // namespace bulkhead::checkpoint
