#include "runtime/communicator.h"

#include <algorithm>

#include "runtime/env.h"
#include "runtime/fault.h"
#include "runtime/monitor.h"

namespace bulkhead {

Communicator::Communicator()
    : ledger_(std::make_shared<Ledger>(static_cast<size_t>(std::max<int64_t>(1, env::kLedgerCapacity.integer())))) {}

Communicator::Injected Communicator::injectFault(Fingerprint& fingerprint) {
  if (!fault::armed()) return Injected::None;
  // Point-to-point operations are numbered on their own (Ledger::issue).
  const LedgerHeads heads = ledger_->heads();
  const bool pointToPoint = isPointToPoint(fingerprint.op);
  auto action = fault::inject(*this, (pointToPoint ? heads.lastIssuedP2P : heads.lastIssued) + 1, fingerprint.op);
  if (!action) return Injected::None;
  if (*action == fault::Action::Skip) return Injected::Skip;
  fingerprint = fault::mismatch(fingerprint, *action);
  return Injected::Altered;
}

void Communicator::checkStrict(uint64_t seq, const Fingerprint& fingerprint, Deadline deadline) {
  if (!monitor_ || !monitor_->strict() || isPointToPoint(fingerprint.op)) return;
  try {
    monitor_->checkBeforeCollective(*this, seq, fingerprint, deadline);
  } catch (...) {
    ledger_->fail(fingerprint.op, seq);
    throw;
  }
}

}  // namespace bulkhead
