// The distributed optimizer's gradient reduction overlapped with the backward:
// on 4 ranks (dense dp 4, expert dp 2 at ep 2), a small model trained with
// real backwards (two micro-batches a step, an expert weight whose gradient
// moe::batchedLinear writes in place) updates exactly as the optimizer that
// reduces everything at step(), and from the second step on every bucket
// starts during the backward. A gradient that changes after its bucket
// started skips that step on every rank; gradients changed after the
// backward are reduced at step() when named.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <functional>

#include "moe/batched_linear.h"
#include "optim/distributed_optimizer.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"
#include "tests/support/parallel_helpers.h"

using namespace bulkhead;
using namespace bulkhead::parallel;
using namespace bulkhead::testing;
using bulkhead::optim::DistributedOptimizer;

namespace {

constexpr int64_t kIn = 6, kHidden = 8, kExperts = 4, kRows = 5;  // kRows rows per local expert

// The model's parameters as this rank holds them: two dense matrices, a bias
// and the expert stack [experts, kHidden, kHidden] split over ep.
std::vector<Parameter> makeModel(const ProcessGroups& groups) {
  const int64_t local = kExperts / groups.ep()->size();
  const int64_t offset = groups.ep()->rank() * local;
  auto leaf = [](at::Tensor t) { return t.contiguous().set_requires_grad(true); };
  at::Tensor experts = seeded({kExperts, kHidden, kHidden}, 30).mul(0.3);
  return {
      {.name = "in.weight",
       .tensor = leaf(seeded({kHidden, kIn}, 31).mul(0.4)),
       .shard = ShardInfo::whole({kHidden, kIn}, groups.dpCp()->rank())},
      {.name = "in.bias",
       .tensor = leaf(seeded({kHidden}, 32)),
       .shard = ShardInfo::whole({kHidden}, groups.dpCp()->rank())},
      {.name = "experts.w",
       .tensor = leaf(experts.narrow(0, offset, local)),
       .shard = {{kExperts, kHidden, kHidden}, {offset, 0, 0}, groups.expertDp()->rank()},
       .group = ParamGroup::Expert},
      {.name = "out.weight",
       .tensor = leaf(seeded({1, kHidden}, 33)),
       .shard = ShardInfo::whole({1, kHidden}, groups.dpCp()->rank())},
  };
}

// One micro-batch's forward and backward: rows drawn for (rank, step, micro-batch).
void backward(const std::vector<Parameter>& model, int step, int micro) {
  const int64_t local = model[2].tensor.size(0);
  at::Tensor x = seeded({local * kRows, kIn}, world().rank(), step, micro, "x");
  at::Tensor h = at::tanh(at::linear(x, model[0].tensor, model[1].tensor));
  at::Tensor y = moe::batchedLinear(h, model[2].tensor);
  at::Tensor loss = at::linear(at::tanh(y), model[3].tensor).square().mean();
  loss.backward();
}

// Trains two copies of the model, one whose reduction overlaps (a bucket per
// parameter) and one that reduces at step(), and checks they stay equal.
void trainSideBySide(const std::function<int(int step)>& microBatches, int steps,
                     const std::function<void(const std::vector<Parameter>&)>& afterBackward = {},
                     std::set<std::string> reduceAtStep = {}) {
  ProcessGroups groups = makeGroups({.ep = 2});
  std::vector<Parameter> overlapped = makeModel(groups), plain = makeModel(groups);
  DistributedOptimizer a(overlapped, groups,
                         {.adamw = {.weightDecay = 0.1}, .bucketBytes = 8, .reduceAtStep = reduceAtStep});
  DistributedOptimizer b(plain, groups, {.adamw = {.weightDecay = 0.1}, .overlapGradReduce = false});
  CHECK(a.buckets() == overlapped.size());
  for (int step = 0; step < steps; ++step) {
    INFO(fmt::format("step {}", step + 1));
    for (int m = 0; m < microBatches(step); ++m) {
      backward(overlapped, step, m);
      backward(plain, step, m);
    }
    if (afterBackward) {
      afterBackward(overlapped);
      afterBackward(plain);
    }
    double normA = a.step(1e-2), normB = b.step(1e-2);
    CHECK(std::abs(normA - normB) <= 1e-12 * normB);
    CHECK(a.overlappedBuckets() == (step == 0 ? 0 : a.buckets() - reduceAtStep.size()));
    for (size_t i = 0; i < overlapped.size(); ++i) {
      INFO(overlapped[i].name);
      CHECK(relativeError(overlapped[i].tensor, plain[i].tensor) <= 1e-13);
    }
    a.zeroGrad();
    b.zeroGrad();
  }
  CHECK(a.skippedSteps() == 0);
}

}  // namespace

