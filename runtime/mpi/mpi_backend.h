#pragma once
// The MPI backend: communicators on CPU tensors over Open MPI (docs/design.md#communicator).
// This header does not include mpi.h; only runtime/mpi sees it.
//
// Every operation is a non-blocking MPI call polled with backoff against its
// deadline. MPI cannot cancel a collective: once one has timed out, the process
// is "poisoned" — its buffers stay allocated for MPI, and finalize() does not
// call MPI_Finalize (which would hang) but exits with code 3 after
// BULKHEAD_ABORT_GRACE, so the job ends non-zero instead of hanging.

#include "runtime/communicator.h"

namespace bulkhead::mpi {

struct WorldOptions {
  // Unset: BULKHEAD_INIT_TIMEOUT from the call. Bounds the duplication of
  // MPI_COMM_WORLD; MPI_Init itself is bounded by the launcher (mpirun/srun).
  std::optional<Deadline> deadline;
};

// Initialises MPI once (MPI_THREAD_SERIALIZED) and returns a communicator named
// "world" over a duplicate of MPI_COMM_WORLD.
CommunicatorPtr initWorld(WorldOptions options = {});

// Rank and size in MPI_COMM_WORLD; initialises MPI if needed.
int worldRank();
int worldSize();

// True once an MPI operation in this process timed out or was aborted.
bool poisoned();

// Bounded shutdown: a world barrier under `deadline`, then MPI_Finalize.
// If the process is poisoned or the barrier times out, it logs why and exits
// with code 3 after BULKHEAD_ABORT_GRACE; it never returns in that case.
void finalize(Deadline deadline);

}  // namespace bulkhead::mpi
