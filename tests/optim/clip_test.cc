// Gradient clipping by the global norm across tp, ep and dp (tp 2, ep 2,
// dp 2 on 4 ranks): the norm equals the norm of the gathered gradient, with
// tp-replicated parameters and data-parallel replicas counted once, for the
// plain path (syncGradients + clipGradNorm) and inside the distributed
// optimizer's step, whose clipped update equals plain AdamW's.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/distributed_optimizer.h"
#include "parallel/grad_sync.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"
#include "tests/support/parallel_helpers.h"

using namespace bulkhead;
using namespace bulkhead::parallel;
using namespace bulkhead::testing;

namespace {

// Three kinds of parameter: split over tp (rows), replicated over tp, split
// over ep (experts). Each rank's gradient of its piece is seeded by the world
// rank, except the tp-replicated one, which every tp rank of a dp replica
// computes alike (seeded by the dp rank).
struct Model {
  const ProcessGroups& groups;
  std::vector<Parameter> local;
  std::vector<at::Tensor> globalInit;
  std::vector<std::vector<int64_t>> shapes{{6, 4}, {4}, {4, 3}};

  explicit Model(const ProcessGroups& g) : groups(g) {
    int tp = groups.tp()->rank(), tpSize = groups.tp()->size(), ep = groups.ep()->rank(), epSize = groups.ep()->size();
    int dp = groups.dp()->rank(), edp = groups.expertDp()->rank();
    for (int i = 0; i < 3; ++i) globalInit.push_back(seeded(shapes[i], 300 + i));
    auto add = [&](const char* name, int i, std::vector<int64_t> offsets, std::vector<int64_t> shape, int replica,
                   ParamGroup group, bool tpReplicated) {
      local.push_back({.name = name,
                       .tensor = sliceOf(globalInit[i], offsets, shape).clone().set_requires_grad(true),
                       .shard = {shapes[i], offsets, replica},
                       .group = group,
                       .tpReplicated = tpReplicated});
    };
    add("w", 0, {6 / tpSize * tp, 0}, {6 / tpSize, 4}, dp, ParamGroup::Dense, false);
    add("norm", 1, {0}, {4}, dp * tpSize + tp, ParamGroup::Dense, true);
    add("experts", 2, {4 / epSize * ep, 0}, {4 / epSize, 3}, edp, ParamGroup::Expert, false);
  }

  // World rank q's gradient of parameter i at `step`.
  at::Tensor gradOf(int q, int i, int step) const {
    Coordinates c = groups.layout().coordinates(q);
    at::IntArrayRef shape = local[i].tensor.sizes();
    return i == 1 ? seeded(shape, 400 + step, c.dp, 1) : seeded(shape, 400 + step, q, i);
  }

  void setGrads(int step) {
    for (int i = 0; i < 3; ++i) local[i].tensor.mutable_grad() = gradOf(groups.world()->rank(), i, step);
  }

  // The gathered gradient: dense pieces averaged over dp, expert pieces summed
  // over expert dp and divided by the dense dp size.
  std::vector<at::Tensor> globalGrads(int step) const {
    const Layout& layout = groups.layout();
    std::vector<at::Tensor> sums;
    for (int i = 0; i < 3; ++i) sums.push_back(at::zeros(shapes[i], at::kDouble));
    for (int q = 0; q < layout.worldSize(); ++q) {
      Coordinates c = layout.coordinates(q);
      int64_t wRows = 6 / layout.tp(), eRows = 4 / layout.ep();
      sliceOf(sums[0], {wRows * c.tp, 0}, {wRows, 4}).add_(gradOf(q, 0, step));
      if (c.tp == 0) sums[1].add_(gradOf(q, 1, step));
      sliceOf(sums[2], {eRows * c.ep, 0}, {eRows, 3}).add_(gradOf(q, 2, step));
    }
    for (at::Tensor& sum : sums) sum.div_(layout.dp());
    return sums;
  }
};

double normOf(const std::vector<at::Tensor>& tensors) {
  double sum = 0;
  for (const at::Tensor& t : tensors) sum += t.square().sum().item<double>();
  return std::sqrt(sum);
}

LayoutOptions clipLayout() { return world().size() % 4 == 0 ? LayoutOptions{.tp = 2, .ep = 2} : LayoutOptions{}; }

}  // namespace

TEST_CASE("plain path: synced gradients and their clipped global norm equal the gathered gradient's") {
  ProcessGroups groups = makeGroups(clipLayout());
  Model model(groups);
  model.setGrads(0);
  parallel::syncGradients(model.local, groups, {.bucketBytes = 64});  // several buckets
  std::vector<at::Tensor> want = model.globalGrads(0);
  for (int i = 0; i < 3; ++i) {
    INFO(model.local[i].name);
    CHECK(relativeError(model.local[i].tensor.grad(),
                        sliceOf(want[i], model.local[i].shard.offsets, model.local[i].tensor.sizes())) <= 1e-12);
  }
  double normWant = normOf(want);
  double maxNorm = normWant / 2;
  double norm = optim::clipGradNorm(model.local, groups, maxNorm);
  CHECK(std::abs(norm - normWant) <= 1e-12 * normWant);
  double scale = optim::clipScale(normWant, maxNorm);
  CHECK(scale < 0.51);
  for (int i = 0; i < 3; ++i)
    CHECK(relativeError(model.local[i].tensor.grad(),
                        sliceOf(want[i], model.local[i].shard.offsets, model.local[i].tensor.sizes()) * scale) <=
          1e-12);
  // Below the limit nothing changes.
  std::vector<at::Tensor> before;
  for (const Parameter& p : model.local) before.push_back(p.tensor.grad().clone());
  CHECK(std::abs(optim::clipGradNorm(model.local, groups, 10 * normWant) - normWant * scale) <= 1e-12 * normWant);
  for (int i = 0; i < 3; ++i) CHECK(at::equal(model.local[i].tensor.grad(), before[i]));
}

