#include "optim/distributed_optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>

#include "optim/clip.h"
#include "optim/fused_update.h"
#include "optim/parameter_checks.h"
#include "parallel/grad_sync.h"
#include "parallel/tensor_parallel.h"
#include "runtime/cuda/host_copy.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::optim {
namespace {

using parallel::Parameter;
using parallel::ParamGroup;

const char* groupName(ParamGroup group) { return group == ParamGroup::Expert ? "expert" : "dense"; }

// A stable hash (FNV-1a) of what every replica must agree on: the names,
// shapes and dtypes of one group's parameters, in bucket order.
void mix(uint64_t& hash, uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    hash ^= (value >> (8 * i)) & 0xff;
    hash *= 1099511628211ULL;
  }
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(std::vector<Parameter> params, const parallel::ProcessGroups& groups,
                                           DistributedOptimizerOptions options)
    : params_(std::move(params)), groups_(groups), options_(std::move(options)) {
  c10::NoGradGuard noGrad;
  const CommunicatorPtr& world = groups_.world();
  int me = world->rank();
  detail::checkParameters(params_, world->device(), me, "DistributedOptimizer");
  for (const Parameter& p : params_) decay_.push_back(weightDecayFor(p, options_.adamw));

  Deadline deadline = parallel::collectiveDeadline(options_.timeout);
  checkReplicasAgree(ParamGroup::Dense, groups_.dpCp(), deadline);
  checkReplicasAgree(ParamGroup::Expert, groups_.expertDp(), deadline);

  int64_t divisor = parallel::gradientDivisor(groups_);
  const bool inParamDtype = options_.reduceInParamDtype;
  std::set<std::string> atStep = options_.reduceAtStep;
  for (const Parameter& p : params_)  // no AccumulateGrad to hook: nothing would say when its gradient is done
    if (options_.overlapGradReduce && (!p.tensor.requires_grad() || !p.tensor.is_leaf())) atStep.insert(p.name);
  const auto plans = planBuckets(params_, options_.bucketBytes, atStep, [&](at::ScalarType type) {
    return static_cast<int64_t>(at::elementSize(inParamDtype ? type : masterType(type)));
  });
  bucketOf_.resize(params_.size());
  for (const BucketPlan& plan : plans) {  // every rank plans the same buckets and issues them in this order
    Bucket bucket;
    bucket.group = plan.group;
    bucket.paramType = plan.dtype;
    bucket.masterType = masterType(bucket.paramType);
    bucket.atStep = plan.atStep;
    if (bucket.group == ParamGroup::Expert && groups_.expertDpInterInstance()->size() > 1) {
      bucket.comm = groups_.expertDpIntraInstance();
      bucket.instances = groups_.expertDpInterInstance();
    } else {
      bucket.comm = bucket.group == ParamGroup::Expert ? groups_.expertDp() : groups_.dpCp();
    }
    bucket.divisor = bucket.group == ParamGroup::Expert ? options_.expertDivisor.value_or(divisor) : divisor;
    bucket.members = plan.members;
    std::vector<std::vector<int64_t>> shapes;
    for (size_t i : plan.members) {
      shapes.push_back(params_[i].tensor.sizes().vec());
      bucketOf_[i] = buckets_.size();
    }
    bucket.layout = ShardLayout::create(shapes, bucket.comm->size());
    for (int r = 0; r < bucket.comm->size(); ++r) bucket.pieces.push_back(bucket.layout.pieces(r));

    int64_t length = bucket.layout.shardLength(bucket.comm->rank());
    auto stateOptions = at::TensorOptions().dtype(bucket.masterType).device(world->device());
    const auto momentOptions = stateOptions.dtype(momentTypeFor(bucket.masterType, options_.adamw));
    bucket.expAvg = at::zeros({length}, momentOptions);
    bucket.expAvgSq = at::zeros({length}, momentOptions);
    if (bucket.masterType != bucket.paramType) {
      bucket.master = at::empty({length}, stateOptions);
      for (const auto& piece : bucket.pieces[bucket.comm->rank()])
        bucket.master.narrow(0, piece.shardOffset, piece.numel).copy_(paramRows(bucket, piece));
    }
    buckets_.push_back(std::move(bucket));
  }
  runs_.assign(params_.size(), 0);
  if (options_.overlapGradReduce) {
    const c10::Device device = world->device();
    if (!device.is_cpu())  // high priority: the reductions' kernels go ahead of the backward's queued ones
      stream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device, /*isHighPriority=*/true);
    hooks_ = std::make_unique<GradientHooks>(params_, [this](size_t param) { onGradient(param); });
  }
  stepTensor_ = at::zeros({1}, at::kLong);
}

