// Multi-rank tests: run under mpirun with any number of ranks. Every rank runs
// every test case in the same order; a rank whose check fails reports it, and a
// collective it then misses times out (BULKHEAD_COLLECTIVE_TIMEOUT) instead of
// hanging the job.
#define CATCH_CONFIG_RUNNER
#include "tests/catch_compat.h"
#include "tests/mpi/helpers.h"

#include "launch/init.h"

namespace bulkhead::testing {
namespace {
std::unique_ptr<Runtime> runtime;
}

Communicator& world() { return runtime->world(); }
CommunicatorPtr worldPtr() { return runtime->worldPtr(); }

at::Generator sharedGenerator(int salt) { return at::detail::createCPUGenerator(0x5eed0000ULL + salt); }

at::Tensor draw(int rank, int salt, at::IntArrayRef shape, at::ScalarType dtype, bool forProduct) {
  auto generator = at::detail::createCPUGenerator(1000003ULL * (rank + 1) + 7919ULL * salt);
  bool floating = at::isFloatingType(dtype);
  at::Tensor values;
  if (forProduct) {
    at::Tensor choices = floating ? at::tensor({-2.0, -1.0, -0.5, 0.5, 1.0, 2.0}, at::kDouble)
                                  : at::tensor({-2.0, -1.0, 1.0, 2.0}, at::kDouble);
    values = choices.index_select(0, at::randint(choices.numel(), shape, generator, at::kLong).flatten()).view(shape);
  } else if (floating) {
    values = at::randint(-8, 8, shape, generator, at::kDouble) / 4;
  } else if (dtype == at::kByte) {
    values = at::randint(0, 16, shape, generator, at::kDouble);
  } else {
    values = at::randint(-8, 8, shape, generator, at::kDouble);
  }
  return values.to(dtype);
}

std::vector<at::ScalarType> supportedDtypes() {
  return {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong, at::kChar, at::kByte};
}

}  // namespace bulkhead::testing

int main(int argc, char** argv) {
  return bulkhead::guardedMain([&] {
    bulkhead::testing::runtime = bulkhead::init();
    int failed = Catch::Session().run(argc, argv);
    // Every rank's verdict: the job fails if any rank failed.
    at::Tensor verdict = at::tensor({failed}, at::kInt);
    bulkhead::testing::world().allReduce(verdict, {.op = bulkhead::ReduceOp::Max})->wait();
    bulkhead::testing::runtime->shutdown();
    return verdict.item<int>() == 0 ? 0 : 1;
  });
}
