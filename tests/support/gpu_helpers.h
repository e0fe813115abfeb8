#pragma once
// The GPU tests' two worlds: the nccl world under test and the mpi world that
// computes the reference on the same inputs.

#include <memory>

#include "runtime/communicator.h"
#include "runtime/store/store.h"
#include "tests/support/inputs.h"

namespace bulkhead::testing {

Communicator& gpuWorld();
Communicator& cpuWorld();
const CommunicatorPtr& gpuWorldPtr();
const CommunicatorPtr& cpuWorldPtr();
c10::Device gpu();
std::shared_ptr<Store> gpuStore();  // the job's rendezvous store

}  // namespace bulkhead::testing
