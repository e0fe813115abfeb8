#pragma once
// What a rank says when one of its operations times out, from its own ledger.
// The monitor (runtime/diagnosis/monitor.h) starts its cross-rank diagnosis from this
// text and adds what the other ranks report through the rendezvous store; a
// communicator without a monitor reports this alone.

#include <string>
#include <vector>

#include "runtime/communicator.h"

namespace bulkhead {

// "group ep[1] (ranks 4,5,6,7) all_to_all seq 18 did not complete in 5.0 s
//  (all_to_all bfloat16 [4096 x 2048] ...); this rank last completed seq 17. ..."
std::string describeTimeout(const Communicator& comm, const Fingerprint& fingerprint, uint64_t seq,
                            double waitedSeconds);

// "rank 3" or "ranks 1,4,6": how every diagnosis names a set of ranks.
std::string rankList(const std::vector<int>& ranks);

}  // namespace bulkhead