void DistributedOptimizer::checkReplicasAgree(ParamGroup group, const CommunicatorPtr& comm, Deadline deadline) const {
  if (comm->size() == 1) return;
  std::vector<const Parameter*> mine;  // in the order passed: buckets follow it
  for (const Parameter& p : params_)
    if (p.group == group) mine.push_back(&p);
  uint64_t hash = 1469598103934665603ULL;
  int64_t elements = 0;
  for (const Parameter* p : mine) {
    for (unsigned char c : p->name) mix(hash, c);
    for (int64_t extent : p->tensor.sizes()) mix(hash, static_cast<uint64_t>(extent));
    mix(hash, static_cast<uint64_t>(p->tensor.scalar_type()));
    elements += p->tensor.numel();
  }
  auto options = at::TensorOptions().dtype(at::kLong).device(comm->device());
  at::Tensor fingerprint =
      at::tensor({static_cast<int64_t>(mine.size()), elements, static_cast<int64_t>(hash)}, at::kLong).to(options);
  at::Tensor all = at::empty({comm->size(), 3}, options);
  comm->allGather(fingerprint, all, {.deadline = deadline})->wait(deadline);
  all = all.cpu();
  std::vector<int> differ;
  for (int r = 0; r < comm->size(); ++r)
    if (!at::equal(all[r], all[comm->rank()])) differ.push_back(comm->members()[r]);
  if (!differ.empty())
    throw ConfigError(
        fmt::format("DistributedOptimizer: the {} parameters of world ranks {} differ from this rank's ({} "
                    "parameters, {} elements) in names, shapes, dtypes or order: every replica in {} must pass "
                    "the same parameters in the same order",
                    groupName(group), fmt::join(differ, ","), mine.size(), elements, comm->name()),
        {.rank = groups_.world()->rank(), .group = comm->name(), .expected = "identical parameters on every replica"});
}

at::Tensor DistributedOptimizer::paramRows(const Bucket& bucket, const ShardLayout::Piece& piece) const {
  const at::Tensor& tensor = params_[bucket.members[piece.param]].tensor;
  int64_t rowElems = bucket.layout.params[piece.param].rowElems;
  return tensor.detach().view({-1}).narrow(0, piece.rowBegin * rowElems, piece.numel);
}

at::Tensor DistributedOptimizer::masterPiece(const Bucket& bucket, const ShardLayout::Piece& piece) const {
  return bucket.distinctMaster() ? bucket.master.narrow(0, piece.shardOffset, piece.numel) : paramRows(bucket, piece);
}

DistributedOptimizer::~DistributedOptimizer() {
  hooks_.reset();  // no hook may reach this object from here on
}

at::Tensor DistributedOptimizer::gradPiece(const Bucket& bucket, size_t k) const {
  if (!bucket.gradPieces.empty()) return bucket.gradPieces[k];
  const ShardLayout::Piece& piece = bucket.pieces[bucket.comm->rank()][k];
  return bucket.gradShard.narrow(0, piece.shardOffset, piece.numel);
}

bool DistributedOptimizer::directGradients(const Bucket& bucket) const {
  return fused::kernels(groups_.world()->device()) && bucket.layout.ranks() == 1 && !bucket.instances &&
         bucket.divisor == 1 && bucket.masterType == at::kFloat;
}

