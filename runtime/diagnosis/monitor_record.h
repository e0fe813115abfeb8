#pragma once
// What the monitor publishes for a rank (docs/design.md#the-ledger-and-diagnosis): one record per
// heartbeat under "state/<rank>", holding the wall-clock time it was written
// and, for every group the rank watches, its ledger heads and newest
// collectives:
//
//   t <ms>
//   g <group key>
//   heads <last issued> <last completed> <last issued p2p> <last completed p2p>
//   e <seq> <fingerprint>        (newest first, at most 8 per group)
//
// The text is parsed leniently: lines it does not know are skipped.

#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/diagnosis/ledger.h"

namespace bulkhead::monitor_record {

// What one member published about one group.
struct GroupRecord {
  LedgerHeads heads;
  std::map<uint64_t, Fingerprint> entries;  // seq -> what it issued there
};

struct State {
  int64_t wallMs = 0;
  std::map<std::string, GroupRecord> groups;  // by group key
};

std::string stateKey(int rank);

// The wall clock the records are written in, ms
// since the epoch: every process of a job reads the same time base.
int64_t wallClockMs();

std::string encode(const Fingerprint& fingerprint);
Fingerprint decodeFingerprint(std::istringstream& in);

// A rank's record at `wallMs`, for the given (group key, ledger) pairs.
std::string encodeState(int64_t wallMs, const std::vector<std::pair<std::string, const Ledger*>>& groups);
std::optional<State> decodeState(const std::optional<std::string>& text);

}  // namespace bulkhead::monitor_record
