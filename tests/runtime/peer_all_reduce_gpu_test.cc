// The all-reduce through peer memory (runtime/nccl/peer_all_reduce.h) on the
// GPUs of one node, ranks under mpirun (handles over the mpi world), rank r on
// GPU r % GPUs: where ranks outnumber GPUs they share one, which checks the
// protocol though not its speed. Inputs are small random integers, so every
// sum is exact in every dtype and compared bit for bit.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "runtime/cuda/cuda_graph.h"
#include "runtime/errors.h"
#include "runtime/nccl/peer_all_reduce.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;
using nccl::PeerAllReduce;

namespace {

int deviceCount() { return static_cast<int>(c10::cuda::device_count()); }
int myDevice() { return world().rank() % deviceCount(); }
bool ownGpu() { return world().size() <= deviceCount(); }
void* currentStream() { return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(myDevice())).stream(); }

std::unique_ptr<PeerAllReduce> make(nccl::PeerAllReduceOptions options = {}) {
  std::string why;
  auto reduce = PeerAllReduce::create(world(), myDevice(), options, Deadline::afterSeconds(60), &why);
  INFO(why);
  REQUIRE(reduce);
  return reduce;
}

// Rank p's random integers in [-8, 8] on this rank's GPU, for every p.
std::vector<at::Tensor> pools(int64_t numel, at::ScalarType dtype, int salt) {
  std::vector<at::Tensor> all;
  for (int p = 0; p < world().size(); ++p) {
    at::Generator generator = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * salt + p + 1));
    all.push_back(at::randint(-8, 9, {numel}, generator, at::kFloat).to(dtype).to(at::Device(at::kCUDA, myDevice())));
  }
  return all;
}

void barrierAll() { world().barrier({.deadline = Deadline::afterSeconds(120)})->wait(); }

// Ends every rank's use of the regions, so that their memory is freed.
void closeAll(PeerAllReduce& reduce) {
  const bool closed = reduce.close(
      [](Deadline deadline) {
        world().barrier({.deadline = deadline})->wait();
        return true;
      },
      Deadline::afterSeconds(60));
  CHECK(closed);
  CHECK(reduce.closed());
}

}  // namespace

TEST_CASE("shapes that change every call, as seed 002's: every sum exact, nothing hangs", "[peer]") {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(myDevice()));
  const char* named = std::getenv("PEER_CALLS");
  const int64_t calls = named ? std::atoll(named) : ownGpu() ? 100000 : 2000;
  constexpr int64_t kRows = 8192, kWide = 2048, kSlack = 4096;
  auto reduce = make({.capacityBytes = kRows * kWide * 2});
  const std::vector<at::Tensor> inputs = pools(kRows * kWide + kSlack, at::kBFloat16, 2);
  at::Tensor wrong = at::zeros({}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA, myDevice()));
  int64_t rows = kRows;
  const auto began = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    if (i > 0 && i % 60 == 0) rows = rows / 2 < 100 ? kRows : rows / 2;
    const int64_t numel = rows * (i % 2 == 0 ? 1024 : 2048), offset = (i * 7919) % kSlack;
    at::Tensor tensor = inputs[world().rank()].narrow(0, offset, numel).clone();
    at::Tensor want = inputs[0].narrow(0, offset, numel).clone();
    for (int p = 1; p < world().size(); ++p) want += inputs[p].narrow(0, offset, numel);
    reduce->enqueue(tensor, currentStream());
    wrong += tensor.ne(want).sum();
    if ((i + 1) % 1000 == 0 || i + 1 == calls) {
      const int64_t bad = wrong.item<int64_t>();  // waits for the calls so far
      REQUIRE_FALSE(reduce->gaveUp());
      INFO(fmt::format("after {} calls", i + 1));
      REQUIRE(bad == 0);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  if (world().rank() == 0)
    std::printf("peer all-reduce: %lld calls of changing shapes on %d ranks (%s) in %.1f s\n",
                static_cast<long long>(calls), world().size(), ownGpu() ? "a GPU each" : "sharing GPUs", seconds);
  closeAll(*reduce);
  barrierAll();
}

