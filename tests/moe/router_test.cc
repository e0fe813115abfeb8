// The router's losses, capacity policy and the token permutation, against
// references computed here element by element (float64, one process).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <vector>

#include "moe/dispatcher.h"
#include "moe/gather_sum.h"
#include "moe/router.h"
#include "moe/router_noise.h"
#include "moe/static_dispatch.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

// Continuous values (gaussian): no ties between scores, so top-k is unambiguous.
using testing::gaussian;

struct Losses {
  double aux, z;
};

// The Switch aux loss and the z-loss written out with loops over plain numbers.
Losses referenceLosses(const at::Tensor& tokens, const at::Tensor& gate, int topK, double auxCoeff, double zCoeff) {
  const int64_t numTokens = tokens.size(0), numExperts = gate.size(0), hidden = gate.size(1);
  auto x = tokens.accessor<double, 2>();
  auto w = gate.accessor<double, 2>();
  std::vector<double> meanProb(numExperts, 0), slots(numExperts, 0);
  double z = 0;
  for (int64_t t = 0; t < numTokens; ++t) {
    std::vector<double> logit(numExperts, 0);
    for (int64_t e = 0; e < numExperts; ++e)
      for (int64_t h = 0; h < hidden; ++h) logit[e] += x[t][h] * w[e][h];
    double top = logit[0];
    for (double value : logit) top = std::max(top, value);
    double sum = 0;
    for (double value : logit) sum += std::exp(value - top);
    const double lse = top + std::log(sum);
    z += lse * lse;
    std::vector<double> prob(numExperts);
    for (int64_t e = 0; e < numExperts; ++e) prob[e] = std::exp(logit[e] - lse), meanProb[e] += prob[e] / numTokens;
    std::vector<bool> taken(numExperts, false);
    for (int pick = 0; pick < topK; ++pick) {
      int64_t best = -1;
      for (int64_t e = 0; e < numExperts; ++e)
        if (!taken[e] && (best < 0 || prob[e] > prob[best])) best = e;
      taken[best] = true;
      slots[best] += 1;
    }
  }
  double aux = 0;
  for (int64_t e = 0; e < numExperts; ++e) aux += slots[e] / double(numTokens * topK) * meanProb[e];
  return {auxCoeff * numExperts * aux, zCoeff * z / numTokens};
}

TEST_CASE("aux and z losses and their gradients match a hand-computed reference", "[moe][router]") {
  const int numExperts = 6, topK = 2;
  at::Tensor tokens = gaussian(1, {9, 5});
  at::Tensor gate = gaussian(2, {numExperts, 5}).mul_(0.5).requires_grad_(true);
  Router router({.numExperts = numExperts, .topK = topK, .auxLossCoeff = 0.1, .zLossCoeff = 0.01}, gate);
  Routing routing = router.route(tokens);
  Losses expected = referenceLosses(tokens, gate.detach(), topK, 0.1, 0.01);
  CHECK(routing.auxLoss.item<double>() == testing::Approx(expected.aux).epsilon(1e-12));
  CHECK(routing.zLoss.item<double>() == testing::Approx(expected.z).epsilon(1e-12));

  // Gradients against central differences of the reference (the selection
  // does not change under so small a step on these inputs).
  (routing.auxLoss + routing.zLoss).backward();
  at::Tensor grad = gate.grad();
  const double step = 1e-6;
  for (int64_t e = 0; e < numExperts; ++e) {
    for (int64_t h = 0; h < 5; ++h) {
      at::Tensor plus = gate.detach().clone(), minus = gate.detach().clone();
      plus[e][h] += step;
      minus[e][h] -= step;
      Losses up = referenceLosses(tokens, plus, topK, 0.1, 0.01),
             down = referenceLosses(tokens, minus, topK, 0.1, 0.01);
      const double numeric = (up.aux + up.z - down.aux - down.z) / (2 * step);
      CHECK(grad[e][h].item<double>() == testing::Approx(numeric).epsilon(1e-6).margin(1e-9));
    }
  }
}

