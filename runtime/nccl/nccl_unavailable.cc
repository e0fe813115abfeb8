// The NCCL backend's entry points in a build without CUDA or NCCL.
#include "runtime/errors.h"
#include "runtime/nccl/nccl_backend.h"

namespace bulkhead::nccl {

bool available() { return false; }
int deviceCount() { return 0; }
std::string deviceName(int) { return ""; }
bool peerAccess(int, int) { return false; }

namespace {

[[noreturn]] void refuse() {
  throw ConfigError(
      "this build of Bulkhead has no NCCL backend (CMake found no CUDA Toolkit or NCCL); use the mpi "
      "backend (BULKHEAD_BACKEND=mpi) or rebuild where CUDA and NCCL are installed");
}

}  // namespace

CommunicatorPtr initWorld(Communicator&, WorldOptions) { refuse(); }
CommunicatorPtr initWorld(Store&, int, int, WorldOptions) { refuse(); }

}  // namespace bulkhead::nccl
