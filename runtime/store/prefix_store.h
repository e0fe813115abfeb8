#pragma once
// A view of a Store in which every key is "<prefix>/<key>": each sub-group
// gets its own key space ("group/ep[1]/heads/3") over the one job store.
// Two PrefixStores with different prefixes never see each other's keys.
// Errors come from the underlying store and name the full key.

#include <memory>
#include <string>

#include "runtime/store/store.h"

namespace bulkhead {

class PrefixStore final : public Store {
 public:
  // ConfigError for a null store or an empty prefix. A trailing '/' in
  // `prefix` is not doubled. PrefixStores nest.
  PrefixStore(std::shared_ptr<Store> store, std::string prefix);

  // The prefix with its trailing '/': "group/ep[1]/".
  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& underlying() const { return store_; }

  void set(const std::string& key, const std::string& value, Deadline deadline) override;
  std::string get(const std::string& key, Deadline deadline) override;
  std::optional<std::string> tryGet(const std::string& key, Deadline deadline) override;
  std::vector<std::optional<std::string>> multiGet(const std::vector<std::string>& keys, Deadline deadline) override;
  void multiSet(const std::vector<std::pair<std::string, std::string>>& pairs, Deadline deadline) override;
  std::vector<std::string> setAndGather(const SetAndGather& round, Deadline deadline) override;
  int64_t add(const std::string& key, int64_t delta, Deadline deadline) override;
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                         Deadline deadline) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool erase(const std::string& key, Deadline deadline) override;
  std::string describe() const override;

 private:
  std::string full(const std::string& key) const;
  std::vector<std::string> full(const std::vector<std::string>& keys) const;

  std::shared_ptr<Store> store_;
  std::string prefix_;
};

}  // namespace bulkhead
