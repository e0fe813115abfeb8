// The TCP rendezvous store across processes: rank 0 hosts the server on
// 127.0.0.1 (a free port), the port and a random token reach the other ranks
// through the world communicator, and every rank runs the same mix of
// operations against it. Run under mpirun with any number of ranks (CTest: 8).
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <random>

#include "launch/init.h"
#include "runtime/errors.h"
#include "runtime/store/prefix_store.h"
#include "runtime/store/tcp_store.h"
#include "tests/support/catch_compat.h"
#include "tests/support/catch_session.h"

using namespace bulkhead;

namespace {

std::unique_ptr<Runtime> runtime;

constexpr size_t kTokenBytes = 32;
constexpr int kOperations = 1000;
constexpr int kCounters = 5;

auto seconds(double value) { return Deadline::afterSeconds(value); }

// The store every rank uses; rank 0 also hosts the server.
struct JobStore {
  std::unique_ptr<TcpStoreServer> server;
  std::shared_ptr<TcpStoreClient> client;
};

std::string randomToken() {
  std::random_device entropy;
  std::string token;
  while (token.size() < kTokenBytes) token += fmt::format("{:08x}", entropy());
  return token.substr(0, kTokenBytes);
}

// Rank 0 starts the server; its port and token travel as one uint8 tensor.
JobStore connectJobStore(Communicator& world) {
  JobStore store;
  at::Tensor payload = at::zeros({static_cast<int64_t>(2 + kTokenBytes)}, at::kByte);
  if (world.rank() == 0) {
    std::string token = randomToken();
    store.server = std::make_unique<TcpStoreServer>(TcpStoreOptions{.host = "127.0.0.1", .port = 0, .token = token});
    auto* bytes = payload.data_ptr<uint8_t>();
    bytes[0] = store.server->port() & 0xff;
    bytes[1] = store.server->port() >> 8;
    std::copy(token.begin(), token.end(), bytes + 2);
  }
  world.broadcast(payload, 0, {.deadline = seconds(60)})->wait();
  const auto* bytes = payload.data_ptr<uint8_t>();
  auto port = static_cast<uint16_t>(bytes[0] | (bytes[1] << 8));
  std::string token(bytes + 2, bytes + 2 + kTokenBytes);
  store.client = std::make_shared<TcpStoreClient>(
      TcpStoreOptions{.host = "127.0.0.1", .port = port, .token = token, .rank = world.rank()});
  store.client->connect(seconds(60));
  return store;
}

// What operation i of every rank does; the same on every rank, so each can
// compute every other rank's contributions alone.
enum class Kind { SetOwn, GetOther, AddShared, CompareSetShared };
Kind kindOf(int i) { return static_cast<Kind>(i % 4); }

std::string itemKey(int rank, int i) { return fmt::format("rank/{}/item/{}", rank, i); }

// Binary values ('\0' included) that any rank can regenerate for any other.
std::string itemValue(int rank, int i) {
  std::mt19937_64 rng(1000003ULL * (rank + 1) + i);
  std::string value(1 + rng() % 64, '\0');
  for (size_t b = 0; b < value.size(); ++b) value[b] = b % 5 == 2 ? '\0' : static_cast<char>(rng() & 0xff);
  return value;
}

int64_t addDelta(int rank, int i) {
  return 1 + static_cast<int64_t>(std::mt19937_64(7919ULL * (rank + 1) + i)() % 1000);
}

int64_t countOf(const std::string& casValue) {
  return casValue.empty() ? 0 : std::stoll(casValue.substr(0, casValue.find('/')));
}

}  // namespace

TEST_CASE("every rank runs 1,000 mixed operations on rank 0's store, and all ranks agree on the final values") {
  Communicator& world = runtime->world();
  int me = world.rank(), n = world.size();
  JobStore job = connectJobStore(world);
  Store& store = *job.client;

  int casIncrements = 0;
  for (int i = 0; i < kOperations; ++i) {
    INFO("operation " << i);
    switch (kindOf(i)) {
      case Kind::SetOwn:
        store.set(itemKey(me, i), itemValue(me, i), seconds(60));
        break;
      case Kind::GetOther: {
        // The item another rank set one operation earlier: waits for it.
        int other = (me + 1 + i) % n;
        CHECK(store.get(itemKey(other, i - 1), seconds(60)) == itemValue(other, i - 1));
        break;
      }
      case Kind::AddShared:
        store.add(fmt::format("counter/{}", i % kCounters), addDelta(me, i), seconds(60));
        break;
      case Kind::CompareSetShared:
        // Values "<count>/<rank>/<i>" are this rank's alone: getting ours back means we won.
        while (true) {
          std::string current = store.tryGet("cas", seconds(60)).value_or("");
          std::string desired = fmt::format("{}/{}/{}", countOf(current) + 1, me, i);
          if (store.compareSet("cas", current, desired, seconds(60)) == desired) break;
        }
        ++casIncrements;
        break;
    }
  }
  store.add("done", 1, seconds(60));
  world.barrier({.deadline = seconds(120)})->wait();

  CHECK(store.get("done", seconds(10)) == std::to_string(n));
  for (int c = 0; c < kCounters; ++c) {
    int64_t expected = 0;
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < kOperations; ++i)
        if (kindOf(i) == Kind::AddShared && i % kCounters == c) expected += addDelta(r, i);
    CHECK(store.get(fmt::format("counter/{}", c), seconds(10)) == std::to_string(expected));
  }
  CHECK(countOf(store.get("cas", seconds(10))) == static_cast<int64_t>(n) * casIncrements);

  // Every rank's items, in one round trip.
  std::vector<std::string> keys;
  std::vector<std::optional<std::string>> expected;
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < kOperations; ++i)
      if (kindOf(i) == Kind::SetOwn) {
        keys.push_back(itemKey(r, i));
        expected.push_back(itemValue(r, i));
      }
  CHECK((store.multiGet(keys, seconds(30)) == expected));

  // Pairs of ranks count their members under their own prefixes.
  PrefixStore pair(job.client, fmt::format("group/pair[{}]", me / 2));
  pair.add("members", 1, seconds(30));
  world.barrier({.deadline = seconds(120)})->wait();
  int pairSize = std::min(2, n - (me / 2) * 2);
  CHECK(pair.get("members", seconds(10)) == std::to_string(pairSize));

  // Rank 0 keeps the server up until every rank has finished reading.
  world.barrier({.deadline = seconds(120)})->wait();
  if (job.server) job.server->stop(seconds(5));
}

int main(int argc, char** argv) {
  return guardedMain([&] {
    runtime = init({.backend = Backend::Mpi});
    int failed = bulkhead::testing::runCatch(argc, argv);
    // Every rank's verdict: the job fails if any rank failed.
    at::Tensor verdict = at::tensor({failed}, at::kInt);
    runtime->world().allReduce(verdict, {.op = ReduceOp::Max})->wait();
    runtime->shutdown();
    return verdict.item<int>() == 0 ? 0 : 1;
  });
}