void DistributedOptimizer::startBucket(size_t b, Deadline deadline) {
  Bucket& bucket = buckets_[b];
  const ShardLayout& layout = bucket.layout;
  const int ranks = layout.ranks();
  const c10::Device device = groups_.world()->device();
  auto options = at::TensorOptions().dtype(reduceType(bucket)).device(device);
  const bool direct = directGradients(bucket);
  // Allocated on the current stream, which the reduction's stream waits for
  // below, and handed to the communicator, which keeps it from reuse until
  // the reduction is done.
  at::Tensor padded = direct ? at::Tensor() : at::empty({ranks * layout.shardMax}, options);
  bucket.reduced = ranks == 1 ? padded : at::empty({layout.shardMax}, options);
  std::optional<c10::StreamGuard> onStream;
  if (stream_) {  // behind everything queued so far, which wrote these gradients
    const c10::impl::VirtualGuardImpl impl(device.type());
    c10::Event queued(device.type());
    queued.record(impl.getStream(device));
    queued.block(*stream_);
    // And behind each gradient's own stream (a shared expert's runs on one of its own).
    for (const auto& [stream, written] : bucket.written) written.block(*stream_);
    onStream.emplace(*stream_);
  }
  if (direct) {  // the update reads the gradients themselves, ordered behind their writes as above
    for (const auto& piece : bucket.pieces[0]) {
      const at::Tensor& grad = params_[bucket.members[piece.param]].tensor.grad();
      const int64_t rowElems = layout.params[piece.param].rowElems;
      bucket.gradPieces.push_back(grad.defined() ? grad.reshape({-1}).narrow(0, piece.rowBegin * rowElems, piece.numel)
                                                 : at::zeros({piece.numel}, options.dtype(bucket.masterType)));
    }
    bucket.started = true;
    return;
  }
  // Every gradient goes straight into its rows' place in the padded input
  // (rank r's region starts at r * shardMax), converted to the master dtype
  // there: one bucket-sized buffer, not a converted copy of each gradient,
  // their concatenation and then this.
  const bool fusedKernels = fused::available(device);
  std::vector<at::Tensor> into, from;  // on a GPU, converted together in few kernels
  for (int r = 0; r < ranks; ++r) {
    at::Tensor region = padded.narrow(0, r * layout.shardMax, layout.shardMax);
    region.narrow(0, layout.shardLength(r), layout.shardMax - layout.shardLength(r)).zero_();
    for (const auto& piece : bucket.pieces[r]) {
      const at::Tensor& grad = params_[bucket.members[piece.param]].tensor.grad();
      if (!grad.defined()) {
        region.narrow(0, piece.shardOffset, piece.numel).zero_();
        continue;
      }
      const int64_t rowElems = layout.params[piece.param].rowElems;
      const at::Tensor rows = grad.reshape({-1}).narrow(0, piece.rowBegin * rowElems, piece.numel);
      if (!fusedKernels) {
        region.narrow(0, piece.shardOffset, piece.numel).copy_(rows);
        continue;
      }
      into.push_back(region.narrow(0, piece.shardOffset, piece.numel));
      from.push_back(rows);
    }
  }
  if (fusedKernels) fused::copy(into, from);
  if (ranks > 1) {
    bucket.work = bucket.comm->reduceScatter(padded, bucket.reduced, {.op = ReduceOp::Sum, .deadline = deadline});
    inFlight_.push_back(bucket.work);
  }
  bucket.started = true;
}

at::ScalarType DistributedOptimizer::reduceType(const Bucket& bucket) const {
  return options_.reduceInParamDtype ? bucket.paramType : bucket.masterType;
}

void DistributedOptimizer::onGradient(size_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++runs_[param];
  if (expectedRuns_.empty()) return;  // learning: everything is reduced at step()
  Bucket& bucket = buckets_[bucketOf_[param]];
  if (bucket.started) {
    if (late_.empty()) late_ = params_[param].name;
    return;
  }
  if (stream_) {  // where this gradient was written
    const c10::Device device = groups_.world()->device();
    const c10::Stream current = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
    auto it = std::find_if(bucket.written.begin(), bucket.written.end(),
                           [&](const auto& entry) { return entry.first == current; });
    if (it == bucket.written.end())
      it = bucket.written.emplace(bucket.written.end(), current, c10::Event(device.type()));
    it->second.record(current);
  }
  if (runs_[param] != expectedRuns_[param] || --bucket.waitingFor > 0) return;
  // In bucket order only, so that every rank issues the same sequence.
  while (nextBucket_ < buckets_.size() && !buckets_[nextBucket_].atStep && buckets_[nextBucket_].waitingFor == 0) {
    startBucket(nextBucket_, parallel::collectiveDeadline(options_.timeout));
    ++nextBucket_;
    ++overlapping_;
  }
}

