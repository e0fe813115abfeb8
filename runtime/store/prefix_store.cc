#include "runtime/store/prefix_store.h"

#include <fmt/format.h>

#include "runtime/errors.h"

namespace bulkhead {

PrefixStore::PrefixStore(std::shared_ptr<Store> store, std::string prefix)
    : store_(std::move(store)), prefix_(std::move(prefix)) {
  if (!store_) throw ConfigError("PrefixStore needs a store; pass the job's store", {.expected = "a store"});
  if (prefix_.empty() || prefix_ == "/")
    throw ConfigError(
        fmt::format("PrefixStore over {} needs a non-empty prefix, e.g. \"group/ep[1]\"", store_->describe()),
        {.expected = "a non-empty prefix"});
  if (prefix_.back() != '/') prefix_ += '/';
}

std::string PrefixStore::full(const std::string& key) const {
  requireKey(key, *this);  // "<prefix>/" alone would be a key of the parent's space
  return prefix_ + key;
}

std::vector<std::string> PrefixStore::full(const std::vector<std::string>& keys) const {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const std::string& key : keys) prefixed.push_back(full(key));
  return prefixed;
}

void PrefixStore::set(const std::string& key, const std::string& value, Deadline deadline) {
  store_->set(full(key), value, deadline);
}

std::string PrefixStore::get(const std::string& key, Deadline deadline) { return store_->get(full(key), deadline); }

std::optional<std::string> PrefixStore::tryGet(const std::string& key, Deadline deadline) {
  return store_->tryGet(full(key), deadline);
}

std::vector<std::optional<std::string>> PrefixStore::multiGet(const std::vector<std::string>& keys, Deadline deadline) {
  return store_->multiGet(full(keys), deadline);
}

void PrefixStore::multiSet(const std::vector<std::pair<std::string, std::string>>& pairs, Deadline deadline) {
  std::vector<std::pair<std::string, std::string>> prefixed;
  prefixed.reserve(pairs.size());
  for (const auto& [key, value] : pairs) prefixed.emplace_back(full(key), value);
  store_->multiSet(prefixed, deadline);
}

std::vector<std::string> PrefixStore::setAndGather(const SetAndGather& round, Deadline deadline) {
  SetAndGather prefixed{
      .key = full(round.key), .value = round.value, .erase = round.erase.empty() ? "" : full(round.erase)};
  for (const std::string& key : round.keys) prefixed.keys.push_back(full(key));
  return store_->setAndGather(prefixed, deadline);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta, Deadline deadline) {
  return store_->add(full(key), delta, deadline);
}

std::string PrefixStore::compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                                    Deadline deadline) {
  return store_->compareSet(full(key), expected, desired, deadline);
}

void PrefixStore::wait(const std::vector<std::string>& keys, Deadline deadline) { store_->wait(full(keys), deadline); }

bool PrefixStore::erase(const std::string& key, Deadline deadline) { return store_->erase(full(key), deadline); }

std::string PrefixStore::describe() const { return fmt::format("{} prefix '{}'", store_->describe(), prefix_); }

}  // namespace bulkhead
