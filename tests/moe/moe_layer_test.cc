// The MoE layer under mpirun (8 ranks, MPI backend, float64): every layout
// computes the same function as a reference layer that holds all experts,
// run locally on every shard of the global input.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moe/moe_layer.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"
#include "tests/support/mpi_helpers.h"

namespace bulkhead::moe {
namespace {

constexpr int kShards = 8;  // the global input: 8 shards of tokens
constexpr int kEmptyShard = 3;
constexpr int kTokens = 10, kHidden = 8, kFfn = 12, kExperts = 16, kTopK = 4;

using testing::gaussian;
at::Tensor shardTokens(int shard) { return gaussian(100 + shard, {shard == kEmptyShard ? 0 : kTokens, kHidden}); }
at::Tensor shardProjection(int shard) { return gaussian(200 + shard, {shard == kEmptyShard ? 0 : kTokens, kHidden}); }
// Each token's routing key: its place in the global input, whichever rank holds it.
at::Tensor shardKeys(int shard) {
  return at::arange(shard == kEmptyShard ? 0 : kTokens, at::kLong) + int64_t{shard} * kTokens;
}

MoEOptions layerOptions(bool oncePerRank, double capacity, bool losses, double noise = 0) {
  return {.hidden = kHidden,
          .ffnHidden = kFfn,
          .router = {.numExperts = kExperts,
                     .topK = kTopK,
                     .auxLossCoeff = losses ? 0.05 : 0,
                     .zLossCoeff = losses ? 0.01 : 0,
                     .expertBias = true,
                     .biasUpdateRate = 100,
                     .capacityFactor = capacity,
                     .selectionNoise = noise,
                     .noiseSeed = 5},
          .oncePerRank = oncePerRank,
          .sharedExpertHidden = 6,
          .initStd = 0.3,
          .seed = 77};
}

// Experts 4-7 and 12 are made to look overloaded: the bias keeps every token
// away from them, so at ep 4 rank 1 (and at ep 8 ranks 2 and 3) receive no
// token at all; with tp 2 x ep 4, a whole etp group then runs its collectives
// on zero rows. At ep 2, 4 and 8, expert 12 leaves one expert of a rank empty.
constexpr int kStarved[] = {4, 5, 6, 7, 12};
void starveExperts(MoELayer& layer) {
  at::Tensor loads = at::ones({kExperts}, at::kLong);
  for (int expert : kStarved) loads[expert] = 1000;
  layer.router().updateBias(loads);
}

at::Tensor parameterNamed(const MoELayer& layer, const std::string& suffix) {
  for (auto& parameter : layer.parameters())
    if (parameter.name == layer.options().name + suffix) return parameter.tensor;
  FAIL("no parameter " << suffix);
  return {};
}

// What the combine's gather-sums rely on (SourceRows::Every): the table's
// listed entries are a permutation of [0, rows).
bool namesEveryRowOnce(const at::Tensor& table, int64_t rows) {
  const at::Tensor listed = table.masked_select(table.ge(0));
  return at::equal(std::get<0>(listed.sort()), at::arange(rows, listed.options()));
}

int64_t total(const std::vector<int64_t>& values) {
  int64_t sum = 0;
  for (int64_t value : values) sum += value;
  return sum;
}

double relativeError(const at::Tensor& value, const at::Tensor& reference) {
  const double scale = reference.numel() ? reference.abs().max().item<double>() : 0;
  const double error = value.numel() ? (value - reference).abs().max().item<double>() : 0;
  return scale > 0 ? error / scale : error;
}

struct Reference {
  std::vector<at::Tensor> outputs, inputGrads;
  std::vector<int64_t> dropped;
  MoELayer* layer;
};

// All experts on every rank (ep 1): the layer's forward is local, so every
// rank runs all shards and owns the global gradients.
Reference referenceRun(MoELayer& layer) {
  Reference reference{.layer = &layer};
  at::Tensor loss = at::zeros({}, at::kDouble);
  std::vector<at::Tensor> inputs;
  for (int shard = 0; shard < kShards; ++shard) {
    inputs.push_back(shardTokens(shard).requires_grad_(true));
    MoEOutput out = layer.forward(inputs.back(), shardKeys(shard));
    loss = loss + (out.output * shardProjection(shard)).sum() + out.auxLoss + out.zLoss;
    reference.outputs.push_back(out.output.detach());
    reference.dropped.push_back(layer.stats().droppedSlots);
  }
  loss.backward();
  for (auto& input : inputs) reference.inputGrads.push_back(input.grad());
  return reference;
}

void checkLayout(const Reference& reference, parallel::LayoutOptions layoutOptions, const MoEOptions& options) {
  auto& world = testing::world();
  auto groups = parallel::ProcessGroups::create(testing::worldPtr(), layoutOptions, {.warmup = false});
  const auto& layout = groups.layout();
  MoELayer layer(options, groups, at::kDouble);
  starveExperts(layer);

  // Tokens replicated over tp: dp rank d holds shards [d * tp, (d + 1) * tp).
  std::vector<int> shards;
  for (int shard = groups.dp()->rank() * layout.tp(); shard < (groups.dp()->rank() + 1) * layout.tp(); ++shard)
    shards.push_back(shard);
  std::vector<at::Tensor> tokenParts, projectionParts, keyParts;
  for (int shard : shards) {
    tokenParts.push_back(shardTokens(shard));
    projectionParts.push_back(shardProjection(shard));
    keyParts.push_back(shardKeys(shard));
  }
  at::Tensor tokens = at::cat(tokenParts).requires_grad_(true);
  MoEOutput out = layer.forward(tokens, at::cat(keyParts));
  ((out.output * at::cat(projectionParts)).sum() + out.auxLoss + out.zLoss).backward();

  INFO(fmt::format("rank {} layout {} oncePerRank {} capacity {} noise {}", world.rank(), layout.describe(),
                   options.oncePerRank, options.router.capacityFactor, options.router.selectionNoise));
  std::vector<at::Tensor> expectedOut, expectedGrad;
  int64_t expectedDropped = 0;
  for (int shard : shards) {
    expectedOut.push_back(reference.outputs[shard]);
    expectedGrad.push_back(reference.inputGrads[shard]);
    expectedDropped += reference.dropped[shard];
  }
  CHECK(relativeError(out.output, at::cat(expectedOut)) < 1e-10);
  CHECK(relativeError(tokens.grad(), at::cat(expectedGrad)) < 1e-10);
  CHECK(layer.stats().auxLoss == out.auxLoss.item<double>());
  CHECK(layer.stats().zLoss == out.zLoss.item<double>());
  if (layout.tp() == 1) CHECK(layer.stats().droppedSlots == expectedDropped);
  for (int expert : kStarved) CHECK(layer.stats().tokensPerExpert[expert] == 0);

  // Dense gradients sum over dp, expert gradients over expert dp.
  for (const char* name : {".router.weight", ".shared.w13", ".shared.w2"}) {
    at::Tensor grad = parameterNamed(layer, name).grad().clone();
    groups.dp()->allReduce(grad)->wait();
    INFO(name);
    CHECK(relativeError(grad, parameterNamed(*reference.layer, name).grad()) < 1e-10);
  }
  for (auto& parameter : layer.experts().parameters("experts", 0)) {
    at::Tensor grad = parameter.tensor.grad().clone();
    groups.expertDp()->allReduce(grad)->wait();
    at::Tensor global = parameterNamed(*reference.layer, "." + parameter.name).grad();
    for (size_t dim = 0; dim < parameter.shard.offsets.size(); ++dim)
      global = global.narrow(dim, parameter.shard.offsets[dim], grad.size(dim));
    INFO(parameter.name);
    CHECK(relativeError(grad, global) < 1e-10);
  }
}

TEST_CASE("every ep layout computes the reference's outputs and gradients", "[moe][layer]") {
  REQUIRE(testing::world().size() == kShards);
  auto local = parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  for (double capacity : {0.0, 1.0}) {
    // With selection noise too: keyed by each token's place in the global
    // input, it draws the same noise whichever rank routes the token.
    std::vector<at::Tensor> cleanOutputs;
    for (double noise : {0.0, 0.05}) {
      MoELayer referenceLayer(layerOptions(true, capacity, true, noise), local, at::kDouble);
      starveExperts(referenceLayer);
      Reference reference = referenceRun(referenceLayer);
      if (capacity > 0) CHECK(reference.dropped[0] > 0);
      if (noise == 0)
        cleanOutputs = reference.outputs;
      else
        CHECK_FALSE(at::allclose(at::cat(reference.outputs), at::cat(cleanOutputs)));  // the noise picked others
      for (bool oncePerRank : {true, false}) {
        for (int ep : {1, 2, 4, 8})
          checkLayout(reference, {.ep = ep}, layerOptions(oncePerRank, capacity, true, noise));
      }
    }
  }
}

TEST_CASE("expert tensor parallelism over the tp group computes the same function", "[moe][layer]") {
  auto local = parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  // Aux and z losses are per rank's tokens, and tp ranks hold two shards: off here.
  MoELayer referenceLayer(layerOptions(true, 0, false), local, at::kDouble);
  starveExperts(referenceLayer);
  Reference reference = referenceRun(referenceLayer);
  for (bool oncePerRank : {true, false}) {
    checkLayout(reference, {.tp = 2, .ep = 2, .etp = 2}, layerOptions(oncePerRank, 0, false));
    checkLayout(reference, {.tp = 2, .ep = 4, .etp = 2}, layerOptions(oncePerRank, 0, false));
  }
}

TEST_CASE("a layout whose etp group differs from tp is refused", "[moe][layer]") {
  for (auto layout : {parallel::LayoutOptions{.tp = 2, .ep = 2}, parallel::LayoutOptions{.ep = 2, .etp = 2}}) {
    auto groups = parallel::ProcessGroups::create(testing::worldPtr(), layout, {.warmup = false});
    CHECK_THROWS_AS(MoELayer(layerOptions(true, 0, true), groups, at::kDouble), ConfigError);
  }
}

TEST_CASE("an input of another dtype than the layer's is refused on every rank, and the layer goes on",
          "[moe][layer]") {
  auto groups =
      parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{.ep = 8}, {.warmup = false});
  MoELayer layer(layerOptions(true, 0, true), groups, at::kDouble);
  const int rank = testing::world().rank();
  try {
    layer.forward(shardTokens(rank).to(at::kFloat));
    FAIL("float32 tokens into a float64 layer were accepted");
  } catch (const ConfigError& error) {
    CHECK(std::string(error.what()).find("of dtype Float") != std::string::npos);
  }
  // No collective was left half-issued: the next forward runs on every rank.
  at::Tensor tokens = shardTokens(rank);
  CHECK(layer.forward(tokens).output.sizes() == tokens.sizes());
}

TEST_CASE("a double backward through the layer is refused on every rank, and the layer goes on", "[moe][layer]") {
  auto groups =
      parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{.ep = 4}, {.warmup = false});
  MoELayer layer(layerOptions(true, 0, true), groups, at::kDouble);
  const int rank = testing::world().rank();
  at::Tensor tokens = shardTokens(rank).requires_grad_(true);
  at::Tensor loss = (layer.forward(tokens).output * shardProjection(rank)).sum();
  // The exchanges' gradients carry no graph: second-order terms would be lost.
  try {
    torch::autograd::grad({loss}, {tokens}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL("create_graph through the MoE exchanges was accepted");
  } catch (const ConfigError& error) {
    CHECK(std::string(error.what()).find("no double backward") != std::string::npos);
  }
  // Every rank raised before the exchange: a first-order backward still runs on all of them.
  at::Tensor grad = torch::autograd::grad({loss}, {tokens})[0];
  CHECK(grad.sizes() == tokens.sizes());
  CHECK((tokens.size(0) == 0 || grad.abs().sum().item<double>() > 0));
}

TEST_CASE("the layer's gradients match finite differences of the global loss", "[moe][layer][gradcheck]") {
  auto& world = testing::world();
  auto groups =
      parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{.ep = 4}, {.warmup = false});
  MoELayer layer(layerOptions(true, 0, true), groups, at::kDouble);
  starveExperts(layer);
  at::Tensor tokens = shardTokens(world.rank()).requires_grad_(true);
  at::Tensor projection = shardProjection(world.rank());
  auto globalLoss = [&]() {
    c10::NoGradGuard noGrad;
    MoEOutput out = layer.forward(tokens);
    at::Tensor loss = ((out.output * projection).sum() + out.auxLoss + out.zLoss).reshape({1}).clone();
    world.allReduce(loss)->wait();
    return loss.item<double>();
  };
  MoEOutput out = layer.forward(tokens);
  ((out.output * projection).sum() + out.auxLoss + out.zLoss).backward();

