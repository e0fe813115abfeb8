#pragma once
// The tensor dtypes a checkpoint stores, by the names the manifest, the
// attributes and `bulkhead-ckpt inspect` use ("float32", "bfloat16", ...).

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace bulkhead::checkpoint {

// ConfigError for a dtype checkpoints do not store (complex, quantized).
std::string dtypeName(c10::ScalarType dtype);
std::optional<c10::ScalarType> parseDtype(const std::string& name);
int64_t dtypeSize(c10::ScalarType dtype);

}  // namespace bulkhead::checkpoint
