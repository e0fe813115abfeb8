#include "moe/moe_layer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>

#include "moe/kernel_support.h"
#include "moe/static_dispatch.h"
#include "moe/swiglu.h"
#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::moe {
namespace {

// A dense weight every rank draws the same way (a generator of its own per
// matrix), so no broadcast is needed at start.
at::Tensor replicatedWeight(uint64_t seed, uint64_t kind, std::vector<int64_t> shape, double std,
                            const at::TensorOptions& options) {
  if (std == 0) return at::zeros(shape, options).set_requires_grad(true);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(initSeed(seed, kind, 0));
  return at::empty(shape, at::kDouble).normal_(0.0, std, generator).to(options).set_requires_grad(true);
}

const parallel::ProcessGroups& checkedGroups(const MoEOptions& options, const parallel::ProcessGroups& groups) {
  const auto& layout = groups.layout();
  if ((layout.tp() > 1 || layout.etp() > 1) && groups.expertTp()->members() != groups.tp()->members()) {
    throw ConfigError(
        fmt::format("MoE layer {}: tokens are replicated over the tp group {} ({}), so expert tensor parallelism "
                    "must span the same ranks, but the etp group {} holds {}",
                    options.name, groups.tp()->name(), fmt::join(groups.tp()->members(), ","),
                    groups.expertTp()->name(), fmt::join(groups.expertTp()->members(), ",")),
        {.rank = groups.world()->rank(), .group = groups.tp()->name(), .expected = "etp == tp"});
  }
  if (options.staticShapes && options.router.capacityFactor <= 0) {
    throw ConfigError(fmt::format("MoE layer {}: static shapes need a capacity factor, not {}", options.name,
                                  options.router.capacityFactor),
                      {.rank = groups.world()->rank(), .expected = "router.capacityFactor > 0"});
  }
  if (options.router.numExperts % layout.ep() != 0) {
    throw ConfigError(fmt::format("MoE layer {}: {} experts do not divide over ep {}", options.name,
                                  options.router.numExperts, layout.ep()),
                      {.rank = groups.world()->rank(), .expected = "numExperts a multiple of ep"});
  }
  return groups;
}

// Work on `side` (a stream of the input's device), from the current stream's
// work so far; join() hands its result to the current stream. The input is
// recorded on the side stream and the result on the current one, so the
// caching allocator reuses neither block while the other stream may still
// read it (weights the work reads must outlive it: the layer's do). Without
// a side stream the work runs inline.
class BesideStream {
 public:
  BesideStream(const at::Tensor& input, std::optional<c10::Stream> side, const std::function<at::Tensor()>& work) {
    if (!side) {
      result_ = work();
      return;
    }
    const c10::impl::VirtualGuardImpl device(input.device().type());
    current_.emplace(device.getStream(input.device()));
    c10::Event inputReady(input.device().type());
    inputReady.record(*current_);
    inputReady.block(*side);
    device.recordDataPtrOnStream(input.storage().data_ptr(), *side);
    {
      const c10::StreamGuard onSide(*side);
      result_ = work();
    }
    done_.emplace(input.device().type());
    done_->record(*side);
  }

  at::Tensor join() const {
    if (done_) {
      done_->block(*current_);
      const c10::impl::VirtualGuardImpl device(result_.device().type());
      device.recordDataPtrOnStream(result_.storage().data_ptr(), *current_);
    }
    return result_;
  }

 private:
  at::Tensor result_;
  std::optional<c10::Stream> current_;
  std::optional<c10::Event> done_;
};

}  // namespace

MoELayer::MoELayer(MoEOptions options, const parallel::ProcessGroups& groups, const at::TensorOptions& tensorOptions)
    : options_(std::move(options)),
      dpCp_(checkedGroups(options_, groups).dpCp()),
      worldRank_(groups.world()->rank()),
      tp_(groups.layout().tp()),
      denseReplica_(parallel::TpGroup::dense(groups).replicaId(true)),
      expertDpRank_(groups.expertDp()->rank()),
      gate_(replicatedWeight(options_.seed, 101, {options_.router.numExperts, options_.hidden}, options_.initStd,
                             tensorOptions)),
      router_(options_.router, gate_),
      dispatcher_(
          groups.ep(),
          {.numExperts = options_.router.numExperts, .oncePerRank = options_.oncePerRank, .timeout = options_.timeout}),
      experts_({.numExperts = options_.router.numExperts,
                .hidden = options_.hidden,
                .ffnHidden = options_.ffnHidden,
                .initStd = options_.initStd,
                .seed = options_.seed,
                .groupedMm = options_.groupedMm,
                .timeout = options_.timeout},
               dispatcher_.firstExpert(), dispatcher_.localExperts(), groups.expertTp(), tensorOptions),
      staticExchange_(groups.ep(), dispatcher_.localExperts(), options_.timeout, options_.name) {
  if (options_.sharedExpertHidden > 0) {
    const int64_t hidden = options_.hidden, shared = options_.sharedExpertHidden;
    sharedW13_ = replicatedWeight(options_.seed, 102, {2, shared, hidden}, options_.initStd, tensorOptions);
    sharedW2_ = replicatedWeight(options_.seed, 104, {hidden, shared}, options_.initStd, tensorOptions);
  }
}