void DistributedOptimizer::reduceScatterGradients(Deadline deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (; nextBucket_ < buckets_.size(); ++nextBucket_) startBucket(nextBucket_, deadline);
  if (stream_) {  // the update reads the shards on the current stream
    const c10::Device device = groups_.world()->device();
    c10::Event reduced(device.type());
    reduced.record(*stream_);
    reduced.block(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  // On a GPU the work is ordered on the streams: nothing for the host to wait for.
  const bool hostWaits = groups_.world()->device().is_cpu();
  for (Bucket& bucket : buckets_) {
    if (bucket.work && hostWaits) bucket.work->wait(deadline);
    if (bucket.reduced.defined())
      bucket.gradShard = bucket.reduced.to(bucket.masterType);  // the same where reduced in it
    bucket.reduced = at::Tensor();
  }
  std::vector<WorkPtr> works;
  for (Bucket& bucket : buckets_)  // the other instances' sums of the same shard
    if (bucket.instances)
      works.push_back(bucket.instances->allReduce(bucket.gradShard, {.op = ReduceOp::Sum, .deadline = deadline}));
  inFlight_.insert(inFlight_.end(), works.begin(), works.end());
  if (hostWaits)
    for (const WorkPtr& work : works) work->wait(deadline);
  for (Bucket& bucket : buckets_)
    if (bucket.divisor != 1) bucket.gradShard.div_(bucket.divisor);
}

void DistributedOptimizer::endCycle(bool completed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!completed) {  // a step that raised: what it counted is not a step's
    expectedRuns_.clear();
  } else if (!late_.empty()) {
    log::warn("optim",
              "the gradient of {} changed after its bucket's reduction had started (it was used more often in this "
              "step than in the step the overlap learned from): this step's update is skipped on every rank and "
              "the overlap learns again",
              late_);
    expectedRuns_.clear();
  } else if (expectedRuns_.empty() && hooks_ && std::any_of(runs_.begin(), runs_.end(), [](int n) { return n > 0; })) {
    expectedRuns_ = runs_;  // a step with no backward (gradients set by hand) teaches nothing
  }
  late_.clear();
  overlappedBuckets_ = overlapping_;
  overlapping_ = 0;
  nextBucket_ = 0;
  inFlight_.clear();
  for (Bucket& bucket : buckets_) {
    bucket.gradShard = at::Tensor();  // not held between steps
    bucket.gradPieces.clear();
    bucket.paramsWritten = false;
    bucket.reduced = at::Tensor();
    bucket.work.reset();
    bucket.started = false;
    bucket.waitingFor = 0;
  }
  if (!expectedRuns_.empty())
    for (size_t i = 0; i < params_.size(); ++i)
      if (expectedRuns_[i] > 0) ++buckets_[bucketOf_[i]].waitingFor;
  std::fill(runs_.begin(), runs_.end(), 0);
}

void DistributedOptimizer::allGatherParameters(Deadline deadline) {
  std::vector<at::Tensor> gathered(buckets_.size());
  std::vector<WorkPtr> works;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    int ranks = bucket.layout.ranks(), me = bucket.comm->rank();
    if (ranks == 1) continue;
    auto options = at::TensorOptions().dtype(bucket.paramType).device(groups_.world()->device());
    at::Tensor send = at::zeros({bucket.layout.shardMax}, options);
    for (const auto& piece : bucket.pieces[me])
      send.narrow(0, piece.shardOffset, piece.numel).copy_(masterPiece(bucket, piece));
    gathered[b] = at::empty({ranks * bucket.layout.shardMax}, options);
    works.push_back(bucket.comm->allGather(send, gathered[b], {.deadline = deadline}));
  }
  inFlight_.insert(inFlight_.end(), works.begin(), works.end());
  if (groups_.world()->device().is_cpu())  // on a GPU the copies below are ordered behind the gathers
    for (const WorkPtr& work : works) work->wait(deadline);
  std::vector<at::Tensor> into, from;  // copies done together at the end
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.paramsWritten) continue;  // by the update itself
    int ranks = bucket.layout.ranks(), me = bucket.comm->rank();
    for (int r = 0; r < ranks; ++r) {
      // This rank's own rows already hold the update when the parameter is the master.
      if (r == me && !bucket.distinctMaster()) continue;
      for (const auto& piece : bucket.pieces[r]) {
        into.push_back(paramRows(bucket, piece));
        from.push_back(ranks == 1 ? masterPiece(bucket, piece)
                                  : gathered[b].narrow(0, r * bucket.layout.shardMax + piece.shardOffset, piece.numel));
      }
    }
  }
  if (fused::available(groups_.world()->device())) return fused::copy(into, from);
  for (size_t i = 0; i < into.size(); ++i) into[i].copy_(from[i]);
}

