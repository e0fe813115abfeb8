#pragma once
// What a rank says when one of its operations times out. For now this rank's
// own view (its ledger); the cross-rank diagnosis through the rendezvous store
// builds on it.

#include <string>

#include "runtime/communicator.h"

namespace bulkhead {

// "group ep[1] (ranks 4,5,6,7) all_to_all seq 18 did not complete in 5.0 s
//  (all_to_all bf16 [4096 x 2048] ...); this rank last completed seq 17. ..."
// `consequence` says what happens next on this backend.
std::string describeTimeout(const Communicator& comm, const Fingerprint& fingerprint, uint64_t seq,
                            double waitedSeconds, const std::string& consequence);

}  // namespace bulkhead