  // Each probe perturbs one element of a global tensor on every rank holding it.
  struct Probe {
    std::string name;  // parameter suffix, or "input"
    std::vector<int64_t> globalIndex;
    int ownerRank;  // for the input: the rank whose token moves
  };
  const std::vector<Probe> probes{{".router.weight", {1, 2}, -1},     {".router.weight", {9, 0}, -1},
                                  {".experts.w13", {6, 0, 3, 1}, -1}, {".experts.w13", {15, 1, 11, 7}, -1},
                                  {".experts.w2", {0, 5, 4}, -1},     {".shared.w13", {1, 4, 2}, -1},
                                  {".shared.w2", {2, 3}, -1},         {"input", {4, 6}, 5}};
  const double step = 1e-5;
  for (const auto& probe : probes) {
    at::Tensor target;
    std::vector<int64_t> index = probe.globalIndex;
    bool holds = true;
    if (probe.name == "input") {
      target = tokens;
      holds = world.rank() == probe.ownerRank;
    } else {
      for (auto& parameter : layer.parameters()) {
        if (parameter.name != layer.options().name + probe.name) continue;
        target = parameter.tensor;
        for (size_t dim = 0; dim < index.size(); ++dim) {
          index[dim] -= parameter.shard.offsets[dim];
          holds = holds && index[dim] >= 0 && index[dim] < target.size(dim);
        }
      }
    }
    at::Tensor analytic = at::zeros({1}, at::kDouble);
    if (holds) {
      at::Tensor grad = target.grad();
      for (int64_t i : index) grad = grad[i];
      analytic[0] = grad.item<double>();
    }
    // Each rank's gradient covers its own tokens: sum over the ranks that
    // split the tokens (the world for dense weights, expert dp for experts).
    if (probe.name.rfind(".experts", 0) == 0) {
      groups.expertDp()->allReduce(analytic)->wait();
      // Every replica now holds the global value; average them into one.
      at::Tensor holders = at::full({1}, holds ? 1.0 : 0.0, at::kDouble);
      if (!holds) analytic.zero_();
      world.allReduce(analytic)->wait();
      world.allReduce(holders)->wait();
      analytic /= holders;
    } else {
      world.allReduce(analytic)->wait();
    }
    auto element = [&]() {
      at::Tensor view = target;
      for (int64_t i : index) view = view[i];
      return view;
    };
    auto nudge = [&](double delta) {
      c10::NoGradGuard noGrad;
      if (holds) element().add_(delta);
    };
    nudge(step);
    const double up = globalLoss();
    nudge(-2 * step);
    const double down = globalLoss();
    nudge(step);
    const double numeric = (up - down) / (2 * step);
    INFO(probe.name << " analytic " << analytic.item<double>() << " numeric " << numeric);
    CHECK(analytic.item<double>() == testing::Approx(numeric).epsilon(1e-6).margin(1e-8));
  }
}

