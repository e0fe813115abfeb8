#pragma once
// Shared pieces of the multi-rank tests: the world communicator (set up by
// mpi_main.cc, one per process) and the seeded inputs of tests/support.

#include <ATen/ATen.h>

#include <vector>

#include "runtime/communicator.h"
#include "runtime/store/store.h"
#include "tests/support/inputs.h"

namespace bulkhead::testing {

Communicator& world();
CommunicatorPtr worldPtr();
// The job's rendezvous store (hosted by rank 0).
std::shared_ptr<Store> store();

}  // namespace bulkhead::testing
