#include "runtime/diagnosis/diagnosis.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/diagnosis/op_checks.h"
#include "runtime/env.h"

namespace bulkhead {

std::string describeTimeout(const Communicator& comm, const Fingerprint& fingerprint, uint64_t seq,
                            double waitedSeconds) {
  LedgerHeads heads = comm.ledger().heads();
  bool p2p = isPointToPoint(fingerprint.op);
  return fmt::format(
      "group {} {} seq {} did not complete in {:.1f} s ({}); this rank last completed seq {}. "
      "Look for a rank that never issued seq {} (stalled, crashed, or in a different collective), "
      "or raise {} if the operation is only slow.",
      checks::describeGroup(comm), toString(fingerprint.op), seq, waitedSeconds, fingerprint.describe(),
      p2p ? heads.lastCompletedP2P : heads.lastCompleted, seq, env::kCollectiveTimeout.name());
}

std::string rankList(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ","));
}

}  // namespace bulkhead
