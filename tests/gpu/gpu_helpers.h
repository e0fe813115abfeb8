#pragma once
// The GPU tests' two worlds: the nccl world under test and the mpi world that
// computes the reference on the same inputs.

#include "runtime/communicator.h"
#include "tests/support/inputs.h"

namespace bulkhead::testing {

Communicator& gpuWorld();
Communicator& cpuWorld();
const CommunicatorPtr& gpuWorldPtr();
const CommunicatorPtr& cpuWorldPtr();
c10::Device gpu();

}  // namespace bulkhead::testing
