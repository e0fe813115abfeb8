#pragma once
// Pipeline parallelism: a trainer's own stage modules run forward and backward
// over micro-batches on a pp group, activations and their gradients going
// between neighbours through Bulkhead's communicator (parallel/pipeline_schedule.h
// gives the order).
//
//   parallel::Pipeline pipeline(groups.pp(), {.schedule = parallel::PipelineSchedule::OneFOneB,
//                                             .microBatches = 8});
//   auto result = pipeline.run({{.forward = [&](int m, const at::Tensor& input) {
//     at::Tensor x = input.defined() ? input : embed(batch(m));  // the first stage reads its micro-batch
//     x = myLayers(x);
//     return lastStage ? loss(x, targets(m)) : x;                // the last stage returns the loss
//   }}});
//
// Contract:
// - Rank r of the pp group runs chunks r, P + r, ... (stage = chunk * P + r).
//   A chunk's forward gets micro-batch m's input (undefined on stage 0) and
//   returns the activations for the next stage, or on the last stage a scalar
//   loss, with optionally an auxiliary loss of its own. Backward runs through
//   autograd; parameter gradients accumulate over the micro-batches, each
//   micro-batch's loss and auxiliary losses scaled by lossScale (default 1 / M,
//   so the gradients are those of the mean loss).
// - Every activation and gradient goes with a header (direction, stage,
//   micro-batch, the run's number, dtype, shape) ahead of it, so any shape
//   can travel and the receiver allocates exactly what comes. Messages
//   between two ranks are read in the order they were sent and kept until
//   their step needs them; one from another stage or another run, or one
//   left over at the end of a run, is a DesyncError. A sent tensor is let go
//   of as soon as its send completes.
//   With activationShape or activationDtype set, a forward activation of
//   another shape or dtype is a DesyncError naming both stages and the
//   micro-batch.
// - Every send and receive is a communicator operation under the deadline
//   (the ledger records it with its peer). A receive that times out raises
//   TimeoutError naming this stage, the micro-batch, the direction and the
//   stage that never sent it; its neighbours then time out in turn, so every
//   stage ends within about the deadline per hop.

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "parallel/pipeline_schedule.h"
#include "runtime/communicator.h"

namespace bulkhead::parallel {

// What a chunk's forward returns for one micro-batch.
struct PipelineOutput {
  PipelineOutput(at::Tensor output, at::Tensor auxLoss = {}) : output(std::move(output)), auxLoss(std::move(auxLoss)) {}
  at::Tensor output;   // the activations for the next stage, or the last stage's loss
  at::Tensor auxLoss;  // optional: this chunk's own loss terms (a MoE layer's aux and z losses), backpropagated
                       // with the micro-batch and scaled like the loss, not sent on
};

struct PipelineChunk {
  std::function<PipelineOutput(int microBatch, const at::Tensor& input)> forward;
};

struct PipelineOptions {
  PipelineSchedule schedule = PipelineSchedule::OneFOneB;
  int microBatches = 1;
  double lossScale = 0;  // 0: 1 / microBatches
  // Optional checks of the forward activations a stage receives.
  std::function<std::vector<int64_t>(int microBatch)> activationShape;
  std::optional<at::ScalarType> activationDtype;
  // Seconds each send and receive may take, from its call; unset: the
  // communicator's default timeout.
  std::optional<double> timeoutSeconds;
};

struct PipelineResult {
  // The last stage's loss of each micro-batch (unscaled), float64 [M] on the
  // communicator's device, read by nothing here (no host sync in the step);
  // undefined on other ranks.
  at::Tensor losses;
  int maxLiveActivations = 0;  // most micro-batches (over this rank's chunks) held for backward at once
};

class Pipeline {
 public:
  Pipeline(CommunicatorPtr pp, PipelineOptions options);
  // Forward and backward of every micro-batch (collective over the pp group).
  PipelineResult run(const std::vector<PipelineChunk>& chunks);

 private:
  CommunicatorPtr pp_;
  PipelineOptions options_;
  int64_t runs_ = 0;  // run() calls so far: a message of another run is a DesyncError
};

}  // namespace bulkhead::parallel
