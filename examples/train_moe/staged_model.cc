#include "examples/train_moe/staged_model.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <utility>

#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::examples {
namespace {

parallel::PipelineOptions pipelineOptions(const StagedOptions& options) {
  return {.schedule = options.virtualStages > 1 ? parallel::PipelineSchedule::Interleaved
                                                : parallel::PipelineSchedule::OneFOneB,
          .microBatches = options.microBatches};
}

}  // namespace

StagedModel::StagedModel(const ModelConfig& config, const parallel::ProcessGroups& groups, StagedOptions options)
    : StagedModel(
          config.layers, config.tiedEmbedding,
          [&](const ModelPart& part) { return std::make_unique<MoETransformer>(config, groups, part); }, groups,
          options) {}

StagedModel::StagedModel(int layers, bool tied, const ChunkFactory& factory, const parallel::ProcessGroups& groups,
                         StagedOptions options)
    : groups_(groups), options_(options), tied_(tied), pipeline_(groups.pp(), pipelineOptions(options)) {
  const int pp = groups.pp()->size(), rank = groups.pp()->rank(), stages = pp * options.virtualStages;
  if (layers % stages != 0)
    throw ConfigError(fmt::format("model: {} layers do not divide over {} pipeline stages (pp {} x vpp {})", layers,
                                  stages, pp, options.virtualStages),
                      {.rank = groups.world()->rank(), .expected = fmt::format("layers a multiple of {}", stages)});
  // The schedule's own checks (micro-batches a multiple of pp when interleaving) before any work.
  parallel::pipelineSteps(
      pipelineOptions(options).schedule,
      {.stages = pp, .rank = rank, .virtualStages = options.virtualStages, .microBatches = options.microBatches});
  const int perStage = layers / stages;
  for (int chunk = 0; chunk < options.virtualStages; ++chunk) {
    const int stage = chunk * pp + rank;
    parts_.push_back(factory(ModelPart{.firstLayer = stage * perStage,
                                       .endLayer = (stage + 1) * perStage,
                                       .first = stage == 0,
                                       .last = stage == stages - 1}));
  }
}

StepLoss::StepLoss(WorkPtr work, at::Tensor sum, int replicas, Deadline deadline)
    : work_(std::move(work)), copy_(sum, "train_moe: the step's loss"), replicas_(replicas), deadline_(deadline) {}

double StepLoss::get() {
  // Raises the all-reduce's error or its timeout.
  if (!value_) value_ = copy_.get(deadline_, work_.get()).item<double>() / replicas_;
  return *value_;
}

std::vector<parallel::PipelineChunk> StagedModel::chunks(const std::vector<TokenBatch>& microBatches) {
  if (static_cast<int>(microBatches.size()) != options_.microBatches)
    throw ConfigError(fmt::format("{} micro-batches for a schedule of {}", microBatches.size(), options_.microBatches),
                      {.rank = groups_.world()->rank()});
  std::vector<parallel::PipelineChunk> chunks;
  for (auto& part : parts_) {
    chunks.push_back({.forward = [&, model = part.get()](int m, const at::Tensor& input) {
      ModelOutput out = model->forwardPart(microBatches[m], input);
      return parallel::PipelineOutput(out.loss, out.auxLoss);
    }});
  }
  return chunks;
}

at::Tensor StagedModel::contribution(const parallel::PipelineResult& result) const {
  // The loss lives on the last stage (the same on every tp rank there): one
  // contribution per data-parallel replica, summed over the world.
  const bool counts = groups_.pp()->rank() == groups_.pp()->size() - 1 && groups_.tp()->rank() == 0;
  return counts ? result.losses.mean().reshape({1})
                : at::zeros({1}, at::TensorOptions(at::kDouble).device(groups_.world()->device()));
}

at::Tensor StagedModel::forwardBackwardLocal(const std::vector<TokenBatch>& microBatches) {
  parallel::PipelineResult result = pipeline_.run(chunks(microBatches));
  if (tied_) tieEmbeddingGradients();
  return contribution(result);
}

StepLoss StagedModel::evaluate(const std::vector<TokenBatch>& microBatches) {
  return reduceLoss(contribution(pipeline_.evaluate(chunks(microBatches))));
}

StepLoss StagedModel::reduceLoss(const at::Tensor& contribution) const {
  const Deadline deadline = parallel::collectiveDeadline(std::nullopt);
  WorkPtr work = groups_.world()->allReduce(contribution, {.deadline = deadline});
  return StepLoss(std::move(work), contribution, groups_.dpCp()->size(), deadline);
}

void StagedModel::tieEmbeddingGradients() {
  c10::NoGradGuard noGrad;
  at::Tensor owner, copy;
  for (const auto& part : parts_) {
    if (part->part().first)
      owner = part->embeddingWeight();
    else if (part->part().last)
      copy = part->embeddingWeight();
  }
  auto gradOf = [](at::Tensor& weight) -> at::Tensor {
    if (!weight.grad().defined()) weight.mutable_grad() = at::zeros_like(weight);
    return weight.grad();
  };
  if (owner.defined() && copy.defined()) {  // both ends on this rank (pp 1, several chunks)
    gradOf(owner).add_(gradOf(copy));
    gradOf(copy).copy_(owner.grad());
    return;
  }
  at::Tensor mine = owner.defined() ? owner : copy;
  const CommunicatorPtr& embedding = groups_.embedding();
  if (!mine.defined() || !embedding || embedding->size() < 2) return;
  at::Tensor grad = gradOf(mine);
  embedding->allReduce(grad)->wait();
}

std::vector<parallel::Parameter> StagedModel::parameters() const {
  std::vector<parallel::Parameter> all;
  for (const auto& part : parts_)
    for (auto& parameter : part->parameters()) all.push_back(std::move(parameter));
  return all;
}

std::vector<parallel::ShardedTensor> StagedModel::buffers() const {
  std::vector<parallel::ShardedTensor> all;
  for (const auto& part : parts_)
    for (auto& buffer : part->buffers()) all.push_back(std::move(buffer));
  return all;
}

const moe::MoELayer* StagedModel::firstMoeLayer() const {
  for (const auto& part : parts_)
    if (!part->moeLayers().empty()) return part->moeLayers().front().get();
  return nullptr;
}

}  // namespace bulkhead::examples
