#pragma once
// A CPU-tensor communicator over a device communicator: each operation copies
// its CPU tensors to the device, runs there, and copies the results back when
// it is waited on. The CPU world of a GPU job started without MPI on a build
// without Gloo: out-of-band coordination (flags, digests, statistics), not
// training data. Deadlines, the ledger, the diagnosis and faults are the
// device communicator's; split returns a staged child.

#include "runtime/communicator.h"

namespace bulkhead {

CommunicatorPtr stagedOnHost(CommunicatorPtr device);

}  // namespace bulkhead
