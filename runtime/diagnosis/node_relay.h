#pragma once
// Per-node relay of the monitor's records (docs/design.md#the-ledger-and-diagnosis). Every rank
// publishes one record per heartbeat (its heartbeat time and the heads and
// newest entries of every group it watches). With a relay, the ranks of a
// node write their records into slots of one shared-memory segment, and the
// node's leader (local rank 0) forwards every changed slot to the store in
// one multiSet: the store's host serves one request per node and heartbeat
// instead of one per rank, while every record still lands under its own
// rank's key, so a diagnosis names single ranks.
//
// A member whose leader stops forwarding (stopped, dead or cut off) notices
// from the leader's stamp in the segment and publishes its own record
// directly until the leader is back; a member that stops writing is seen as
// silent exactly as without a relay.
//
// The segment is created by the leader under a random name, opened by the
// members and unlinked as soon as all of them have opened it, so nothing is
// left in /dev/shm when a job dies.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/store/store.h"

namespace bulkhead {

struct NodeRelayOptions {
  int localRank = 0;
  int localSize = 1;  // ranks on this node; no relay below 2
  int worldRank = 0;
  size_t slotBytes = 64 << 10;  // the largest record a slot holds
  // Names this node: ranks that share it share a segment. Empty: the host's
  // name and boot id, and this process's IPC namespace.
  std::string nodeId;
};

class NodeRelay {
 public:
  // A record read from a slot.
  struct Record {
    int slot = 0;
    int worldRank = -1;
    uint64_t version = 0;
    std::string text;
  };

  // The leader's side: creates a segment of `slots` slots.
  static std::unique_ptr<NodeRelay> create(int slots, size_t slotBytes);
  // A member's side: opens the segment the leader created.
  static std::unique_ptr<NodeRelay> open(const std::string& name);
  ~NodeRelay();
  NodeRelay(const NodeRelay&) = delete;
  NodeRelay& operator=(const NodeRelay&) = delete;

  const std::string& name() const { return name_; }
  bool leader() const { return leader_; }
  int slots() const;
  // Removes the segment's name; those who opened it keep it. Idempotent.
  void unlink();

  // Writes `text` as slot `slot`'s record; false (nothing written) when it is
  // larger than a slot. One writer per slot: only its rank's thread writes it.
  bool write(int slot, int worldRank, std::string_view text);
  // The records whose version differs from `seen` (indexed by slot; grown to
  // slots()), updating `seen`. A slot being written is skipped this time; a
  // record returned is always one write's whole record, never a mix of two.
  // Safe against concurrent writes from any thread or process of the node.
  std::vector<Record> changed(std::vector<uint64_t>& seen) const;
  // The leader stamps each forwarding turn; members read how long ago the
  // last one was. The stamps are in the monotonic clock (steady_clock,
  // CLOCK_MONOTONIC on Linux): one clock for the whole host since its boot,
  // so every process of the node agrees on it (processes in time namespaces
  // of their own aside), and a step of the wall clock (NTP, an operator)
  // makes no leader look late or early.
  void stampForwarded();
  double secondsSinceForwarded() const;
  // The version of slot `slot` the leader forwarded last.
  void markForwarded(int slot, uint64_t version);
  uint64_t forwarded(int slot) const;
  uint64_t version(int slot) const;

  struct Header;  // node_relay.cc: the segment's layout
  struct Slot;

 private:
  NodeRelay(std::string name, void* base, size_t bytes, bool leader);
  Slot* slot(int index) const;

  std::string name_;
  void* base_;
  size_t bytes_;
  bool leader_;
  bool linked_;
};

// Sets up this rank's side of its node's relay through `store`: local rank 0
// creates the segment and publishes its name under the node's key; the others
// open it and say so; the leader unlinks the name once all have. Null (with a
// warning where something failed) when the launcher gives no local size above
// 1, BULKHEAD_NODE_RELAY is 0, or the segment cannot be shared: the monitor
// then publishes directly.
std::shared_ptr<NodeRelay> joinNodeRelay(Store& store, const NodeRelayOptions& options, Deadline deadline);

// This node's identity: host name, boot id and IPC namespace.
std::string thisNodeId();

}  // namespace bulkhead
