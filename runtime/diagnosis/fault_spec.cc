#include "runtime/diagnosis/fault_spec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "runtime/errors.h"
#include "runtime/store/store.h"

namespace bulkhead::fault {

FaultSpec::FaultSpec(SpecSyntax syntax, std::string text) : syntax_(std::move(syntax)), text_(std::move(text)) {
  std::istringstream fields(text_);
  std::string field;
  while (std::getline(fields, field, ',')) {
    const auto equals = field.find('=');
    if (equals == std::string::npos) reject(fmt::format("'{}' is not key=value", field));
    std::string key = field.substr(0, equals), value = field.substr(equals + 1);
    if (std::find(syntax_.keys.begin(), syntax_.keys.end(), key) == syntax_.keys.end())
      reject(fmt::format("unknown key '{}'", key));
    if (!fields_.emplace(key, std::move(value)).second) reject(fmt::format("key '{}' is given twice", key));
  }
}

std::string FaultSpec::text(const std::string& key) const {
  const auto found = fields_.find(key);
  return found == fields_.end() ? std::string() : found->second;
}

int64_t FaultSpec::integer(const std::string& key, int64_t minimum, int64_t maximum) const {
  if (!has(key)) reject(fmt::format("'{}' is missing", key));
  const std::string value = text(key);
  const std::optional<int64_t> parsed = parseStoreInteger(value);  // strict decimal, no overflow
  if (!parsed || *parsed < minimum || *parsed > maximum)
    reject(fmt::format("{}='{}' is not an integer in [{}, {}]", key, value, minimum, maximum));
  return *parsed;
}

FaultSpec::Action FaultSpec::action(const std::string& key) const {
  if (!has(key)) reject(fmt::format("'{}' is missing", key));
  const std::string value = text(key);
  const auto colon = value.find(':');
  Action action{value.substr(0, colon), std::nullopt};
  if (colon == std::string::npos) return action;
  const std::string number = value.substr(colon + 1);
  char* end = nullptr;
  const double parsed = std::strtod(number.c_str(), &end);
  if (number.empty() || *end != '\0' || !std::isfinite(parsed) || parsed < 0)
    reject(fmt::format("'{}' in {}='{}' is not a number of seconds", number, key, value));
  action.argument = parsed;
  return action;
}

void FaultSpec::reject(const std::string& why) const {
  throw ConfigError(fmt::format("{}='{}': {}", syntax_.variable, text_, why), {.expected = syntax_.form});
}

}  // namespace bulkhead::fault
