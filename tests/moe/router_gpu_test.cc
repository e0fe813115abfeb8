// The router's fused score kernels (moe/router_scores.h) against the ATen
// form, on one GPU: the selection, the weights, the loss sums and their
// gradients to the logits; then the whole Router on the GPU against the same
// Router on the CPU. Part of bulkhead_moe_gpu_tests (its main skips without a
// GPU).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "moe/router.h"
#include "moe/router_noise.h"
#include "moe/router_scores.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

struct ScoreCase {
  int64_t tokens, experts;
  int topK;
};

// The fused outputs written as ATen operations, for the selection `indices`
// (so that the gradients compare even where float32 rounding would order two
// near-equal scores the other way).
std::tuple<at::Tensor, at::Tensor, at::Tensor> referenceScores(const at::Tensor& logits, const at::Tensor& indices,
                                                               const RouterOptions& options) {
  const bool softmax = options.scoreFunction == ScoreFunction::Softmax;
  at::Tensor scores = softmax ? at::softmax(logits, -1) : at::sigmoid(logits);
  at::Tensor weights = scores.gather(1, indices);
  if (options.normalizeWeights) weights = weights / weights.sum(-1, true);
  at::Tensor normalised = softmax ? scores : scores / scores.sum(-1, true);
  return {weights, normalised.sum(0), at::logsumexp(logits, -1).pow(2).sum()};
}

// Every selected value at least every unselected one (up to `slack`), in
// descending order: a top-k, whichever of two near-equal values it took.
void checkIsTopK(const at::Tensor& selection, const at::Tensor& indices, double slack) {
  at::Tensor picked = selection.gather(1, indices);
  at::Tensor rest = selection.scatter(1, indices, -1e30);
  const bool aboveTheRest = (std::get<0>(picked.min(1)) + slack).ge(std::get<0>(rest.max(1))).all().item<bool>();
  CHECK(aboveTheRest);
  const int64_t k = indices.size(1);
  const bool descending =
      k < 2 || (picked.narrow(1, 0, k - 1) + slack).ge(picked.narrow(1, 1, k - 1)).all().item<bool>();
  CHECK(descending);
}

