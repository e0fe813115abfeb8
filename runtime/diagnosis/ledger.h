#pragma once
// The collective ledger (docs/design.md#the-ledger-and-diagnosis): each communicator numbers its
// operations and remembers the last N of them, with a fingerprint that ranks
// can compare. Collectives and point-to-point operations are numbered apart:
// every member of a group issues the same collectives, but not the same sends.
// Thread-safe: the issuing thread, waiters and (later) a heartbeat read it.

#include <c10/core/ScalarType.h>

#include "runtime/dtype.h"

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace bulkhead {

enum class OpType { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Barrier, Send, Recv, Split };
enum class ReduceOp { Sum, Avg, Prod, Min, Max };

const char* toString(OpType op);
const char* toString(ReduceOp op);
bool isPointToPoint(OpType op);

// What a rank says it is doing at one sequence number. Two ranks of a group
// agree when op, dtype, reduce op, root and the per-rank element count agree
// (all-to-all split sizes differ between ranks by design and are kept for the
// report, not compared).
struct Fingerprint {
  OpType op = OpType::Barrier;
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t numel = 0;           // elements this rank contributes (input side)
  std::vector<int64_t> shape;  // input shape, for messages
  ReduceOp reduce = ReduceOp::Sum;
  int root = -1;                                // broadcast root, or the peer of send/recv
  std::vector<int64_t> sendSplits, recvSplits;  // all-to-all only
  std::string label;                            // send/recv: the caller's CallOptions::label (not compared)

  // "all_to_all bfloat16 [4096 x 2048]"
  std::string describe() const;
  bool matches(const Fingerprint& other) const;
};

enum class OpState { Issued, Completed, Failed };
const char* toString(OpState state);

struct LedgerEntry {
  uint64_t seq = 0;  // 1-based, per kind (collective or point-to-point)
  Fingerprint fingerprint;
  OpState state = OpState::Issued;
  std::chrono::system_clock::time_point issuedAt, endedAt;
};

// Where a rank stands: the newest operation it issued and the newest it saw
// complete, per kind. Published to peers by the diagnosis (a later issue).
struct LedgerHeads {
  uint64_t lastIssued = 0, lastCompleted = 0;
  uint64_t lastIssuedP2P = 0, lastCompletedP2P = 0;
};

class Ledger {
 public:
  explicit Ledger(size_t capacity);
  // Records a new operation and returns its sequence number.
  uint64_t issue(const Fingerprint& fingerprint);
  void complete(OpType op, uint64_t seq);
  void fail(OpType op, uint64_t seq);
  LedgerHeads heads() const;
  // The remembered entries, oldest first.
  std::vector<LedgerEntry> entries() const;
  size_t capacity() const { return capacity_; }

  // A checked region's record (runtime/diagnosis/checked_region.h): while attached, every
  // collective issued here is appended to it with its sequence number, however
  // many the ring keeps. Point-to-point operations are not recorded. Attaching
  // observes the ledger without changing it, hence const.
  struct Recording {
    std::vector<std::pair<uint64_t, Fingerprint>> collectives;  // (seq, fingerprint), in issue order
  };
  void attach(const std::shared_ptr<Recording>& recording) const;
  void detach(const std::shared_ptr<Recording>& recording) const;

 private:
  LedgerEntry* find(OpType op, uint64_t seq);
  void end(OpType op, uint64_t seq, OpState state);

  mutable std::mutex mutex_;
  size_t capacity_;
  std::deque<LedgerEntry> ring_;
  LedgerHeads heads_;
  mutable std::vector<std::shared_ptr<Recording>> recordings_;
};

}  // namespace bulkhead
