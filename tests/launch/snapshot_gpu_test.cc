// Peer snapshots of GPU state (launch/snapshot.h), one rank per GPU: the
// device copy, the download behind the work queued after take(), and the swap
// with the buddies GPU to GPU. After each take() the test overwrites the live
// tensors at once on the stream, as the next step's optimizer would, while a
// 64 MB tensor is still on its way to the host: every landed copy must hold
// the values of its own step, and so must the ward's copy.
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "launch/snapshot.h"
#include "tests/launch/snapshot_support.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;
using launch::NamedTensors;
using launch::Snapshots;

namespace {

// A rank's state after `step`: GPU tensors of several dtypes (one of 64 MB) and host ones.
NamedTensors stateOf(int rank, int step) {
  return {{"experts.w", draw(rank, step, {4096, 4096}, at::kFloat).to(gpu())},
          {"step", draw(rank, step + 100, {2, 2}, at::kLong)},
          {"norm.weight", draw(rank, step + 200, {1000, 33}, at::kBFloat16).to(gpu())},
          {"scale", draw(rank, step + 300, {17}, at::kDouble)},
          {"moment", draw(rank, step + 400, {3 + rank, 5}, at::kDouble).to(gpu())}};
}

std::vector<int64_t> sorted(std::vector<int64_t> steps) {
  std::sort(steps.begin(), steps.end());
  return steps;
}

void takeWhileOverwriting(bool stageOnDevice) {
  const int rank = gpuWorld().rank(), size = gpuWorld().size();
  Snapshots snapshots({.stageOnDevice = stageOnDevice});
  NamedTensors live = stateOf(rank, 1);
  for (int step = 1; step <= 4; ++step) {
    const NamedTensors values = stateOf(rank, step);
    for (size_t i = 0; i < live.size(); ++i) live[i].second.copy_(values[i].second);
    snapshots.take(cpuWorld(), size, step, live, Deadline::afterSeconds(60), &gpuWorld());
    for (auto& [name, tensor] : live) {  // the next step's update, queued behind the snapshot at once
      tensor.mul_(3).add_(1);
      tensor.mul_(-2);
    }
  }
  snapshots.settle(Deadline::afterSeconds(30));
  const launch::SnapshotCost cost = snapshots.cost();  // the device copy's spans are timed on the stream
  CHECK(cost.taken == 4);
  CHECK(cost.timed == (stageOnDevice ? 4 : 0));
  CHECK((cost.streamSeconds > 0) == stageOnDevice);
  CHECK(sorted(snapshots.ownSteps()) == std::vector<int64_t>{3, 4});
  if (size > 1) CHECK(sorted(snapshots.wardSteps()) == std::vector<int64_t>{3, 4});
  const int ward = launch::wardOf(rank, size, size);
  for (int step : {3, 4}) {
    NamedTensors restored = zerosLike(live);
    Snapshots::unpack(snapshots.own(step), restored, rank);
    CHECK(equalStates(restored, stateOf(rank, step)));
    if (size == 1) continue;
    NamedTensors wards = zerosLike(stateOf(ward, step));
    Snapshots::unpack(snapshots.ward(step), wards, rank);
    CHECK(equalStates(wards, stateOf(ward, step)));
  }
}

}  // namespace

TEST_CASE("GPU snapshots: each landed copy holds its step although the state changes at once after take()") {
  SECTION("through a device copy, downloaded behind the work") { takeWhileOverwriting(true); }
  SECTION("copied to the host in place") { takeWhileOverwriting(false); }
}
