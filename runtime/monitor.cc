#include "runtime/monitor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <functional>
#include <map>
#include <sstream>

#include "runtime/diagnosis.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/op_checks.h"

namespace bulkhead {
namespace {

constexpr size_t kPublishedEntries = 8;  // the newest collectives each record carries

int64_t nowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string encode(const Fingerprint& fp) {
  std::string text = fmt::format("{} {} {} {} {} {}", static_cast<int>(fp.op), static_cast<int>(fp.dtype),
                                 static_cast<int>(fp.reduce), fp.root, fp.numel, fp.shape.size());
  for (int64_t d : fp.shape) text += fmt::format(" {}", d);
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
  return fp;
}

// What one member published about one group.
struct Record {
  LedgerHeads heads;
  std::map<uint64_t, Fingerprint> entries;  // seq -> what it issued there
};

std::string encode(const Ledger& ledger) {
  LedgerHeads h = ledger.heads();
  std::string text = fmt::format("heads {} {} {} {}\n", h.lastIssued, h.lastCompleted, h.lastIssuedP2P,
                                 h.lastCompletedP2P);
  auto entries = ledger.entries();
  size_t written = 0;
  for (auto it = entries.rbegin(); it != entries.rend() && written < kPublishedEntries; ++it) {
    if (isPointToPoint(it->fingerprint.op)) continue;
    text += fmt::format("e {} {}\n", it->seq, encode(it->fingerprint));
    ++written;
  }
  return text;
}

std::optional<Record> decodeRecord(const std::optional<std::string>& value) {
  if (!value) return std::nullopt;
  Record record;
  std::istringstream lines(*value);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string tag;
    in >> tag;
    if (tag == "heads") {
      in >> record.heads.lastIssued >> record.heads.lastCompleted >> record.heads.lastIssuedP2P >>
          record.heads.lastCompletedP2P;
    } else if (tag == "e") {
      uint64_t seq = 0;
      in >> seq;
      record.entries[seq] = decodeFingerprint(in);
    }
  }
  return record;
}

std::string rankList(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ","));
}

}  // namespace

MonitorOptions MonitorOptions::fromEnvironment() {
  MonitorOptions options;
  options.heartbeatSeconds = env::kHeartbeat.seconds();
  options.strict = env::kStrict.flag();
  options.dumpDirectory = env::kLedgerDump.text();
  options.deadAfterSeconds = std::max(1.0, 3 * options.heartbeatSeconds);
  return options;
}

std::string groupKey(const Communicator& comm) {
  size_t hash = std::hash<std::string>{}(fmt::format("{}", fmt::join(comm.members(), ",")));
  return fmt::format("{}:{}#{:x}", comm.backend(), comm.name(), hash & 0xffffffff);
}

Monitor::Monitor(std::shared_ptr<Store> store, int worldRank, MonitorOptions options)
    : store_(std::move(store)), worldRank_(worldRank), options_(std::move(options)), strict_(options_.strict) {
  lastTick_ = storeAnswered_ = std::chrono::steady_clock::now();
  thread_ = std::thread([this] { heartbeat(); });
}

Monitor::~Monitor() { stop(); }

void Monitor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (!options_.dumpDirectory.empty()) {
    try {
      dump();
    } catch (const std::exception& e) {
      log::warn("monitor", "could not dump the ledger: {}", e.what());
    }
  }
}

void Monitor::watch(const std::shared_ptr<Communicator>& comm) {
  comm->setMonitor(shared_from_this());
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.push_back({comm, comm->name(), groupKey(*comm), comm->members(), comm->sharedLedger()});
}

std::vector<Monitor::Group> Monitor::groups() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return groups_;
}

void Monitor::publish(const std::string& key, const Ledger& ledger, Deadline deadline) {
  store_->set(fmt::format("ledger/{}/{}", key, worldRank_), encode(ledger), deadline);
}

// One turn of the heartbeat thread: a gap since the last turn beyond one
// interval and its store round trips means this process did not run.
void Monitor::tick() {
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  double gap = std::chrono::duration<double>(now - lastTick_).count() - options_.heartbeatSeconds;
  if (gap > options_.deadAfterSeconds) {
    pauseSeconds_ = gap;
    pauseEnd_ = now;
    log::warn("monitor", "this rank was not running for {:.1f} s (stopped or starved)", gap);
  }
  lastTick_ = now;
}

