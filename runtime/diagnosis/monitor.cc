#include "runtime/diagnosis/monitor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <functional>
#include <map>
#include <sstream>

#include "runtime/diagnosis/diagnosis.h"
#include "runtime/diagnosis/monitor_record.h"
#include "runtime/diagnosis/node_relay.h"
#include "runtime/diagnosis/op_checks.h"
#include "runtime/env.h"
#include "runtime/log.h"

namespace bulkhead {
namespace {

using monitor_record::stateKey;
using monitor_record::wallClockMs;

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

void Monitor::relayThrough(std::shared_ptr<NodeRelay> relay, int slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  relay_ = std::move(relay);
  relaySlot_ = slot;
}

std::string Monitor::state() const {
  auto watched = groups();
  std::vector<std::pair<std::string, const Ledger*>> ledgers;
  for (const Group& group : watched)
    if (!group.comm.expired()) ledgers.emplace_back(group.key, group.ledger.get());
  return monitor_record::encodeState(wallClockMs(), ledgers);
}

void Monitor::publishDirectly(const std::string& record, Deadline deadline) {
  store_->set(stateKey(worldRank_), record, deadline);
  std::lock_guard<std::mutex> lock(mutex_);
  storeAnswered_ = std::chrono::steady_clock::now();
}

// Through the node's relay when there is one: the leader forwards every
// changed slot in one request; a member publishes directly only while its
// leader is late.
void Monitor::publishState(Deadline deadline) {
  std::shared_ptr<NodeRelay> relay;
  int slot = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    relay = relay_;
    slot = relaySlot_;
  }
  std::string record = state();
  if (!relay || !relay->write(slot, worldRank_, record)) return publishDirectly(record, deadline);
  if (!relay->leader()) {
    if (leaderLate(*relay)) publishDirectly(record, deadline);
    return;
  }
  std::vector<std::pair<std::string, std::string>> pairs;
  auto records = relay->changed(relaySeen_);
  for (const NodeRelay::Record& r : records) pairs.emplace_back(stateKey(r.worldRank), r.text);
  store_->multiSet(pairs, deadline);
  for (const NodeRelay::Record& r : records) relay->markForwarded(r.slot, r.version);
  relay->stampForwarded();
  std::lock_guard<std::mutex> lock(mutex_);
  storeAnswered_ = std::chrono::steady_clock::now();
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
  const auto interval = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.heartbeatSeconds));
  bool warned = false;
  for (;;) {
    const auto turn = std::chrono::steady_clock::now();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (stopping_) return;
    }
    tick();
    try {
      publishState(Deadline::afterSeconds(options_.heartbeatSeconds));
      warned = false;
    } catch (const std::exception& e) {
      if (!warned) log::warn("monitor", "cannot publish the ledger through the store: {}", e.what());
      warned = true;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    // A relay member looks at its leader again half a period on, so a
    // stopped leader leaves its node's records stale for less than the dead
    // threshold (at most 1.25 + 0.5 heartbeats since the newest forwarded one).
    if (relay_ && !relay_->leader() && !wake_.wait_until(lock, turn + interval / 2, [this] { return stopping_; })) {
      lock.unlock();
      try {
        publishIfLeaderLate(Deadline::afterSeconds(options_.heartbeatSeconds / 2));
      } catch (const std::exception&) {  // reported by the next turn's publish
      }
      lock.lock();
    }
    // A fixed rate, so a relay's leader stamps its node's turn every period.
    wake_.wait_until(lock, std::max(turn + interval, std::chrono::steady_clock::now() + interval / 10),
                     [this] { return stopping_; });
  }
}

void Monitor::publishIfLeaderLate(Deadline deadline) {
  std::shared_ptr<NodeRelay> relay;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    relay = relay_;
  }
  if (relay && leaderLate(*relay)) publishDirectly(state(), deadline);
}

bool Monitor::leaderLate(const NodeRelay& relay) const {
  return relay.secondsSinceForwarded() > kRelayLateHeartbeats * options_.heartbeatSeconds;
}

std::string Monitor::storeSilence(const Error& error, double paused) const {
  const int host = options_.storeHostRank;
  // Where the store lives, for the messages: a rank, or outside the job.
  const std::string store = host >= 0 ? fmt::format("rank {}", host) : "outside the job, at " + store_->describe();
  if (paused > 0)
    return fmt::format(
        "this rank was not running for {:.1f} s (stopped or starved), and the store ({}) no "
        "longer answers: the job most likely ended while this rank was paused ({})",
        paused, store, error.what());
  double silent;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    silent = std::chrono::duration<double>(std::chrono::steady_clock::now() - storeAnswered_).count();
    // A relay member hears from the store through its leader's turns.
    if (relay_ && !relay_->leader()) silent = std::min(silent, relay_->secondsSinceForwarded());
  }
  if (host < 0) {
    const bool timeout = dynamic_cast<const TimeoutError*>(&error) != nullptr;
    return fmt::format("the store {} {}: restart it or check the network ({})", store,
                       timeout ? fmt::format("has not answered for {:.1f} s", silent)
                               : std::string("no longer answers (its connections are closed or refused)"),
                       error.what());
  }
  if (dynamic_cast<const TimeoutError*>(&error))
    return fmt::format("rank {} hosts the store and has not answered for {:.1f} s: it is stalled or dead ({})", host,
                       silent, error.what());
  return fmt::format(
      "rank {} hosts the store and no longer answers (its connections are closed or refused): it has "
      "exited or crashed ({})",
      host, error.what());
}

