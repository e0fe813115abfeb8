#pragma once
// The rendezvous Store (docs/design.md#launch-and-the-rendezvous-store): a small key-value store that ranks
// use for out-of-band coordination (addresses, ledger heads, heartbeats,
// checkpoint reports), never for training data and never through the training
// communicators. PyTorch c10d's Store is the model.
//
// Contract, for every implementation (tcp_store.h, file_store.h, prefix_store.h):
// - Keys are non-empty strings; values are binary-safe strings (any bytes,
//   '\0' included). A key that holds "" exists: it differs from a missing key.
// - Every operation takes a Deadline and returns or raises by it (plus a short
//   grace for one system call). There is no default that waits forever.
// - Operations on one key are atomic and linearizable: every rank sees the
//   same order of writes to a key.
// - Errors:
//     TimeoutError  the deadline passed. For get and wait it names the keys
//                   that never appeared and the store. For set, add,
//                   compareSet and erase a timeout means the write may or may
//                   not have been applied: read the key to find out.
//     CommError     the store could not be reached or broke the protocol (a
//                   dropped connection that could not be retried; see each
//                   implementation), or refused a malformed request.
//     ConfigError   a bad argument: an empty key, a value over the store's
//                   message limit, add on a key whose value is not an integer,
//                   a token the server refuses.
//     IoError       the file store's directory cannot be read or written.
// - A Store is thread-safe: threads may share one (a heartbeat thread and the
//   main thread do), and a get that waits does not hold up other threads.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/deadline.h"

namespace bulkhead {

class Store {
 public:
  virtual ~Store() = default;

  // Stores `value` under `key`, replacing any value it held.
  virtual void set(const std::string& key, const std::string& value, Deadline deadline) = 0;

  // Waits until `key` exists and returns its value. TimeoutError names the
  // key and the store when it does not appear by the deadline.
  virtual std::string get(const std::string& key, Deadline deadline) = 0;

  // The value of `key`, or nullopt when it does not exist now. Does not wait
  // for the key: the deadline bounds only the round trip.
  virtual std::optional<std::string> tryGet(const std::string& key, Deadline deadline) = 0;

  // tryGet of every key at once, in one round trip where the store allows
  // (tcp: one request). Results are in the order of `keys`.
  virtual std::vector<std::optional<std::string>> multiGet(const std::vector<std::string>& keys, Deadline deadline) = 0;

  // Sets every (key, value) pair, in one round trip where the store allows
  // (tcp: one request, applied in order). Each key is set as by set(); a
  // timeout means some of them may have been applied. The default calls set()
  // for each pair.
  virtual void multiSet(const std::vector<std::pair<std::string, std::string>>& pairs, Deadline deadline);

  // One round of an all-gather through the store: sets `key` to `value`,
  // removes `erase` when it is not empty (this rank's key of an earlier
  // round), then waits until every key of `keys` exists and returns their
  // values, in order. One request where the store allows (tcp); the default
  // calls set, erase, wait and multiGet. TimeoutError names the keys still
  // missing at the deadline.
  struct SetAndGather {
    std::string key, value, erase;
    std::vector<std::string> keys;
  };
  virtual std::vector<std::string> setAndGather(const SetAndGather& round, Deadline deadline);
  // Adds `delta` to the integer held by `key` (a missing key counts as 0) and
  // returns the new value. The value is stored as decimal text, so get()
  // returns e.g. "42". ConfigError when the key holds something else.
  virtual int64_t add(const std::string& key, int64_t delta, Deadline deadline) = 0;

  // Sets `key` to `desired` only if it now holds `expected`; an empty
  // `expected` means "only if the key is missing" (a key that holds "" does
  // not match it). Returns the value stored after the call: `desired` when it
  // was set, the current value when not, and "" when the key is missing and
  // stays missing.
  virtual std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                                 Deadline deadline) = 0;

  // Waits until every key exists (a key that appeared and was erased again
  // during the wait counts as seen). TimeoutError names the keys still missing.
  virtual void wait(const std::vector<std::string>& keys, Deadline deadline) = 0;

  // Removes `key`; returns whether it existed.
  virtual bool erase(const std::string& key, Deadline deadline) = 0;

  // Where the store lives, for messages: "tcp://127.0.0.1:29500",
  // "file:///shared/job", "tcp://... prefix 'group/ep[1]/'".
  virtual std::string describe() const = 0;
};

// For implementations: ConfigError unless `key` is non-empty.
void requireKey(const std::string& key, const Store& store, int rank = -1);
// The integer an add stored: the whole value must be decimal int64 text.
std::optional<int64_t> parseStoreInteger(const std::string& value);
// "'a', 'b' and 3 more": keys for messages, at most `limit` of them.
std::string quoteKeys(const std::vector<std::string>& keys, size_t limit = 8);

}  // namespace bulkhead
