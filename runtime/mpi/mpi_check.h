#pragma once
// The one place where MPI return codes become Bulkhead errors. Backend-internal:
// only runtime/mpi includes mpi.h.

#include <mpi.h>

#include <mutex>

#include "runtime/diagnosis/ledger.h"
#include "runtime/errors.h"

namespace bulkhead::mpi {

// Raises CommError naming the MPI call and MPI's own description of `rc`.
void check(int rc, const char* call, const ErrorContext& context);

// Bulkhead asks for MPI_THREAD_SERIALIZED: every MPI call in the process holds
// this lock, so waiters on several threads never call MPI at the same time.
std::mutex& callLock();

// 16-bit floats have no MPI type: they travel as MPI_UINT16_T and reduce with
// Bulkhead's own MPI_Op (created at init, freed at finalize).
MPI_Datatype datatype(c10::ScalarType dtype);
MPI_Op reduceOp(ReduceOp op, c10::ScalarType dtype);
void createReduceOps();
void freeReduceOps();

}  // namespace bulkhead::mpi
