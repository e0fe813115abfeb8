#include "runtime/diagnosis/checked_region.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>

#include "runtime/diagnosis/diagnosis.h"
#include "runtime/diagnosis/monitor_record.h"
#include "runtime/env.h"
#include "runtime/errors.h"

namespace bulkhead {
namespace {

// Region n of a name on this process: every rank numbers its regions alike.
uint64_t nextIndex(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, uint64_t> counters;
  std::lock_guard<std::mutex> lock(mutex);
  return ++counters[name];
}

std::string regionKey(const std::string& name, uint64_t index, int rank) {
  return fmt::format("region/{}/{}/{}", name, index, rank);
}

// One rank's record, split by group: the members and the collectives' lines
// as written. Ranks that agree wrote the same lines, so most checks compare
// text; the fingerprints are decoded only where the text differs.
struct GroupRecord {
  std::vector<int> members;
  size_t count = 0;
  std::string lines;
};
using Record = std::map<std::string, GroupRecord>;
using Collectives = std::vector<std::pair<uint64_t, Fingerprint>>;

// The record's text:
//   g <group> <member count> <members...> <collective count>
//   c <seq> <fingerprint (monitor_record::encode)>      (that many, in issue order)
std::optional<Record> parse(const std::string& text) {
  Record record;
  GroupRecord* group = nullptr;
  size_t expected = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    if (line.substr(0, 2) == "c ") {
      if (!group) return std::nullopt;
      group->lines.append(line).push_back('\n');
      ++group->count;
      continue;
    }
    if (line.substr(0, 2) != "g ") return std::nullopt;
    if (group && group->count != expected) return std::nullopt;
    std::istringstream in{std::string(line.substr(2))};
    std::string name;
    size_t members = 0;
    if (!(in >> name >> members) || members > (1u << 20)) return std::nullopt;
    group = &record[name];
    for (size_t i = 0; i < members; ++i) {
      int member = -1;
      if (!(in >> member)) return std::nullopt;
      group->members.push_back(member);
    }
    if (!(in >> expected)) return std::nullopt;
  }
  if (group && group->count != expected) return std::nullopt;
  return record;
}

std::optional<Collectives> decode(const GroupRecord& group) {
  Collectives collectives;
  std::istringstream lines(group.lines);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream in(line.substr(2));
    uint64_t seq = 0;
    if (!(in >> seq)) return std::nullopt;
    collectives.emplace_back(seq, monitor_record::decodeFingerprint(in));
    if (in.fail()) return std::nullopt;
  }
  return collectives;
}

// What the members of one group did at one position: classes of ranks whose
// fingerprints match, in order of their lowest rank; nullopt: issued nothing.
struct Side {
  std::vector<int> ranks;
  std::vector<uint64_t> seqs;
  std::optional<Fingerprint> fingerprint;
};

std::vector<Side> sidesAt(const std::map<int, Collectives>& byRank, size_t position) {
  std::vector<Side> sides;
  for (const auto& [rank, collectives] : byRank) {
    std::optional<Fingerprint> fp;
    uint64_t seq = 0;
    if (position < collectives.size()) std::tie(seq, fp) = collectives[position];
    auto same = std::find_if(sides.begin(), sides.end(), [&](const Side& side) {
      return side.fingerprint.has_value() == fp.has_value() && (!fp || side.fingerprint->matches(*fp));
    });
    if (same == sides.end()) same = sides.insert(sides.end(), Side{.fingerprint = fp});
    same->ranks.push_back(rank);
    if (fp) same->seqs.push_back(seq);
  }
  return sides;
}

std::string describeSide(const Side& side, size_t issuedBefore) {
  if (!side.fingerprint)
    return fmt::format("{} issued nothing there (no more than {} collective{} on this group in the region)",
                       rankList(side.ranks), issuedBefore, issuedBefore == 1 ? "" : "s");
  std::vector<uint64_t> seqs = side.seqs;
  std::sort(seqs.begin(), seqs.end());
  seqs.erase(std::unique(seqs.begin(), seqs.end()), seqs.end());
  return fmt::format("{} issued {} (seq {})", rankList(side.ranks), side.fingerprint->describe(), fmt::join(seqs, ","));
}