TEST_CASE("the expert bias moves by the rate against the loads summed over dp", "[moe][layer]") {
  auto& world = testing::world();
  auto groups =
      parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{.ep = 4}, {.warmup = false});
  MoEOptions options = layerOptions(true, 0, false);
  options.router.biasUpdateRate = 0.25;
  MoELayer layer(options, groups, at::kDouble);
  at::Tensor tokens = shardTokens(world.rank());
  layer.forward(tokens);
  // The loads every rank saw, summed: what the bias must move against.
  at::Tensor loads = at::zeros({kExperts}, at::kLong);
  for (int shard = 0; shard < kShards; ++shard) {
    at::Tensor indices = layer.router().route(shardTokens(shard)).indices;
    loads.index_add_(0, indices.reshape(-1), at::ones({indices.numel()}, at::kLong));
  }
  layer.forward(tokens);  // routes anew with the same (zero) bias: the loads above
  layer.updateExpertBias();
  at::Tensor expected = at::sign(loads.to(at::kDouble).mean() - loads.to(at::kDouble)) * 0.25;
  CHECK(at::allclose(layer.router().bias().to(at::kDouble), expected, 0, 1e-7));
  CHECK(layer.router().bias().abs().sum().item<double>() > 0);
}

TEST_CASE("with globalAuxLoss the aux loss counts the slots of every replica's batch", "[moe][layer]") {
  // Every shard routed by a layer that holds every expert (same router weights).
  auto local = parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  MoELayer referenceLayer(layerOptions(true, 0, true), local, at::kDouble);
  at::Tensor slots = at::zeros({kExperts}, at::kDouble);
  int64_t tokensInAll = 0;
  for (int shard = 0; shard < kShards; ++shard) {
    slots += referenceLayer.router().route(shardTokens(shard)).tokensPerExpert.to(at::kDouble);
    tokensInAll += shardTokens(shard).size(0);
  }
  // With tp 2 both ranks of a tp group hold (and route) the same two shards.
  for (auto layoutOptions : {parallel::LayoutOptions{.ep = 2}, parallel::LayoutOptions{.ep = 8},
                             parallel::LayoutOptions{.tp = 2, .ep = 2, .etp = 2}}) {
    auto groups = parallel::ProcessGroups::create(testing::worldPtr(), layoutOptions, {.warmup = false});
    MoEOptions options = layerOptions(true, 0, true);
    options.globalAuxLoss = true;
    MoELayer layer(options, groups, at::kDouble);
    const int tp = groups.layout().tp(), replica = groups.dp()->rank();
    std::vector<at::Tensor> tokenParts, projectionParts;
    for (int shard = replica * tp; shard < (replica + 1) * tp; ++shard)
      tokenParts.push_back(shardTokens(shard)), projectionParts.push_back(shardProjection(shard));
    at::Tensor tokens = at::cat(tokenParts).requires_grad_(true);
    MoEOutput out = layer.forward(tokens);
    const at::Tensor meanProb = referenceLayer.router().route(tokens.detach()).meanProb;
    const at::Tensor expected =
        options.router.auxLossCoeff * kExperts * (slots / static_cast<double>(tokensInAll * kTopK) * meanProb).sum();
    INFO(groups.layout().describe() << ", replica " << replica);
    CHECK(relativeError(out.auxLoss.detach(), expected) < 1e-12);
    ((out.output * at::cat(projectionParts)).sum() + out.auxLoss + out.zLoss).backward();
    if (tokens.size(0) > 0) CHECK(tokens.grad().abs().sum().item<double>() > 0);
  }
}