at::Tensor MoELayer::noiseKeys(const at::Tensor& tokens, const at::Tensor& routingKeys) {
  const int64_t forward = forwards_++;
  if (!router_.noisy()) return {};
  if (!routingKeys.defined()) return at::arange(tokens.size(0), tokens.options().dtype(at::kLong)) + (forward << 32);
  return routingKeys.reshape({-1}).to(tokens.device());  // the router checks them
}

MoEOutput MoELayer::forward(const at::Tensor& input, const at::Tensor& routingKeys) {
  if (input.size(-1) != options_.hidden) {
    throw ConfigError(fmt::format("MoE layer {}: input of shape [{}] does not end in hidden size {}", options_.name,
                                  fmt::join(input.sizes(), ", "), options_.hidden),
                      {.rank = worldRank_, .expected = "tokens [..., hidden]"});
  }
  // Checked on every rank before any collective: a mismatch found inside the
  // experts would raise only on ranks that received rows.
  if (input.scalar_type() != gate_.scalar_type() || input.device() != gate_.device()) {
    throw ConfigError(fmt::format("MoE layer {}: input of dtype {} on {}, but the layer's weights are {} on {}",
                                  options_.name, c10::toString(input.scalar_type()), input.device().str(),
                                  c10::toString(gate_.scalar_type()), gate_.device().str()),
                      {.rank = worldRank_, .expected = "tokens of the weights' dtype and device"});
  }
  at::Tensor tokens = input.reshape({-1, options_.hidden});
  std::optional<BesideStream> shared;
  if (sharedW13_.defined())
    shared.emplace(tokens, sharedExpertStreamFor(tokens.device()), [&] { return sharedExpert(tokens); });
  const bool capturing = streamCapturing(tokens);
  if (!options_.staticShapes && capturing && !droplessOnDevice(tokens)) throwHostCounts();
  if (options_.router.expertBias && capturing)
    throw ConfigError(fmt::format("MoE layer {}: the expert bias sums the loads of every forward between updates, "
                                  "which a CUDA graph of this layer does not capture; balance with the aux loss",
                                  options_.name),
                      {.rank = worldRank_, .expected = "router.expertBias off when capturing"});
  Routing routing = router_.select(tokens, /*hostCounts=*/!options_.staticShapes, noiseKeys(tokens, routingKeys));
  at::Tensor output = routed(tokens, routing, capturing);
  if (shared) output = output + shared->join();

  lastLoads_ = routing.tokensPerExpert;
  // Every training micro-batch of a step counts towards the bias; an evaluation's forward does not.
  if (options_.router.expertBias && c10::GradMode::is_enabled())
    pendingLoads_ = pendingLoads_.defined() ? pendingLoads_ + lastLoads_ : lastLoads_.clone();
  lastAux_ = routing.auxLoss.detach();
  lastZ_ = routing.zLoss.detach();
  lastDropped_ = routing.droppedSlots;
  lastDroppedOnDevice_ = options_.staticShapes ? routing.dropped : at::Tensor();
  return {output.view(input.sizes()), routing.auxLoss, routing.zLoss};
}

at::Tensor MoELayer::routed(const at::Tensor& tokens, Routing& routing, bool capturing) {
  std::optional<DispatchPlan> plan;
  std::optional<StaticPlan> fixed;
  at::Tensor expertOutput;
  if (options_.staticShapes) {
    const int64_t capacity = staticCapacity(options_.router, tokens.size(0));
    const bool exchanged = dispatcher_.localExperts() < options_.router.numExperts;  // ep > 1
    staticExchange_.check(tokens, capacity, capturing);
    const bool packed = options_.packedStaticRows && !exchanged && experts_.groupedFor(tokens);
    fixed = staticDispatch(tokens, routing, options_.router.numExperts, capacity, packed);
    if (packed)
      expertOutput = experts_.forward(fixed->expertInput, fixed->rowsPerExpert, fixed->rowEnds);
    else if (!exchanged)
      expertOutput = experts_.forwardPadded(fixed->expertInput, fixed->keptRows);
    else  // each expert's rows from every ep rank; after the exchange its kept rows are no longer a prefix
      expertOutput = staticExchange_.fromExperts(
          experts_.forwardPadded(staticExchange_.toExperts(fixed->expertInput, capacity)), capacity);
  } else if (droplessOnDevice(tokens) &&
             (fixed = droplessDispatch(tokens, routing, options_.router.numExperts, /*groupedExperts=*/true))) {
    expertOutput = experts_.forward(fixed->expertInput, {}, fixed->rowEnds);
  } else {
    if (capturing) throwHostCounts();
    plan = dispatcher_.dispatch(tokens, routing);
    expertOutput = experts_.forward(plan->expertInput, plan->tokensPerLocalExpert, plan->expertRowEnds);
  }
  router_.addLosses(routing);  // launched while the experts run (see Router::select)
  if (options_.globalAuxLoss && options_.router.auxLossCoeff != 0) {
    // Under capture the all-reduce goes into the graph (the nccl backend's captured path).
    // Slot counts and the token count, summed over every replica's batch.
    at::Tensor counts =
        at::cat({routing.tokensPerExpert, at::full({1}, tokens.size(0), routing.tokensPerExpert.options())});
    if (dpCp_->size() > 1 || !capturing) {  // under capture at dp 1 the sum is the counts
      const Deadline deadline = parallel::collectiveDeadline(options_.timeout);
      auto work = dpCp_->allReduce(counts, {.deadline = deadline});
      if (!counts.is_cuda()) work->wait(deadline);
    }
    at::Tensor slots = counts.narrow(0, 0, options_.router.numExperts);
    at::Tensor total =
        counts.narrow(0, options_.router.numExperts, 1).to(routing.meanProb.scalar_type()) * options_.router.topK;
    // An empty batch on every replica has no balance to measure: 0, not 0/0.
    routing.auxLoss = router_.switchLoss(slots, 1.0, routing.meanProb) / total.squeeze(0).clamp_min(1);
  }
  return fixed ? staticCombine(*fixed, routing, expertOutput) : dispatcher_.combine(*plan, expertOutput);
}

