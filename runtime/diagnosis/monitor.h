#pragma once
// The Monitor watches this process's communicators (docs/design.md#the-ledger-and-diagnosis). It
// publishes each one's ledger heads and a heartbeat through the rendezvous
// store, never through a communicator that may be stuck; explains a timeout
// from what every member of the group published; checks fingerprints across
// the group before each collective in strict mode; and dumps the ledger as
// JSON and as a Chrome trace.
//
// Keys, under the store given: "state/<rank>" (one record per heartbeat: its
// wall-clock time and every watched group's heads and newest entries, see
// monitor_record.h), "strict/<group key>/<seq>/<rank>",
// "report/<group key>/<seq>". With a node relay (node_relay.h) a node's
// records reach the store in one request per heartbeat from its leader.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/errors.h"
#include "runtime/store/store.h"

namespace bulkhead {

struct MonitorOptions {
  double heartbeatSeconds = 0.5;  // BULKHEAD_HEARTBEAT
  bool strict = false;            // BULKHEAD_STRICT
  std::string dumpDirectory;      // BULKHEAD_LEDGER_DUMP; empty: no dumps
  // A member silent for this long is reported dead (3 heartbeats, >= 1 s).
  double deadAfterSeconds = 1.5;
  // What the diagnosis of one timeout may take on top of the deadline.
  double diagnosisSeconds = 1.5;
  // The rank that hosts the store: when the store stops answering, the
  // diagnosis names it. -1: the store runs outside the job (BULKHEAD_STORE_ADDR).
  int storeHostRank = 0;
  static MonitorOptions fromEnvironment();
};

// What the members of a group said about one stuck operation.
struct Diagnosis {
  std::string message;  // the report of docs/design.md#the-ledger-and-diagnosis
  bool desync = false;  // members issued different collectives at that seq
};

class NodeRelay;

class Monitor : public std::enable_shared_from_this<Monitor> {
 public:
  Monitor(std::shared_ptr<Store> store, int worldRank, MonitorOptions options = MonitorOptions::fromEnvironment());
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;
  // Calls stop().
  ~Monitor();
  // Stops the heartbeat thread (bounded by one store round trip) and writes
  // the dumps if a directory is set. Idempotent.
  void stop();

  // Publishes through `relay` (this rank's slot `slot`) from the next
  // heartbeat on; null: directly, one request per heartbeat.
  void relayThrough(std::shared_ptr<NodeRelay> relay, int slot);

  // Attaches this monitor to `comm` and publishes its ledger from now on.
  void watch(const std::shared_ptr<Communicator>& comm);
  bool strict() const { return strict_; }
  // Turns strict mode on or off for this process (BULKHEAD_STRICT sets it at
  // start); every rank must agree, as for the knob.
  void setStrict(bool on) { strict_ = on; }
  int worldRank() const { return worldRank_; }
  const std::shared_ptr<Store>& store() const { return store_; }

  // Strict mode: publishes this rank's fingerprint for `seq` and compares it
  // with every member's before the collective is issued. DesyncError names
  // both sides; TimeoutError if a member does not arrive by the deadline.
  void checkBeforeCollective(const Communicator& comm, uint64_t seq, const Fingerprint& fingerprint, Deadline deadline);

  // Builds the report for operation `seq` of `comm` that timed out on this
  // rank after `waitedSeconds`, from every member's published state; the first
  // rank to finish stores it, and every rank reports that same text.
  Diagnosis diagnose(const Communicator& comm, uint64_t seq, const Fingerprint& fingerprint, double waitedSeconds);

  // Writes <dir>/ledger_rank<r>.json and <dir>/trace_rank<r>.json (Chrome
  // trace: one track per group) for every watched communicator.
  void dump() const;

  // How long this process was not running (SIGSTOP, a debugger, a swap storm,
  // a starved host) in its longest pause since `since`, as the heartbeat
  // thread's clock saw it; 0 when no pause exceeded deadAfterSeconds. A rank
  // that was paused must not read its peers' silence in that time as death.
  double pausedSeconds(std::chrono::steady_clock::time_point since) const;

 private:
  // What the monitor keeps of a group: enough to publish and dump its ledger
  // after the communicator itself is gone.
  struct Group {
    std::weak_ptr<Communicator> comm;
    std::string name, key;
    std::vector<int> members;
    std::shared_ptr<const Ledger> ledger;
  };
  void heartbeat();
  void tick();
  // This rank's record now, for every watched group.
  std::string state() const;
  void publishState(Deadline deadline);
  void publishDirectly(const std::string& record, Deadline deadline);
  // A relay member's record, directly, when its leader has not forwarded lately.
  void publishIfLeaderLate(Deadline deadline);
  // Whether this member's relay leader has not forwarded for kRelayLateHeartbeats.
  bool leaderLate(const NodeRelay& relay) const;
  // What a diagnosis says when the store did not answer it.
  std::string storeSilence(const Error& error, double paused) const;
  // A send or receive's timeout: whether its peer still beats.
  Diagnosis diagnosePeer(const Communicator& comm, const Fingerprint& fingerprint, const std::string& local,
                         double paused);
  std::vector<Group> groups() const;

  std::shared_ptr<Store> store_;
  int worldRank_;
  MonitorOptions options_;
  std::atomic<bool> strict_;
  mutable std::mutex mutex_;
  std::vector<Group> groups_;
  std::condition_variable wake_;
  bool stopping_ = false;
  // The heartbeat thread's clock (under mutex_): its last turn, the longest
  // pause it saw and when that pause ended, and the store's last answer.
  std::chrono::steady_clock::time_point lastTick_, pauseEnd_, storeAnswered_;
  double pauseSeconds_ = 0;
  std::shared_ptr<NodeRelay> relay_;  // under mutex_
  int relaySlot_ = 0;
  std::vector<uint64_t> relaySeen_;  // the heartbeat thread's: slot versions forwarded
  // A member publishes directly while its leader's last turn is older than this many heartbeats.
  static constexpr double kRelayLateHeartbeats = 1.25;
  std::thread thread_;
};

// The key that names a group in the store: its backend, name and members, so
// two groups with one name (splits of different parents, or the MPI world that
// bootstraps the NCCL world) never share keys.
std::string groupKey(const Communicator& comm);

}  // namespace bulkhead
