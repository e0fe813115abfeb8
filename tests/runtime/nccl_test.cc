#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pthread.h>

#include <atomic>
#include <string>
#include <thread>

#include <cuda_runtime_api.h>

#include "runtime/errors.h"
#include "runtime/nccl/nccl_backend.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

#if BULKHEAD_TORCH_CUDA  // libtorch's CUDA headers, for the case that sets the current stream
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{0}, {1}, {7}, {3, 5}, {1000}, {65537}};

std::vector<ReduceOp> opsFor(at::ScalarType dtype) {
  std::vector<ReduceOp> ops = {ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max};
  if (dtype != at::kChar && dtype != at::kByte) ops.push_back(ReduceOp::Prod);
  if (at::isFloatingType(dtype)) ops.push_back(ReduceOp::Avg);
  return ops;
}

// Runs the same all-to-all on both backends and compares.
bool allToAllMatches(const std::vector<std::vector<int64_t>>& rows, std::vector<int64_t> rowShape, at::ScalarType dtype,
                     int salt) {
  int n = gpuWorld().size(), me = gpuWorld().rank();
  std::vector<int64_t> sendSplits = rows[me], recvSplits;
  int64_t sendRows = 0, recvRows = 0;
  for (int s = 0; s < n; ++s) {
    recvSplits.push_back(rows[s][me]);
    recvRows += rows[s][me];
    sendRows += rows[me][s];
  }
  std::vector<int64_t> sendShape = {sendRows}, recvShape = {recvRows};
  sendShape.insert(sendShape.end(), rowShape.begin(), rowShape.end());
  recvShape.insert(recvShape.end(), rowShape.begin(), rowShape.end());
  at::Tensor send = draw(me, salt, sendShape, dtype);
  at::Tensor cpuRecv = at::empty(recvShape, at::TensorOptions().dtype(dtype));
  at::Tensor gpuRecv = at::full(recvShape, 77, at::TensorOptions().dtype(dtype).device(gpu()));
  cpuWorld().allToAll(send, cpuRecv, sendSplits, recvSplits)->wait();
  gpuWorld().allToAll(send.to(gpu()), gpuRecv, sendSplits, recvSplits)->wait();
  return at::equal(gpuRecv.cpu(), cpuRecv);
}

std::vector<std::vector<int64_t>> randomSplits(at::Generator& generator, int64_t high) {
  int n = gpuWorld().size();
  at::Tensor draws = at::randint(0, high, {n, n}, generator, at::kLong);
  std::vector<std::vector<int64_t>> rows(n, std::vector<int64_t>(n));
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < n; ++d) rows[s][d] = draws[s][d].item<int64_t>();
  return rows;
}

// Sets up a late peer: rank 1 issues its next operation 200 ms after rank 0, so rank 0's stays pending
// that long. False (with a warning) with one rank, where no operation waits for a peer.
bool rankOneJoinsLate() {
  if (gpuWorld().size() < 2) {
    WARN("one rank: no operation waits for a peer, so this case checks nothing here");
    return false;
  }
  // Connected first, so the operation under test does not wait for its peer inside the NCCL call instead.
  gpuWorld().allReduce(at::ones({1024}, at::TensorOptions().dtype(at::kFloat).device(gpu())))->wait();
  cpuWorld().barrier()->wait();
  if (gpuWorld().rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  return true;
}

}  // namespace

TEST_CASE("nccl all-reduce matches mpi for every dtype, op and shape") {
  int salt = 0, me = gpuWorld().rank();
  for (at::ScalarType dtype : supportedDtypes())
    for (ReduceOp op : opsFor(dtype))
      for (const auto& shape : kShapes) {
        ++salt;
        INFO(fmt::format("{} {} [{}]", dtypeName(dtype), toString(op), fmt::join(shape, ",")));
        at::Tensor cpu = draw(me, salt, shape, dtype, op == ReduceOp::Prod);
        at::Tensor onGpu = cpu.to(gpu());
        cpuWorld().allReduce(cpu, {.op = op})->wait();
        gpuWorld().allReduce(onGpu, {.op = op})->wait();
        CHECK(at::equal(onGpu.cpu(), cpu));
      }
}

