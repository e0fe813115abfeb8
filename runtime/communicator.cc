#include "runtime/communicator.h"

#include <algorithm>

#include "runtime/env.h"

namespace bulkhead {

Communicator::Communicator()
    : ledger_(std::make_shared<Ledger>(static_cast<size_t>(std::max<int64_t>(1, env::kLedgerCapacity.integer())))) {}

}  // namespace bulkhead
