// The distributed optimizer's step (optim/distributed_optimizer.h): the gradients' norm, then the
// update on the host (one operation per piece, after waiting for the norm) or queued on the device
// (the fused kernels, reading the clip scale and the skip of a non-finite step from the device), and
// the settling of queued steps' norms.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include "optim/clip.h"
#include "optim/distributed_optimizer.h"
#include "optim/fused_update.h"
#include "parallel/tensor_parallel.h"
#include "runtime/cuda/host_copy.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::optim {

namespace detail {

// A norm on its way to the host, copied behind the step's reductions.
// Its collectives' errors are raised when it is read.
struct PendingNorm {
  HostCopy copy;
  Deadline deadline;
  WorkPtr normWork;                // the norm's all-reduce (none on one rank)
  std::vector<WorkPtr> stepWorks;  // the step's reductions and gathers
  std::optional<double> value;

  PendingNorm(const at::Tensor& norm, Deadline deadline, WorkPtr normWork, std::vector<WorkPtr> stepWorks)
      : copy(norm, "DistributedOptimizer: the step's gradient norm"),
        deadline(deadline),
        normWork(std::move(normWork)),
        stepWorks(std::move(stepWorks)) {}
  bool ready() const { return value || copy.ready(); }
  double get() {
    if (value) return *value;
    const double norm = copy.get(deadline, normWork.get()).item<double>();
    // Done on the device by now (they precede the copy), unless one failed: then this raises why.
    for (const WorkPtr& work : stepWorks) work->wait(deadline);
    value = norm;
    return *value;
  }
};

}  // namespace detail

double StepNorm::get() {
  if (!value_) value_ = pending_->get();
  return *value_;
}

std::vector<at::Tensor> DistributedOptimizer::countedPieces() const {
  std::vector<at::Tensor> counted;
  for (const Bucket& bucket : buckets_) {
    if (bucket.instances && bucket.instances->rank() != 0) continue;  // the first instance counts the shard
    const auto& pieces = bucket.pieces[bucket.comm->rank()];
    for (size_t k = 0; k < pieces.size(); ++k)
      if (countsOnThisTpRank(params_[bucket.members[pieces[k].param]], groups_))
        counted.push_back(gradPiece(bucket, k));
  }
  return counted;
}

StepNorm DistributedOptimizer::launchStep(double lr, StepOptions stepOptions) {
  try {
    return queueStep(lr, stepOptions);
  } catch (...) {
    endCycle(/*completed=*/false);  // the next step starts afresh and learns again
    throw;
  }
}

StepNorm DistributedOptimizer::queueStep(double lr, const StepOptions& stepOptions) {
  c10::NoGradGuard noGrad;
  Deadline deadline = stepOptions.deadline.value_or(parallel::collectiveDeadline(options_.timeout));
  settle(/*wait=*/false);
  reduceScatterGradients(deadline);
  const auto device = groups_.world()->device();
  const bool onDevice = fused::available(device);
  const auto normOptions = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor partial = at::zeros({1}, normOptions);
  if (onDevice)
    partial = fused::sumOfSquares(countedPieces(), normOptions);
  else
    for (const at::Tensor& piece : countedPieces()) addSquares(partial, piece);
  // A gradient that changed after its reduction started: every rank skips this update.
  if (!late_.empty()) partial.fill_(std::numeric_limits<double>::quiet_NaN());
  if (onDevice) return deviceUpdate(partial, lr, stepOptions, deadline);
  return StepNorm(hostUpdate(partial, lr, stepOptions, deadline));
}