TEST_CASE("fused router scores equal the ATen form, forward and backward", "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  // One lane's worth of experts and fewer, several per lane (64, 130), the
  // kernels' largest (1024 experts, top-32), and more tokens than warps.
  const std::vector<ScoreCase> cases{{1, 1, 1},    {37, 7, 3},  {300, 64, 8},   {129, 130, 1},
                                     {40, 300, 6}, {5, 33, 32}, {64, 1024, 32}, {4500, 64, 8}};
  int salt = 0;
  for (const ScoreCase& c : cases) {
    for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      for (ScoreFunction function : {ScoreFunction::Softmax, ScoreFunction::Sigmoid}) {
        for (bool normalize : {true, false}) {
          for (int extra : {0, 1, 2}) {  // nothing, a bias, a bias and selection noise
            const bool biased = extra >= 1, noisy = extra == 2;
            ++salt;
            const RouterOptions options{.numExperts = static_cast<int>(c.experts),
                                        .topK = c.topK,
                                        .scoreFunction = function,
                                        .normalizeWeights = normalize};
            at::Tensor logits = (3 * at::randn({c.tokens, c.experts}, testing::sharedGenerator(salt), at::kDouble));
            at::Tensor bias = biased ? 0.02 * at::randn({c.experts}, testing::sharedGenerator(salt + 1000), at::kFloat)
                                     : at::Tensor();
            // Keys far apart and negative ones: the kernel draws the noise router_noise.cc draws.
            at::Tensor keys = noisy ? at::arange(c.tokens, at::kLong) * 1000003 - 77 : at::Tensor();
            RouterOptions noisyOptions = options;
            noisyOptions.selectionNoise = noisy ? 0.05 : 0;
            noisyOptions.noiseSeed = static_cast<uint64_t>(salt) << 33 | 5;
            at::Tensor gradWeights = at::randn({c.tokens, c.topK}, testing::sharedGenerator(salt + 2000), at::kDouble);
            at::Tensor gradProb = at::randn({c.experts}, testing::sharedGenerator(salt + 3000), at::kDouble);
            const double gradLse = 0.37;

            at::Tensor input = logits.to(gpu, dtype).requires_grad_(true);
            auto fused = fusedScores(input, noisyOptions, biased ? bias.to(gpu) : at::Tensor(),
                                     noisy ? keys.to(gpu) : at::Tensor());
            REQUIRE(fused.has_value());
            ((fused->weights * gradWeights.to(gpu, dtype)).sum() + (fused->probSum * gradProb.to(gpu, dtype)).sum() +
             fused->lseSquaredSum * gradLse)
                .backward();

            // The reference in float64 on the CPU, from the values the GPU saw.
            at::Tensor reference = input.detach().cpu().to(at::kDouble).requires_grad_(true);
            at::Tensor indices = fused->indices.cpu();
            auto [weights, probSum, lseSquaredSum] = referenceScores(reference, indices, options);
            ((weights * gradWeights).sum() + (probSum * gradProb).sum() + lseSquaredSum * gradLse).backward();

            INFO("tokens " << c.tokens << " experts " << c.experts << " top-" << c.topK << " " << c10::toString(dtype)
                           << (function == ScoreFunction::Sigmoid ? " sigmoid" : " softmax")
                           << (normalize ? " normalised" : "") << (biased ? " biased" : "") << (noisy ? " noisy" : ""));
            const double tolerance = dtype == at::kDouble ? 1e-12 : 2e-5;
            at::Tensor scores = function == ScoreFunction::Softmax ? at::softmax(reference.detach(), -1)
                                                                   : at::sigmoid(reference.detach());
            at::Tensor selection = biased ? scores + bias.to(at::kDouble) : scores;
            if (noisy)
              selection =
                  selection + selectionNoise(keys, c.experts, 0.05, noisyOptions.noiseSeed, dtype).to(at::kDouble);
            if (dtype == at::kDouble) {
              CHECK(at::equal(indices, std::get<1>(selection.topk(c.topK, -1))));
            } else {
              checkIsTopK(selection, indices, 1e-6);
            }
            CHECK(at::equal(fused->tokensPerExpert.cpu(),
                            at::zeros({c.experts}, at::kLong)
                                .index_add_(0, indices.reshape(-1), at::ones({indices.numel()}, at::kLong))));
            CHECK(at::allclose(fused->weights.cpu().to(at::kDouble), weights, tolerance, tolerance));
            CHECK(at::allclose(fused->probSum.cpu().to(at::kDouble), probSum, tolerance, tolerance * c.tokens));
            CHECK(at::allclose(fused->lseSquaredSum.cpu().to(at::kDouble), lseSquaredSum, tolerance, tolerance));
            CHECK(at::allclose(input.grad().cpu().to(at::kDouble), reference.grad(), tolerance, tolerance * 10));
          }
        }
      }
    }
  }
}

