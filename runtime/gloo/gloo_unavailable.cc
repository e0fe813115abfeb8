// Builds without Gloo: the backend refuses to start and says what to install.

#include "runtime/errors.h"
#include "runtime/gloo/gloo_backend.h"

namespace bulkhead::gloo {

bool available() { return false; }

CommunicatorPtr initWorld(std::shared_ptr<Store>, int rank, int, WorldOptions) {
  throw ConfigError(
      "this build of Bulkhead has no Gloo, so the gloo backend (CPU jobs started without MPI) is "
      "unavailable; install libgloo-dev and rebuild, or start the job with mpirun",
      {.rank = rank, .expected = "a build with Gloo"});
}

}  // namespace bulkhead::gloo
