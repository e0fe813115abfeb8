#pragma once
// A checked collective region (docs/design.md#the-ledger-and-diagnosis): a scope over some of this
// rank's communicators that records, in order, the fingerprint of every
// collective issued on them, and at its end compares the records of all ranks
// through the store.
//
//   CheckedRegion region(runtime->store(), {groups.tp(), groups.ep()}, {.name = "step"});
//   ... forward, backward, the collectives they issue (waited on or not) ...
//   region.end();  // DesyncError on every rank if any two ranks of a group differ
//
// Contract:
// - Every member of every watched group opens regions of the same name in the
//   same order and ends them; region n of a name is matched with region n of
//   that name on every other rank, and regions of one name watch the same
//   groups every time. A rank compares the records of the union of the members
//   of its watched groups: watch the world too (or a group spanning every
//   rank) and every rank reads every record, so every rank finds the same
//   first difference; without it, a rank checks only what its groups reach.
// - end() publishes this rank's record under "region/<name>/<n>/<rank>",
//   waits for the other ranks' records and reads them, in one store request
//   (Store::setAndGather), then checks every group that any of them recorded: the
//   same number of collectives, and at each position fingerprints that match
//   (Fingerprint::matches) and, at an all-to-all, the rows each rank sends
//   each peer equal to the rows that peer expects from it. The first group (by name) and position that differ
//   raise DesyncError on every rank that read those records, with the same
//   text on each: the position, the sequence numbers and which ranks issued
//   what. Group names must not hold whitespace (ConfigError).
// - Collectives inside the region need not have completed: the check runs on
//   what was issued, so a rank that issued another sequence fails at the end
//   of the region rather than hanging in a wait after it.
// - A rank that does not reach the end within the deadline: TimeoutError
//   naming it. A record that cannot be parsed: DesyncError naming its rank.
// - Recording stops at end() or at destruction, whichever is first; a region
//   destroyed without end() (an exception unwinding) checks nothing, and the
//   ranks that do end theirs report this one as not reaching the end.
// - Point-to-point operations are not recorded: pipeline peers send different
//   things by design (their ledger entries carry their own checks).

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/deadline.h"
#include "runtime/diagnosis/ledger.h"
#include "runtime/store/store.h"

namespace bulkhead {

struct CheckedRegionOptions {
  // Part of the store keys and of every message; no '/' in it.
  std::string name = "region";
  // Bounds end(); unset: BULKHEAD_COLLECTIVE_TIMEOUT, counted from end().
  std::optional<Deadline> deadline;
};

// What end() compared, for logs and benches.
struct RegionReport {
  uint64_t index = 0;       // n: this region's number among regions of its name on this rank
  size_t ranks = 0;         // ranks whose records were compared
  size_t groups = 0;        // groups checked
  size_t collectives = 0;   // collectives this rank issued inside the region, over its groups
  double checkSeconds = 0;  // end()'s exchange through the store and the comparison
};

class CheckedRegion {
 public:
  // Starts recording on every communicator in `comms` (this rank's; nulls, as
  // split returns for ranks outside a group, are skipped). ConfigError for a
  // null store, no communicator, or a name with '/'.
  CheckedRegion(std::shared_ptr<Store> store, std::vector<CommunicatorPtr> comms, CheckedRegionOptions options = {});
  ~CheckedRegion();
  CheckedRegion(const CheckedRegion&) = delete;
  CheckedRegion& operator=(const CheckedRegion&) = delete;

  // Stops recording and compares (see the contract). Once; a second call is a
  // ConfigError.
  RegionReport end();

  // The collectives recorded so far on `comm` (one of the watched ones); read
  // it from the thread that issues them.
  size_t recorded(const Communicator& comm) const;

 private:
  struct Watched {
    CommunicatorPtr comm;
    std::shared_ptr<Ledger::Recording> recording;
  };
  void stopRecording();
  std::string encode() const;

  std::shared_ptr<Store> store_;
  std::vector<Watched> watched_;
  CheckedRegionOptions options_;
  int worldRank_ = -1;
  uint64_t index_ = 0;
  bool ended_ = false, recording_ = false;
};

}  // namespace bulkhead
