#include "runtime/diagnosis/monitor_record.h"

#include <fmt/format.h>

#include <chrono>

namespace bulkhead::monitor_record {
namespace {

constexpr size_t kPublishedEntries = 8;  // the newest collectives each group's record carries

std::string encodeGroup(const Ledger& ledger) {
  LedgerHeads h = ledger.heads();
  std::string text =
      fmt::format("heads {} {} {} {}\n", h.lastIssued, h.lastCompleted, h.lastIssuedP2P, h.lastCompletedP2P);
  auto entries = ledger.entries();
  size_t written = 0;
  for (auto it = entries.rbegin(); it != entries.rend() && written < kPublishedEntries; ++it) {
    if (isPointToPoint(it->fingerprint.op)) continue;
    text += fmt::format("e {} {}\n", it->seq, encode(it->fingerprint));
    ++written;
  }
  return text;
}

}  // namespace

std::string stateKey(int rank) { return fmt::format("state/{}", rank); }

int64_t wallClockMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string encode(const Fingerprint& fp) {
  std::string text = fmt::format("{} {} {} {} {} {}", static_cast<int>(fp.op), static_cast<int>(fp.dtype),
                                 static_cast<int>(fp.reduce), fp.root, fp.numel, fp.shape.size());
  for (int64_t d : fp.shape) text += fmt::format(" {}", d);
  if (fp.op == OpType::AllToAll)  // rows to and from each rank, so peers can check each other's
    for (const auto* splits : {&fp.sendSplits, &fp.recvSplits}) {
      text += fmt::format(" {}", splits->size());
      for (int64_t rows : *splits) text += fmt::format(" {}", rows);
    }
  return text;
}

Fingerprint decodeFingerprint(std::istringstream& in) {
  Fingerprint fp;
  int op = 0, dtype = 0, reduce = 0;
  size_t dims = 0;
  in >> op >> dtype >> reduce >> fp.root >> fp.numel >> dims;
  fp.op = static_cast<OpType>(op);
  fp.dtype = static_cast<c10::ScalarType>(dtype);
  fp.reduce = static_cast<ReduceOp>(reduce);
  for (size_t i = 0; i < dims && in; ++i) {
    int64_t d = 0;
    in >> d;
    fp.shape.push_back(d);
  }
  if (fp.op == OpType::AllToAll)
    for (auto* splits : {&fp.sendSplits, &fp.recvSplits}) {
      size_t count = 0;
      in >> count;
      for (size_t i = 0; i < count && in; ++i) {
        int64_t rows = 0;
        in >> rows;
        splits->push_back(rows);
      }
    }
  return fp;
}

std::string encodeState(int64_t wallMs, const std::vector<std::pair<std::string, const Ledger*>>& groups) {
  std::string text = fmt::format("t {}\n", wallMs);
  for (const auto& [key, ledger] : groups) text += fmt::format("g {}\n", key) + encodeGroup(*ledger);
  return text;
}

std::optional<State> decodeState(const std::optional<std::string>& text) {
  if (!text) return std::nullopt;
  State state;
  GroupRecord* group = nullptr;
  std::istringstream lines(*text);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string tag;
    in >> tag;
    if (tag == "t") {
      in >> state.wallMs;
    } else if (tag == "g") {
      std::string key;
      std::getline(in >> std::ws, key);  // a group's name may hold spaces
      group = &state.groups[key];
    } else if (tag == "heads" && group) {
      in >> group->heads.lastIssued >> group->heads.lastCompleted >> group->heads.lastIssuedP2P >>
          group->heads.lastCompletedP2P;
    } else if (tag == "e" && group) {
      uint64_t seq = 0;
      in >> seq;
      group->entries[seq] = decodeFingerprint(in);
    }
  }
  return state;
}

}  // namespace bulkhead::monitor_record