bool MoELayer::droplessOnDevice(const at::Tensor& tokens) const {
  return options_.router.capacityFactor <= 0 && dispatcher_.localExperts() == options_.router.numExperts &&
         droplessDispatchApplies(tokens, options_.router.numExperts, experts_.groupedFor(tokens));
}

void MoELayer::throwHostCounts() const {
  throw ConfigError(fmt::format("MoE layer {}: dropless dispatch here reads its counts on the host and cannot be "
                                "captured by a CUDA graph; set a capacity factor and MoEOptions::staticShapes",
                                options_.name),
                    {.rank = worldRank_, .expected = "static shapes under CUDA-graph capture"});
}

std::optional<c10::Stream> MoELayer::sharedExpertStreamFor(c10::Device device) {
  if (!options_.overlapSharedExpert || !device.is_cuda()) return std::nullopt;
  // One stream for the layer's life: the caching allocator keeps its blocks
  // per stream, so a new stream each step would allocate afresh each step.
  if (!sharedStream_ || sharedStream_->device() != device)
    sharedStream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
  return sharedStream_;
}

at::Tensor MoELayer::sharedExpert(const at::Tensor& tokens) const {
  const at::Tensor gateUp = at::matmul(tokens, sharedW13_.view({-1, options_.hidden}).t());
  return at::matmul(swiglu(gateUp), sharedW2_.t());
}

MoEStats MoELayer::stats() const {
  MoEStats stats;
  if (!lastLoads_.defined()) return stats;
  // One copy to the host: the loads (exact in float64 below 2^53), then the two losses.
  at::Tensor host =
      at::cat({lastLoads_.to(at::kDouble), lastAux_.to(at::kDouble).view(1), lastZ_.to(at::kDouble).view(1)})
          .to(at::kCPU);
  const int64_t experts = lastLoads_.numel();
  const double* values = host.data_ptr<double>();
  stats.tokensPerExpert.assign(values, values + experts);
  const double total = std::accumulate(stats.tokensPerExpert.begin(), stats.tokensPerExpert.end(), 0.0);
  const auto most = static_cast<double>(*std::max_element(stats.tokensPerExpert.begin(), stats.tokensPerExpert.end()));
  stats.imbalance = total > 0 ? most / (total / static_cast<double>(stats.tokensPerExpert.size())) : 0;
  stats.droppedSlots = lastDroppedOnDevice_.defined() ? lastDroppedOnDevice_.item<int64_t>() : lastDropped_;
  stats.auxLoss = values[experts];
  stats.zLoss = values[experts + 1];
  return stats;
}

std::vector<parallel::Parameter> MoELayer::parameters() const {
  const bool replicatedOverTp = tp_ > 1;
  auto dense = [&](const std::string& name, const at::Tensor& tensor) {
    return parallel::Parameter{.name = options_.name + name,
                               .tensor = tensor,
                               .shard = parallel::ShardInfo::whole(tensor.sizes(), denseReplica_),
                               .group = parallel::ParamGroup::Dense,
                               .tpReplicated = replicatedOverTp};
  };
  std::vector<parallel::Parameter> parameters{dense(".router.weight", gate_)};
  for (auto& expert : experts_.parameters(options_.name + ".experts", expertDpRank_)) parameters.push_back(expert);
  if (sharedW13_.defined()) {
    parameters.push_back(dense(".shared.w13", sharedW13_));
    parameters.push_back(dense(".shared.w2", sharedW2_));
  }
  return parameters;
}

void MoELayer::updateExpertBias(std::optional<Deadline> deadline) {
  if (!options_.router.expertBias || !pendingLoads_.defined()) return;
  at::Tensor loads = std::move(pendingLoads_);
  pendingLoads_ = at::Tensor();
  const Deadline bound = deadline.value_or(parallel::collectiveDeadline(options_.timeout));
  dpCp_->allReduce(loads, {.deadline = bound})->wait(bound);
  router_.updateBias(loads);
}

}  // namespace bulkhead::moe
