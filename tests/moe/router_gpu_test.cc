// The router's fused score kernels (moe/router_scores.h) against the ATen
// form, on one GPU: the selection, the weights, the loss sums and their
// gradients to the logits; then the whole Router on the GPU against the same
// Router on the CPU. Part of bulkhead_moe_gpu_tests (its main skips without a
// GPU).
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "moe/router.h"
#include "moe/router_scores.h"
#include "tests/catch_compat.h"
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
  const bool descending = k < 2 || (picked.narrow(1, 0, k - 1) + slack).ge(picked.narrow(1, 1, k - 1)).all().item<bool>();
  CHECK(descending);
}

TEST_CASE("fused router scores equal the ATen form, forward and backward", "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  // One lane's worth of experts and fewer, several per lane (64, 130), the
  // kernels' largest (1024 experts, top-32), and more tokens than warps.
  const std::vector<ScoreCase> cases{{1, 1, 1},  {37, 7, 3},    {300, 64, 8},     {129, 130, 1},
                                     {5, 33, 32}, {64, 1024, 32}, {4500, 64, 8}};
  int salt = 0;
  for (const ScoreCase& c : cases) {
    for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      for (ScoreFunction function : {ScoreFunction::Softmax, ScoreFunction::Sigmoid}) {
        for (bool normalize : {true, false}) {
          for (bool biased : {false, true}) {
            ++salt;
            const RouterOptions options{.numExperts = static_cast<int>(c.experts),
                                        .topK = c.topK,
                                        .scoreFunction = function,
                                        .normalizeWeights = normalize};
            at::Tensor logits = (3 * at::randn({c.tokens, c.experts}, testing::sharedGenerator(salt), at::kDouble));
            at::Tensor bias = biased ? 0.02 * at::randn({c.experts}, testing::sharedGenerator(salt + 1000), at::kFloat)
                                     : at::Tensor();
            at::Tensor gradWeights = at::randn({c.tokens, c.topK}, testing::sharedGenerator(salt + 2000), at::kDouble);
            at::Tensor gradProb = at::randn({c.experts}, testing::sharedGenerator(salt + 3000), at::kDouble);
            const double gradLse = 0.37;

            at::Tensor input = logits.to(gpu, dtype).requires_grad_(true);
            auto fused = fusedScores(input, options, biased ? bias.to(gpu) : at::Tensor());
            REQUIRE(fused.has_value());
            ((fused->weights * gradWeights.to(gpu, dtype)).sum() + (fused->probSum * gradProb.to(gpu, dtype)).sum() +
             fused->lseSquaredSum * gradLse)
                .backward();

            // The reference in float64 on the CPU, from the values the GPU saw.
            at::Tensor reference = input.detach().cpu().to(at::kDouble).requires_grad_(true);
            at::Tensor indices = fused->indices.cpu();
            auto [weights, probSum, lseSquaredSum] = referenceScores(reference, indices, options);
            ((weights * gradWeights).sum() + (probSum * gradProb).sum() + lseSquaredSum * gradLse).backward();

            INFO("tokens " << c.tokens << " experts " << c.experts << " top-" << c.topK << " "
                           << c10::toString(dtype) << (function == ScoreFunction::Sigmoid ? " sigmoid" : " softmax")
                           << (normalize ? " normalised" : "") << (biased ? " biased" : ""));
            const double tolerance = dtype == at::kDouble ? 1e-12 : 2e-5;
            at::Tensor scores = function == ScoreFunction::Softmax ? at::softmax(reference.detach(), -1)
                                                                   : at::sigmoid(reference.detach());
            at::Tensor selection = biased ? scores + bias.to(at::kDouble) : scores;
            if (dtype == at::kDouble) {
              CHECK(at::equal(indices, std::get<1>(selection.topk(c.topK, -1))));
            } else {
              checkIsTopK(selection, indices, 1e-6);
            }
            CHECK(at::equal(fused->tokensPerExpert.cpu(),
                            at::zeros({c.experts}, at::kLong).index_add_(0, indices.reshape(-1),
                                                                         at::ones({indices.numel()}, at::kLong))));
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

TEST_CASE("the router on the GPU equals the router on the CPU, losses and gate gradient included", "[moe][gpu][router]") {
  const at::Device gpu(at::kCUDA, 0);
  const int64_t hidden = 48;
  for (int64_t tokens : {0, 1, 333}) {
    for (const RouterOptions& options :
         {RouterOptions{.numExperts = 16, .topK = 4},
          RouterOptions{.numExperts = 24, .topK = 3, .scoreFunction = ScoreFunction::Sigmoid, .expertBias = true},
          RouterOptions{.numExperts = 16, .topK = 2, .normalizeWeights = false, .capacityFactor = 1.0}}) {
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
        Routing routing = router.route(tokensIn.to(device));
        (routing.auxLoss + routing.zLoss + (routing.weights * gradWeights.to(device)).sum()).backward();
        return std::make_tuple(routing.indices.cpu(), routing.weights.detach().cpu(), routing.keep.cpu(),
                               routing.tokensPerExpert.cpu(), routing.meanProb.detach().cpu(),
                               routing.auxLoss.detach().cpu(), routing.zLoss.detach().cpu(),
                               w.grad().defined() ? w.grad().cpu() : at::zeros_like(gate));
      };
      auto [indices, weights, keep, perExpert, meanProb, aux, z, gradGate] = run(gpu);
      auto [refIndices, refWeights, refKeep, refPerExpert, refMeanProb, refAux, refZ, refGradGate] = run(at::kCPU);
      INFO(tokens << " tokens, " << options.numExperts << " experts, top-" << options.topK
                  << (options.expertBias ? ", biased sigmoid" : "") << (options.capacityFactor > 0 ? ", capacity" : ""));
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

}  // namespace
}  // namespace bulkhead::moe
