#include "runtime/diagnosis/ledger.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace bulkhead {

const char* toString(OpType op) {
  switch (op) {
    case OpType::AllReduce:
      return "all_reduce";
    case OpType::AllGather:
      return "all_gather";
    case OpType::ReduceScatter:
      return "reduce_scatter";
    case OpType::AllToAll:
      return "all_to_all";
    case OpType::Broadcast:
      return "broadcast";
    case OpType::Barrier:
      return "barrier";
    case OpType::Send:
      return "send";
    case OpType::Recv:
      return "recv";
    case OpType::Split:
      return "split";
  }
  return "?";
}

const char* toString(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Prod:
      return "prod";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Max:
      return "max";
  }
  return "?";
}

const char* toString(OpState state) {
  switch (state) {
    case OpState::Issued:
      return "issued";
    case OpState::Completed:
      return "completed";
    case OpState::Failed:
      return "failed";
  }
  return "?";
}

bool isPointToPoint(OpType op) { return op == OpType::Send || op == OpType::Recv; }

std::string Fingerprint::describe() const {
  std::string text = toString(op);
  if (op == OpType::Barrier) return text;
  text += fmt::format(" {} [{}]", dtypeName(dtype), fmt::join(shape, " x "));
  if (op == OpType::AllReduce || op == OpType::ReduceScatter) text += fmt::format(" {}", toString(reduce));
  if (op == OpType::Broadcast) text += fmt::format(" root {}", root);
  if (isPointToPoint(op)) text += fmt::format(" peer {}", root);
  if (!label.empty()) text += fmt::format(" ({})", label);
  if (op == OpType::AllToAll && (!sendSplits.empty() || !recvSplits.empty()))
    text += fmt::format(" send [{}] recv [{}]", fmt::join(sendSplits, ","), fmt::join(recvSplits, ","));
  return text;
}

bool Fingerprint::matches(const Fingerprint& other) const {
  if (op != other.op) return false;
  if (op == OpType::Barrier) return true;
  if (dtype != other.dtype || reduce != other.reduce || root != other.root) return false;
  // All-to-all ranks send different amounts; the row width must agree.
  if (op == OpType::AllToAll)
    return shape.size() == other.shape.size() &&
           std::equal(shape.begin() + std::min<size_t>(1, shape.size()), shape.end(),
                      other.shape.begin() + std::min<size_t>(1, other.shape.size()));
  return numel == other.numel;
}

Ledger::Ledger(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {}

uint64_t Ledger::issue(const Fingerprint& fingerprint) {
  std::lock_guard<std::mutex> lock(mutex_);
  bool p2p = isPointToPoint(fingerprint.op);
  uint64_t seq = p2p ? ++heads_.lastIssuedP2P : ++heads_.lastIssued;
  if (ring_.size() == capacity_) ring_.pop_front();
  ring_.push_back({.seq = seq, .fingerprint = fingerprint, .issuedAt = std::chrono::system_clock::now()});
  if (!p2p)
    for (const auto& recording : recordings_) recording->collectives.emplace_back(seq, fingerprint);
  return seq;
}

void Ledger::attach(const std::shared_ptr<Recording>& recording) const {
  std::lock_guard<std::mutex> lock(mutex_);
  recordings_.push_back(recording);
}

void Ledger::detach(const std::shared_ptr<Recording>& recording) const {
  std::lock_guard<std::mutex> lock(mutex_);
  recordings_.erase(std::remove(recordings_.begin(), recordings_.end(), recording), recordings_.end());
}

LedgerEntry* Ledger::find(OpType op, uint64_t seq) {
  bool p2p = isPointToPoint(op);
  for (auto it = ring_.rbegin(); it != ring_.rend(); ++it)
    if (it->seq == seq && isPointToPoint(it->fingerprint.op) == p2p) return &*it;
  return nullptr;
}

void Ledger::end(OpType op, uint64_t seq, OpState state) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (LedgerEntry* entry = find(op, seq)) {
    entry->state = state;
    entry->endedAt = std::chrono::system_clock::now();
  }
  if (state != OpState::Completed) return;
  uint64_t& head = isPointToPoint(op) ? heads_.lastCompletedP2P : heads_.lastCompleted;
  head = std::max(head, seq);
}

void Ledger::complete(OpType op, uint64_t seq) { end(op, seq, OpState::Completed); }
void Ledger::fail(OpType op, uint64_t seq) { end(op, seq, OpState::Failed); }

LedgerHeads Ledger::heads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return heads_;
}

std::vector<LedgerEntry> Ledger::entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {ring_.begin(), ring_.end()};
}

}  // namespace bulkhead
