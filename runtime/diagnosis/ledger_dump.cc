// Monitor::dump: each rank's ledger as JSON, and as a Chrome trace (open it in
// Perfetto or chrome://tracing) with one track per rank (process) and group
// (thread). Times are wall-clock microseconds, so traces of all ranks line up.
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/diagnosis/monitor.h"
#include "runtime/errors.h"

namespace bulkhead {
namespace {

using Json = nlohmann::ordered_json;

int64_t micros(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

void writeFile(const std::string& path, const Json& json) {
  std::ofstream file(path);
  // Invalid UTF-8 in a group name is replaced, never a reason to lose the dump.
  if (file) file << json.dump(1, ' ', false, Json::error_handler_t::replace) << '\n';
  if (!file) throw IoError(fmt::format("cannot write {}; check that its folder exists and is writable", path));
}

}  // namespace

void Monitor::dump() const {
  Json ledger{{"rank", worldRank_}, {"groups", Json::array()}};
  Json events = Json::array();
  events.push_back({{"ph", "M"},
                    {"name", "process_name"},
                    {"pid", worldRank_},
                    {"args", {{"name", fmt::format("rank {}", worldRank_)}}}});
  int track = 0;
  for (const Group& group : groups()) {
    LedgerHeads heads = group.ledger->heads();
    Json entries = Json::array();
    events.push_back(
        {{"ph", "M"}, {"name", "thread_name"}, {"pid", worldRank_}, {"tid", track}, {"args", {{"name", group.name}}}});
    for (const LedgerEntry& entry : group.ledger->entries()) {
      const int64_t start = micros(entry.issuedAt);
      const bool ended = entry.state != OpState::Issued;
      const int64_t duration = ended ? std::max<int64_t>(0, micros(entry.endedAt) - start) : 0;
      const std::string op = toString(entry.fingerprint.op), what = entry.fingerprint.describe();
      entries.push_back({{"seq", entry.seq},
                         {"op", op},
                         {"what", what},
                         {"state", toString(entry.state)},
                         {"issued_us", start},
                         {"duration_us", duration}});
      events.push_back({{"ph", "X"},
                        {"name", fmt::format("{} {}", op, entry.seq)},
                        {"pid", worldRank_},
                        {"tid", track},
                        {"ts", start},
                        {"dur", duration},
                        {"args", {{"seq", entry.seq}, {"state", toString(entry.state)}, {"what", what}}}});
    }
    ledger["groups"].push_back({{"name", group.name},
                                {"members", group.members},
                                {"last_issued", heads.lastIssued},
                                {"last_completed", heads.lastCompleted},
                                {"entries", std::move(entries)}});
    ++track;
  }
  writeFile(fmt::format("{}/ledger_rank{}.json", options_.dumpDirectory, worldRank_), ledger);
  writeFile(fmt::format("{}/trace_rank{}.json", options_.dumpDirectory, worldRank_), Json{{"traceEvents", events}});
}

}  // namespace bulkhead
