#include "runtime/dtype.h"

#include <utility>

namespace bulkhead {
namespace {

constexpr std::pair<c10::ScalarType, const char*> kNames[] = {
    {c10::ScalarType::Float, "float32"},     {c10::ScalarType::Double, "float64"}, {c10::ScalarType::Half, "float16"},
    {c10::ScalarType::BFloat16, "bfloat16"}, {c10::ScalarType::Long, "int64"},     {c10::ScalarType::Int, "int32"},
    {c10::ScalarType::Short, "int16"},       {c10::ScalarType::Char, "int8"},      {c10::ScalarType::Byte, "uint8"},
    {c10::ScalarType::Bool, "bool"},
};

}  // namespace

const char* dtypeName(c10::ScalarType dtype) {
  for (const auto& [type, name] : kNames)
    if (type == dtype) return name;
  return c10::toString(dtype);
}

bool hasDtypeName(c10::ScalarType dtype) {
  for (const auto& [type, name] : kNames)
    if (type == dtype) return true;
  return false;
}

std::optional<c10::ScalarType> parseDtype(const std::string& name) {
  for (const auto& [type, known] : kNames)
    if (name == known) return type;
  return std::nullopt;
}

}  // namespace bulkhead
