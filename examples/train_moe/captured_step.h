#pragma once
// train_moe --cuda-graph: the forward and backward of a step, every
// micro-batch of it, captured once into a CUDA graph and replayed each step.
// The graph holds the MoE layers' capacity-padded exchanges (ep), the
// tensor-parallel and expert-tp all-reduces and the aux loss's counts
// all-reduce (dp x cp); the capture is a checked region over those groups and
// the world, so ranks that captured different collectives fail at capture,
// every one of them, with DesyncError. The optimizer step (its learning rate
// changes every step), the gradient reduce-scatters and the loss's sum over
// the world run eagerly after each replay.
//
// Contract:
// - Needs a GPU, MoE layers of static shapes (a capacity), pp 1 and gradients
//   reduced at the optimizer step (no overlap: the hooks that start the
//   reduce-scatters during the backward would run only at capture).
// - Each step copies the batches into the graph's own input tensors. The
//   gradients are the graph's: set to none before capture, written (not
//   added) by every replay, and left in place between steps (the optimizer
//   reads them; nothing releases them).
// - run() launches the replay and does not wait for it; the loss's
//   all-reduce, queued behind it, carries the step's deadline.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "examples/train_moe/data.h"
#include "examples/train_moe/staged_model.h"
#include "parallel/process_groups.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/store/store.h"

namespace bulkhead::examples {

// ConfigError, with what to do, where these groups and this capacity factor
// cannot capture a step (see the contract). Called before the model is built.
void checkCapturable(const parallel::ProcessGroups& groups, double capacityFactor);

class CapturedStep {
 public:
  // Captures at once, from `first` (this rank's micro-batches of the first
  // step), on groups that passed checkCapturable.
  CapturedStep(StagedModel& model, const parallel::ProcessGroups& groups, std::shared_ptr<Store> store,
               const std::vector<TokenBatch>& first);

  StepLoss run(const std::vector<TokenBatch>& microBatches);

 private:
  StagedModel& model_;
  std::vector<TokenBatch> inputs_;
  at::Tensor loss_;  // this rank's contribution, written by each replay
  std::unique_ptr<CapturedGraph> graph_;
};

}  // namespace bulkhead::examples