double Monitor::pausedSeconds(std::chrono::steady_clock::time_point since) const {
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  // A pause still unseen by the heartbeat thread (this thread resumed first).
  double current = std::chrono::duration<double>(now - lastTick_).count() - 2 * options_.heartbeatSeconds;
  double recorded = pauseEnd_ >= since ? pauseSeconds_ : 0;
  double paused = std::max(current, recorded);
  return paused > options_.deadAfterSeconds ? paused : 0;
}

void Monitor::heartbeat() {
  auto interval = std::chrono::duration<double>(options_.heartbeatSeconds);
  bool warned = false;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (stopping_) return;
    }
    tick();
    try {
      Deadline deadline = Deadline::afterSeconds(options_.heartbeatSeconds);
      store_->set(fmt::format("alive/{}", worldRank_), std::to_string(nowMs()), deadline);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        storeAnswered_ = std::chrono::steady_clock::now();
      }
      for (const Group& group : groups())
        if (!group.comm.expired()) publish(group.key, *group.ledger, deadline);
      warned = false;
    } catch (const std::exception& e) {
      if (!warned) log::warn("monitor", "cannot publish the ledger through the store: {}", e.what());
      warned = true;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait_for(lock, interval, [this] { return stopping_; });
  }
}

std::string Monitor::storeSilence(const Error& error, double paused) const {
  const int host = options_.storeHostRank;
  if (paused > 0)
    return fmt::format("this rank was not running for {:.1f} s (stopped or starved), and the store (on rank {}) no "
                       "longer answers: the job most likely ended while this rank was paused ({})",
                       paused, host, error.what());
  double silent;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    silent = std::chrono::duration<double>(std::chrono::steady_clock::now() - storeAnswered_).count();
  }
  if (dynamic_cast<const TimeoutError*>(&error))
    return fmt::format("rank {} hosts the store and has not answered for {:.1f} s: it is stalled or dead ({})", host,
                       silent, error.what());
  return fmt::format("rank {} hosts the store and no longer answers (its connections are closed or refused): it has "
                     "exited or crashed ({})",
                     host, error.what());
}

void Monitor::checkBeforeCollective(const Communicator& comm, uint64_t seq, const Fingerprint& fingerprint,
                                    Deadline deadline) {
  std::string prefix = fmt::format("strict/{}/{}/", groupKey(comm), seq);
  store_->set(prefix + std::to_string(worldRank_), encode(fingerprint), deadline);
  std::vector<std::string> keys;
  for (int member : comm.members()) keys.push_back(prefix + std::to_string(member));
  store_->wait(keys, deadline);
  auto values = store_->multiGet(keys, deadline);
  for (size_t i = 0; i < keys.size(); ++i) {
    std::istringstream in(values[i].value_or(""));
    Fingerprint theirs = decodeFingerprint(in);
    if (!theirs.matches(fingerprint))
      throw DesyncError(fmt::format("group {} seq {}: this rank ({}) issues {} but rank {} issues {}; every rank of a "
                                    "group must issue the same collectives in the same order",
                                    checks::describeGroup(comm), seq, worldRank_, fingerprint.describe(),
                                    comm.members()[i], theirs.describe()),
                        checks::context(comm, fingerprint.describe()));
  }
  // Every member has read seq - 2 before it set seq - 1, which this rank has seen.
  if (seq > 2) store_->erase(fmt::format("strict/{}/{}/{}", groupKey(comm), seq - 2, worldRank_), deadline);
}

