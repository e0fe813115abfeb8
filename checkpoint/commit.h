#pragma once
// The coordination of one save or load through the rendezvous store (never a
// training communicator), every wait bounded by a deadline. Keys live under
// the operation's prefix ("ckpt/<dir hash>/<n>/save/<seq>/"):
//   report/<rank>/<i>   parts of a rank's report (its file's index), ≤ 256 KiB each
//   status/<rank>       "ok <parts>" or "failed <kind> <message>"
//   failure             the first failure any rank reported (compare-and-set)
//   count               ranks that have reported (add)
//   verdict             "commit" or "failed <kind> <message>": set once, by
//                       compare-and-set, by whoever decides first (rank 0
//                       claiming the commit, or any rank giving up), so no
//                       rank can believe a save failed that then commits
//   committed           "ok" or "failed ...": the outcome of a claimed commit

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/errors.h"
#include "runtime/store/store.h"

namespace bulkhead::checkpoint::commit {

// An outcome that is not success: the kind of error and its message, carried
// between ranks as text and raised again with its type.
struct Failure {
  std::string kind;     // "IoError", "TimeoutError", "CheckpointError", "ConfigError", "CommError", "Error"
  std::string message;  // "on rank 3: <what happened> (expected: ...)"

  static Failure of(const std::exception& error);
  std::string encode() const;  // "failed <kind> <escaped message>"
  static std::optional<Failure> decode(const std::string& text);
  [[noreturn]] void raise(int rank) const;
};

class Exchange {
 public:
  Exchange(std::shared_ptr<Store> store, std::string prefix, int rank, int worldSize)
      : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), worldSize_(worldSize) {}

  // This rank's report (or failure), then the count.
  void publish(const std::string& report, Deadline deadline);
  void publishFailure(const Failure& failure, Deadline deadline);
  // Rank 0: every rank's report, in rank order, once all arrived. Returns the
  // first failure a rank published, or a TimeoutError failure naming the
  // ranks that never reported by the deadline.
  std::optional<Failure> gather(std::vector<std::string>& reports, Deadline deadline);

  // Sets the verdict unless one is set; returns the verdict that holds.
  std::string claim(const std::string& verdict, Deadline deadline);
  // The verdict once set, or nullopt when the deadline passes first.
  std::optional<std::string> verdict(Deadline deadline);
  std::optional<std::string> peekVerdict(Deadline deadline);
  void setCommitted(const std::string& outcome, Deadline deadline);
  std::optional<std::string> committed(Deadline deadline);
  // Removes the reports (the bulky keys) once read.
  void eraseReports(Deadline deadline);

  Store& store() { return *store_; }
  std::string key(const std::string& name) const { return prefix_ + name; }

 private:
  std::shared_ptr<Store> store_;
  std::string prefix_;
  int rank_;
  int worldSize_;
  std::vector<std::string> reportKeys_;
};

}  // namespace bulkhead::checkpoint::commit
