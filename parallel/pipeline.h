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
// - Messages: the schedule fixes every message's place, so each stage
//   receives its neighbours' messages in the order they send them, in
//   grouped exchanges (Communicator::sendRecv): before each unit of the
//   schedule (pipelineUnits) a rank sends what the previous unit produced
//   and receives what this one needs, together, so neighbours never wait on
//   each other's sends (the interleaved schedule exchanges each direction on
//   its own, so a forward computes while the backward's messages move).
//   A sent tensor is let go of as soon as its send completes.
// - Shapes (parallel/pipeline_channel.h): on a CPU backend every tensor goes
//   with a header read on the host. On a GPU backend the first forward
//   activation a chunk receives in a run brings one (none when
//   activationShape and activationDtype give both) and the run's later
//   activations must match it; gradients have their activations' shape. No
//   other message costs a host sync: sends and receives run on a stream of
//   their own, the current stream waits for them where it reads them, and
//   the host waits for them at the end of the run.
// - A message from another stage, micro-batch or run, or an activation of
//   another shape or dtype than activationShape / activationDtype (or, on a
//   GPU, than the run's first), is a DesyncError naming both stages and the
//   micro-batch: raised where the header is read, or on a GPU by the sender,
//   which then ends the job (runtime/diagnosis/fatal_exit.h).
// - Every exchange is a communicator operation under the deadline (the
//   ledger records each send and receive with its peer and label). One that
//   times out raises TimeoutError naming this stage's messages in it (stage,
//   micro-batch, direction) and the last message each peer sent; its
//   neighbours then time out in turn, so every stage ends within about the
//   deadline per hop.

#include <ATen/core/Tensor.h>

#include <c10/core/Stream.h>

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
  // Called on the host as each step's compute is issued, once the current
  // stream waits for its input (begin), and once it is issued (end): a
  // trace's hook (bench/pipeline_bench.cc records CUDA events there).
  std::function<void(const PipelineStep& step, bool begin)> onStep;
};

struct PipelineResult {
  // The last stage's loss of each micro-batch (unscaled), float64 [M] on the
  // communicator's device, read by nothing here (no host sync in the step);
  // undefined on other ranks.
  at::Tensor losses;
  int maxLiveActivations = 0;  // most micro-batches (over this rank's chunks) held for backward at once
};

// Connects every link a pipeline on `pp` uses: a grouped send to and
// receive from each neighbour around the ring, forward then backward (the
// interleaved schedule's wrap from the last stage to the first included),
// `bytes` a message, each under `deadline`. Collective over `pp`; nothing
// on one rank. ProcessGroups warms its pp groups with it, and a Pipeline on
// a GPU its own group (NCCL connects a pair at its first message).
void warmPipelineLinks(Communicator& pp, int64_t bytes, Deadline deadline);

class Pipeline {
 public:
  // On GPUs, connects every link the schedules use (collective over the pp
  // group, bounded by timeoutSeconds or BULKHEAD_INIT_TIMEOUT).
  Pipeline(CommunicatorPtr pp, PipelineOptions options);
  // Forward and backward of every micro-batch (collective over the pp group).
  PipelineResult run(const std::vector<PipelineChunk>& chunks);
  // Forward alone, without autograd (an evaluation): micro-batch m reaches stage s at unit m + s, so every
  // activation is received in the exchange right after its sender computed it. Returns the last stage's
  // losses; nothing is held for a backward. Collective over the pp group.
  PipelineResult evaluate(const std::vector<PipelineChunk>& chunks);

 private:
  CommunicatorPtr pp_;
  PipelineOptions options_;
  std::optional<c10::Stream> stream_;  // GPU: where the pipeline's sends and receives run
  int64_t runs_ = 0;                   // run() calls so far: a message of another run is a DesyncError
};

}  // namespace bulkhead::parallel