TEST_CASE("nccl all-gather, reduce-scatter and broadcast match mpi") {
  int n = gpuWorld().size(), me = gpuWorld().rank(), salt = 1000;
  for (at::ScalarType dtype : supportedDtypes()) {
    for (int64_t count : {0, 1, 13, 4099}) {
      ++salt;
      at::Tensor in = draw(me, salt, {count}, dtype);
      at::Tensor cpuOut = at::empty({n * count}, at::TensorOptions().dtype(dtype));
      at::Tensor gpuOut = at::empty({n * count}, at::TensorOptions().dtype(dtype).device(gpu()));
      cpuWorld().allGather(in, cpuOut)->wait();
      gpuWorld().allGather(in.to(gpu()), gpuOut)->wait();
      CHECK(at::equal(gpuOut.cpu(), cpuOut));

      at::Tensor big = draw(me, salt + 500, {n * count}, dtype);
      at::Tensor cpuPart = at::empty({count}, at::TensorOptions().dtype(dtype));
      at::Tensor gpuPart = at::empty({count}, at::TensorOptions().dtype(dtype).device(gpu()));
      cpuWorld().reduceScatter(big, cpuPart)->wait();
      gpuWorld().reduceScatter(big.to(gpu()), gpuPart)->wait();
      CHECK(at::equal(gpuPart.cpu(), cpuPart));

      int root = salt % n;
      at::Tensor shared = draw(me, salt + 700, {count, 3}, dtype);
      at::Tensor onGpu = shared.to(gpu());
      cpuWorld().broadcast(shared, root)->wait();
      gpuWorld().broadcast(onGpu, root)->wait();
      CHECK(at::equal(onGpu.cpu(), shared));
    }
  }
}

TEST_CASE("nccl all-to-all matches mpi with uneven, zero and very unequal splits") {
  auto generator = sharedGenerator(31);
  int n = gpuWorld().size(), salt = 2000;
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat, at::kLong, at::kByte})
    for (std::vector<int64_t> rowShape : {std::vector<int64_t>{}, {7}, {2, 3}})
      CHECK(allToAllMatches(randomSplits(generator, 6), rowShape, dtype, ++salt));
  std::vector<std::vector<int64_t>> none(n, std::vector<int64_t>(n, 0));
  CHECK(allToAllMatches(none, {5}, at::kFloat, ++salt));
  std::vector<std::vector<int64_t>> skewed(n, std::vector<int64_t>(n, 1));
  skewed[0][n - 1] = 100000;
  if (n > 1) skewed[n - 1][0] = 0;
  CHECK(allToAllMatches(skewed, {16}, at::kBFloat16, ++salt));
}

TEST_CASE("nccl send/recv and barrier work between every pair") {
  int n = gpuWorld().size(), me = gpuWorld().rank();
  // NCCL pairs a send to self only with its receive in one group: refused
  // before anything is queued, and the group goes on working.
  at::Tensor self = at::ones({8}, at::TensorOptions().dtype(at::kFloat).device(gpu()));
  CHECK_THROWS_AS(gpuWorld().send(self, me), ConfigError);
  CHECK_THROWS_AS(gpuWorld().recv(self, me), ConfigError);
  for (int shift = 1; shift < n; ++shift) {
    int to = (me + shift) % n, from = (me - shift % n + n) % n;
    at::Tensor out = draw(me, 3000 + shift, {4097}, at::kBFloat16).to(gpu());
    at::Tensor in = at::empty({4097}, at::TensorOptions().dtype(at::kBFloat16).device(gpu()));
    auto sent = gpuWorld().send(out, to);
    auto received = gpuWorld().recv(in, from);
    sent->wait();
    received->wait();
    CHECK(at::equal(in.cpu(), draw(from, 3000 + shift, {4097}, at::kBFloat16)));
  }
  gpuWorld().barrier()->wait();
}

