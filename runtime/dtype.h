#pragma once
// The one dtype vocabulary: the names Bulkhead gives tensor dtypes in every
// message, ledger entry, checkpoint manifest and flag ("float32", "bfloat16",
// "int64", ...).

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace bulkhead {

// float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool;
// c10's own name for any other dtype.
const char* dtypeName(c10::ScalarType dtype);
// Whether `dtype` is one of the named ten (the dtypes checkpoints store).
bool hasDtypeName(c10::ScalarType dtype);
// The dtype of a name above; nullopt for any other text.
std::optional<c10::ScalarType> parseDtype(const std::string& name);

}  // namespace bulkhead