Diagnosis Monitor::diagnose(const Communicator& comm, uint64_t seq, const Fingerprint& fingerprint,
                            double waitedSeconds) {
  std::string local = describeTimeout(comm, fingerprint, seq, waitedSeconds, "");
  const double paused = pausedSeconds(std::chrono::steady_clock::now() -
                                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                          std::chrono::duration<double>(waitedSeconds + options_.heartbeatSeconds)));
  if (isPointToPoint(fingerprint.op))
    return {paused > 0 ? fmt::format("{} This rank was not running for {:.1f} s (stopped or starved) while it waited.",
                                     local, paused)
                       : local,
            false};
  Deadline deadline = Deadline::afterSeconds(options_.diagnosisSeconds);
  std::string key = groupKey(comm);
  try {
    publish(key, comm.ledger(), deadline);
    std::vector<std::string> keys;
    for (int member : comm.members()) {
      keys.push_back(fmt::format("ledger/{}/{}", key, member));
      keys.push_back(fmt::format("alive/{}", member));
    }
    auto values = store_->multiGet(keys, deadline);
    int64_t now = nowMs();
    std::vector<int> waiting, completed, silent;
    std::map<uint64_t, std::vector<int>> lagging;  // last completed seq -> ranks that never issued `seq`
    std::vector<std::string> dead, mismatched;
    for (size_t i = 0; i < comm.members().size(); ++i) {
      int member = comm.members()[i];
      auto record = decodeRecord(values[2 * i]);
      auto alive = values[2 * i + 1] ? parseStoreInteger(*values[2 * i + 1]) : std::nullopt;
      double silentFor = alive ? (now - *alive) / 1000.0 : 0;
      // A paused rank saw no heartbeats while it was stopped: no evidence.
      if (member != worldRank_ && alive && silentFor > options_.deadAfterSeconds && paused == 0) {
        dead.push_back(record ? fmt::format("rank {} is dead (no heartbeat for {:.1f} s; it last completed seq {})",
                                            member, silentFor, record->heads.lastCompleted)
                              : fmt::format("rank {} is dead (no heartbeat for {:.1f} s)", member, silentFor));
      } else if (!record || !alive) {
        silent.push_back(member);
      } else if (record->heads.lastIssued < seq) {
        lagging[record->heads.lastCompleted].push_back(member);
      } else if (record->heads.lastCompleted >= seq) {
        completed.push_back(member);
      } else if (auto it = record->entries.find(seq); it != record->entries.end() && !it->second.matches(fingerprint)) {
        mismatched.push_back(fmt::format("rank {} issued {}", member, it->second.describe()));
      } else {
        waiting.push_back(member);
      }
    }
    std::vector<std::string> parts;
    if (paused > 0)
      parts.push_back(fmt::format("this rank was not running for {:.1f} s (stopped or starved) while it waited, so "
                                  "its peers' silence in that time is not evidence against them",
                                  paused));
    for (const auto& [last, ranks] : lagging)
      parts.push_back(fmt::format("{} last completed seq {} and never issued seq {}", rankList(ranks), last, seq));
    parts.insert(parts.end(), dead.begin(), dead.end());
    if (!silent.empty())
      parts.push_back(fmt::format("{} published no state (not started, or cut off from the store)",
                                  rankList(silent)));
    if (!completed.empty()) parts.push_back(fmt::format("{} completed seq {}", rankList(completed), seq));
    if (!waiting.empty())
      parts.push_back(fmt::format("{} wait in seq {} ({})", rankList(waiting), seq, fingerprint.describe()));
    Diagnosis diagnosis;
    if (!mismatched.empty()) {
      diagnosis.desync = true;
      diagnosis.message = fmt::format("group {} seq {}: {} issued {} but {}. Every rank of a group must issue the same "
                                      "collectives in the same order; set BULKHEAD_STRICT=1 to stop at the first "
                                      "mismatching call.",
                                      checks::describeGroup(comm), seq, rankList(waiting), fingerprint.describe(),
                                      fmt::join(mismatched, "; "));
    } else {
      diagnosis.message = fmt::format("group {} {} seq {} did not complete in {:.1f} s: {}.",
                                      checks::describeGroup(comm), toString(fingerprint.op), seq, waitedSeconds,
                                      fmt::join(parts, "; "));
    }
    // The first rank to explain this timeout stores its report; all use it.
    std::string stored = store_->compareSet(fmt::format("report/{}/{}", key, seq), "",
                                            (diagnosis.desync ? "D" : "T") + diagnosis.message, deadline);
    if (!stored.empty()) diagnosis = {stored.substr(1), stored[0] == 'D'};
    if (!options_.dumpDirectory.empty()) dump();
    return diagnosis;
  } catch (const Error& e) {
    return {fmt::format("{} {}.", local, storeSilence(e, paused)), false};
  }
}

}  // namespace bulkhead
