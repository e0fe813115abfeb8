#pragma once
// The job's rendezvous store (docs/design.md#launch-and-the-rendezvous-store): rank 0 hosts a TCP store,
// whose address and per-job token reach the other ranks through the MPI world
// (BULKHEAD_STORE_HOST, MASTER_ADDR and MASTER_PORT steer where it listens);
// or every rank reaches a store outside the job (joinOutsideStore).

#include <memory>
#include <optional>
#include <string>

#include "launch/world.h"
#include "runtime/communicator.h"
#include "runtime/store/tcp_store.h"

namespace bulkhead::launch {

struct Rendezvous {
  std::unique_ptr<TcpStoreServer> server;  // rank 0 only
  std::shared_ptr<Store> store;            // every rank, connected and authenticated
  bool outside = false;                    // the store runs outside the job (joinOutsideStore): no rank hosts it
};

// Whether `host` is a numeric IPv4 or IPv6 address (a server binds to it),
// not a name (a server binds to every interface): "10.0.0.1", "::1", not "bad.cafe".
bool isNumericAddress(const std::string& host);

// The store outside the job (BULKHEAD_STORE_ADDR, bulkhead-store), or nullopt
// where it is unset: connected and authenticated (BULKHEAD_STORE_TOKEN), every
// key under "run/<run id>/" (BULKHEAD_RUN_ID, else the launcher's job id), so
// that one store serves run after run. ConfigError for an address that is not
// host:port, or a missing token or run id; TimeoutError when the store does
// not answer by `deadline`.
std::optional<Rendezvous> joinOutsideStore(const WorldInfo& world, Deadline deadline,
                                           const EnvLookup& lookup = processEnvironment());

// Collective over `cpuWorld` (a CPU communicator), bounded by `deadline`.
Rendezvous startRendezvous(Communicator& cpuWorld, const WorldInfo& world, Deadline deadline);

}  // namespace bulkhead::launch
