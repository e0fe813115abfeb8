// Optimizer state as sharded tensors: exported state imports into a fresh
// optimizer of the same layout (bitwise, and the next step matches), and a
// state exported at dp 4 (ep 1) imports at tp 2 / ep 2 / dp 2, after which
// both layouts take the same step. The plain AdamW exports the same global
// state as the distributed optimizer. Pieces are copied the way a checkpoint
// load would copy them (tests/support/parallel_helpers.h).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <algorithm>

#include "optim/adamw.h"
#include "optim/distributed_optimizer.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"
#include "tests/support/parallel_helpers.h"

using namespace bulkhead;
using namespace bulkhead::parallel;
using namespace bulkhead::testing;
using bulkhead::optim::DistributedOptimizer;

namespace {

const optim::AdamWOptions kStateTestAdamW{.beta1 = 0.85, .beta2 = 0.97, .weightDecay = 0.02};

// w [6, 4] split over tp by rows, norm [4] replicated over tp, experts
// [6, 5, 2] split over ep (their state is cut inside experts, a rank's piece
// spanning two: several boxes per key); the global gradient of step s is
// seeded by s alone.
const std::vector<std::vector<int64_t>> kShapes{{6, 4}, {4}, {6, 5, 2}};
const char* kNames[] = {"w", "norm", "experts"};

std::vector<Parameter> makeParams(const ProcessGroups& groups, const std::vector<at::Tensor>& globals) {
  int tp = groups.tp()->rank(), tpSize = groups.tp()->size(), ep = groups.ep()->rank(), epSize = groups.ep()->size();
  int dp = groups.dpCp()->rank(), edp = groups.expertDp()->rank();
  std::vector<std::vector<int64_t>> offsets{{6 / tpSize * tp, 0}, {0}, {6 / epSize * ep, 0, 0}};
  std::vector<std::vector<int64_t>> shapes{{6 / tpSize, 4}, {4}, {6 / epSize, 5, 2}};
  std::vector<int> replicas{dp, dp * tpSize + tp, edp};
  std::vector<Parameter> params;
  for (int i = 0; i < 3; ++i)
    params.push_back({.name = kNames[i],
                      .tensor = sliceOf(globals[i], offsets[i], shapes[i]).clone().set_requires_grad(true),
                      .shard = {kShapes[i], offsets[i], replicas[i]},
                      .group = i == 2 ? ParamGroup::Expert : ParamGroup::Dense,
                      .tpReplicated = i == 1});
  return params;
}

// Every replica passes its piece of the same global gradient, so the averaged
// gradient is that global gradient in every layout (experts: edp replicas
// summed, divided by the dense dp size, which equals edp here).
void setGrads(std::vector<Parameter>& params, int step) {
  for (int i = 0; i < 3; ++i)
    params[i].tensor.mutable_grad() =
        sliceOf(seeded(kShapes[i], 500 + step, i), params[i].shard.offsets, params[i].tensor.sizes()).clone();
}

std::vector<GlobalKey> stateKeys() {
  std::vector<GlobalKey> keys;
  for (int i = 0; i < 3; ++i)
    for (const char* suffix : {".exp_avg", ".exp_avg_sq"})
      keys.push_back({fmt::format("optim.{}{}", kNames[i], suffix), kShapes[i]});
  keys.push_back({"optim.step", {1}});
  return keys;
}

std::vector<at::Tensor> initialGlobals() {
  std::vector<at::Tensor> globals;
  for (int i = 0; i < 3; ++i) globals.push_back(seeded(kShapes[i], 600, i));
  return globals;
}

}  // namespace