void DistributedOptimizer::zeroGrad() {
  for (const Parameter& param : params_) param.tensor.mutable_grad() = at::Tensor();
}

int64_t DistributedOptimizer::stateElements() const {
  int64_t elements = 0;
  for (const Bucket& bucket : buckets_) elements += bucket.expAvg.numel() * (bucket.distinctMaster() ? 3 : 2);
  return elements;
}

std::vector<parallel::ShardedTensor> DistributedOptimizer::state() {
  settle(/*wait=*/true);  // optim.step counts every queued step
  std::vector<parallel::ShardedTensor> state;
  for (const Bucket& bucket : buckets_) {
    for (const auto& piece : bucket.pieces[bucket.comm->rank()]) {
      const Parameter& p = params_[bucket.members[piece.param]];
      const std::vector<int64_t> local = p.tensor.sizes().vec();
      int replicaId = 0;
      if (p.tpReplicated) {
        const CommunicatorPtr& tp = p.group == ParamGroup::Expert ? groups_.expertTp() : groups_.tp();
        replicaId = tp->rank();
        if (bucket.instances) replicaId += tp->size() * bucket.instances->rank();
      } else if (bucket.instances) {
        replicaId = bucket.instances->rank();  // every instance holds this shard: the first writes it
      }
      if (p.pipelineCopy) replicaId += 1 << 16;  // the owning stage writes it
      const std::string prefix = "optim." + p.name;
      int64_t shardOffset = piece.shardOffset;  // of the next box, which follows the one before
      for (const Box& box : rowBoxes(local, piece.rowBegin, piece.rowBegin + piece.rows)) {
        parallel::ShardInfo shard{p.shard.globalShape, p.shard.offsets, replicaId};
        for (size_t d = 0; d < box.offsets.size(); ++d) shard.offsets[d] += box.offsets[d];
        const int64_t numel = std::accumulate(box.extents.begin(), box.extents.end(), int64_t{1}, std::multiplies<>());
        auto view = [&](const at::Tensor& flat) { return flat.narrow(0, shardOffset, numel).view(box.extents); };
        if (bucket.distinctMaster()) state.push_back({prefix + ".master", view(bucket.master), shard});
        state.push_back({prefix + ".exp_avg", view(bucket.expAvg), shard});
        state.push_back({prefix + ".exp_avg_sq", view(bucket.expAvgSq), shard});
        shardOffset += numel;
      }
    }
  }
  state.push_back({"optim.step", stepTensor_, {{1}, {0}, groups_.world()->rank()}});
  return state;
}

void DistributedOptimizer::restart() {
  for (Bucket& bucket : buckets_) {
    bucket.expAvg.zero_();
    bucket.expAvgSq.zero_();
    if (!bucket.distinctMaster()) continue;
    for (const auto& piece : bucket.pieces[bucket.comm->rank()])
      bucket.master.narrow(0, piece.shardOffset, piece.numel).copy_(paramRows(bucket, piece));
  }
  settle(/*wait=*/true);
  step_ = 0;
  stepTensor_.fill_(0);
  deviceStep_ = at::Tensor();  // made again from step_ at the next update
}

void DistributedOptimizer::afterLoad() {
  pending_.clear();            // the loaded state replaces what queued steps would count
  deviceStep_ = at::Tensor();  // made again from step_ at the next update
  step_ = stepTensor_.item<int64_t>();
  if (step_ < 0)
    throw CheckpointError(
        fmt::format("DistributedOptimizer: the loaded optim.step is {}; a step count cannot be negative", step_),
        {.rank = groups_.world()->rank(), .expected = "optim.step >= 0"});
}

}  // namespace bulkhead::optim