TEST_CASE("10,000 nccl calls with shapes changing on every call all match mpi", "[stress]") {
  int n = gpuWorld().size(), me = gpuWorld().rank();
  auto generator = sharedGenerator(77);
  at::Tensor sizes = at::randint(1, 70000, {5000}, generator, at::kLong);
  int failures = 0;
  for (int i = 0; i < 5000 && failures < 5; ++i) {
    int64_t numel = i % 500 == 0 ? (1 << 22) + i % 5 : sizes[i].item<int64_t>();
    at::Tensor cpu = draw(me, 10000 + i, {numel}, at::kFloat);
    at::Tensor onGpu = cpu.to(gpu());
    cpuWorld().allReduce(cpu)->wait();
    gpuWorld().allReduce(onGpu)->wait();
    bool reduced = at::equal(onGpu.cpu(), cpu);
    auto splits = randomSplits(generator, i % 7 == 0 ? 1 : 64);  // every 7th: all zero
    if (i % 50 == 1) splits[0][n - 1] = 20000;
    bool exchanged = allToAllMatches(splits, {1 + i % 9}, i % 2 ? at::kBFloat16 : at::kFloat, 20000 + i);
    if (!reduced || !exchanged) {
      ++failures;
      FAIL_CHECK(fmt::format("call {}: all-reduce of {} {}, all-to-all {}", i, numel, reduced ? "ok" : "WRONG",
                             exchanged ? "ok" : "WRONG"));
    }
  }
  CHECK(failures == 0);
  CHECK(gpuWorld().ledger().heads().lastCompleted >= 10000);
}

TEST_CASE("nccl split builds working groups named by color") {
  int me = gpuWorld().rank();
  auto gpuHalf = gpuWorld().split(me % 2, me, "parity");
  auto cpuHalf = cpuWorld().split(me % 2, me, "parity");
  REQUIRE(gpuHalf != nullptr);
  CHECK(gpuHalf->members() == cpuHalf->members());
  CHECK(gpuHalf->name() == fmt::format("parity[{}]", me % 2));
  at::Tensor cpu = draw(me, 4000, {333}, at::kFloat);
  at::Tensor onGpu = cpu.to(gpu());
  cpuHalf->allReduce(cpu)->wait();
  gpuHalf->allReduce(onGpu)->wait();
  CHECK(at::equal(onGpu.cpu(), cpu));
  auto none = gpuWorld().split(-1, me, "nobody");
  CHECK(none == nullptr);
}

TEST_CASE("the watchdog completes work that nobody waits on") {
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 64; ++i) {
    tensors.push_back(draw(gpuWorld().rank(), 5000 + i, {1024}, at::kFloat).to(gpu()));
    gpuWorld().allReduce(tensors.back());  // the Work is dropped at once
  }
  tensors.back().cpu();  // the stream has run everything
  LedgerHeads heads = gpuWorld().ledger().heads();
  auto deadline = Deadline::after(std::chrono::seconds(1));
  while (heads.lastCompleted < heads.lastIssued && !deadline.expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    heads = gpuWorld().ledger().heads();
  }
  CHECK(heads.lastCompleted == heads.lastIssued);
}

TEST_CASE("the watchdog settles an operation within a few polls of its completion, also after idling") {
  // Settling records the completion in the ledger (what a hang's diagnosis reads) and lets go of memory that
  // the caching allocator does not own: neither may wait out the watchdog's idle sleep (100 ms).
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));  // nothing pending: the watchdog sleeps long
    at::Tensor tensor = draw(gpuWorld().rank(), 6000 + i, {1 << 20}, at::kFloat).to(gpu());
    gpuWorld().allReduce(tensor);  // the Work is dropped at once: only the watchdog settles the operation
    const uint64_t issued = gpuWorld().ledger().heads().lastIssued;
    tensor.cpu();  // the stream has run it
    const auto completed = std::chrono::steady_clock::now();
    auto deadline = Deadline::after(std::chrono::seconds(1));
    while (gpuWorld().ledger().heads().lastCompleted < issued && !deadline.expired())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - completed).count();
    INFO("operation " << i << ": settled " << ms << " ms after completion");
    CHECK(gpuWorld().ledger().heads().lastCompleted >= issued);
    CHECK(ms < 30);
  }
}

#if BULKHEAD_TORCH_CUDA
TEST_CASE("an operation on the current stream hands the caller's buffers back at once, none reused before it ends") {
  // Rank 1 joins late, so rank 0's all-reduce is still running on another PyTorch stream when rank 0 drops
  // the tensor and allocates one of the same size on the stream that allocated it: that one must get another
  // block, or the all-reduce would write its sum into it.
  const int me = gpuWorld().rank();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, gpu().index());
  for (int round = 0; round < 3; ++round) {
    at::Tensor tensor = draw(me, 6100 + round, {1 << 20}, at::kFloat).to(gpu());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    const void* block = tensor.data_ptr();
    if (!rankOneJoinsLate()) return;
    WorkPtr work;
    {
      c10::cuda::CUDAStreamGuard current(side);
      work = gpuWorld().allReduce(tensor);
    }
    CHECK(tensor.use_count() == 1);  // the operation does not hold it
    tensor.reset();
    at::Tensor marker = at::full({1 << 20}, 3.25 + round, at::TensorOptions().dtype(at::kFloat).device(gpu()));
    const bool pending = !work->isCompleted();
    if (me == 0) CHECK(pending);  // rank 1 is still asleep
    if (pending) CHECK(marker.data_ptr() != block);
    work->wait();
    CHECK(at::equal(marker.cpu(), at::full({1 << 20}, 3.25 + round, at::kFloat)));
  }
}
#endif  // BULKHEAD_TORCH_CUDA