// Where every member issued an all-to-all at `position`: the first member
// that sends another number of rows to a member than that one expects from it
// ("rank 0 sends 80 rows to rank 1, which expects 128 from it ..."), or
// nothing. Their fingerprints match (the rows' width), so only the splits tell.
std::optional<std::string> unpairedRows(const std::map<int, Collectives>& byRank, const std::vector<int>& members,
                                        size_t position) {
  std::map<int, const std::pair<uint64_t, Fingerprint>*> issued;
  for (const auto& [rank, collectives] : byRank) {
    if (position >= collectives.size() || collectives[position].second.op != OpType::AllToAll) return std::nullopt;
    issued.emplace(rank, &collectives[position]);
  }
  auto indexOf = [&](int rank) {
    return static_cast<size_t>(std::find(members.begin(), members.end(), rank) - members.begin());
  };
  for (const auto& [from, sent] : issued) {
    const auto& send = sent->second.sendSplits;
    for (const auto& [to, received] : issued) {
      const auto& recv = received->second.recvSplits;
      if (send.size() != members.size() || recv.size() != members.size()) continue;
      const int64_t rows = send[indexOf(to)], expected = recv[indexOf(from)];
      if (rows == expected) continue;
      return fmt::format(
          "rank {} sends {} rows to rank {}, which expects {} from it (rank {}: {}, seq {}; rank {}: {}, "
          "seq {})",
          from, rows, to, expected, from, sent->second.describe(), sent->first, to, received->second.describe(),
          received->first);
    }
  }
  return std::nullopt;
}

// DesyncError unless every member of group `name` this rank has a record of
// watched it and issued the same collectives there.
void checkGroup(const std::string& title, const std::string& name, const std::vector<int>& members,
                const std::map<int, Record>& records, int worldRank) {
  const std::string where = fmt::format("group {} (ranks {})", name, fmt::join(members, ","));
  std::map<int, const GroupRecord*> byRank;
  std::vector<int> absent;
  for (int member : members) {
    auto it = records.find(member);
    if (it == records.end()) continue;  // not a rank this one compares with
    auto group = it->second.find(name);
    if (group == it->second.end())
      absent.push_back(member);
    else
      byRank.emplace(member, &group->second);
  }
  if (!absent.empty())
    throw DesyncError(fmt::format("{}: {} of {} {} not watch it in this region; every member must", title,
                                  rankList(absent), where, absent.size() == 1 ? "does" : "do"),
                      {.rank = worldRank, .group = name, .expected = "the same groups watched on every member"});
  // Ranks in step wrote the same lines (the same sequence numbers too).
  const bool sameText = std::all_of(byRank.begin(), byRank.end(), [&](const auto& entry) {
    return entry.second->lines == byRank.begin()->second->lines;
  });
  if (sameText) return;
  std::map<int, Collectives> decoded;
  size_t longest = 0;
  for (const auto& [rank, group] : byRank) {
    auto collectives = decode(*group);
    if (!collectives)
      throw DesyncError(fmt::format("{}: rank {}'s record of {} cannot be read", title, rank, where),
                        {.rank = worldRank, .group = name, .expected = "records written by Bulkhead's CheckedRegion"});
    longest = std::max(longest, collectives->size());
    decoded.emplace(rank, std::move(*collectives));
  }
  for (size_t position = 0; position < longest; ++position) {
    std::vector<Side> sides = sidesAt(decoded, position);
    std::vector<std::string> told;
    if (sides.size() >= 2) {
      for (const Side& side : sides) told.push_back(describeSide(side, position));
    } else if (auto unpaired = unpairedRows(decoded, members, position)) {
      told.push_back(*unpaired);
    } else {
      continue;
    }
    throw DesyncError(fmt::format("{}: {} diverged at collective {} of the region: {}. Every rank of a group must "
                                  "issue the same collectives in the same order, of the same sizes",
                                  title, where, position + 1, fmt::join(told, "; ")),
                      {.rank = worldRank, .group = name, .expected = "the same collectives on every member"});
  }
}

}  // namespace

