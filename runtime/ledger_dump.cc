// Monitor::dump: each rank's ledger as JSON, and as a Chrome trace (open it in
// Perfetto or chrome://tracing) with one track per rank (process) and group
// (thread). Times are wall-clock microseconds, so traces of all ranks line up.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>

#include "runtime/errors.h"
#include "runtime/monitor.h"

namespace bulkhead {
namespace {

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", c);
      continue;
    }
    out += c;
  }
  return out + "\"";
}

int64_t micros(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

void writeFile(const std::string& path, const std::string& text) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (!file) throw IoError(fmt::format("cannot write {}; check that {} exists and is writable", path, path));
  std::fwrite(text.data(), 1, text.size(), file);
  std::fclose(file);
}

}  // namespace

void Monitor::dump() const {
  std::string ledger = fmt::format("{{\"rank\": {}, \"groups\": [", worldRank_);
  std::string trace = fmt::format(
      "{{\"traceEvents\": [\n{{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": {0}, \"args\": {{\"name\": "
      "\"rank {0}\"}}}}",
      worldRank_);
  int track = 0;
  for (const Group& group : groups()) {
    LedgerHeads heads = group.ledger->heads();
    ledger += fmt::format("{}\n {{\"name\": {}, \"members\": [{}], \"last_issued\": {}, \"last_completed\": {}, "
                          "\"entries\": [",
                          track == 0 ? "" : ",", quoted(group.name), fmt::join(group.members, ", "),
                          heads.lastIssued, heads.lastCompleted);
    trace += fmt::format(",\n{{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": {}, \"tid\": {}, \"args\": "
                         "{{\"name\": {}}}}}",
                         worldRank_, track, quoted(group.name));
    bool first = true;
    for (const LedgerEntry& entry : group.ledger->entries()) {
      int64_t start = micros(entry.issuedAt);
      bool ended = entry.state != OpState::Issued;
      int64_t duration = ended ? std::max<int64_t>(0, micros(entry.endedAt) - start) : 0;
      ledger += fmt::format("{}\n  {{\"seq\": {}, \"op\": {}, \"what\": {}, \"state\": \"{}\", \"issued_us\": {}, "
                            "\"duration_us\": {}}}",
                            first ? "" : ",", entry.seq, quoted(toString(entry.fingerprint.op)),
                            quoted(entry.fingerprint.describe()), toString(entry.state), start, duration);
      trace += fmt::format(",\n{{\"ph\": \"X\", \"name\": {}, \"pid\": {}, \"tid\": {}, \"ts\": {}, \"dur\": {}, "
                           "\"args\": {{\"seq\": {}, \"state\": \"{}\", \"what\": {}}}}}",
                           quoted(fmt::format("{} {}", toString(entry.fingerprint.op), entry.seq)), worldRank_, track,
                           start, duration, entry.seq, toString(entry.state), quoted(entry.fingerprint.describe()));
      first = false;
    }
    ledger += "]}";
    ++track;
  }
  ledger += "]}\n";
  trace += "\n]}\n";
  writeFile(fmt::format("{}/ledger_rank{}.json", options_.dumpDirectory, worldRank_), ledger);
  writeFile(fmt::format("{}/trace_rank{}.json", options_.dumpDirectory, worldRank_), trace);
}

}  // namespace bulkhead