TEST_CASE("dispatch and combine around identity experts return each token's weighted sum", "[moe][dispatcher]") {
  auto& world = testing::world();
  for (int ep : {2, 8}) {
    auto groups =
        parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{.ep = ep}, {.warmup = false});
    for (bool oncePerRank : {true, false}) {
      // Routing travels beside the tokens in the weights' dtype (at least
      // float32), whose elements may be wider than the tokens'.
      for (auto [dtype, weightType] :
           {std::pair{at::kDouble, at::kDouble}, {at::kFloat, at::kFloat}, {at::kFloat, at::kDouble}}) {
        TokenDispatcher dispatcher(groups.ep(), {.numExperts = kExperts, .oncePerRank = oncePerRank});
        at::Tensor tokens = shardTokens(world.rank()).to(dtype);
        Routing routing;
        routing.indices = std::get<1>(
            at::randn({tokens.size(0), kExperts}, testing::sharedGenerator(300 + world.rank()), at::kDouble).topk(1));
        routing.weights = at::ones({tokens.size(0), 1}, weightType);
        routing.keep = at::ones({tokens.size(0), 1}, at::kBool);
        DispatchPlan plan = dispatcher.dispatch(tokens, routing);
        INFO("ep " << ep << " oncePerRank " << oncePerRank << " dtype " << c10::toString(dtype) << " weights "
                   << c10::toString(weightType));
        CHECK(plan.recvWeights.scalar_type() == weightType);
        CHECK(at::equal(plan.expertRowEnds, at::tensor(plan.tokensPerLocalExpert, at::kLong).cumsum(0, at::kInt)));
        CHECK(namesEveryRowOnce(plan.recvTable, plan.expertInput.size(0)));
        CHECK(namesEveryRowOnce(plan.sendTable, total(plan.sendSplits)));
        // Top-1 with weight 1: the round trip is exact.
        CHECK(at::equal(dispatcher.combine(plan, plan.expertInput), tokens));
      }
    }
  }
}

