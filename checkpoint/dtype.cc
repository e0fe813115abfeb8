#include "checkpoint/dtype.h"

#include <fmt/format.h>

#include <utility>

#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

constexpr std::pair<c10::ScalarType, const char*> kNames[] = {
    {c10::ScalarType::Float, "float32"},    {c10::ScalarType::Double, "float64"},
    {c10::ScalarType::Half, "float16"},     {c10::ScalarType::BFloat16, "bfloat16"},
    {c10::ScalarType::Long, "int64"},       {c10::ScalarType::Int, "int32"},
    {c10::ScalarType::Short, "int16"},      {c10::ScalarType::Char, "int8"},
    {c10::ScalarType::Byte, "uint8"},       {c10::ScalarType::Bool, "bool"},
};

}  // namespace

std::string dtypeName(c10::ScalarType dtype) {
  for (const auto& [type, name] : kNames)
    if (type == dtype) return name;
  throw ConfigError(fmt::format("checkpoints do not store tensors of dtype {}; convert it (for example to float32) "
                                "before adding it to the state dict",
                                c10::toString(dtype)),
                    {.expected = "float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8 or bool"});
}

std::optional<c10::ScalarType> parseDtype(const std::string& name) {
  for (const auto& [type, known] : kNames)
    if (name == known) return type;
  return std::nullopt;
}

int64_t dtypeSize(c10::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

}  // namespace bulkhead::checkpoint