TEST_CASE("capacity keeps each expert's highest-weight slots, ties to the earlier token", "[moe][router]") {
  // 4 tokens, top-2 over 3 experts, capacity 2 per expert.
  at::Tensor indices = at::tensor({0, 1, 0, 2, 0, 1, 0, 1}, at::kLong).view({4, 2});
  at::Tensor weights = at::tensor({0.6, 0.4, 0.7, 0.3, 0.6, 0.4, 0.9, 0.1}, at::kDouble).view({4, 2});
  at::Tensor keep = capacityKeep(indices, weights, 3, 2);
  // Expert 0: weights 0.6 (t0), 0.7 (t1), 0.6 (t2), 0.9 (t3) -> keeps t3, t1.
  // Expert 1: 0.4 (t0), 0.4 (t2), 0.1 (t3) -> keeps t0, t2 (tie: earlier first).
  // Expert 2: 0.3 (t1) -> kept.
  at::Tensor expected = at::tensor({0, 1, 1, 1, 0, 1, 1, 0}, at::kInt).to(at::kBool).view({4, 2});
  CHECK(at::equal(keep, expected));

  Router router({.numExperts = 3, .topK = 2, .capacityFactor = 0.75}, gaussian(3, {3, 4}));
  Routing routing = router.route(gaussian(4, {8, 4}));
  // ceil(0.75 * 8 * 2 / 3) = 4 slots per expert at most.
  at::Tensor keptPerExpert = at::zeros({3}, at::kLong)
                                 .index_add_(0, routing.indices.reshape(-1).masked_select(routing.keep.reshape(-1)),
                                             at::ones({routing.keep.sum().item<int64_t>()}, at::kLong));
  CHECK(keptPerExpert.max().item<int64_t>() <= 4);
  CHECK(routing.droppedSlots == 16 - routing.keep.sum().item<int64_t>());
  CHECK(routing.droppedSlots > 0);
  CHECK(at::equal(routing.keep, capacityKeep(routing.indices, routing.weights.detach(), 3, 4)));
}

TEST_CASE("the expert bias steers selection but not the combine weights", "[moe][router]") {
  at::Tensor gate = gaussian(5, {4, 6});
  at::Tensor tokens = gaussian(6, {10, 6});
  Router router({.numExperts = 4, .topK = 1, .normalizeWeights = false, .expertBias = true, .biasUpdateRate = 10},
                gate);
  // Expert 2 reported overloaded: its bias drops by 10 and it is never chosen.
  router.updateBias(at::tensor({1, 1, 100, 1}, at::kLong));
  CHECK(router.bias()[2].item<float>() == -10.0f);
  Routing routing = router.route(tokens);
  CHECK((routing.indices != 2).all().item<bool>());
  at::Tensor scores = at::softmax(at::matmul(tokens, gate.t()), -1);
  CHECK(at::allclose(routing.weights, scores.gather(1, routing.indices), 1e-15, 0));
}

TEST_CASE("selection noise spreads tokens the gate cannot tell apart, only in training", "[moe][router]") {
  // One token repeated: every copy has the same scores, and a gate this small
  // keeps them within a few thousandths of 1/16.
  at::Tensor gate = 0.01 * gaussian(31, {16, 8});
  at::Tensor tokens = gaussian(32, {1, 8}).expand({4096, 8}).contiguous();
  at::Tensor keys = at::arange(4096, at::kLong) * 3 + (int64_t{1} << 40);
  const RouterOptions options{.numExperts = 16, .topK = 2, .selectionNoise = 0.05, .noiseSeed = 11};
  auto imbalance = [](const Routing& routing) {
    at::Tensor loads = routing.tokensPerExpert.to(at::kDouble);
    return (loads.max() / loads.mean()).item<double>();
  };
  Router clean({.numExperts = 16, .topK = 2}, gate);
  CHECK(imbalance(clean.route(tokens)) == 8.0);  // every copy takes the same two of 16

  Router noisy(options, gate);
  CHECK(noisy.noisy());
  Routing routing = noisy.route(tokens, keys);
  CHECK(imbalance(routing) < 1.25);
  // The weights stay the clean scores of the chosen experts.
  at::Tensor scores = at::softmax(at::matmul(tokens, gate.t()), -1);
  at::Tensor picked = scores.gather(1, routing.indices);
  CHECK(at::allclose(routing.weights, picked / picked.sum(-1, true), 1e-15, 0));
  // A pure function of (seed, key, expert): the same again, the same for a
  // slice of the tokens routed alone, other draws under another seed.
  CHECK(at::equal(noisy.route(tokens, keys).indices, routing.indices));
  at::Tensor part = noisy.route(tokens.narrow(0, 1000, 300), keys.narrow(0, 1000, 300)).indices;
  CHECK(at::equal(part, routing.indices.narrow(0, 1000, 300)));
  Router reseeded({.numExperts = 16, .topK = 2, .selectionNoise = 0.05, .noiseSeed = 12}, gate);
  CHECK_FALSE(at::equal(reseeded.route(tokens, keys).indices, routing.indices));

  CHECK_THROWS_AS(noisy.route(tokens), ConfigError);  // no keys
  CHECK_THROWS_AS(noisy.route(tokens, keys.narrow(0, 0, 10)), ConfigError);
  CHECK_THROWS_AS(Router({.numExperts = 16, .topK = 2, .selectionNoise = -0.1}, gate), ConfigError);
  {
    const c10::NoGradGuard noGrad;  // evaluation: the clean top-k, no keys needed
    CHECK_FALSE(noisy.noisy());
    CHECK(at::equal(noisy.route(tokens).indices, clean.route(tokens).indices));
  }
}

