#pragma once
// The distributed optimizer (ZeRO-1 / Megatron-LM's distributed optimizer):
// AdamW whose state is sharded across data-parallel replicas. Dense
// parameters shard over the dp x cp group, expert parameters over the
// expert-dp group; with LayoutOptions::optimizerInstances = n > 1, over each
// of the n parts of it (expert dp intra-instance), every part holding the
// whole state (Megatron-LM's partial distributed optimizer: n times the state
// memory, all-gathers within a part). Each step:
//   1. reduce-scatter the gradients (every replica's full gradient in, this
//      rank's shard of the sum out; with instances, within this rank's part,
//      then all-reduced across the parts), divided by
//      parallel::gradientDivisor: the dense dp x cp size for both groups
//      (parallel/grad_sync.h says why);
//   2. the global gradient norm (optim/clip.h) over the shards, and clipping
//      (a norm that is not finite skips 3 and 4);
//   3. AdamW (optim::adamwUpdate, the plain optimizer's function) on this
//      rank's shard of the master weights and moments;
//   4. all-gather the updated parameters into every replica's tensors.
//
// Sharding (optim/shard_layout.h): parameters of one group and dtype form a
// bucket, ordered by name; its flat buffer is cut on row boundaries (rows run
// over all dimensions but the last, so one expert's state spreads over the
// expert-dp ranks too), so each rank's state of a parameter is a run of whole
// rows and exports as one to a few ShardedTensors (optim::rowBoxes) under the
// keys of optim/adamw.h, with the parameter's global shape, its offsets plus
// the box's, and replicaId 0 (for a tpReplicated parameter: the tp rank,
// expert-tp for experts; with instances, non-zero outside the first;
// optim.step: the world rank). A state saved under one layout (or by the
// plain AdamW) loads into another.
//
// Contract: collective over dp x cp, expert dp and (for the norm) the world.
// Every replica passes the same parameters (names, shapes, dtypes; any order)
// and calls step() together. Parameter tensors are contiguous, on the groups'
// device, and hold the same values on every replica at construction. A
// parameter without a gradient steps with a zero gradient.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <optional>
#include <vector>

#include "optim/adamw.h"
#include "optim/shard_layout.h"
#include "parallel/parameter.h"
#include "parallel/process_groups.h"

namespace bulkhead::optim {

struct DistributedOptimizerOptions {
  AdamWOptions adamw;
  // Covers a whole step (and construction's check); unset:
  // BULKHEAD_COLLECTIVE_TIMEOUT from the call.
  std::optional<std::chrono::milliseconds> timeout;
  // Expert gradients summed over expert dp are divided by this; unset:
  // parallel::gradientDivisor(groups) (the dense dp x cp size).
  std::optional<int64_t> expertDivisor;
};

struct StepOptions {
  double maxGradNorm = 0.0;          // > 0: clip the global gradient norm to this
  std::optional<Deadline> deadline;  // unset: options.timeout from the call
};

class DistributedOptimizer {
 public:
  // Checks, collectively, that every replica passed the same parameters
  // (ConfigError naming the ranks that differ).
  DistributedOptimizer(std::vector<parallel::Parameter> params, const parallel::ProcessGroups& groups,
                       DistributedOptimizerOptions options = {});
  // The state lives in tensors; a copy would share it.
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;
  DistributedOptimizer(DistributedOptimizer&&) = default;
  DistributedOptimizer& operator=(DistributedOptimizer&&) = default;

  // Steps 1-4 above with learning rate `lr`. Returns the global gradient norm
  // before clipping. A norm that is not finite (an inf or NaN gradient
  // anywhere in the model) skips steps 3 and 4 on every rank alike:
  // parameters, state and stepCount() stay as they were, skippedSteps()
  // counts it, and the caller decides whether to go on.
  double step(double lr, StepOptions options = {});
  // Releases every gradient (as PyTorch's zero_grad(set_to_none=True)): the
  // next backward then writes each one fresh, with no zero fill before it and
  // no add into it.
  void zeroGrad();
  int64_t stepCount() const { return step_; }
  // Steps skipped for a gradient norm that was not finite, since construction.
  int64_t skippedSteps() const { return skippedSteps_; }
  const std::vector<parallel::Parameter>& parameters() const { return params_; }
  // Elements of master weights (when distinct) and moments this rank holds.
  int64_t stateElements() const;

  // Views of the live state of this rank's shards (keys in optim/adamw.h).
  // Save: read them (copy first if the save outlives the next step). Load:
  // use them as targets, filled in place, then call afterLoad().
  std::vector<parallel::ShardedTensor> state();
  // Takes in the loaded step count.
  void afterLoad();
  // Starts afresh from the parameters as they are now, for a load that carried
  // weights but no optimizer state (an imported checkpoint): moments zero,
  // step 0, master weights copied from the parameters. Local.
  void restart();

 private:
  struct Bucket {
    parallel::ParamGroup group;
    at::ScalarType paramType, masterType;
    CommunicatorPtr comm;       // the ranks the bucket is sharded over
    CommunicatorPtr instances;  // with optimizer instances (expert buckets): the same shard in the others
    int64_t divisor = 1;
    std::vector<size_t> members;  // indices into params_, in bucket order
    ShardLayout layout;
    std::vector<std::vector<ShardLayout::Piece>> pieces;  // per rank of comm
    at::Tensor master;                                    // this rank's shard, when distinct from the parameters
    at::Tensor expAvg, expAvgSq;                          // this rank's shard
    at::Tensor gradShard;                                 // the reduced gradient, during a step (shardMax long)
    bool distinctMaster() const { return master.defined(); }
  };

  void checkReplicasAgree(parallel::ParamGroup group, const CommunicatorPtr& comm, Deadline deadline) const;
  at::Tensor paramRows(const Bucket& bucket, const ShardLayout::Piece& piece) const;
  at::Tensor masterPiece(const Bucket& bucket, const ShardLayout::Piece& piece) const;
  void reduceScatterGradients(Deadline deadline);
  void allGatherParameters(Deadline deadline);

  std::vector<parallel::Parameter> params_;
  parallel::ProcessGroups groups_;
  DistributedOptimizerOptions options_;
  std::vector<double> decay_;
  std::vector<Bucket> buckets_;
  int64_t step_ = 0;
  int64_t skippedSteps_ = 0;
  at::Tensor stepTensor_;
};

}  // namespace bulkhead::optim