TEST_CASE("exported optimizer state imports into a fresh optimizer of the same layout") {
  ProcessGroups groups = makeGroups({.ep = world().size() % 2 == 0 ? 2 : 1});
  std::vector<at::Tensor> globals = initialGlobals();
  std::vector<Parameter> params = makeParams(groups, globals);
  DistributedOptimizer first(params, groups, {.adamw = kStateTestAdamW});
  for (int step = 0; step < 2; ++step) {
    setGrads(params, step);
    first.step(0.01);
  }
  // Saved copies, as a checkpoint would write them (a key may have several pieces).
  std::vector<ShardedTensor> saved = first.state();
  for (ShardedTensor& piece : saved) piece.local = piece.local.clone();
  if (groups.ep()->size() == 2 && groups.expertDp()->size() == 2) {
    // Three experts per rank, cut inside the second: two boxes on each rank.
    CHECK(std::count_if(saved.begin(), saved.end(),
                        [](const ShardedTensor& piece) { return piece.key == "optim.experts.exp_avg"; }) == 2);
  }

  std::vector<Parameter> params2;
  for (const Parameter& p : params)
    params2.push_back({p.name, p.tensor.detach().clone().set_requires_grad(true), p.shard, p.group, p.tpReplicated});
  DistributedOptimizer second(params2, groups, {.adamw = kStateTestAdamW});
  CHECK(second.stepCount() == 0);
  std::vector<ShardedTensor> targets = second.state();
  REQUIRE(targets.size() == saved.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    INFO(targets[i].key);
    REQUIRE(targets[i].key == saved[i].key);
    REQUIRE(targets[i].shard.offsets == saved[i].shard.offsets);
    targets[i].local.copy_(saved[i].local);
  }
  second.afterLoad();
  CHECK(second.stepCount() == 2);
  const std::vector<ShardedTensor> loaded = second.state();
  for (size_t i = 0; i < loaded.size(); ++i) CHECK(at::equal(loaded[i].local, saved[i].local));

  setGrads(params, 2);
  setGrads(params2, 2);
  first.step(0.01);
  second.step(0.01);
  for (int i = 0; i < 3; ++i) CHECK(at::equal(params[i].tensor, params2[i].tensor));
}

TEST_CASE("optimizer state exported at dp 4 imports at tp 2, ep 2, dp 2 and steps alike") {
  if (world().size() != 4) return;
  std::vector<at::Tensor> globals = initialGlobals();

  // Layout A: dp 4, every rank holds whole parameters; plain AdamW alongside.
  ProcessGroups groupsA = makeGroups({});
  std::vector<Parameter> paramsA = makeParams(groupsA, globals);
  DistributedOptimizer optimizerA(paramsA, groupsA, {.adamw = kStateTestAdamW});
  std::vector<Parameter> paramsPlain = makeParams(groupsA, globals);
  optim::AdamW plain(paramsPlain, kStateTestAdamW, world().rank());
  for (int step = 0; step < 2; ++step) {
    setGrads(paramsA, step);
    setGrads(paramsPlain, step);
    optimizerA.step(0.02);
    plain.step(0.02);
  }
  std::map<std::string, at::Tensor> stateA = assemble(optimizerA.state(), stateKeys());
  std::map<std::string, at::Tensor> statePlain = assemble(plain.state(), stateKeys());
  for (const auto& [key, value] : stateA) {
    INFO(key);
    CHECK(relativeError(statePlain[key], value) <= 1e-12);
  }
  CHECK(stateA["optim.step"].item<double>() == 2.0);

  // Layout B: tp 2, ep 2, dp 2 (expert dp 2), parameters and state resharded.
  ProcessGroups groupsB = makeGroups({.tp = 2, .ep = 2});
  std::vector<at::Tensor> now;
  for (const Parameter& p : paramsA) now.push_back(p.tensor.detach());  // whole on every rank of A
  std::vector<Parameter> paramsB = makeParams(groupsB, now);
  DistributedOptimizer optimizerB(paramsB, groupsB, {.adamw = kStateTestAdamW});
  fillFrom(optimizerB.state(), stateA);
  optimizerB.afterLoad();
  CHECK(optimizerB.stepCount() == 2);

  for (int step = 2; step < 4; ++step) {
    INFO(fmt::format("step {}", step + 1));
    setGrads(paramsA, step);
    setGrads(paramsB, step);
    optimizerA.step(0.02);
    optimizerB.step(0.02);
    for (int i = 0; i < 3; ++i) {
      INFO(kNames[i]);
      at::Tensor want = sliceOf(paramsA[i].tensor, paramsB[i].shard.offsets, paramsB[i].tensor.sizes());
      CHECK(relativeError(paramsB[i].tensor, want) <= 1e-12);
    }
  }
  // And B's state, gathered, is A's.
  std::map<std::string, at::Tensor> stateB = assemble(optimizerB.state(), stateKeys());
  std::map<std::string, at::Tensor> stateA2 = assemble(optimizerA.state(), stateKeys());
  for (const auto& [key, value] : stateA2) {
    INFO(key);
    CHECK(relativeError(stateB[key], value) <= 1e-12);
  }
}