TEST_CASE("a kept slot naming no expert makes every ep rank raise together, and the group goes on",
          "[moe][dispatcher]") {
  auto& world = testing::world();
  constexpr int kBadRank = 5;
  auto groups =
      parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{.ep = kShards}, {.warmup = false});
  for (bool oncePerRank : {true, false}) {
    TokenDispatcher dispatcher(groups.ep(), {.numExperts = kExperts, .oncePerRank = oncePerRank});
    at::Tensor tokens = gaussian(400 + world.rank(), {kTokens, kHidden});
    Routing routing;
    routing.indices = std::get<1>(gaussian(500 + world.rank(), {kTokens, kExperts}).topk(kTopK));
    routing.weights = at::rand({kTokens, kTopK}, testing::sharedGenerator(600 + world.rank()), at::kDouble);
    routing.keep = at::ones({kTokens, kTopK}, at::kBool);
    routing.indices[7][2] = -1 - world.rank();  // dropped: no expert needed
    routing.keep[7][2] = false;
    Routing broken = routing;
    broken.indices = routing.indices.clone();
    if (world.rank() == kBadRank) broken.indices[3][1] = kExperts + 2;
    INFO("oncePerRank " << oncePerRank);
    try {
      dispatcher.dispatch(tokens, broken);
      FAIL("dispatch accepted an expert id past the last expert");
    } catch (const ConfigError& error) {
      INFO(error.what());
      CHECK(std::string(error.what()).find(fmt::format("1 on rank {}", kBadRank)) != std::string::npos);
    }
    // Every rank ran the same exchanges: the next dispatch on the group works.
    DispatchPlan plan = dispatcher.dispatch(tokens, routing);
    CHECK(at::equal(plan.expertRowEnds, at::tensor(plan.tokensPerLocalExpert, at::kLong).cumsum(0, at::kInt)));
    CHECK(namesEveryRowOnce(plan.recvTable, plan.expertInput.size(0)));
    CHECK(namesEveryRowOnce(plan.sendTable, total(plan.sendSplits)));
    // Expert output with a row too many is refused before the results
    // exchange (here on every rank), and the plan still combines after it.
    at::Tensor tooMany = at::cat({plan.expertInput, gaussian(700 + world.rank(), {1, kHidden})});
    CHECK_THROWS_AS(dispatcher.combine(plan, tooMany), ConfigError);
    CHECK(dispatcher.combine(plan, plan.expertInput).sizes() == tokens.sizes());
  }
}

}  // namespace
}  // namespace bulkhead::moe

