#pragma once
// The NCCL backend: communicators on CUDA tensors (docs/design.md#communicator). This
// header does not include nccl.h; only runtime/nccl sees it.
//
// Bootstrap and splits are non-blocking (config.blocking = 0) and polled with
// ncclCommGetAsyncError against the init deadline: a rank that never joins
// gives TimeoutError, not a hang. Operations are enqueued on a CUDA stream and
// complete through CUDA events; a watchdog thread per communicator marks them
// complete, watches for asynchronous NCCL errors and enforces the deadline of
// work nobody waits on. On expiry or an error the communicator is aborted with
// ncclCommAbort on a helper thread, abandoned after BULKHEAD_ABORT_GRACE, and
// every pending Work fails with the error.

#include <string>

#include "runtime/communicator.h"
#include "runtime/store/store.h"

namespace bulkhead::nccl {

// True when Bulkhead was built with NCCL, libtorch has CUDA, and a GPU is visible.
bool available();
// GPUs visible to this process (0 without a driver).
int deviceCount();
// GPU `index`'s product name ("NVIDIA H100 80GB HBM3"); empty without one.
std::string deviceName(int index);
// Whether GPU `a` can reach GPU `b` directly (cudaDeviceCanAccessPeer: NVLink,
// or PCIe peer-to-peer); false without a driver.
bool peerAccess(int a, int b);

struct WorldOptions {
  // Unset: BULKHEAD_INIT_TIMEOUT from the call.
  std::optional<Deadline> deadline;
  // The GPU of this rank; -1: local rank modulo the visible GPUs.
  int device = -1;
  int localRank = 0;
};

// Creates the world communicator over the ranks of `bootstrap` (a CPU
// communicator, e.g. MPI's world), which carries NCCL's unique id.
CommunicatorPtr initWorld(Communicator& bootstrap, WorldOptions options = {});
// The same over `size` ranks that share `store`: rank 0's unique id travels
// through the store (jobs started without MPI).
CommunicatorPtr initWorld(Store& store, int rank, int size, WorldOptions options = {});

}  // namespace bulkhead::nccl
