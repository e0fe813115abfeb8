#include "checkpoint/dtype.h"

#include <fmt/format.h>

#include "runtime/errors.h"

namespace bulkhead::checkpoint {

void requireStored(c10::ScalarType dtype) {
  if (hasDtypeName(dtype)) return;
  throw ConfigError(fmt::format("checkpoints do not store tensors of dtype {}; convert it (for example to float32) "
                                "before adding it to the state dict",
                                c10::toString(dtype)),
                    {.expected = "float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8 or bool"});
}

int64_t dtypeSize(c10::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

}  // namespace bulkhead::checkpoint
