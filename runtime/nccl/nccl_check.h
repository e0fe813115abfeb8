#pragma once
// The one place where NCCL and CUDA runtime return codes become Bulkhead
// errors, and where dtypes and reduce ops map to NCCL's. Backend-internal:
// only runtime/nccl includes nccl.h.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "runtime/diagnosis/ledger.h"
#include "runtime/errors.h"

namespace bulkhead::nccl {

// Raises CommError naming the call and NCCL's (or CUDA's) own description.
// ncclInProgress is not an error: callers of non-blocking communicators poll it.
void check(ncclResult_t rc, const char* call, const ErrorContext& context);
void check(cudaError_t rc, const char* call, const ErrorContext& context);

ncclDataType_t datatype(c10::ScalarType dtype);
ncclRedOp_t reduceOp(ReduceOp op);

}  // namespace bulkhead::nccl