TEST_CASE("selection noise is standard normal draws, independent across keys and experts", "[moe][router]") {
  // Keys far apart, negative and consecutive ones among them.
  at::Tensor keys = at::cat({at::arange(-20000, 20000, at::kLong), at::arange(0, 20000, at::kLong) * 1000003 + 7,
                             at::arange(0, 20000, at::kLong) + (int64_t{5} << 50)});
  at::Tensor noise = selectionNoise(keys, 8, 0.5, 99, at::kDouble);
  REQUIRE(noise.sizes() == at::IntArrayRef({80000, 8}));
  at::Tensor unit = noise / 0.5;
  CHECK(std::abs(unit.mean().item<double>()) < 0.01);
  CHECK(std::abs(unit.std().item<double>() - 1) < 0.01);
  CHECK(std::abs((unit.pow(4).mean().item<double>()) - 3) < 0.1);  // a normal's fourth moment
  // Neighbouring experts and neighbouring keys uncorrelated.
  CHECK(std::abs((unit.narrow(1, 0, 7) * unit.narrow(1, 1, 7)).mean().item<double>()) < 0.01);
  CHECK(std::abs((unit.narrow(0, 0, 79999) * unit.narrow(0, 1, 79999)).mean().item<double>()) < 0.01);
  CHECK(at::equal(selectionNoise(keys.narrow(0, 500, 9), 8, 0.5, 99, at::kDouble), noise.narrow(0, 500, 9)));
  CHECK(at::equal(selectionNoise(keys, 8, 0.5, 99, at::kFloat), noise.to(at::kFloat)));
}

TEST_CASE("sigmoid scores: top-k of the sigmoids, weights renormalised to one", "[moe][router]") {
  at::Tensor gate = gaussian(12, {6, 5});
  at::Tensor tokens = gaussian(13, {7, 5});
  Router router({.numExperts = 6, .topK = 3, .scoreFunction = ScoreFunction::Sigmoid}, gate);
  Routing routing = router.route(tokens);
  at::Tensor scores = at::sigmoid(at::matmul(tokens, gate.t()));
  at::Tensor expected = std::get<1>(scores.topk(3));
  CHECK(at::equal(routing.indices, expected));
  at::Tensor picked = scores.gather(1, expected);
  CHECK(at::allclose(routing.weights, picked / picked.sum(-1, true), 1e-15, 0));
  // P_i of the aux loss: the per-token normalised scores.
  CHECK(at::allclose(routing.meanProb, (scores / scores.sum(-1, true)).mean(0), 1e-15, 0));
}

TEST_CASE("permute then unpermute returns the input exactly", "[moe][dispatcher]") {
  // 13 tokens, 3 columns each (say, destination ranks); one entry per token.
  at::Tensor tokens = gaussian(7, {13, 8});
  at::Tensor column = at::randint(3, {13}, testing::sharedGenerator(8), at::kLong);
  at::Tensor group = at::full({13, 3}, -1, at::kLong);
  group.scatter_(1, column.unsqueeze(1), column.unsqueeze(1));
  Grouping grouping = groupEntries(group, 3, 13);
  at::Tensor rows = permuteTokens(tokens, grouping);
  CHECK(!at::equal(rows, tokens));
  // Grouped by column, stable within a column.
  at::Tensor groupOfRow = column.index_select(0, grouping.order.div(3, "floor"));
  CHECK(at::equal(groupOfRow, std::get<0>(at::sort(column))));
  CHECK(at::equal(unpermuteTokens(rows, grouping), tokens));
}

TEST_CASE("gather-sum sums the named rows with their weights, and its gradients", "[moe][dispatcher]") {
  at::Tensor source = gaussian(9, {5, 4}).requires_grad_(true);
  at::Tensor table = at::tensor({3, -1, 0, -1, -1, -1, 4, 1, 2}, at::kLong).view({3, 3});
  at::Tensor weights = gaussian(10, {3, 3}).requires_grad_(true);
  at::Tensor out = gatherSum(source, table, weights);
  at::Tensor expected = at::stack({weights[0][0] * source[3] + weights[0][2] * source[0], at::zeros({4}, at::kDouble),
                                   weights[2][0] * source[4] + weights[2][1] * source[1] + weights[2][2] * source[2]});
  CHECK(at::allclose(out, expected, 1e-15, 1e-15));
  at::Tensor grad = gaussian(11, {3, 4});
  out.backward(grad);
  CHECK(at::allclose(source.grad()[3], weights[0][0].detach() * grad[0], 1e-15, 1e-15));
  CHECK(at::allclose(weights.grad()[2][1], (grad[2] * source[1].detach()).sum(), 1e-15, 1e-15));
  CHECK(weights.grad()[0][1].item<double>() == 0);
}

}  // namespace
}  // namespace bulkhead::moe

