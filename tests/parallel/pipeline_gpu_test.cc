// Pipeline schedules on the nccl backend, one rank per GPU: every schedule at
// pp 2 and 4 (and 8 where there are 8 GPUs), interleaved included, gives the
// float64 losses and gradients of the same chain of layers run on one GPU
// within 1e-12. Activations go without a given shape, so each run agrees on
// it from its first micro-batch; a second run with other shapes agrees anew.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include "parallel/pipeline.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

namespace bulkhead::testing {
namespace {

using parallel::PipelineSchedule;

constexpr int kLayers = 8, kHidden = 32, kMicroBatches = 8;

at::Tensor seeded(std::vector<int64_t> shape, uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  return at::randn(shape, generator, at::kDouble).to(gpu());
}

struct Chain {
  std::vector<at::Tensor> weights, biases;
  Chain() {
    for (int l = 0; l < kLayers; ++l) {
      weights.push_back((seeded({kHidden, kHidden}, 1000 + l) / 5).requires_grad_(true));
      biases.push_back((seeded({kHidden}, 2000 + l) / 10).requires_grad_(true));
    }
  }
  at::Tensor layers(at::Tensor x, int begin, int end) const {
    for (int l = begin; l < end; ++l) x = at::tanh(at::matmul(x, weights[l]) + biases[l]);
    return x;
  }
};

// Micro-batch m's rows: `rows` of them (a run's batch size).
at::Tensor inputOf(int m, int rows) { return seeded({rows, kHidden}, 77 + m); }
at::Tensor targetOf(int m, int rows) { return seeded({rows, kHidden}, 5000 + m); }

struct Run {
  std::vector<at::Tensor> losses;  // per run
  Chain chain;
  std::vector<int> layers;
};

// Two runs (batches of 5 then 3 rows) on pp groups of `stages` consecutive ranks.
Run runPipeline(PipelineSchedule schedule, int stages, int virtualStages) {
  const int rank = gpuWorld().rank();
  auto pp = gpuWorldPtr()->split(rank / stages, rank, fmt::format("pp{}x{}", stages, virtualStages));
  const int r = pp->rank(), total = stages * virtualStages, perStage = kLayers / total;
  Run run;
  int rows = 5;
  std::vector<parallel::PipelineChunk> chunks;
  for (int c = 0; c < virtualStages; ++c) {
    const int stage = c * stages + r, begin = stage * perStage, end = begin + perStage;
    for (int l = begin; l < end; ++l) run.layers.push_back(l);
    chunks.push_back({.forward = [&run, &rows, stage, begin, end, total](int m, const at::Tensor& input) {
      at::Tensor x = run.chain.layers(stage == 0 ? inputOf(m, rows) : input, begin, end);
      return stage == total - 1 ? (x - targetOf(m, rows)).pow(2).mean() : x;
    }});
  }
  parallel::Pipeline pipeline(pp, {.schedule = schedule, .microBatches = kMicroBatches, .timeoutSeconds = 30});
  for (int each : {5, 3}) {
    rows = each;
    run.losses.push_back(pipeline.run(chunks).losses);
  }
  return run;
}

Run reference() {
  Run run;
  for (int l = 0; l < kLayers; ++l) run.layers.push_back(l);
  for (int rows : {5, 3}) {
    std::vector<at::Tensor> losses;
    for (int m = 0; m < kMicroBatches; ++m) {
      at::Tensor loss = (run.chain.layers(inputOf(m, rows), 0, kLayers) - targetOf(m, rows)).pow(2).mean();
      losses.push_back(loss.detach());
      (loss / kMicroBatches).backward();
    }
    run.losses.push_back(at::stack(losses));
  }
  return run;
}

void checkAgainst(const Run& run, const Run& ref, int stages) {
  for (int l : run.layers) {
    INFO("layer " << l);
    const at::Tensor& g = run.chain.weights[l].grad();
    REQUIRE(g.defined());
    CHECK(at::allclose(g.cpu(), ref.chain.weights[l].grad().cpu(), 1e-12, 0));
    CHECK(at::allclose(run.chain.biases[l].grad().cpu(), ref.chain.biases[l].grad().cpu(), 1e-12, 0));
  }
  const bool last = gpuWorld().rank() % stages == stages - 1;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    INFO("run " << i);
    REQUIRE(run.losses[i].defined() == last);
    if (last) CHECK(at::allclose(run.losses[i].cpu(), ref.losses[i].cpu(), 1e-12, 0));
  }
}

TEST_CASE("on GPUs every schedule gives the float64 losses and gradients of the chain on one GPU") {
  const int n = gpuWorld().size();
  const Run ref = reference();
  struct Case {
    PipelineSchedule schedule;
    int stages, virtualStages;
  };
  std::vector<Case> cases;
  for (int stages : {2, 4, 8}) {
    if (n % stages != 0) continue;
    cases.push_back({PipelineSchedule::OneFOneB, stages, 1});
    cases.push_back({PipelineSchedule::AllForwardAllBackward, stages, 1});
    if (stages <= 4) cases.push_back({PipelineSchedule::Interleaved, stages, 2});
    if (stages == 2) cases.push_back({PipelineSchedule::Interleaved, stages, 4});
    if (stages == 2) cases.push_back({PipelineSchedule::AllForwardAllBackward, stages, 2});
  }
  if (cases.empty()) {
    WARN("needs 2, 4 or 8 stages over " << n << " GPUs; skipped");
    return;
  }
  for (const Case& c : cases) {
    INFO(toString(c.schedule) << " pp " << c.stages << " vpp " << c.virtualStages << " on " << n << " GPUs");
    Run run = runPipeline(c.schedule, c.stages, c.virtualStages);
    checkAgainst(run, ref, c.stages);
  }
}

TEST_CASE("on GPUs the pipeline's sends and receives are grouped in the ledger with their labels") {
  if (gpuWorld().size() % 2 != 0) {
    WARN("needs an even number of GPUs; skipped");
    return;
  }
  const int rank = gpuWorld().rank();
  auto pp = gpuWorldPtr()->split(rank / 2, rank, "pp-ledger");
  Chain chain;
  const int stage = pp->rank();
  parallel::Pipeline pipeline(pp, {.schedule = PipelineSchedule::OneFOneB, .microBatches = 4});
  pipeline.run({{.forward = [&](int m, const at::Tensor& input) {
    at::Tensor x = chain.layers(stage == 0 ? inputOf(m, 4) : input, stage * 4, stage * 4 + 4);
    return stage == 1 ? x.pow(2).mean() : x;
  }}});
  int sends = 0, receives = 0, warming = 0;
  for (const LedgerEntry& entry : pp->ledger().entries()) {
    if (entry.fingerprint.op != OpType::Send && entry.fingerprint.op != OpType::Recv) continue;
    CHECK(entry.state == OpState::Completed);
    CHECK(entry.fingerprint.root == 1 - stage);
    if (entry.fingerprint.label == "pipeline warm-up") {  // the constructor connects each link both ways
      ++warming;
      continue;
    }
    CHECK(entry.fingerprint.label.find("micro-batch") != std::string::npos);
    (entry.fingerprint.op == OpType::Send ? sends : receives)++;
  }
  CHECK(warming == 4);
  // 4 activations forward (one header with the first), 4 gradients back.
  CHECK(sends == (stage == 0 ? 5 : 4));
  CHECK(receives == (stage == 0 ? 4 : 5));
}

}  // namespace
}  // namespace bulkhead::testing