double DistributedOptimizer::hostUpdate(const at::Tensor& partial, double lr, const StepOptions& stepOptions,
                                        Deadline deadline) {
  double norm = worldNorm(partial, groups_, deadline);
  if (!std::isfinite(norm)) {
    // Every rank holds the same all-reduced norm, so all skip alike. An
    // update from an inf or NaN gradient would write NaN into the master
    // weights and both moments for good (and into every later checkpoint).
    countSkipped(norm);
    endCycle();
    return norm;
  }
  double scale = clipScale(norm, stepOptions.maxGradNorm);
  ++step_;
  stepTensor_.fill_(step_);
  if (scale < 1.0)
    for (Bucket& bucket : buckets_) bucket.gradShard.mul_(scale);
  for (Bucket& bucket : buckets_)
    for (const auto& piece : bucket.pieces[bucket.comm->rank()])
      adamwUpdate(masterPiece(bucket, piece), bucket.gradShard.narrow(0, piece.shardOffset, piece.numel),
                  bucket.expAvg.narrow(0, piece.shardOffset, piece.numel),
                  bucket.expAvgSq.narrow(0, piece.shardOffset, piece.numel), step_, lr,
                  decay_[bucket.members[piece.param]], options_.adamw);
  allGatherParameters(deadline);
  endCycle();
  return norm;
}

StepNorm DistributedOptimizer::deviceUpdate(const at::Tensor& partial, double lr, const StepOptions& stepOptions,
                                            Deadline deadline) {
  std::map<double, fused::AdamWPieces> groups;  // by weight decay
  const bool kernels = fused::kernels(groups_.world()->device());
  for (Bucket& bucket : buckets_) {
    // On one rank the update writes the parameters from their masters in the same pass.
    bucket.paramsWritten = kernels && bucket.distinctMaster() && bucket.layout.ranks() == 1;
    const auto& pieces = bucket.pieces[bucket.comm->rank()];
    for (size_t k = 0; k < pieces.size(); ++k) {
      const ShardLayout::Piece& piece = pieces[k];
      fused::AdamWPieces& group = groups[decay_[bucket.members[piece.param]]];
      group.masters.push_back(masterPiece(bucket, piece));
      group.grads.push_back(gradPiece(bucket, k));
      group.expAvg.push_back(bucket.expAvg.narrow(0, piece.shardOffset, piece.numel));
      group.expAvgSq.push_back(bucket.expAvgSq.narrow(0, piece.shardOffset, piece.numel));
      if (kernels) group.params.push_back(bucket.paramsWritten ? paramRows(bucket, piece) : at::Tensor());
    }
  }
  const CommunicatorPtr& world = groups_.world();
  at::Tensor sum = partial.reshape({1}).contiguous();
  WorkPtr normWork;  // stream-ordered: the host does not wait for it here
  if (world->size() > 1) normWork = world->allReduce(sum, {.op = ReduceOp::Sum, .deadline = deadline});
  const at::Tensor norm = sum.sqrt();
  // Every rank holds the same all-reduced norm, so all skip alike (see hostUpdate).
  const at::Tensor finite = at::isfinite(norm).to(at::kFloat).reshape({});
  if (!deviceStep_.defined()) deviceStep_ = at::full({}, static_cast<double>(step_), finite.options());
  deviceStep_.add_(finite);
  fused::DeviceScalars scalars{.step = deviceStep_, .skip = (1 - finite)};
  if (const double maxNorm = stepOptions.maxGradNorm; maxNorm > 0)  // clipScale's rule, on the device
    scalars.unscale =
        at::where(norm > maxNorm, (norm + 1e-6) / maxNorm, at::ones_like(norm)).to(at::kFloat).reshape({});
  fused::adamw(groups, lr, scalars, options_.adamw);
  allGatherParameters(deadline);
  auto pending = std::make_shared<detail::PendingNorm>(norm, deadline, std::move(normWork), std::move(inFlight_));
  endCycle();
  pending_.push_back(pending);
  return StepNorm(std::move(pending));
}

void DistributedOptimizer::settle(bool wait) const {
  while (!pending_.empty() && (wait || pending_.front()->ready())) {
    const double norm = pending_.front()->get();
    pending_.pop_front();
    if (std::isfinite(norm)) {
      stepTensor_.fill_(++step_);
      continue;
    }
    countSkipped(norm);
  }
}

void DistributedOptimizer::countSkipped(double norm) const {
  ++skippedSteps_;
  if (groups_.world()->rank() == 0)
    log::warn("optim",
              "step skipped on every rank: the global gradient norm is {} (an inf or NaN gradient); the "
              "parameters, the optimizer state and the step count are unchanged ({} skipped so far)",
              norm, skippedSteps_);
}

}  // namespace bulkhead::optim