namespace bulkhead::moe {
namespace {

// Forward and backward of `layer` on `tokens`: the output, the input's
// gradient and every parameter's gradient, in parameter order.
std::vector<at::Tensor> stepOf(MoELayer& layer, const at::Tensor& tokens, const at::Tensor& projection) {
  at::Tensor input = tokens.clone().requires_grad_(true);
  MoEOutput out = layer.forward(input);
  torch::autograd::backward({(out.output * projection).sum() + out.auxLoss + out.zLoss});
  std::vector<at::Tensor> results{out.output.detach(), input.grad()};
  for (auto& parameter : layer.parameters()) {
    results.push_back(parameter.tensor.grad().clone());
    parameter.tensor.mutable_grad().reset();
  }
  return results;
}

}  // namespace

TEST_CASE("static shapes compute what the dispatcher computes with the same capacity, gradients included",
          "[moe][layer]") {
  auto groups = parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  for (double capacity : {0.5, 1.0, 2.5}) {
    MoEOptions options = layerOptions(true, capacity, true);
    options.router.expertBias = false;
    MoELayer dispatched(options, groups, at::kDouble);
    options.staticShapes = true;
    MoELayer fixed(options, groups, at::kDouble);
    for (int shard : {0, 5}) {
      auto ours = stepOf(fixed, shardTokens(shard), shardProjection(shard));
      auto theirs = stepOf(dispatched, shardTokens(shard), shardProjection(shard));
      REQUIRE(ours.size() == theirs.size());
      for (size_t i = 0; i < ours.size(); ++i) {
        INFO("capacity " << capacity << " shard " << shard << " tensor " << i);
        CHECK(at::allclose(ours[i], theirs[i], 1e-12, 1e-12));
      }
      CHECK(fixed.stats().droppedSlots == dispatched.stats().droppedSlots);
      if (capacity == 0.5) CHECK(fixed.stats().droppedSlots > 0);
    }
  }
}

TEST_CASE("static shapes need a capacity factor", "[moe][layer]") {
  auto local = parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  MoEOptions options = layerOptions(true, 0, false);
  options.staticShapes = true;
  CHECK_THROWS_AS(MoELayer(options, local, at::kDouble), ConfigError);
}

TEST_CASE("static shapes at ep > 1 exchange padded rows and compute what the dispatcher computes", "[moe][layer]") {
  REQUIRE(testing::world().size() == kShards);
  const std::vector<parallel::LayoutOptions> layouts{
      {.ep = 2}, {.ep = 4}, {.ep = 8}, {.tp = 2, .ep = 2, .etp = 2}, {.tp = 2, .ep = 4, .etp = 2}};
  for (const auto& layoutOptions : layouts) {
    auto groups = parallel::ProcessGroups::create(testing::worldPtr(), layoutOptions, {.warmup = false});
    for (double capacity : {0.5, 1.25}) {
      MoEOptions options = layerOptions(true, capacity, true);
      options.router.expertBias = false;
      MoELayer dispatched(options, groups, at::kDouble);
      options.staticShapes = true;
      MoELayer fixed(options, groups, at::kDouble);
      // Every rank of a tp group holds the same tokens, each dp rank its own.
      const int dpRank = groups.dp()->rank();
      for (int round = 0; round < 2; ++round) {
        at::Tensor tokens = gaussian(300 + 10 * round + dpRank, {kTokens, kHidden});
        at::Tensor projection = gaussian(400 + 10 * round + dpRank, {kTokens, kHidden});
        auto ours = stepOf(fixed, tokens, projection);
        auto theirs = stepOf(dispatched, tokens, projection);
        REQUIRE(ours.size() == theirs.size());
        for (size_t i = 0; i < ours.size(); ++i) {
          INFO(fmt::format("rank {} layout {} capacity {} round {} tensor {}", testing::world().rank(),
                           groups.layout().describe(), capacity, round, i));
          CHECK(ours[i].abs().max().item<double>() > 0);
          CHECK(at::allclose(ours[i], theirs[i], 1e-12, 1e-12));
        }
        CHECK(fixed.stats().droppedSlots == dispatched.stats().droppedSlots);
        if (capacity == 0.5) CHECK(fixed.stats().droppedSlots > 0);
      }
    }
  }
}

TEST_CASE("static shapes at ep > 1 refuse ranks of unequal batches on every rank of the group, then go on",
          "[moe][layer]") {
  auto groups =
      parallel::ProcessGroups::create(testing::worldPtr(), parallel::LayoutOptions{.ep = 4}, {.warmup = false});
  MoEOptions options = layerOptions(true, 1.0, false);
  options.router.expertBias = false;
  options.staticShapes = true;
  MoELayer layer(options, groups, at::kDouble);
  const int me = testing::world().rank();
  const auto& members = groups.ep()->members();
  const bool withShort = std::find(members.begin(), members.end(), kEmptyShard) != members.end();
  try {
    layer.forward(gaussian(500 + me, {me == kEmptyShard ? kTokens / 2 : kTokens, kHidden}));
    CHECK_FALSE(withShort);
  } catch (const ConfigError& error) {
    const std::string text = error.what();
    INFO(text);
    CHECK(withShort);
    CHECK(text.find(fmt::format("rank {}: {} tokens", kEmptyShard, kTokens / 2)) != std::string::npos);
    CHECK(text.find("give every rank batches of one size") != std::string::npos);
  }
  MoEOutput out = layer.forward(gaussian(600 + me, {kTokens, kHidden}));
  CHECK(out.output.sizes().vec() == std::vector<int64_t>{kTokens, kHidden});
}

}  // namespace bulkhead::moe
