// GPU tests: the nccl backend, one rank per GPU under mpirun, checked against
// the mpi backend on the same seeded data. Exits 77 (CTest's "skipped") with a
// clear message where no GPU or no CUDA libtorch is present.
#include "tests/support/catch_compat.h"
#include "tests/support/catch_session.h"
#include "tests/support/gpu_helpers.h"

#include <cstdio>

#include "launch/init.h"
#include "runtime/nccl/nccl_backend.h"

namespace bulkhead::testing {
namespace {
std::unique_ptr<Runtime> runtime;
}
Communicator& gpuWorld() { return runtime->world(); }
Communicator& cpuWorld() { return runtime->cpuWorld(); }
const CommunicatorPtr& gpuWorldPtr() { return runtime->worldPtr(); }
const CommunicatorPtr& cpuWorldPtr() { return runtime->cpuWorldPtr(); }
c10::Device gpu() { return runtime->device(); }
std::shared_ptr<Store> gpuStore() { return runtime->store(); }
}  // namespace bulkhead::testing

int main(int argc, char** argv) {
  if (!bulkhead::nccl::available()) {
    std::printf("SKIPPED: the GPU tests need a GPU, NCCL and a libtorch with CUDA; none here\n");
    return 77;
  }
  return bulkhead::guardedMain([&] {
    bulkhead::testing::runtime = bulkhead::init({.backend = bulkhead::Backend::Nccl});
    int failed = bulkhead::testing::runCatch(argc, argv);
    at::Tensor verdict = at::tensor({failed}, at::kInt);
    bulkhead::testing::cpuWorld().allReduce(verdict, {.op = bulkhead::ReduceOp::Max})->wait();
    bulkhead::testing::runtime->shutdown();
    return verdict.item<int>() == 0 ? 0 : 1;
  });
}
