#include "moe/router.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <utility>

#include "moe/router_noise.h"
#include "moe/router_scores.h"
#include "runtime/errors.h"

namespace bulkhead::moe {

Router::Router(RouterOptions options, at::Tensor gateWeight) : options_(options), gate_(std::move(gateWeight)) {
  if (options_.numExperts < 1 || options_.topK < 1 || options_.topK > options_.numExperts) {
    throw ConfigError(
        fmt::format("router: top-k {} of {} experts is not a valid choice", options_.topK, options_.numExperts),
        {.expected = "1 <= topK <= numExperts"});
  }
  if (gate_.dim() != 2 || gate_.size(0) != options_.numExperts) {
    throw ConfigError(fmt::format("router: gate weight of shape {} does not score {} experts",
                                  fmt::join(gate_.sizes(), " x "), options_.numExperts),
                      {.expected = "gate weight [numExperts, hidden]"});
  }
  if (!(options_.selectionNoise >= 0) || !std::isfinite(options_.selectionNoise)) {
    throw ConfigError(fmt::format("router: selection noise {} is not a standard deviation", options_.selectionNoise),
                      {.expected = "selectionNoise >= 0 (0: off)"});
  }
  if (options_.capacityFactor < 0) {
    throw ConfigError(fmt::format("router: capacity factor {} is negative", options_.capacityFactor),
                      {.expected = "0 (dropless) or a positive factor"});
  }
  bias_ = at::zeros({options_.numExperts}, gate_.options().dtype(at::kFloat));
}

bool Router::noisy() const { return options_.selectionNoise > 0 && c10::GradMode::is_enabled(); }

Routing Router::route(const at::Tensor& tokens, const at::Tensor& noiseKeys) const {
  Routing routing = select(tokens, /*hostCounts=*/true, noiseKeys);
  addLosses(routing);
  return routing;
}

Routing Router::select(const at::Tensor& tokens, bool hostCounts, const at::Tensor& noiseKeys) const {
  const int64_t numTokens = tokens.size(0);
  const int64_t numExperts = options_.numExperts;
  // Scores in at least float32: bf16 softmax over many experts loses the ranking.
  const bool doubleScores = tokens.scalar_type() == at::kDouble && !options_.float32Scores;
  const auto scoreType = doubleScores ? at::kDouble : at::kFloat;
  at::Tensor keys;  // defined where the selection adds noise
  if (noisy()) {
    if (!noiseKeys.defined() || noiseKeys.numel() != numTokens || noiseKeys.device() != tokens.device() ||
        noiseKeys.scalar_type() != at::kLong)
      throw ConfigError(fmt::format("router: selection noise needs an int64 key for each of the {} tokens on {}",
                                    numTokens, tokens.device().str()),
                        {.expected = "noiseKeys [T] int64 on the tokens' device"});
    keys = noiseKeys;
  }
  Routing routing;
  if (options_.float32Scores)  // Hugging Face's routers: logits rounded to the tokens' dtype, then float32
    routing.logits = at::matmul(tokens, gate_.to(tokens.scalar_type()).t()).to(at::kFloat);
  else if (auto mixed = mixedPrecisionLogits(tokens, gate_))
    routing.logits = std::move(*mixed);
  else
    routing.logits = at::matmul(tokens.to(scoreType), gate_.to(scoreType).t());
  if (auto fused = fusedScores(routing.logits, options_, options_.expertBias ? bias_ : at::Tensor(), keys)) {
    routing.indices = std::move(fused->indices);
    routing.weights = std::move(fused->weights);
    routing.tokensPerExpert = std::move(fused->tokensPerExpert);
    routing.probSum = std::move(fused->probSum);
    routing.lseSquaredSum = std::move(fused->lseSquaredSum);
    routing.keep = std::move(fused->keep);
  } else {
    routing.scores = options_.scoreFunction == ScoreFunction::Softmax ? at::softmax(routing.logits, -1)
                                                                      : at::sigmoid(routing.logits);
    at::Tensor selection =
        options_.expertBias ? routing.scores.detach() + bias_.to(scoreType) : routing.scores.detach();
    if (keys.defined())
      selection = selection + selectionNoise(keys, numExperts, options_.selectionNoise, options_.noiseSeed, scoreType);
    routing.indices = std::get<1>(at::topk(selection, options_.topK, -1));
    routing.weights = routing.scores.gather(1, routing.indices);
    if (options_.normalizeWeights) routing.weights = routing.weights / routing.weights.sum(-1, true);
  }

  if (options_.capacityFactor > 0) {
    const auto capacity = static_cast<int64_t>(
        std::ceil(options_.capacityFactor * static_cast<double>(numTokens * options_.topK) / numExperts));
    routing.position = capacityPosition(routing.indices, routing.weights.detach(), options_.numExperts);
    routing.keep = routing.position < capacity;
    routing.dropped = routing.keep.numel() - routing.keep.sum();
    if (hostCounts) routing.droppedSlots = routing.dropped.item<int64_t>();
  } else if (!routing.keep.defined()) {
    routing.keep = at::ones_like(routing.indices, routing.indices.options().dtype(at::kBool));
  }
  return routing;
}

void Router::addLosses(Routing& routing) const {
  const int64_t numTokens = routing.indices.size(0);
  const int64_t numExperts = options_.numExperts;
  if (!routing.tokensPerExpert.defined()) routing.tokensPerExpert = countValues(routing.indices, numExperts);
  if (routing.probSum.defined()) {
    routing.meanProb = routing.probSum / static_cast<double>(numTokens);
  } else if (numTokens > 0) {
    at::Tensor probs = options_.scoreFunction == ScoreFunction::Softmax ? routing.scores
                                                                        : routing.scores / routing.scores.sum(-1, true);
    routing.meanProb = probs.mean(0);
  } else {
    routing.meanProb = at::zeros({numExperts}, routing.logits.options());
  }
  routing.auxLoss = numTokens > 0 ? switchLoss(routing.tokensPerExpert, static_cast<double>(numTokens * options_.topK),
                                               routing.meanProb)
                                  : at::zeros({}, routing.logits.options());
  if (options_.zLossCoeff != 0 && routing.lseSquaredSum.defined()) {
    routing.zLoss = routing.lseSquaredSum * (options_.zLossCoeff / static_cast<double>(numTokens));
  } else if (options_.zLossCoeff != 0 && numTokens > 0) {
    routing.zLoss = options_.zLossCoeff * at::logsumexp(routing.logits, -1).pow(2).mean();
  } else {
    routing.zLoss = at::zeros({}, routing.logits.options());
  }
}

at::Tensor Router::switchLoss(const at::Tensor& slotsPerExpert, double totalSlots, const at::Tensor& meanProb) const {
  if (options_.auxLossCoeff == 0 || totalSlots == 0) return at::zeros({}, meanProb.options());
  at::Tensor fraction = slotsPerExpert.to(meanProb.scalar_type()) / totalSlots;
  return options_.auxLossCoeff * options_.numExperts * (fraction * meanProb).sum();
}

void Router::updateBias(const at::Tensor& loads) {
  at::Tensor load = loads.to(bias_.device(), at::kFloat);
  at::Tensor error = load.mean() - load;  // > 0: underloaded
  bias_.add_(at::sign(error), options_.biasUpdateRate);
}

at::Tensor countValues(const at::Tensor& values, int64_t bins) {
  at::Tensor flat = values.reshape(-1);
  return at::zeros({bins}, flat.options().dtype(at::kLong)).scatter_add_(0, flat, at::ones_like(flat, at::kLong));
}

at::Tensor capacityKeep(const at::Tensor& indices, const at::Tensor& weights, int numExperts, int64_t capacity) {
  return capacityPosition(indices, weights, numExperts) < capacity;
}

at::Tensor capacityPosition(const at::Tensor& indices, const at::Tensor& weights, int numExperts) {
  if (auto kernels = capacityPositionKernels(indices, weights, numExperts)) return *kernels;
  const int64_t slots = indices.numel();
  at::Tensor flatExperts = indices.reshape(-1);
  // Rank slots by weight (descending, ties by slot order), then group by
  // expert keeping that rank: position within the group decides.
  at::Tensor order;
  if (weights.scalar_type() == at::kFloat) {
    // One stable sort of (expert, weight descending) as 64-bit keys: a float's
    // bits, flipped so that they order as unsigned integers do, below the expert.
    const int64_t two32 = int64_t{1} << 32;
    at::Tensor bits = weights.reshape(-1).contiguous().view(at::kInt).to(at::kLong);
    at::Tensor unsignedBits = at::bitwise_and(bits, two32 - 1);
    at::Tensor ascending = at::where(bits.ge(0), unsignedBits + (two32 >> 1), two32 - 1 - unsignedBits);
    at::Tensor keys = flatExperts * two32 + (two32 - 1 - ascending);
    order = std::get<1>(at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  } else {
    at::Tensor byWeight = std::get<1>(at::sort(weights.reshape(-1), /*stable=*/true, /*dim=*/0, /*descending=*/true));
    at::Tensor expertsByWeight = flatExperts.index_select(0, byWeight);
    at::Tensor byExpert = std::get<1>(at::sort(expertsByWeight, /*stable=*/true, 0, false));
    order = byWeight.index_select(0, byExpert);  // slots grouped by expert, best first
  }
  at::Tensor counts = countValues(flatExperts, numExperts);
  at::Tensor groupStart = at::cumsum(counts, 0) - counts;
  at::Tensor sortedExperts = flatExperts.index_select(0, order);
  at::Tensor position = at::arange(slots, indices.options()) - groupStart.index_select(0, sortedExperts);
  at::Tensor placed = at::empty({slots}, indices.options());
  placed.index_put_({order}, position);
  return placed.view(indices.sizes());
}

}  // namespace bulkhead::moe
