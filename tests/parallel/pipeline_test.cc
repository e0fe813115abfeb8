// Pipeline schedules on a chain of float64 layers: every schedule and
// pipeline size gives the losses and gradients of the same model run on one
// rank, and 1F1B bounds the activations the first stage keeps.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>

#include "parallel/pipeline.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

namespace bulkhead::testing {
namespace {

using parallel::PipelineSchedule;

constexpr int kLayers = 8, kHidden = 16, kBatch = 5, kMicroBatches = 8;

// Layer l's weight and bias, the same on every rank (seeded by l).
struct Chain {
  std::vector<at::Tensor> weights, biases;
  Chain() {
    for (int l = 0; l < kLayers; ++l) {
      auto generator = at::detail::createCPUGenerator(1000 + l);
      weights.push_back((at::randn({kHidden, kHidden}, generator, at::kDouble) / 4).requires_grad_(true));
      biases.push_back((at::randn({kHidden}, generator, at::kDouble) / 10).requires_grad_(true));
    }
  }
  at::Tensor layers(at::Tensor x, int begin, int end) const {
    for (int l = begin; l < end; ++l) x = at::tanh(at::matmul(x, weights[l]) + biases[l]);
    return x;
  }
};

at::Tensor inputOf(int m) {
  auto generator = at::detail::createCPUGenerator(77 + m);
  return at::randn({kBatch, kHidden}, generator, at::kDouble);
}
at::Tensor targetOf(int m) {
  auto generator = at::detail::createCPUGenerator(5000 + m);
  return at::randn({kBatch, kHidden}, generator, at::kDouble);
}

struct Run {
  parallel::PipelineResult result;
  Chain chain;
  std::vector<int> layers;  // the layers this rank ran
};

// The chain on a pp group of `stages` ranks (the world split into groups of
// that size) with `virtualStages` chunks per rank.
Run runPipeline(PipelineSchedule schedule, int stages, int virtualStages) {
  const int rank = world().rank();
  auto pp = world().split(rank / stages, rank, fmt::format("pp{}x{}", stages, virtualStages));
  const int r = pp->rank(), total = stages * virtualStages, perStage = kLayers / total;
  Run run;
  std::vector<parallel::PipelineChunk> chunks;
  for (int c = 0; c < virtualStages; ++c) {
    const int stage = c * stages + r, begin = stage * perStage, end = begin + perStage;
    for (int l = begin; l < end; ++l) run.layers.push_back(l);
    chunks.push_back({.forward = [&run, stage, begin, end, total](int m, const at::Tensor& input) {
      at::Tensor x = run.chain.layers(stage == 0 ? inputOf(m) : input, begin, end);
      return stage == total - 1 ? (x - targetOf(m)).pow(2).mean() : x;
    }});
  }
  parallel::Pipeline pipeline(pp, {.schedule = schedule,
                                   .microBatches = kMicroBatches,
                                   .activationShape =
                                       [](int) {
                                         return std::vector<int64_t>{kBatch, kHidden};
                                       },
                                   .activationDtype = at::kDouble});
  run.result = pipeline.run(chunks);
  return run;
}

// The same model on this rank alone, micro-batch by micro-batch.
Run reference() {
  Run run;
  for (int l = 0; l < kLayers; ++l) run.layers.push_back(l);
  std::vector<at::Tensor> losses;
  for (int m = 0; m < kMicroBatches; ++m) {
    at::Tensor loss = (run.chain.layers(inputOf(m), 0, kLayers) - targetOf(m)).pow(2).mean();
    losses.push_back(loss.detach());
    (loss / kMicroBatches).backward();
  }
  run.result.losses = at::stack(losses);
  return run;
}

void checkAgainst(const Run& run, const Run& ref, int stages) {
  for (int l : run.layers) {
    INFO("layer " << l);
    const at::Tensor& g = run.chain.weights[l].grad();
    REQUIRE(g.defined());
    CHECK(at::allclose(g, ref.chain.weights[l].grad(), 1e-12, 0));
    CHECK(at::allclose(run.chain.biases[l].grad(), ref.chain.biases[l].grad(), 1e-12, 0));
  }
  if (world().rank() % stages == stages - 1) {  // the last stage
    REQUIRE(run.result.losses.defined());
    REQUIRE(run.result.losses.numel() == ref.result.losses.numel());
    for (int64_t m = 0; m < ref.result.losses.numel(); ++m) {
      const double got = run.result.losses[m].item<double>(), want = ref.result.losses[m].item<double>();
      CHECK(std::abs(got - want) <= 1e-12 * std::abs(want));
    }
  } else {
    CHECK(!run.result.losses.defined());
  }
}

TEST_CASE("every schedule and pipeline size gives the losses and gradients of the model on one rank") {
  REQUIRE(world().size() == 4);
  const Run ref = reference();
  struct Case {
    PipelineSchedule schedule;
    int stages, virtualStages;
  };
  for (const Case& c : {Case{PipelineSchedule::AllForwardAllBackward, 1, 1}, Case{PipelineSchedule::OneFOneB, 1, 1},
                        Case{PipelineSchedule::AllForwardAllBackward, 2, 1}, Case{PipelineSchedule::OneFOneB, 2, 1},
                        Case{PipelineSchedule::AllForwardAllBackward, 4, 1}, Case{PipelineSchedule::OneFOneB, 4, 1},
                        Case{PipelineSchedule::Interleaved, 1, 2}, Case{PipelineSchedule::Interleaved, 2, 2},
                        Case{PipelineSchedule::Interleaved, 4, 2}, Case{PipelineSchedule::AllForwardAllBackward, 2, 2},
                        Case{PipelineSchedule::Interleaved, 2, 4}}) {
    INFO(toString(c.schedule) << " pp " << c.stages << " vpp " << c.virtualStages);
    Run run = runPipeline(c.schedule, c.stages, c.virtualStages);
    checkAgainst(run, ref, c.stages);
    CHECK(static_cast<int>(run.layers.size()) == kLayers / c.stages);
  }
}

TEST_CASE("1f1b keeps at most pp micro-batches' activations on the first stage; all-forward-all-backward keeps all") {
  Run oneFOneB = runPipeline(PipelineSchedule::OneFOneB, 4, 1);
  Run all = runPipeline(PipelineSchedule::AllForwardAllBackward, 4, 1);
  const int r = world().rank();
  CHECK(oneFOneB.result.maxLiveActivations == 4 - r);  // stage r warms up with pp - r - 1 forwards
  CHECK(all.result.maxLiveActivations == kMicroBatches);
}

TEST_CASE("pipeline shapes a schedule cannot run are refused before anything is sent") {
  CHECK_THROWS_AS(parallel::pipelineSteps(PipelineSchedule::OneFOneB, {.stages = 2, .virtualStages = 2}), ConfigError);
  CHECK_THROWS_AS(
      parallel::pipelineSteps(PipelineSchedule::Interleaved, {.stages = 4, .virtualStages = 2, .microBatches = 6}),
      ConfigError);
  // Each micro-batch of each chunk is forwarded once and backwarded once, the backward after the forward.
  for (auto schedule : {PipelineSchedule::AllForwardAllBackward, PipelineSchedule::OneFOneB}) {
    for (int rank = 0; rank < 4; ++rank) {
      auto steps = parallel::pipelineSteps(schedule, {.stages = 4, .rank = rank, .microBatches = 7});
      REQUIRE(steps.size() == 14);
      std::map<int, int> forwardAt;
      for (size_t i = 0; i < steps.size(); ++i) {
        if (steps[i].forward)
          forwardAt[steps[i].microBatch] = static_cast<int>(i);
        else
          CHECK(forwardAt.count(steps[i].microBatch) == 1);
      }
    }
  }
}

}  // namespace
}  // namespace bulkhead::testing