void Monitor::checkBeforeCollective(const Communicator& comm, uint64_t seq, const Fingerprint& fingerprint,
                                    Deadline deadline) {
  std::string prefix = fmt::format("strict/{}/{}/", groupKey(comm), seq);
  store_->set(prefix + std::to_string(worldRank_), monitor_record::encode(fingerprint), deadline);
  std::vector<std::string> keys;
  for (int member : comm.members()) keys.push_back(prefix + std::to_string(member));
  store_->wait(keys, deadline);
  auto values = store_->multiGet(keys, deadline);
  for (size_t i = 0; i < keys.size(); ++i) {
    std::istringstream in(values[i].value_or(""));
    Fingerprint theirs = monitor_record::decodeFingerprint(in);
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

Diagnosis Monitor::diagnosePeer(const Communicator& comm, const Fingerprint& fingerprint, const std::string& local,
                                double paused) {
  if (paused > 0)
    return {
        fmt::format("{} This rank was not running for {:.1f} s (stopped or starved) while it waited.", local, paused),
        false};
  if (fingerprint.root < 0 || fingerprint.root >= static_cast<int>(comm.members().size())) return {local, false};
  const int peer = comm.members()[fingerprint.root];
  try {
    auto values = store_->multiGet({stateKey(peer)}, Deadline::afterSeconds(options_.diagnosisSeconds));
    auto state = monitor_record::decodeState(values.at(0));
    if (!state)
      return {fmt::format("{} Its peer, rank {}, published no state (not started, or cut off from the store).", local,
                          peer),
              false};
    const double silentFor = (wallClockMs() - state->wallMs) / 1000.0;
    if (silentFor > options_.deadAfterSeconds)
      return {fmt::format("{} Its peer: rank {} is dead (no heartbeat for {:.1f} s).", local, peer, silentFor), false};
    return {fmt::format("{} Its peer, rank {}, is alive: it skipped or reordered the matching {}, or is itself held up "
                        "by another rank.",
                        local, peer, fingerprint.op == OpType::Send ? "receive" : "send"),
            false};
  } catch (const Error& e) {
    return {fmt::format("{} {}.", local, storeSilence(e, paused)), false};
  }
}

Diagnosis Monitor::diagnose(const Communicator& comm, uint64_t seq, const Fingerprint& fingerprint,
                            double waitedSeconds) {
  std::string local = describeTimeout(comm, fingerprint, seq, waitedSeconds);
  const double paused = pausedSeconds(std::chrono::steady_clock::now() -
                                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                          std::chrono::duration<double>(waitedSeconds + options_.heartbeatSeconds)));
  if (isPointToPoint(fingerprint.op)) return diagnosePeer(comm, fingerprint, local, paused);
  Deadline deadline = Deadline::afterSeconds(options_.diagnosisSeconds);
  std::string key = groupKey(comm);
  try {
    publishDirectly(state(), deadline);
    std::vector<std::string> keys;
    for (int member : comm.members()) keys.push_back(stateKey(member));
    auto values = store_->multiGet(keys, deadline);
    int64_t now = wallClockMs();
    std::vector<int> waiting, completed, silent;
    std::map<uint64_t, std::vector<int>> lagging;  // last completed seq -> ranks that never issued `seq`
    std::vector<std::string> dead, mismatched;
    for (size_t i = 0; i < comm.members().size(); ++i) {
      int member = comm.members()[i];
      auto state = monitor_record::decodeState(values[i]);
      std::optional<int64_t> alive = state ? std::optional<int64_t>(state->wallMs) : std::nullopt;
      std::optional<monitor_record::GroupRecord> record;
      if (state)
        if (auto it = state->groups.find(key); it != state->groups.end()) record = it->second;
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
      parts.push_back(
          fmt::format("this rank was not running for {:.1f} s (stopped or starved) while it waited, so "
                      "its peers' silence in that time is not evidence against them",
                      paused));
    for (const auto& [last, ranks] : lagging)
      parts.push_back(fmt::format("{} last completed seq {} and never issued seq {}", rankList(ranks), last, seq));
    parts.insert(parts.end(), dead.begin(), dead.end());
    if (!silent.empty())
      parts.push_back(fmt::format("{} published no state (not started, or cut off from the store)", rankList(silent)));
    if (!completed.empty()) parts.push_back(fmt::format("{} completed seq {}", rankList(completed), seq));
    if (!waiting.empty())
      parts.push_back(fmt::format("{} wait in seq {} ({})", rankList(waiting), seq, fingerprint.describe()));
    Diagnosis diagnosis;
    if (!mismatched.empty()) {
      diagnosis.desync = true;
      diagnosis.message = fmt::format(
          "group {} seq {}: {} issued {} but {}. Every rank of a group must issue the same "
          "collectives in the same order; set BULKHEAD_STRICT=1 to stop at the first "
          "mismatching call.",
          checks::describeGroup(comm), seq, rankList(waiting), fingerprint.describe(), fmt::join(mismatched, "; "));
    } else {
      diagnosis.message =
          fmt::format("group {} {} seq {} did not complete in {:.1f} s: {}.", checks::describeGroup(comm),
                      toString(fingerprint.op), seq, waitedSeconds, fmt::join(parts, "; "));
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