TEST_CASE("an operation on a stream the caller names holds its buffers until it settles") {
  // The caller may destroy that stream once the operation has completed, before it frees the buffers.
  const int me = gpuWorld().rank();
  cudaStream_t named = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&named, cudaStreamNonBlocking) == cudaSuccess);
  at::Tensor tensor = draw(me, 6150, {1 << 16}, at::kFloat).to(gpu());
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  if (!rankOneJoinsLate()) {
    cudaStreamDestroy(named);
    return;
  }
  WorkPtr work = gpuWorld().allReduce(tensor, {.stream = named});
  if (me == 0) {
    CHECK(!work->isCompleted());  // rank 1 is still asleep
    CHECK(tensor.use_count() == 2);
  }
  work->wait();
  auto deadline = Deadline::after(std::chrono::seconds(1));
  while (tensor.use_count() > 1 && !deadline.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(tensor.use_count() == 1);
  REQUIRE(cudaStreamDestroy(named) == cudaSuccess);
  tensor.reset();  // after the stream is gone
}

TEST_CASE("an operation holds memory that the caching allocator does not own until it settles") {
  const int me = gpuWorld().rank();
  const int64_t count = 1 << 18;
  void* memory = nullptr;
  REQUIRE(cudaMalloc(&memory, count * sizeof(float)) == cudaSuccess);
  auto freed = std::make_shared<std::atomic<bool>>(false);
  at::Tensor tensor = at::from_blob(
      memory, {count},
      [freed](void* pointer) {
        cudaFree(pointer);
        *freed = true;
      },
      at::TensorOptions().dtype(at::kFloat).device(gpu()));
  tensor.copy_(draw(me, 6200, {count}, at::kFloat));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  if (!rankOneJoinsLate()) return;
  WorkPtr work = gpuWorld().allReduce(tensor.view({count / 4, 4}));
  tensor.reset();
  if (me == 0) {
    CHECK(!work->isCompleted());  // rank 1 is still asleep
    CHECK(!*freed);
  }
  work->wait();
  // Settling (by this wait or by the watchdog) lets go of the memory.
  auto deadline = Deadline::after(std::chrono::seconds(1));
  while (!*freed && !deadline.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(*freed);
}

TEST_CASE("the watchdog runs no buffer's deleter: a thread of its own lets go of what it settles") {
  // A deleter may be a cudaFree, which waits for the whole device: on the
  // watchdog it would stall behind a hung operation whose deadline it enforces.
  const int me = gpuWorld().rank();
  const int64_t count = 1 << 16;
  void* memory = nullptr;
  REQUIRE(cudaMalloc(&memory, count * sizeof(float)) == cudaSuccess);
  auto freedOn = std::make_shared<std::string>();
  auto freed = std::make_shared<std::atomic<bool>>(false);
  at::Tensor tensor = at::from_blob(
      memory, {count},
      [freedOn, freed](void* pointer) {
        cudaFree(pointer);
        char name[16] = {};
        pthread_getname_np(pthread_self(), name, sizeof(name));
        *freedOn = name;
        *freed = true;
      },
      at::TensorOptions().dtype(at::kFloat).device(gpu()));
  tensor.copy_(draw(me, 6300, {count}, at::kFloat));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  // Products queued ahead on the current stream (tens of milliseconds) keep the all-reduce, which is
  // ordered after them, pending until this thread has let go of the tensor: on one rank too, the last
  // reference is then the watchdog's.
  at::Tensor busy = draw(me, 6301, {2048, 2048}, at::kFloat).to(gpu());
  for (int i = 0; i < 40; ++i) busy = at::matmul(busy, busy) / 64;
  WorkPtr work = gpuWorld().allReduce(tensor);
  tensor.reset();
  // Neither wait() nor isCompleted(): the watchdog settles it.
  auto deadline = Deadline::after(std::chrono::seconds(5));
  while (!*freed && !deadline.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(*freed);
  CHECK(gpuWorld().ledger().heads().lastCompleted >= work->sequence());
  CHECK(*freedOn == "bulkhead-free");
}

TEST_CASE("nccl rejects CPU tensors and tensors on another GPU before communicating") {
  uint64_t before = gpuWorld().ledger().heads().lastIssued;
  CHECK_THROWS_AS(gpuWorld().allReduce(at::ones({4})), ConfigError);
  int count = nccl::deviceCount();
  if (count > 1) {
    c10::Device other(c10::kCUDA, static_cast<c10::DeviceIndex>((gpu().index() + 1) % count));
    CHECK_THROWS_AS(gpuWorld().allReduce(at::ones({4}, at::TensorOptions().device(other))), ConfigError);
  }
  CHECK(gpuWorld().ledger().heads().lastIssued == before);
}

TEST_CASE("an operation runs on a stream of the caller's choice") {
  int me = gpuWorld().rank();
  at::Tensor cpu = draw(me, 6000, {4096}, at::kFloat);
  at::Tensor onGpu = cpu.to(gpu());
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // the copy ran on another stream
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  cpuWorld().allReduce(cpu)->wait();
  auto work = gpuWorld().allReduce(onGpu, {.stream = stream});
  work->wait();
  CHECK(work->isCompleted());
  CHECK(work->exception() == nullptr);
  CHECK(at::equal(onGpu.cpu(), cpu));
  cudaStreamDestroy(stream);
}

TEST_CASE("a grouped send and receive around the ring, both ways at once, delivers every message in order") {
  const int n = gpuWorld().size(), me = gpuWorld().rank();
  if (n < 2) {
    WARN("one rank: a grouped exchange needs a peer, so this case checks nothing here");
    return;
  }
  const int next = (me + 1) % n, previous = (me + n - 1) % n;
  // Two messages each way per call: matched in issue order between each pair.
  auto message = [](int from, int k) { return draw(from, 3000 + k, {257 + 64 * k}, at::kFloat); };
  std::vector<at::Tensor> fromPrevious, fromNext;
  std::vector<PeerOp> ops;
  for (int k = 0; k < 2; ++k) {
    ops.push_back({PeerOp::Kind::Send, message(me, k).to(gpu()), next, fmt::format("to next {}", k)});
    ops.push_back({PeerOp::Kind::Send, message(me, 2 + k).to(gpu()), previous, fmt::format("to previous {}", k)});
  }
  for (int k = 0; k < 2; ++k) {
    fromPrevious.push_back(at::full({257 + 64 * k}, 77.0, at::TensorOptions(at::kFloat).device(gpu())));
    fromNext.push_back(at::full({257 + 64 * (2 + k)}, 77.0, at::TensorOptions(at::kFloat).device(gpu())));
    ops.push_back({PeerOp::Kind::Recv, fromPrevious.back(), previous, fmt::format("from previous {}", k)});
    ops.push_back({PeerOp::Kind::Recv, fromNext.back(), next, fmt::format("from next {}", k)});
  }
  const uint64_t before = gpuWorld().ledger().heads().lastIssuedP2P;
  WorkPtr work = gpuWorld().sendRecv(ops, {.deadline = Deadline::afterSeconds(60)});
  work->wait();
  for (int k = 0; k < 2; ++k) {
    CHECK(at::equal(fromPrevious[k].cpu(), message(previous, k)));
    CHECK(at::equal(fromNext[k].cpu(), message(next, 2 + k)));
  }
  // One ledger entry per member, each with its peer and label, all completed.
  const LedgerHeads heads = gpuWorld().ledger().heads();
  CHECK(heads.lastIssuedP2P == before + 8);
  CHECK(heads.lastCompletedP2P == before + 8);
  int labelled = 0;
  for (const LedgerEntry& entry : gpuWorld().ledger().entries()) {
    if (entry.seq <= before || !isPointToPoint(entry.fingerprint.op)) continue;
    CHECK(entry.state == OpState::Completed);
    const bool toNext = entry.fingerprint.label.find("next") != std::string::npos;
    CHECK(entry.fingerprint.root == (toNext ? next : previous));
    ++labelled;
  }
  CHECK(labelled == 8);
}