TEST_CASE("fused router scores pass on the gradients of just the outputs that get one", "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  const int64_t tokens = 300, experts = 64;
  const int topK = 8;
  at::Tensor logits = 2 * at::randn({tokens, experts}, testing::sharedGenerator(41), at::kDouble);
  at::Tensor gradWeights = at::randn({tokens, topK}, testing::sharedGenerator(42), at::kDouble);
  at::Tensor gradProb = at::randn({experts}, testing::sharedGenerator(43), at::kDouble);
  for (ScoreFunction function : {ScoreFunction::Softmax, ScoreFunction::Sigmoid}) {
    const RouterOptions options{.numExperts = experts, .topK = topK, .scoreFunction = function};
    // Which of weights, probSum and lseSquaredSum the loss uses (a z-loss or
    // aux loss of coefficient 0 leaves its output without a gradient).
    for (auto [useWeights, useProb, useLse] : {std::tuple{true, false, false},
                                               {false, true, false},
                                               {false, false, true},
                                               {false, true, true},
                                               {true, true, false}}) {
      auto loss = [&, useWeights = useWeights, useProb = useProb, useLse = useLse](
                      const at::Tensor& weights, const at::Tensor& probSum, const at::Tensor& lseSquaredSum) {
        at::Tensor total = at::zeros({}, weights.options());
        if (useWeights) total = total + (weights * gradWeights.to(weights.device())).sum();
        if (useProb) total = total + (probSum * gradProb.to(probSum.device())).sum();
        if (useLse) total = total + lseSquaredSum * 0.37;
        return total;
      };
      at::Tensor input = logits.to(gpu).requires_grad_(true);
      auto fused = fusedScores(input, options, at::Tensor());
      REQUIRE(fused.has_value());
      loss(fused->weights, fused->probSum, fused->lseSquaredSum).backward();
      at::Tensor reference = logits.clone().requires_grad_(true);
      auto [weights, probSum, lseSquaredSum] = referenceScores(reference, fused->indices.cpu(), options);
      loss(weights, probSum, lseSquaredSum).backward();
      INFO((function == ScoreFunction::Sigmoid ? "sigmoid" : "softmax")
           << ", gradients to weights " << useWeights << ", probSum " << useProb << ", lse^2 " << useLse);
      CHECK(at::allclose(input.grad().cpu(), reference.grad(), 1e-12, 1e-12));
    }
  }
}

TEST_CASE("fused router scores break exact ties to the lower expert id", "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  // Equal logits: every score ties. Float32 sigmoid of logits above ~17 is exactly 1.
  for (auto [function, dtype, value] :
       {std::tuple{ScoreFunction::Softmax, at::kDouble, 0.0}, {ScoreFunction::Sigmoid, at::kFloat, 20.0}}) {
    const RouterOptions options{.numExperts = 40, .topK = 3, .scoreFunction = function};
    at::Tensor logits = at::full({5, 40}, value, at::TensorOptions(dtype).device(gpu));
    auto plain = fusedScores(logits, options, at::Tensor());
    REQUIRE(plain.has_value());
    CHECK(at::equal(plain->indices.cpu(), at::arange(3, at::kLong).expand({5, 3})));
    // A bias lifts experts 39 and 33 above the rest, 39 the most.
    at::Tensor bias = at::zeros({40}, at::kFloat)
                          .index_fill_(0, at::tensor({39}, at::kLong), 0.5f)
                          .index_fill_(0, at::tensor({33}, at::kLong), 0.25f);
    auto biased = fusedScores(logits, options, bias.to(gpu));
    REQUIRE(biased.has_value());
    CHECK(at::equal(biased->indices.cpu(), at::tensor({39, 33, 0}, at::kLong).expand({5, 3})));
  }
}

TEST_CASE("fused router scores keep autograd's checks: no graph without grad, no second backward, no stale logits",
          "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  const RouterOptions options{.numExperts = 16, .topK = 4};
  at::Tensor logits = at::randn({50, 16}, testing::sharedGenerator(51), at::kFloat).to(gpu);
  {
    auto constant = fusedScores(logits, options, at::Tensor());
    REQUIRE(constant.has_value());
    CHECK_FALSE(constant->weights.requires_grad());
    const c10::NoGradGuard noGrad;
    auto untracked = fusedScores(logits.clone().requires_grad_(true), options, at::Tensor());
    REQUIRE(untracked.has_value());
    CHECK_FALSE(untracked->weights.requires_grad());
  }
  at::Tensor leaf = logits.clone().requires_grad_(true);
  auto once = fusedScores(leaf, options, at::Tensor());
  REQUIRE(once.has_value());
  at::Tensor loss = once->weights.sum() + once->lseSquaredSum;
  loss.backward();
  CHECK_THROWS(loss.backward());  // the saved logits were freed by the first
  at::Tensor scaled = leaf * 2;
  auto stale = fusedScores(scaled, options, at::Tensor());
  REQUIRE(stale.has_value());
  {
    const c10::NoGradGuard noGrad;
    scaled.add_(1);
  }
  CHECK_THROWS(stale->lseSquaredSum.backward());  // logits changed in place since the forward
}

