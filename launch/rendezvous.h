#pragma once
// The job's rendezvous store (docs/design.md#launch-and-the-rendezvous-store): rank 0 hosts a TCP store,
// whose address and per-job token reach the other ranks through the MPI world
// (BULKHEAD_STORE_HOST, MASTER_ADDR and MASTER_PORT steer where it listens).

#include <memory>

#include "launch/world.h"
#include "runtime/communicator.h"
#include "runtime/tcp_store.h"

namespace bulkhead::launch {

struct Rendezvous {
  std::unique_ptr<TcpStoreServer> server;  // rank 0 only
  std::shared_ptr<Store> store;            // every rank, connected and authenticated
};

// Collective over `cpuWorld` (a CPU communicator), bounded by `deadline`.
Rendezvous startRendezvous(Communicator& cpuWorld, const WorldInfo& world, Deadline deadline);

}  // namespace bulkhead::launch