TEST_CASE("distributed optimizer: the step's global norm and clipped update equal plain AdamW's") {
  ProcessGroups groups = makeGroups(clipLayout());
  Model model(groups);
  optim::AdamWOptions adamw{.weightDecay = 0.05};
  optim::DistributedOptimizer distributed(model.local, groups, {.adamw = adamw});
  std::vector<Parameter> global;
  for (int i = 0; i < 3; ++i)
    global.push_back({.name = model.local[i].name,
                      .tensor = model.globalInit[i].clone().set_requires_grad(true),
                      .shard = ShardInfo::whole(model.shapes[i])});
  optim::AdamW plain(global, adamw);

  for (int step = 0; step < 3; ++step) {
    INFO(fmt::format("step {}", step + 1));
    model.setGrads(step);
    std::vector<at::Tensor> want = model.globalGrads(step);
    double normWant = normOf(want);
    double maxNorm = step == 1 ? 10 * normWant : normWant / 3;  // step 2 does not clip
    double norm = distributed.step(0.01, {.maxGradNorm = maxNorm});
    CHECK(std::abs(norm - normWant) <= 1e-12 * normWant);
    for (int i = 0; i < 3; ++i) global[i].tensor.mutable_grad() = want[i] * optim::clipScale(normWant, maxNorm);
    plain.step(0.01);
    for (int i = 0; i < 3; ++i) {
      INFO(model.local[i].name);
      at::Tensor expected = sliceOf(global[i].tensor, model.local[i].shard.offsets, model.local[i].tensor.sizes());
      CHECK(relativeError(model.local[i].tensor, expected) <= 1e-12);
    }
  }
}

TEST_CASE("a gradient that is not finite on one rank skips the distributed step on every rank") {
  ProcessGroups groups = makeGroups(clipLayout());
  Model model(groups);
  optim::DistributedOptimizer distributed(model.local, groups, {.adamw = {.weightDecay = 0.05}});
  const bool poisoned = world().rank() == world().size() - 1;  // one expert gradient element on the last rank
  auto snapshot = [&] {
    std::vector<at::Tensor> copies;
    for (const Parameter& p : model.local) copies.push_back(p.tensor.detach().clone());
    for (const ShardedTensor& s : distributed.state()) copies.push_back(s.local.clone());
    return copies;
  };
  auto unchangedSince = [&](const std::vector<at::Tensor>& before) {
    std::vector<at::Tensor> now = snapshot();
    bool same = now.size() == before.size();
    for (size_t i = 0; same && i < now.size(); ++i) same = at::equal(now[i], before[i]);
    return same;
  };
  // A finite step first, so the skipped ones have moments and a step count to keep.
  model.setGrads(0);
  CHECK(std::isfinite(distributed.step(0.01, {.maxGradNorm = 1.0})));
  int step = 1;
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    INFO("a gradient element of " << bad);
    const std::vector<at::Tensor> before = snapshot();
    model.setGrads(step++);
    if (poisoned) model.local[2].tensor.mutable_grad().view({-1})[1].fill_(bad);
    const double norm = distributed.step(0.01, {.maxGradNorm = 1.0});
    CHECK(!std::isfinite(norm));
    CHECK(distributed.stepCount() == 1);
    CHECK(unchangedSince(before));
  }
  CHECK(distributed.skippedSteps() == 2);
  // The next finite step is taken as usual.
  const std::vector<at::Tensor> before = snapshot();
  model.setGrads(step);
  CHECK(std::isfinite(distributed.step(0.01, {.maxGradNorm = 1.0})));
  CHECK(distributed.stepCount() == 2);
  CHECK_FALSE(unchangedSince(before));
}

TEST_CASE("plain path: clipping an inf gradient norm scales nothing") {
  ProcessGroups groups = makeGroups(clipLayout());
  Model model(groups);
  model.setGrads(0);
  if (world().rank() == 0)
    model.local[0].tensor.mutable_grad().view({-1})[2].fill_(std::numeric_limits<double>::infinity());
  syncGradients(model.local, groups);
  std::vector<at::Tensor> synced;
  for (const Parameter& p : model.local) synced.push_back(p.tensor.grad().clone());
  // Scaling by maxNorm / inf = 0 would turn every finite gradient into 0 and the inf into NaN.
  CHECK(std::isinf(optim::clipGradNorm(model.local, groups, 1.0)));
  for (size_t i = 0; i < model.local.size(); ++i) CHECK(at::equal(model.local[i].tensor.grad(), synced[i]));
}

TEST_CASE("plain path: bf16 gradients are summed in float32 and rounded once") {
  // Per element, the four dp replicas' values: no order of bf16 additions gives, for both elements, what
  // the float32 sum gives (2.009765625 / 4 = 0.50244140625, 0.50390625 in bf16); a bf16 sum rounds one of them.
  ProcessGroups groups = makeGroups({});
  if (groups.dpCp()->size() != 4) return;
  const double values[2][4] = {{1, 1, 1.0 / 512, 1.0 / 128}, {1, 1.0 / 512, 1, 1.0 / 128}};
  const int replica = groups.dpCp()->rank();
  at::Tensor weight = at::zeros({2}, at::kBFloat16).set_requires_grad(true);
  weight.mutable_grad() = at::tensor({values[0][replica], values[1][replica]}, at::kDouble).to(at::kBFloat16);
  syncGradients({{.name = "w", .tensor = weight, .shard = ShardInfo::whole({2}, replica)}}, groups);
  CHECK(at::equal(weight.grad(), at::full({2}, 0.50390625, at::kBFloat16)));
}