TEST_CASE("bf16 and fp16 logits: one float32-output GEMM with the converting form's values and gradients",
          "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    INFO(c10::toString(dtype));
    at::Tensor tokens = at::randn({300, 96}, testing::sharedGenerator(61), at::kFloat).to(gpu, dtype);
    at::Tensor gate = (at::randn({24, 96}, testing::sharedGenerator(62), at::kFloat) * 0.3).to(gpu, dtype);
    at::Tensor grad = at::randn({300, 24}, testing::sharedGenerator(63), at::kFloat).to(gpu);
    // Where libtorch has no float32-output GEMM, the router converts: nothing to compare.
    const bool expected = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8);
    CHECK(mixedPrecisionLogits(tokens, gate).has_value() == expected);
    if (!expected) continue;
    CHECK_FALSE(mixedPrecisionLogits(tokens.cpu(), gate.cpu()).has_value());
    CHECK_FALSE(mixedPrecisionLogits(tokens.narrow(0, 0, 0), gate).has_value());
    CHECK_FALSE(mixedPrecisionLogits(tokens, gate.to(at::kFloat)).has_value());

    // One rounding: a unit in the last place, relative (bf16 keeps 8 bits, fp16 11), and a little
    // absolute slack where float32 sums in another order cancel to near zero.
    const double ulp = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
    auto oneRounding = [&](const at::Tensor& ours, const at::Tensor& theirs) {
      at::Tensor a = ours.to(at::kFloat), b = theirs.to(at::kFloat);
      return ((a - b).abs() <= b.abs() * ulp + b.abs().max() * 1e-5).all().item<bool>();
    };
    for (auto [tokensLearn, gateLearns] : {std::pair{true, true}, {true, false}, {false, true}}) {
      INFO("tokens learn " << tokensLearn << ", gate learns " << gateLearns);
      // The tokens as a transposed view: not contiguous.
      at::Tensor xBase = tokens.t().contiguous().requires_grad_(tokensLearn), x = xBase.t();
      at::Tensor w = gate.clone().requires_grad_(gateLearns);
      at::Tensor xRef = tokens.clone().requires_grad_(tokensLearn), wRef = gate.clone().requires_grad_(gateLearns);
      REQUIRE_FALSE(x.is_contiguous());
      at::Tensor logits = *mixedPrecisionLogits(x, w);
      at::Tensor reference = at::matmul(xRef.to(at::kFloat), wRef.to(at::kFloat).t());
      CHECK(logits.scalar_type() == at::kFloat);
      // The same exact products, summed in float32 in another order.
      CHECK(at::allclose(logits, reference, 1e-5, 1e-4));
      logits.backward(grad);
      reference.backward(grad);
      CHECK_THROWS(logits.backward(grad));  // what the first backward needed was freed
      CHECK(xBase.grad().defined() == tokensLearn);
      CHECK(w.grad().defined() == gateLearns);
      if (tokensLearn) CHECK(oneRounding(xBase.grad().t(), xRef.grad()));
      if (gateLearns) CHECK(oneRounding(w.grad(), wRef.grad()));
    }
    {
      const c10::NoGradGuard noGrad;
      CHECK_FALSE(mixedPrecisionLogits(tokens.clone().requires_grad_(true), gate)->requires_grad());
    }
  }
}

