// Multi-rank tests: run under mpirun with any number of ranks. Every rank runs
// every test case in the same order; a rank whose check fails reports it, and a
// collective it then misses times out (BULKHEAD_COLLECTIVE_TIMEOUT) instead of
// hanging the job.
#include "tests/support/catch_compat.h"
#include "tests/support/catch_session.h"
#include "tests/support/mpi_helpers.h"

#include <cstdlib>

#include "launch/init.h"

namespace bulkhead::testing {
namespace {
std::unique_ptr<Runtime> runtime;
}

Communicator& world() { return runtime->world(); }
CommunicatorPtr worldPtr() { return runtime->worldPtr(); }
std::shared_ptr<Store> store() { return runtime->store(); }

}  // namespace bulkhead::testing

int main(int argc, char** argv) {
  return bulkhead::guardedMain([&] {
    // mpi unless BULKHEAD_BACKEND names another CPU backend (gloo).
    const char* named = std::getenv("BULKHEAD_BACKEND");
    bulkhead::testing::runtime =
        bulkhead::init({.backend = named && *named ? bulkhead::parseBackend(named) : bulkhead::Backend::Mpi});
    int failed = bulkhead::testing::runCatch(argc, argv);
    // Every rank's verdict: the job fails if any rank failed.
    at::Tensor verdict = at::tensor({failed}, at::kInt);
    bulkhead::testing::world().allReduce(verdict, {.op = bulkhead::ReduceOp::Max})->wait();
    bulkhead::testing::runtime->shutdown();
    return verdict.item<int>() == 0 ? 0 : 1;
  });
}
