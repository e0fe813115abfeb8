#include "runtime/store/store.h"

#include <fmt/format.h>

#include <charconv>

#include "runtime/errors.h"

namespace bulkhead {

void Store::multiSet(const std::vector<std::pair<std::string, std::string>>& pairs, Deadline deadline) {
  for (const auto& [key, value] : pairs) set(key, value, deadline);
}

std::vector<std::string> Store::setAndGather(const SetAndGather& round, Deadline deadline) {
  set(round.key, round.value, deadline);
  if (!round.erase.empty()) erase(round.erase, deadline);
  wait(round.keys, deadline);
  std::vector<std::string> values;
  auto found = multiGet(round.keys, deadline);
  for (size_t i = 0; i < found.size(); ++i) {
    if (!found[i])
      throw CommError(fmt::format("setAndGather on store {}: key '{}' was erased while the round gathered it",
                                  describe(), round.keys[i]),
                      {.expected = "keys of a round kept until every rank has read them"});
    values.push_back(std::move(*found[i]));
  }
  return values;
}

void requireKey(const std::string& key, const Store& store, int rank) {
  if (key.empty())
    throw ConfigError(fmt::format("an empty key was passed to store {}; name every key", store.describe()),
                      {.rank = rank, .expected = "a non-empty key"});
}

std::optional<int64_t> parseStoreInteger(const std::string& value) {
  int64_t parsed = 0;
  auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  if (value.empty() || error != std::errc() || end != value.data() + value.size()) return std::nullopt;
  return parsed;
}

std::string quoteKeys(const std::vector<std::string>& keys, size_t limit) {
  std::string text;
  for (size_t i = 0; i < keys.size() && i < limit; ++i) text += fmt::format("{}'{}'", i ? ", " : "", keys[i]);
  if (keys.size() > limit) text += fmt::format(" and {} more", keys.size() - limit);
  return text;
}

}  // namespace bulkhead
