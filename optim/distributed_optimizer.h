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
// Overlap (DistributedOptimizerOptions::overlapGradReduce, on by default):
// the reduce-scatters of step 1 start during the backward. Buckets
// (optim/grad_buckets.h) are reduce-scattered in bucket order, each as soon as
// the backward has finished every gradient in it and the buckets before it
// have started, on a stream of their own (on a GPU); step() starts the rest.
// When a gradient is finished is learned in the first step, which reduces
// everything at step(): how many times each parameter's AccumulateGrad runs
// in one step (once per backward, so micro-batches count too). A gradient
// that changes after its bucket started (a parameter used more often than in
// the step counts were learned in) makes that step skip its update on every
// rank (its norm is NaN), and the rank that saw it learns the counts again.
// Gradients the caller changes after the backward (a tied embedding's sum
// across pipeline stages) must be named in reduceAtStep.
//
// Sharding (optim/shard_layout.h): each bucket's flat buffer is cut on row
// boundaries (rows run over all dimensions but the last, so one expert's state
// spreads over the expert-dp ranks too), so each rank's state of a parameter
// is a run of whole rows and exports as one to a few ShardedTensors
// (optim::rowBoxes) under the keys of optim/adamw.h, with the parameter's
// global shape, its offsets plus the box's, and replicaId 0 (for a
// tpReplicated parameter: the tp rank, expert-tp for experts; with instances,
// non-zero outside the first; optim.step: the world rank). A state saved
// under one layout (or by the plain AdamW) loads into another.
//
// Contract: collective over dp x cp, expert dp and (for the norm) the world.
// Every replica passes the same parameters (names, shapes, dtypes) in the
// same order (forward order, for the overlap to pay) and calls step()
// together. Parameter tensors are contiguous, on the groups' device, and hold
// the same values on every replica at construction. A parameter without a
// gradient steps with a zero gradient.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "optim/adamw.h"
#include "optim/grad_buckets.h"
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
  // Reduce-scatter buckets during the backward (see above); off: all at step().
  bool overlapGradReduce = true;
  // bf16 and fp16 gradients reduce-scattered in their own dtype (half the
  // bytes; every addition of the sum rounds to it), then converted to the
  // float32 master dtype; false: converted first, summed in float32.
  bool reduceInParamDtype = false;
  // Gradient bytes (of the reduction dtype) per bucket.
  int64_t bucketBytes = int64_t{64} << 20;
  // Parameters whose gradients the caller changes between the backward and
  // step() (a tied embedding's sum across stages): reduced at step().
  std::set<std::string> reduceAtStep;
};

struct StepOptions {
  double maxGradNorm = 0.0;          // > 0: clip the global gradient norm to this
  std::optional<Deadline> deadline;  // unset: options.timeout from the call
};

namespace detail {
struct PendingNorm;
}

// A step's global gradient norm before clipping. On a GPU it stays on the
// device until get(): the step is queued without the host waiting for it.
class StepNorm {
 public:
  explicit StepNorm(double value) : value_(value) {}
  explicit StepNorm(std::shared_ptr<detail::PendingNorm> pending) : pending_(std::move(pending)) {}
  // Waits for the norm, bounded by the step's deadline (TimeoutError).
  double get();

 private:
  std::shared_ptr<detail::PendingNorm> pending_;
  std::optional<double> value_;
};

class DistributedOptimizer {
 public:
  // Checks, collectively, that every replica passed the same parameters
  // (ConfigError naming the ranks that differ).
  DistributedOptimizer(std::vector<parallel::Parameter> params, const parallel::ProcessGroups& groups,
                       DistributedOptimizerOptions options = {});
  // The state lives in tensors, and the gradient hooks hold this object.
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;
  ~DistributedOptimizer();