TEST_CASE("overlapped gradient reduction updates as reduction at step(), and overlaps from the second step") {
  if (world().size() % 2 != 0) return;
  // One micro-batch, then two: the counts learned at the first step carry on
  // as long as the micro-batches do not change.
  trainSideBySide([](int) { return 2; }, 4);
  trainSideBySide([](int) { return 1; }, 3);
}

TEST_CASE("gradients changed after the backward are reduced at step() when named") {
  if (world().size() % 2 != 0) return;
  // As a tied embedding's sum across pipeline stages: the change must reach the reduction.
  auto twice = [](const std::vector<Parameter>& model) {
    c10::NoGradGuard noGrad;
    model[3].tensor.mutable_grad().mul_(2.0);
  };
  trainSideBySide([](int) { return 1; }, 3, twice, {"out.weight"});
}

TEST_CASE("a gradient that changes after its bucket started skips that step on every rank, then overlap resumes") {
  if (world().size() % 2 != 0) return;
  ProcessGroups groups = makeGroups({.ep = 2});
  std::vector<Parameter> model = makeModel(groups);
  DistributedOptimizer optimizer(model, groups, {.adamw = {.weightDecay = 0.1}, .bucketBytes = 8});
  auto train = [&](int step, int micro) {
    for (int m = 0; m < micro; ++m) backward(model, step, m);
    optimizer.step(1e-2);
    optimizer.zeroGrad();
  };
  train(0, 1);  // learns one backward a step
  train(1, 1);
  CHECK(optimizer.overlappedBuckets() == optimizer.buckets());
  CHECK(optimizer.skippedSteps() == 0);
  // World rank 1 alone runs a second backward: its buckets started after the first.
  std::vector<at::Tensor> before;
  for (const Parameter& p : model) before.push_back(p.tensor.detach().clone());
  train(2, world().rank() == 1 ? 2 : 1);
  CHECK(optimizer.skippedSteps() == 1);
  for (size_t i = 0; i < model.size(); ++i) CHECK(at::equal(model[i].tensor, before[i]));
  train(3, 1);  // the rank that saw it learns again; the others overlap on
  CHECK(optimizer.overlappedBuckets() == (world().rank() == 1 ? 0 : optimizer.buckets()));
  train(4, 1);
  CHECK(optimizer.overlappedBuckets() == optimizer.buckets());
  CHECK(optimizer.skippedSteps() == 1);
  CHECK(optimizer.stepCount() == 4);
}

TEST_CASE("a step whose gradients were set by hand teaches the overlap nothing; the next one does") {
  if (world().size() % 2 != 0) return;
  ProcessGroups groups = makeGroups({.ep = 2});
  std::vector<Parameter> model = makeModel(groups);
  DistributedOptimizer optimizer(model, groups, {.adamw = {.weightDecay = 0.1}, .bucketBytes = 8});
  for (const Parameter& p : model) p.tensor.mutable_grad() = seeded(p.tensor.sizes(), world().rank(), 90);
  optimizer.step(1e-2);
  optimizer.zeroGrad();
  for (int step = 1; step <= 3; ++step) {
    backward(model, step, 0);
    optimizer.step(1e-2);
    optimizer.zeroGrad();
    INFO("step " << step);
    CHECK(optimizer.overlappedBuckets() == (step == 1 ? 0 : optimizer.buckets()));  // step 1 learns
  }
  CHECK(optimizer.skippedSteps() == 0);
}