TEST_CASE("the router on the GPU equals the router on the CPU, losses and gate gradient included",
          "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  const int64_t hidden = 48;
  for (int64_t tokens : {0, 1, 333}) {
    for (const RouterOptions& options :
         {RouterOptions{.numExperts = 16, .topK = 4},
          RouterOptions{.numExperts = 24, .topK = 3, .scoreFunction = ScoreFunction::Sigmoid, .expertBias = true},
          RouterOptions{.numExperts = 16, .topK = 2, .normalizeWeights = false, .capacityFactor = 1.0},
          RouterOptions{.numExperts = 16, .topK = 2, .selectionNoise = 0.05, .noiseSeed = 7}}) {
      at::Tensor tokensIn = at::randn({tokens, hidden}, testing::sharedGenerator(11), at::kDouble);
      at::Tensor gate = at::randn({options.numExperts, hidden}, testing::sharedGenerator(12), at::kDouble) * 0.3;
      at::Tensor gradWeights = at::randn({tokens, options.topK}, testing::sharedGenerator(13), at::kDouble);
      auto run = [&](const at::Device& device) {
        at::Tensor w = gate.to(device).clone().requires_grad_(true);
        Router router(options, w);
        // A bias that changes the selection, the same on both devices.
        if (options.expertBias) {
          router.updateBias(at::arange(options.numExperts, at::kFloat).remainder(5));
          router.updateBias(at::arange(options.numExperts, at::kFloat).remainder(3));
        }
        // Keys that are not the token's index: the noise is drawn from the key, on either device.
        Routing routing = router.route(tokensIn.to(device), (at::arange(tokens, at::kLong) * 7919 + 123).to(device));
        (routing.auxLoss + routing.zLoss + (routing.weights * gradWeights.to(device)).sum()).backward();
        return std::make_tuple(routing.indices.cpu(), routing.weights.detach().cpu(), routing.keep.cpu(),
                               routing.tokensPerExpert.cpu(), routing.meanProb.detach().cpu(),
                               routing.auxLoss.detach().cpu(), routing.zLoss.detach().cpu(),
                               w.grad().defined() ? w.grad().cpu() : at::zeros_like(gate));
      };
      auto [indices, weights, keep, perExpert, meanProb, aux, z, gradGate] = run(gpu);
      auto [refIndices, refWeights, refKeep, refPerExpert, refMeanProb, refAux, refZ, refGradGate] = run(at::kCPU);
      INFO(tokens << " tokens, " << options.numExperts << " experts, top-" << options.topK
                  << (options.expertBias ? ", biased sigmoid" : "") << (options.capacityFactor > 0 ? ", capacity" : "")
                  << (options.selectionNoise > 0 ? ", noisy" : ""));
      CHECK(at::equal(indices, refIndices));
      CHECK(at::equal(keep, refKeep));
      CHECK(at::equal(perExpert, refPerExpert));
      CHECK(at::allclose(weights, refWeights, 1e-12, 1e-12));
      CHECK(at::allclose(meanProb, refMeanProb, 1e-12, 1e-12));
      CHECK(at::allclose(aux, refAux, 1e-12, 1e-12));
      CHECK(at::allclose(z, refZ, 1e-12, 1e-12));
      CHECK(at::allclose(gradGate, refGradGate, 1e-10, 1e-10));
    }
  }
}

TEST_CASE("bf16 logits' gradients keep the float32 gradient's low bits where paired rows nearly cancel",
          "[moe][gpu][router]") {
  // Rows t and t + T/2 hold the same token, with gradients g and -g + d, d about 2^-12 of g: the exact
  // gradients are the small sums of d. Rounding g to bf16 before multiplying would leave errors near
  // 2^-9 of g in each pair; the two bf16 halves leave near 2^-17.
  const at::Device gpu(at::kCUDA, 0);
  const int64_t half = 200, hidden = 64, experts = 24;
  at::Tensor tokenHalf = at::randn({half, hidden}, testing::sharedGenerator(71), at::kFloat).to(at::kBFloat16);
  at::Tensor tokens = at::cat({tokenHalf, tokenHalf}).to(gpu);
  at::Tensor gate =
      (at::randn({experts, hidden}, testing::sharedGenerator(72), at::kFloat) * 0.3).to(gpu, at::kBFloat16);
  at::Tensor g = at::randn({half, experts}, testing::sharedGenerator(73), at::kFloat);
  at::Tensor d = at::randn({half, experts}, testing::sharedGenerator(74), at::kFloat) * g.abs() * (1.0 / 4096);
  at::Tensor grad = at::cat({g, -g + d}).to(gpu);
  at::Tensor x = tokens.clone().requires_grad_(true), w = gate.clone().requires_grad_(true);
  // Where libtorch has no float32-output GEMM, the router converts: nothing to compare.
  if (TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 8)) return;
  std::optional<at::Tensor> logits = mixedPrecisionLogits(x, w);
  REQUIRE(logits.has_value());
  logits->backward(grad);
  const at::Tensor grad64 = grad.to(at::kDouble), tokens64 = tokens.to(at::kDouble), gate64 = gate.to(at::kDouble);
  // Within half a bf16 unit of the exact products (2^-8 of them bounds it) plus 2^-16 of the
  // products' magnitudes for the halves' truncation and float32 sums.
  auto close = [](const at::Tensor& ours, const at::Tensor& exact, const at::Tensor& magnitude) {
    return ((ours.to(at::kDouble) - exact).abs() <= exact.abs() * (1.0 / 256) + magnitude * (1.0 / 65536))
        .all()
        .item<bool>();
  };
  CHECK(close(x.grad(), at::mm(grad64, gate64), at::mm(grad64.abs(), gate64.abs())));
  CHECK(close(w.grad(), at::mm(grad64.t(), tokens64), at::mm(grad64.abs().t(), tokens64.abs())));
  // Rounded to bf16 first, the gate's gradient misses by far more: the check above can fail.
  at::Tensor roundedFirst = at::mm(grad.to(at::kBFloat16).to(at::kDouble).t(), tokens64);
  CHECK_FALSE(close(roundedFirst, at::mm(grad64.t(), tokens64), at::mm(grad64.abs().t(), tokens64.abs())));
}