  // Steps 1-4 above with learning rate `lr`. Returns the global gradient norm
  // before clipping. A norm that is not finite (an inf or NaN gradient
  // anywhere in the model) skips steps 3 and 4 on every rank alike:
  // parameters, state and stepCount() stay as they were, skippedSteps()
  // counts it, and the caller decides whether to go on.
  double step(double lr, StepOptions options = {}) { return launchStep(lr, options).get(); }
  // The same step, queued: on a GPU the host waits for no GPU work (the clip
  // scale, and the skip of a step whose norm is not finite, are read by the
  // update's kernels from the device), so it goes on to queue the next step's
  // work while this one runs. stepCount() and skippedSteps() count a queued
  // step once its norm is known (they wait for it).
  StepNorm launchStep(double lr, StepOptions options = {});
  // Releases every gradient (as PyTorch's zero_grad(set_to_none=True)): the
  // next backward then writes each one fresh, with no zero fill before it and
  // no add into it.
  void zeroGrad();
  int64_t stepCount() const {
    settle(/*wait=*/true);
    return step_;
  }
  // Steps skipped for a gradient norm that was not finite, since construction.
  int64_t skippedSteps() const {
    settle(/*wait=*/true);
    return skippedSteps_;
  }
  // Buckets, and how many of them the last step started during the backward.
  size_t buckets() const { return buckets_.size(); }
  size_t overlappedBuckets() const { return overlappedBuckets_; }
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
    at::Tensor reduced;                                   // the reduce-scatter's output, in the reduction dtype
    at::Tensor gradShard;  // the reduced gradient in the master dtype, during a step (shardMax long)
    // Instead of gradShard where nothing is reduced (one rank, no instances, no divisor) and the
    // optimizer's kernels run: this rank's pieces of the gradients as they are, in their own dtype.
    std::vector<at::Tensor> gradPieces;
    bool paramsWritten = false;  // this step's update wrote the parameters: nothing to copy at the gather
    bool atStep = false;         // never started during the backward
    // During a step: members whose gradients are not finished yet, and the reduce-scatter once started.
    int waitingFor = 0;
    // On a GPU: one event per stream its gradients were written on, recorded
    // again at each write (kept across steps: no event made per gradient).
    std::vector<std::pair<c10::Stream, c10::Event>> written;
    WorkPtr work;
    bool started = false;
    bool distinctMaster() const { return master.defined(); }
  };

  void checkReplicasAgree(parallel::ParamGroup group, const CommunicatorPtr& comm, Deadline deadline) const;
  at::Tensor paramRows(const Bucket& bucket, const ShardLayout::Piece& piece) const;
  at::Tensor masterPiece(const Bucket& bucket, const ShardLayout::Piece& piece) const;
  // This rank's k-th piece of the bucket's gradient during a step (gradPieces or gradShard).
  at::Tensor gradPiece(const Bucket& bucket, size_t k) const;
  // Whether bucket b's gradients go to the update as they are (see Bucket::gradPieces).
  bool directGradients(const Bucket& bucket) const;
  void reduceScatterGradients(Deadline deadline);
  // Converts bucket b's gradients into its padded float buffer and starts its reduce-scatter.
  void startBucket(size_t b, Deadline deadline);
  void onGradient(size_t param);  // from the hooks
  at::ScalarType reduceType(const Bucket& bucket) const;
  // After a step (taken or skipped): counts learned, everything ready for the
  // next backward. `completed` false: the step raised, and counts are learned again.
  void endCycle(bool completed = true);
  StepNorm queueStep(double lr, const StepOptions& stepOptions);
  std::vector<at::Tensor> countedPieces() const;  // of the gradient shards, for the norm
  // The update after the norm: on the host (CPU), or queued on the device.
  double hostUpdate(const at::Tensor& partial, double lr, const StepOptions& stepOptions, Deadline deadline);
  StepNorm deviceUpdate(const at::Tensor& partial, double lr, const StepOptions& stepOptions, Deadline deadline);
  // Counts the queued steps whose norms are known (all of them, waiting, with `wait`).
  void settle(bool wait) const;
  void countSkipped(double norm) const;  // a step not taken, logged once by rank 0
  void allGatherParameters(Deadline deadline);

  std::vector<parallel::Parameter> params_;
  parallel::ProcessGroups groups_;
  DistributedOptimizerOptions options_;
  std::vector<double> decay_;
  std::vector<Bucket> buckets_;
  mutable int64_t step_ = 0;
  mutable int64_t skippedSteps_ = 0;
  at::Tensor stepTensor_;
  at::Tensor deviceStep_;  // float32 on a GPU: the count the update kernels read
  mutable std::deque<std::shared_ptr<detail::PendingNorm>> pending_;  // queued steps, oldest first

  // The overlap: per parameter, its bucket, its AccumulateGrad runs this step
  // and in the step counts were learned in (empty: learning).
  std::vector<size_t> bucketOf_;
  std::vector<int> runs_, expectedRuns_;
  size_t nextBucket_ = 0;  // the first bucket not started
  std::string late_;       // a parameter whose gradient changed after its bucket started
  size_t overlapping_ = 0, overlappedBuckets_ = 0;
  std::optional<c10::Stream> stream_;  // the reductions' stream on a GPU
  std::mutex mutex_;                   // hooks may run on autograd's threads
  std::vector<WorkPtr> inFlight_;      // this step's collectives, read with its norm on a GPU
  std::unique_ptr<GradientHooks> hooks_;
};

}  // namespace bulkhead::optim
