#pragma once
// How the ranks of a job find each other.
//
//   mpi    an MPI launcher started the job (mpirun, or srun with PMIx): the MPI
//          world carries rank 0's store address and token (rendezvous.h).
//   store  any other launcher (torchrun, Kubernetes, srun without PMIx, a shell
//          loop): rank 0 hosts the store at MASTER_ADDR:MASTER_PORT and every
//          rank joins it with BULKHEAD_STORE_TOKEN. The roster is checked
//          there: every rank must claim the same world size, no rank may be
//          claimed twice (ConfigError on every rank that sees it), and a rank
//          that has not joined by the init deadline is named (TimeoutError).
//
// BULKHEAD_BOOTSTRAP=auto picks mpi when Open MPI's or PMIx's variables are
// set, or no launcher's at all (a single process), and store otherwise.

#include <optional>
#include <string>

#include "launch/rendezvous.h"
#include "launch/world.h"

namespace bulkhead::launch {

enum class Bootstrap { Mpi, Store };

// "host:pid:nonce": a name for this process no other process of the job has.
std::string processId();
const char* toString(Bootstrap bootstrap);

// Reads BULKHEAD_BOOTSTRAP; ConfigError for a value it does not know, or for
// store mode without a launcher's RANK and WORLD_SIZE.
Bootstrap resolveBootstrap(const std::optional<WorldInfo>& found, const EnvLookup& lookup = processEnvironment());

// Store mode: reaches the store outside the job (BULKHEAD_STORE_ADDR,
// rendezvous.h), or hosts (rank 0) or reaches rank 0's, then waits under
// `deadline` until every rank of the world has joined.
Rendezvous joinStore(const WorldInfo& world, Deadline deadline);

// joinStore's roster, once connected, in two halves (so that one process can
// drive many simulated ranks through it: bulkhead-store-scale-bench
// --rendezvous). Linear in the ranks: each arrival takes a slot, writes its
// record and reads the first arrival's (a world size that differs is found by
// one side or the other); the rank that takes slot WORLD_SIZE reads every
// record once, checks them and publishes the roster; every other rank waits
// on that one key, and a process past slot WORLD_SIZE is refused at once. Contradictions are published there for every rank to
// raise; at the deadline a full read names the ranks that never joined.
int64_t arriveAtRoster(Store& store, const WorldInfo& world, Deadline deadline);
void awaitRoster(Store& store, const WorldInfo& world, Deadline deadline);

}  // namespace bulkhead::launch