TEST_CASE("every dtype, odd and empty sizes, one-shot and two-shot", "[peer]") {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(myDevice()));
  auto reduce = make({.capacityBytes = 8 << 20, .oneShotBytes = 64 << 10});
  int salt = 10;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf})
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4095}, int64_t{4096}, int64_t{65537},
                          int64_t{(1 << 20) + 3}, int64_t{(2 << 20) - 8}}) {
      const std::vector<at::Tensor> inputs = pools(numel + 1, dtype, ++salt);
      // From element 1: a base address that is not 16-byte aligned, so single elements.
      for (int64_t start : {int64_t{0}, int64_t{1}}) {
        const int64_t length = start == 0 ? numel : std::max<int64_t>(numel - 1, 0);
        at::Tensor tensor = inputs[world().rank()].clone().narrow(0, start, length);
        at::Tensor want = inputs[0].narrow(0, start, length).clone();
        for (int p = 1; p < world().size(); ++p) want += inputs[p].narrow(0, start, length);
        reduce->enqueue(tensor, currentStream());
        INFO(fmt::format("{} x {} from element {}", dtypeName(dtype), length, start));
        CHECK(at::equal(tensor, want));
      }
    }
  // Ranks whose tensors differ in alignment (rank r's starts at element r % 2) keep one layout.
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const std::vector<at::Tensor> inputs = pools(40001, dtype, ++salt);
    const int64_t start = world().rank() % 2, length = 40000;
    at::Tensor tensor = inputs[world().rank()].clone().narrow(0, start, length);
    at::Tensor want = at::zeros({length}, tensor.options());
    for (int p = 0; p < world().size(); ++p) want += inputs[p].narrow(0, p % 2, length);
    reduce->enqueue(tensor, currentStream());
    INFO(fmt::format("{} x {}, unaligned on odd ranks", dtypeName(dtype), length));
    CHECK(at::equal(tensor, want));
  }
  // Calls alternating between two streams that the caller does not order: each runs after the last.
  at::cuda::CUDAStream side = at::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(myDevice()));
  const std::vector<at::Tensor> inputs = pools(1 << 16, at::kFloat, ++salt);
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 200; ++i)
    tensors.push_back(inputs[world().rank()].narrow(0, 0, 1 + (i * 977) % (1 << 16)).clone());
  at::cuda::getCurrentCUDAStream().synchronize();
  for (int i = 0; i < 200; ++i) reduce->enqueue(tensors[i], i % 2 == 0 ? currentStream() : side.stream());
  side.synchronize();
  at::cuda::getCurrentCUDAStream().synchronize();
  at::Tensor want = inputs[0].clone();
  for (int p = 1; p < world().size(); ++p) want += inputs[p];
  int wrong = 0;
  for (const at::Tensor& tensor : tensors) wrong += at::equal(tensor, want.narrow(0, 0, tensor.numel())) ? 0 : 1;
  CHECK(wrong == 0);
  at::Tensor tooLarge = at::ones({(8 << 20) / 4 + 1}, at::TensorOptions().device(at::kCUDA, myDevice()));
  CHECK_FALSE(reduce->fits(tooLarge));
  CHECK_THROWS_AS(reduce->enqueue(tooLarge, currentStream()), ConfigError);
  CHECK_FALSE(reduce->fits(at::ones({4}, at::kFloat)));  // host memory
  CHECK_FALSE(reduce->fits(at::ones({4}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA, myDevice()))));
  closeAll(*reduce);
  barrierAll();
}

TEST_CASE("calls captured in a CUDA graph replay with no host work and stay exact", "[peer]") {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(myDevice()));
  auto reduce = make();
  const c10::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(myDevice()));
  at::Tensor small = at::empty({3000}, at::TensorOptions().dtype(at::kBFloat16).device(device));
  at::Tensor medium = at::empty({600000}, at::TensorOptions().dtype(at::kFloat).device(device));
  CapturedGraph graph(device, [&] {
    reduce->enqueue(small, currentStream());
    reduce->enqueue(medium, currentStream());
    reduce->enqueue(small, currentStream());
  });
  for (int replay = 0; replay < 50; ++replay) {
    const std::vector<at::Tensor> a = pools(3000, at::kBFloat16, 100 + replay),
                                  b = pools(600000, at::kFloat, 200 + replay);
    at::Tensor wantSmall = a[0].clone(), wantMedium = b[0].clone();
    for (int p = 1; p < world().size(); ++p) wantSmall += a[p], wantMedium += b[p];
    wantSmall *= world().size();  // summed twice: the second call sums the first's sums
    small.copy_(a[world().rank()]);
    medium.copy_(b[world().rank()]);
    graph.replay(Deadline::afterSeconds(60));
    INFO(fmt::format("replay {}", replay));
    REQUIRE(at::equal(small, wantSmall));
    REQUIRE(at::equal(medium, wantMedium));
  }
  closeAll(*reduce);
  barrierAll();
}

TEST_CASE("a rank that skips a call: every other rank's kernel gives up and names it", "[peer][fault]") {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(myDevice()));
  constexpr double kGiveUp = 3;
  auto reduce = make({.giveUpSeconds = kGiveUp});
  const int skipper = world().size() - 1;
  const std::vector<at::Tensor> inputs = pools(5000, at::kFloat, 300);
  for (int i = 0; i < 5; ++i) {
    at::Tensor tensor = inputs[world().rank()].clone();
    reduce->enqueue(tensor, currentStream());
  }
  at::cuda::getCurrentCUDAStream().synchronize();
  barrierAll();
  if (world().rank() != skipper) {
    at::Tensor tensor = inputs[world().rank()].clone();
    const auto began = std::chrono::steady_clock::now();
    reduce->enqueue(tensor, currentStream());
    at::cuda::getCurrentCUDAStream().synchronize();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    const std::optional<nccl::PeerGaveUp> verdict = reduce->gaveUp();
    REQUIRE(verdict);
    CHECK(verdict->call == 6);
    CHECK(verdict->peer == skipper);
    CHECK(waited >= kGiveUp - 0.5);
    CHECK(waited < kGiveUp + 2);
    CHECK_THROWS_AS(reduce->enqueue(tensor, currentStream()), CommError);
  }
  barrierAll();
}

TEST_CASE("abort makes a kernel that waits for its peers give up at once", "[peer][fault]") {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(myDevice()));
  auto reduce = make({.giveUpSeconds = 120});
  if (world().rank() == 0) {
    at::Tensor tensor = at::ones({100}, at::TensorOptions().device(at::kCUDA, myDevice()));
    reduce->enqueue(tensor, currentStream());
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const auto began = std::chrono::steady_clock::now();
    reduce->abort();
    at::cuda::getCurrentCUDAStream().synchronize();
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() < 2);
    CHECK_FALSE(reduce->gaveUp());  // an abort names nobody: its caller knows why
    CHECK_THROWS_AS(reduce->enqueue(tensor, currentStream()), CommError);
  }
  barrierAll();
}