namespace bulkhead::moe {

TEST_CASE("static dispatch: packed and padded rows hold the same kept slots", "[moe][static]") {
  const int experts = 6, topK = 2;
  const int64_t tokensCount = 40;
  at::Tensor gate = bulkhead::testing::draw(0, 31, {experts, 16}, at::kDouble);
  // A shared direction skews the routing, so capacity 0.8 drops slots.
  at::Tensor tokens = bulkhead::testing::draw(0, 32, {tokensCount, 16}, at::kDouble) +
                      bulkhead::testing::draw(0, 33, {1, 16}, at::kDouble);
  Router router({.numExperts = experts, .topK = topK, .capacityFactor = 0.8}, gate);
  Routing routing = router.select(tokens, /*hostCounts=*/false);
  const int64_t capacity = staticCapacity(router.options(), tokensCount);
  const StaticPlan padded = staticDispatch(tokens, routing, experts, capacity, /*packed=*/false);
  const StaticPlan packed = staticDispatch(tokens, routing, experts, capacity, /*packed=*/true);
  REQUIRE(routing.dropped.item<int64_t>() > 0);
  CHECK(packed.expertInput.size(0) == tokensCount * topK);
  CHECK(padded.expertInput.size(0) == experts * capacity);
  CHECK(packed.rowsPerExpert.empty());
  const at::Tensor ends = packed.rowEnds.to(at::kLong);
  CHECK(ends[experts - 1].item<int64_t>() == tokensCount * topK);
  int64_t start = 0, keptTotal = 0;
  for (int e = 0; e < experts; ++e) {
    const int64_t kept = routing.keep.logical_and(routing.indices == e).sum().item<int64_t>();
    CHECK(kept <= capacity);
    // Expert e's kept rows, in the router's rank order, in both layouts.
    CHECK(at::equal(packed.expertInput.narrow(0, start, kept), padded.expertInput.narrow(0, e * capacity, kept)));
    CHECK(padded.expertInput.narrow(0, e * capacity + kept, capacity - kept).abs().sum().item<double>() == 0);
    if (e < experts - 1) CHECK(ends[e].item<int64_t>() == start + kept);
    start += kept;
    keptTotal += kept;
  }
  // Past every kept row: zeros, in the last expert's group.
  CHECK(packed.expertInput.narrow(0, keptTotal, tokensCount * topK - keptTotal).abs().sum().item<double>() == 0);
  CHECK(keptTotal < tokensCount * topK);
  CHECK(at::equal(packed.slotTable.lt(0), routing.keep.logical_not()));
  // Any row-wise function of the expert rows combines to the same output.
  auto rowwise = [](const at::Tensor& rows) { return at::tanh(rows) * 3 + rows.sum(1, true); };
  const at::Tensor ours = staticCombine(packed, routing, rowwise(packed.expertInput));
  const at::Tensor theirs = staticCombine(padded, routing, rowwise(padded.expertInput));
  CHECK(at::allclose(ours, theirs, 1e-12, 1e-12));
  CHECK(ours.abs().max().item<double>() > 0);
}

}  // namespace bulkhead::moe

namespace bulkhead::moe {

TEST_CASE("capacity ranks in float32 by one sort of packed keys, as the two sorts rank in float64", "[moe][router]") {
  // Weights with ties and negative values (quarter steps), 300 tokens of 4 slots over 7 experts.
  at::Tensor indices = at::randint(0, 7, {300, 4}, bulkhead::testing::sharedGenerator(5), at::kLong);
  at::Tensor weights = bulkhead::testing::draw(0, 41, {300, 4}, at::kDouble);
  REQUIRE(weights.lt(0).any().item<bool>());
  at::Tensor packedKeys = capacityPosition(indices, weights.to(at::kFloat), 7);
  at::Tensor twoSorts = capacityPosition(indices, weights, 7);
  CHECK(at::equal(packedKeys, twoSorts));
  // Within each expert, positions 0, 1, ... follow descending weight.
  for (int e = 0; e < 7; ++e) {
    at::Tensor mine = indices.eq(e);
    at::Tensor order = std::get<1>(at::sort(packedKeys.masked_select(mine)));
    at::Tensor ranked = weights.masked_select(mine).index_select(0, order);
    CHECK(ranked.slice(0, 1).le(ranked.slice(0, 0, -1)).all().item<bool>());
  }
}

}  // namespace bulkhead::moe
