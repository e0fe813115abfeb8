#pragma once
// The Gloo backend: communicators on CPU tensors over Gloo's TCP transport,
// for jobs started without MPI (torchrun, Kubernetes, srun without PMIx).
// This header does not include Gloo's; only runtime/gloo sees them.
//
// Every group is a Gloo context whose ranks find each other through the job's
// rendezvous store. Collectives run in issue order on one worker thread per
// communicator, each Gloo call bounded by the operation's deadline (Gloo's own
// timeout); sends and receives are posted at once and completed in order per
// peer and direction. Work::wait and the deadlines, the ledger, the diagnosis
// and BULKHEAD_FAULT behave as on the other backends. A timed-out Gloo context
// cannot be reused: the communicator is aborted and refuses further work, but
// unlike MPI the process need not exit (Gloo's calls all end by their timeout).

#include <memory>
#include <optional>
#include <string>

#include "runtime/communicator.h"
#include "runtime/store/store.h"

namespace bulkhead::gloo {

// True when this build has Gloo.
bool available();

struct WorldOptions {
  // Unset: BULKHEAD_INIT_TIMEOUT from the call. Bounds connecting every pair.
  std::optional<Deadline> deadline;
  // The address this rank's Gloo device listens on and advertises. Empty:
  // GLOO_SOCKET_IFNAME's interface when set, else this host's name.
  std::string host;
  // Store keys of this world live under this prefix.
  std::string prefix = "gloo/";
};

// Connects `size` ranks into the communicator "world" through `store`
// (collective: every rank calls it with its own `rank`).
CommunicatorPtr initWorld(std::shared_ptr<Store> store, int rank, int size, WorldOptions options = {});

}  // namespace bulkhead::gloo