CheckedRegion::CheckedRegion(std::shared_ptr<Store> store, std::vector<CommunicatorPtr> comms,
                             CheckedRegionOptions options)
    : store_(std::move(store)), options_(std::move(options)) {
  if (options_.name.empty() || options_.name.find('/') != std::string::npos)
    throw ConfigError(fmt::format("checked region: name '{}' must be non-empty and without '/'", options_.name),
                      {.expected = "a name such as 'step' or 'graph-capture'"});
  for (auto& comm : comms) {
    if (!comm) continue;
    if (std::any_of(comm->name().begin(), comm->name().end(), [](unsigned char c) { return std::isspace(c); }))
      throw ConfigError(fmt::format("checked region '{}': group name '{}' holds whitespace, which its record cannot "
                                    "carry; name groups without it",
                                    options_.name, comm->name()),
                        {.group = comm->name(), .expected = "group names without whitespace"});
    const int rank = comm->members().at(static_cast<size_t>(comm->rank()));
    if (worldRank_ >= 0 && rank != worldRank_)
      throw ConfigError(fmt::format("checked region '{}': the communicators belong to world ranks {} and {}",
                                    options_.name, worldRank_, rank),
                        {.rank = worldRank_, .expected = "this rank's communicators only"});
    worldRank_ = rank;
    watched_.push_back({comm, std::make_shared<Ledger::Recording>()});
  }
  if (!store_ || watched_.empty())
    throw ConfigError(fmt::format("checked region '{}' needs a store and at least one communicator", options_.name),
                      {.rank = worldRank_, .expected = "the runtime's store and this rank's groups"});
  index_ = nextIndex(options_.name);
  for (auto& w : watched_) w.comm->ledger().attach(w.recording);
  recording_ = true;
}

CheckedRegion::~CheckedRegion() { stopRecording(); }

void CheckedRegion::stopRecording() {
  if (!recording_) return;
  for (auto& w : watched_) w.comm->ledger().detach(w.recording);
  recording_ = false;
}

size_t CheckedRegion::recorded(const Communicator& comm) const {
  for (const auto& w : watched_)
    if (w.comm.get() == &comm) return w.recording->collectives.size();
  return 0;
}

std::string CheckedRegion::encode() const {
  std::string text;
  for (const auto& w : watched_) {
    text += fmt::format("g {} {} {} {}\n", w.comm->name(), w.comm->members().size(), fmt::join(w.comm->members(), " "),
                        w.recording->collectives.size());
    for (const auto& [seq, fp] : w.recording->collectives)
      text += fmt::format("c {} {}\n", seq, monitor_record::encode(fp));
  }
  return text;
}

RegionReport CheckedRegion::end() {
  if (ended_)
    throw ConfigError(fmt::format("checked region '{}' #{} ended twice", options_.name, index_),
                      {.rank = worldRank_, .expected = "one end() per region"});
  ended_ = true;
  stopRecording();
  const auto start = std::chrono::steady_clock::now();
  const Deadline deadline = options_.deadline.value_or(Deadline::afterSeconds(env::kCollectiveTimeout.seconds()));
  const std::string title = fmt::format("checked region '{}' #{}", options_.name, index_);

  std::set<int> participants;
  for (const auto& w : watched_) participants.insert(w.comm->members().begin(), w.comm->members().end());
  std::vector<int> ranks(participants.begin(), participants.end());
  std::vector<std::string> keys;
  for (int rank : ranks) keys.push_back(regionKey(options_.name, index_, rank));

  // One request: this rank's record in, region n - 2's out (every rank read it
  // before it set n - 1, which this rank has seen), every record of n back.
  std::vector<std::string> values;
  try {
    values = store_->setAndGather({.key = regionKey(options_.name, index_, worldRank_),
                                   .value = encode(),
                                   .erase = index_ > 2 ? regionKey(options_.name, index_ - 2, worldRank_) : "",
                                   .keys = keys},
                                  deadline);
  } catch (const TimeoutError&) {
    auto present = store_->multiGet(keys, Deadline::afterSeconds(2));
    std::vector<int> missing;
    for (size_t i = 0; i < keys.size(); ++i)
      if (!present[i]) missing.push_back(ranks[i]);
    throw TimeoutError(fmt::format("{}: {} did not reach the end of the region in time; they are still inside it "
                                   "(in a collective, or stopped) or never opened it",
                                   title, rankList(missing)),
                       {.rank = worldRank_, .expected = "every rank of the watched groups ends the region"});
  }

  std::map<int, Record> records;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto record = parse(values[i]);
    if (!record)
      throw DesyncError(fmt::format("{}: rank {}'s record under '{}' cannot be read", title, ranks[i], keys[i]),
                        {.rank = worldRank_, .expected = "records written by Bulkhead's CheckedRegion"});
    records.emplace(ranks[i], std::move(*record));
  }
  // Every group any rank recorded, in name order, so every rank reports the same first difference.
  std::map<std::string, std::vector<int>> groups;
  for (const auto& [rank, record] : records)
    for (const auto& [name, group] : record) groups.emplace(name, group.members);
  RegionReport report{.index = index_, .ranks = ranks.size(), .groups = groups.size()};
  for (const auto& w : watched_) report.collectives += w.recording->collectives.size();

  for (const auto& [name, members] : groups) checkGroup(title, name, members, records, worldRank_);
  report.checkSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace bulkhead
