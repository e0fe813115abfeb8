#include "examples/train_moe/captured_step.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <utility>

#include "runtime/errors.h"

namespace bulkhead::examples {
namespace {

TokenBatch ownCopy(const TokenBatch& batch) {
  return {.ids = batch.ids.clone(), .targets = batch.targets.clone(), .keys = batch.keys.clone()};
}

void copyInto(TokenBatch& into, const TokenBatch& from) {
  if (from.ids.sizes() != into.ids.sizes())
    throw ConfigError(fmt::format("captured step: a batch of shape [{}] for a graph captured on [{}]",
                                  fmt::join(from.ids.sizes(), ", "), fmt::join(into.ids.sizes(), ", ")),
                      {.expected = "every step's batches of the captured shape"});
  c10::NoGradGuard noGrad;
  into.ids.copy_(from.ids, /*non_blocking=*/true);
  into.targets.copy_(from.targets, /*non_blocking=*/true);
  into.keys.copy_(from.keys, /*non_blocking=*/true);
}

// Every communicator the step's collectives may use, and the world, so that
// every rank reads every record at the capture's check.
std::vector<CommunicatorPtr> watchedGroups(const parallel::ProcessGroups& groups) {
  std::vector<CommunicatorPtr> comms{groups.world()};
  for (const auto& group : {groups.tp(), groups.ep(), groups.expertTp(), groups.dpCp(), groups.embedding()})
    if (group && group->size() > 1) comms.push_back(group);
  return comms;
}

}  // namespace

void checkCapturable(const parallel::ProcessGroups& groups, double capacityFactor) {
  const int rank = groups.world()->rank();
  if (!groups.world()->device().is_cuda())
    throw ConfigError("--cuda-graph captures the step on a GPU: run with --backend nccl",
                      {.rank = rank, .expected = "a GPU world"});
  if (groups.pp()->size() > 1)
    throw ConfigError("--cuda-graph captures the step at pp 1: the pipeline's exchanges are not captured",
                      {.rank = rank, .expected = "--pp 1"});
  if (capacityFactor <= 0)
    throw ConfigError(
        "--cuda-graph needs --capacity: dropless dispatch sizes its exchanges from counts read on the "
        "host, which a CUDA graph cannot capture",
        {.rank = rank, .expected = "--capacity > 0 with --cuda-graph"});
}

CapturedStep::CapturedStep(StagedModel& model, const parallel::ProcessGroups& groups, std::shared_ptr<Store> store,
                           const std::vector<TokenBatch>& first)
    : model_(model) {
  for (const auto& batch : first) inputs_.push_back(ownCopy(batch));
  const auto parameters = model_.parameters();
  graph_ = std::make_unique<CapturedGraph>(
      groups.world()->device(),
      [this, parameters] {
        // None before each warm-up and the capture: the captured backward
        // writes every gradient rather than adding to one.
        for (const auto& parameter : parameters) parameter.tensor.mutable_grad() = at::Tensor();
        loss_ = model_.forwardBackwardLocal(inputs_);
      },
      GraphOptions{.name = "train-step", .store = std::move(store), .comms = watchedGroups(groups)});
}

StepLoss CapturedStep::run(const std::vector<TokenBatch>& microBatches) {
  if (microBatches.size() != inputs_.size())
    throw ConfigError(
        fmt::format("captured step: {} micro-batches for a graph of {}", microBatches.size(), inputs_.size()),
        {.expected = "the captured number of micro-batches"});
  for (size_t m = 0; m < inputs_.size(); ++m) copyInto(inputs_[m], microBatches[m]);
  graph_->launch();
  // A copy: the next replay overwrites the graph's own before this step's loss is read.
  return model_.reduceLoss(loss_.clone());
}

}  // namespace bulkhead::examples
