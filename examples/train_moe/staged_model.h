#pragma once
// train_moe's model over a pipeline: this rank's parts of the model (ModelChunk: the built-in MoE
// transformer or a Hugging Face decoder; stage = chunk * pp + pp rank; the layers split evenly over pp x vpp
// stages),
// the schedule that runs them over micro-batches, and, with a tied embedding,
// the sum of its gradients between the first and the last stage. With pp = 1,
// vpp = 1 and one micro-batch it is the whole model in one forward and one
// backward.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "examples/train_moe/model.h"
#include "parallel/pipeline.h"
#include "runtime/communicator.h"
#include "runtime/cuda/host_copy.h"
#include "runtime/deadline.h"

namespace bulkhead::examples {

// A step's loss on its way to the host: the world's sum is all-reduced and
// copied to page-locked memory behind the step's work, and get() waits for
// that alone, not for work queued after it (the optimizer's), so the host
// queues the update without first draining the GPU.
class StepLoss {
 public:
  StepLoss(WorkPtr work, at::Tensor sum, int replicas, Deadline deadline);
  // The mean over every data-parallel rank's tokens, on every rank; raises the
  // all-reduce's error, or TimeoutError past its deadline.
  double get();

 private:
  WorkPtr work_;
  HostCopy copy_;  // behind the all-reduce
  int replicas_;
  Deadline deadline_;
  std::optional<double> value_;
};

struct StagedOptions {
  int virtualStages = 1;  // chunks per pipeline rank (interleaved 1F1B when > 1)
  int microBatches = 1;   // per step; this rank's batch rows must divide by it
};

// Builds the chunk of one part (pipeline stage).
using ChunkFactory = std::function<std::unique_ptr<ModelChunk>(const ModelPart& part)>;

class StagedModel {
 public:
  // ConfigError when the layers do not divide over pp x vpp stages.
  StagedModel(const ModelConfig& config, const parallel::ProcessGroups& groups, StagedOptions options = {});
  // `layers` of chunks the factory builds; `tied`: the last part holds a copy of the first part's embedding.
  StagedModel(int layers, bool tied, const ChunkFactory& factory, const parallel::ProcessGroups& groups,
              StagedOptions options = {});

  // Forward and backward of this rank's micro-batches (microBatches of them,
  // [rows, sequence] each); gradients accumulate in the
  // parameters (the tied embedding's copies hold their sum). Returns the loss,
  // the mean over every data-parallel rank's tokens, on every rank, as a
  // StepLoss to read once the rest of the step is queued.
  // Collective over the world.
  StepLoss forwardBackward(const std::vector<TokenBatch>& microBatches) {
    return reduceLoss(forwardBackwardLocal(microBatches));
  }
  // Its two halves: the forward and backward, which return this rank's
  // contribution to the loss ([1] float64 on the device, zero outside the last
  // stage's tp rank 0) and need no host read at pp 1 (a CUDA graph captures
  // them); and the sum of the contributions over the world.
  at::Tensor forwardBackwardLocal(const std::vector<TokenBatch>& microBatches);
  StepLoss reduceLoss(const at::Tensor& contribution) const;

  // The loss of `microBatches` without a backward or any gradient (a validation), the mean over every
  // data-parallel rank's tokens. Collective over the world.
  StepLoss evaluate(const std::vector<TokenBatch>& microBatches);

  std::vector<parallel::Parameter> parameters() const;
  std::vector<parallel::ShardedTensor> buffers() const;
  // The first MoE layer this rank holds (its stats go in the log), or null.
  const moe::MoELayer* firstMoeLayer() const;

 private:
  std::vector<parallel::PipelineChunk> chunks(const std::vector<TokenBatch>& microBatches);
  at::Tensor contribution(const parallel::PipelineResult& result) const;
  void tieEmbeddingGradients();

  const parallel::ProcessGroups& groups_;
  StagedOptions options_;
  bool tied_;  // the embedding's gradients are summed between the first and the last stage
  std::vector<std::unique_ptr<ModelChunk>> parts_;
  parallel::Pipeline pipeline_;
};

}  // namespace bulkhead::examples