TEST_CASE("capacity ranks on the GPU: the kernels' positions are the ATen form's", "[moe][gpu][router]") {
  // One slot, one expert, 800 slots at one expert, 1,000 and 1,500 experts, 32,768 slots and more.
  const at::Device gpu(at::kCUDA, 0);
  for (auto [tokens, topK, experts] : {std::tuple<int64_t, int64_t, int>{0, 4, 7},
                                       {1, 1, 1},
                                       {300, 4, 7},
                                       {4096, 8, 64},
                                       {2000, 2, 1000},
                                       {16384, 2, 32},
                                       {100, 8, 1},
                                       {9000, 1, 3},
                                       {17000, 1, 1},
                                       {2000, 2, 1500},
                                       {16385, 2, 32},
                                       {20000, 2, 64}}) {
    INFO(tokens << " tokens, top-" << topK << ", " << experts << " experts");
    at::Tensor indices = at::randint(0, experts, {tokens, topK}, testing::sharedGenerator(81), at::kLong);
    // Quarter steps with ties, negative values, and both zeros.
    at::Tensor weights =
        (at::randint(-20, 21, {tokens, topK}, testing::sharedGenerator(82), at::kLong) * 0.25).to(at::kFloat);
    if (tokens > 4) {  // both zeros, both infinities, and NaN: ranked by their bits on both sides
      weights.view(-1)[0] = -0.0f;
      weights.view(-1)[1] = 0.0f;
      weights.view(-1)[2] = std::numeric_limits<float>::infinity();
      weights.view(-1)[3] = -std::numeric_limits<float>::infinity();
      weights.view(-1)[4] = std::numeric_limits<float>::quiet_NaN();
    }
    REQUIRE(capacityPositionKernels(indices.to(gpu), weights.to(gpu), experts).has_value());
    at::Tensor ours = capacityPosition(indices.to(gpu), weights.to(gpu), experts);
    at::Tensor theirs = capacityPosition(indices, weights, experts);  // the CPU's ATen form
    CHECK(ours.sizes() == indices.sizes());
    CHECK(at::equal(ours.cpu(), theirs));
    CHECK(at::equal(capacityKeep(indices.to(gpu), weights.to(gpu), experts, 3).cpu(),
                    capacityKeep(indices, weights, experts, 3)));
  }
  at::Tensor indices = at::randint(0, 5, {64, 2}, testing::sharedGenerator(83), at::kLong).to(gpu);
  CHECK_FALSE(capacityPositionKernels(indices, at::rand({64, 2}, at::kDouble).to(gpu), 5).has_value());
  CHECK_FALSE(capacityPositionKernels(indices.cpu(), at::rand({64, 2}, at::kFloat), 5).has_value());
}

}  // namespace
}  // namespace bulkhead::moe
