// Peer snapshots (launch/snapshot.h): the buddy ring, packing and unpacking of
// random tensors of several dtypes, the two kept steps, and the swap with the
// buddies over real Gloo communicators (three ranks as threads of this process,
// around an in-process TCP store).

#include <ATen/ATen.h>

#include <memory>
#include <thread>
#include <vector>

#include "launch/snapshot.h"
#include "runtime/errors.h"
#include "runtime/gloo/gloo_backend.h"
#include "runtime/store/tcp_store.h"
#include "tests/launch/snapshot_support.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

using namespace bulkhead;
using launch::NamedTensors;
using launch::Snapshots;
using testing::equalStates;
using testing::zerosLike;

namespace {

// A rank's state at `step`: random tensors of several dtypes and shapes (rank-dependent sizes).
NamedTensors stateOf(int rank, int step) {
  return {{"w", testing::draw(rank, step, {3 + rank, 5}, at::kDouble)},
          {"b", testing::draw(rank, step + 100, {7}, at::kFloat)},
          {"count", testing::draw(rank, step + 200, {2, 2}, at::kLong)},
          {"half", testing::draw(rank, step + 300, {9}, at::kBFloat16)}};
}

}  // namespace

TEST_CASE("the buddy ring: every rank holds one other rank's copy, on another node where nodes are equal") {
  for (int size : {2, 3, 8, 16})
    for (int local : {-1, 1, 2, 4, 8, 16}) {
      std::vector<int> held(size, 0);
      for (int r = 0; r < size; ++r) {
        const int holder = launch::holderOf(r, size, local);
        CHECK(holder != r);
        CHECK(launch::wardOf(holder, size, local) == r);
        ++held[holder];
        if (local > 1 && local < size && size % local == 0) CHECK(holder / local != r / local);
      }
      for (int count : held) CHECK(count == 1);
    }
}

TEST_CASE("a snapshot unpacks into the tensors it was taken of, and refuses others") {
  TcpStoreServer server(TcpStoreOptions{.host = "127.0.0.1", .port = 0, .token = "snapshot-test"});
  auto store = std::make_shared<TcpStoreClient>(
      TcpStoreOptions{.host = "127.0.0.1", .port = server.port(), .token = "snapshot-test", .rank = 0});
  auto world = gloo::initWorld(store, 0, 1, {.deadline = Deadline::afterSeconds(20), .host = "127.0.0.1"});
  Snapshots snapshots;
  for (int step : {3, 4, 5}) snapshots.take(*world, 1, step, stateOf(0, step), Deadline::afterSeconds(20));
  CHECK_FALSE(snapshots.own(3).defined());  // two steps are kept: 4 and 5
  const launch::SnapshotCost cost = snapshots.cost();
  CHECK(cost.taken == 3);
  CHECK(cost.hostSeconds > 0);
  CHECK(cost.setupSeconds > 0);
  CHECK(cost.setupSeconds < cost.hostSeconds);
  CHECK(cost.timed == 0);  // CPU state: nothing on a stream
  for (int step : {4, 5}) {
    REQUIRE(snapshots.own(step).defined());
    CHECK(Snapshots::stepOf(snapshots.own(step)) == step);
    NamedTensors restored = zerosLike(stateOf(0, step));
    Snapshots::unpack(snapshots.own(step), restored, 0);
    CHECK(equalStates(restored, stateOf(0, step)));
  }
  NamedTensors other = zerosLike(stateOf(1, 5));  // another shape: another rank's model
  CHECK_THROWS_AS(Snapshots::unpack(snapshots.own(5), other, 0), ConfigError);
  snapshots.forgetAfter(4);
  CHECK_FALSE(snapshots.own(5).defined());
  CHECK(snapshots.own(4).defined());
}

TEST_CASE("each rank receives its ward's snapshot over Gloo") {
  TcpStoreServer server(TcpStoreOptions{.host = "127.0.0.1", .port = 0, .token = "snapshot-ring"});
  constexpr int kRanks = 3;
  std::vector<std::unique_ptr<Snapshots>> snapshots(kRanks);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(kRanks);
  for (int rank = 0; rank < kRanks; ++rank)
    threads.emplace_back([&, rank] {
      try {
        auto store = std::make_shared<TcpStoreClient>(
            TcpStoreOptions{.host = "127.0.0.1", .port = server.port(), .token = "snapshot-ring", .rank = rank});
        auto world =
            gloo::initWorld(store, rank, kRanks, {.deadline = Deadline::afterSeconds(30), .host = "127.0.0.1"});
        snapshots[rank] = std::make_unique<Snapshots>();
        for (int step : {1, 2})
          snapshots[rank]->take(*world, kRanks, step, stateOf(rank, step), Deadline::afterSeconds(30));
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  for (auto& thread : threads) thread.join();
  for (auto& error : errors)
    if (error) std::rethrow_exception(error);
  for (int rank = 0; rank < kRanks; ++rank) {
    const int ward = launch::wardOf(rank, kRanks, kRanks);
    CHECK(snapshots[rank]->wardSteps() == std::vector<int64_t>{1, 2});
    for (int step : {1, 2}) {
      NamedTensors restored = zerosLike(stateOf(ward, step));
      Snapshots::unpack(snapshots[rank]->ward(step), restored, rank);
      CHECK(equalStates(restored, stateOf(ward, step)));
    }
  }
}
