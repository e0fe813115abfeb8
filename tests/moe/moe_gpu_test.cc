// The MoE layer over NCCL, one rank per GPU (ep = every rank): its outputs
// and gradients against the same layer over MPI in float64 on the same
// inputs (float32 on the GPU), and, in bf16, against the layer with every
// expert on the rank's own GPU computing one product per expert. This runs
// the CUDA grouping and gather-sum kernels, the routed exchange of bf16 tokens
// with float32 routing, and _grouped_mm where libtorch has it; with starved
// experts, the last rank receives no token at all and the first runs
// _grouped_mm with an empty group. The shared expert, on a stream of its own,
// is held to the layer that runs it in line, with both streams delayed.
#include <ATen/ATen.h>
#if BULKHEAD_TORCH_CUDA  // libtorch's CUDA headers, for the case that delays streams
#include <ATen/cuda/Sleep.h>
#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <fmt/format.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moe/moe_layer.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

constexpr int kTokens = 257, kHidden = 64, kFfn = 96, kExperts = 8, kTopK = 3;

moe::MoEOptions layerOptions(bool oncePerRank, bool starve) {
  return {.hidden = kHidden,
          .ffnHidden = kFfn,
          .router = {.numExperts = kExperts,
                     .topK = kTopK,
                     .auxLossCoeff = 0.05,
                     .zLossCoeff = 0.01,
                     .expertBias = starve,
                     // Enough to starve (scores lie in (0, 1)), small enough
                     // for float32 selection to keep the scores' resolution.
                     .biasUpdateRate = 1},
          .oncePerRank = oncePerRank,
          .sharedExpertHidden = 32,
          // Scores not too peaked: with the starving bias of 1 added, float32
          // selection resolves scores only to about 1e-7, and tiny scores of
          // a peaked softmax can lie closer than that (their order then
          // differs from float64's).
          .initStd = 0.05,
          .seed = 91};
}

// Expert 1 and the upper half of the experts look overloaded: the bias keeps
// every token away from them, so at ep 2 the last rank receives no token and
// the first multiplies an empty group (and on one GPU, five experts get none).
bool starved(int expert) { return expert == 1 || expert >= kExperts / 2; }
void starveExperts(moe::MoELayer& layer) {
  at::Tensor loads = at::ones({kExperts}, at::kLong);
  for (int expert = 0; expert < kExperts; ++expert)
    if (starved(expert)) loads[expert] = 1000;
  layer.router().updateBias(loads);
}

struct Result {
  at::Tensor output, inputGrad;
  std::map<std::string, at::Tensor> grads;  // by parameter name, this rank's slice
  std::map<std::string, bool> expert;       // by parameter name
};

// Forward and backward of a loss that weights every output differently.
Result run(const CommunicatorPtr& world, parallel::LayoutOptions layout, const moe::MoEOptions& options,
           const at::TensorOptions& tensorOptions, const at::Tensor& tokens, const at::Tensor& projection) {
  auto groups = parallel::ProcessGroups::create(world, layout, {.warmup = false});
  moe::MoELayer layer(options, groups, tensorOptions);
  if (options.router.expertBias) starveExperts(layer);
  at::Tensor input = tokens.to(tensorOptions).detach().requires_grad_(true);  // a leaf of its own, never `tokens`
  moe::MoEOutput out = layer.forward(input);
  ((out.output * projection.to(tensorOptions)).sum() + out.auxLoss + out.zLoss).backward();
  if (options.router.expertBias) {
    const std::vector<int64_t> loads = layer.stats().tokensPerExpert;
    for (int expert = 0; expert < kExperts; ++expert)
      if (starved(expert)) CHECK(loads[expert] == 0);
  }
  Result result{.output = out.output.detach().to(at::kCPU, at::kDouble),
                .inputGrad = input.grad().to(at::kCPU, at::kDouble)};
  for (auto& parameter : layer.parameters()) {
    result.grads[parameter.name] = parameter.tensor.grad().to(at::kCPU, at::kDouble);
    result.expert[parameter.name] = parameter.group == parallel::ParamGroup::Expert;
  }
  return result;
}

// Max error over the reference's largest magnitude (absolute where the
// reference is all zeros: a starved expert's gradient).
double relativeError(const at::Tensor& value, const at::Tensor& reference) {
  const double scale = reference.abs().max().item<double>();
  const double error = (value - reference).abs().max().item<double>();
  return scale > 0 ? error / scale : error;
}

void compare(const Result& ours, const Result& reference, double tolerance) {
  CHECK(relativeError(ours.output, reference.output) < tolerance);
  CHECK(relativeError(ours.inputGrad, reference.inputGrad) < tolerance);
  REQUIRE(ours.grads.size() == reference.grads.size());
  for (auto& [name, grad] : reference.grads) {
    INFO(name);
    CHECK(relativeError(ours.grads.at(name), grad) < tolerance);
  }
}

}  // namespace

TEST_CASE("the MoE layer over NCCL matches the layer over MPI in float64") {
  const int ranks = gpuWorld().size(), me = gpuWorld().rank();
  if (ranks < 2) WARN("one GPU: ep 1, so no token crosses between ranks here");
  at::Tensor tokens = at::randn({kTokens, kHidden}, sharedGenerator(300 + me), at::kDouble);
  at::Tensor projection = at::randn({kTokens, kHidden}, sharedGenerator(400 + me), at::kDouble);
  for (bool oncePerRank : {true, false}) {
    for (bool starve : {false, true}) {
      INFO(fmt::format("rank {} ep {} oncePerRank {} starve {}", me, ranks, oncePerRank, starve));
      const moe::MoEOptions options = layerOptions(oncePerRank, starve);
      Result reference = run(cpuWorldPtr(), {.ep = ranks}, options, at::kDouble, tokens, projection);
      Result ours =
          run(gpuWorldPtr(), {.ep = ranks}, options, at::TensorOptions(at::kFloat).device(gpu()), tokens, projection);
      compare(ours, reference, 1e-4);
    }
  }
}

TEST_CASE("in bf16, the MoE layer over NCCL matches the layer holding every expert") {
  const int ranks = gpuWorld().size(), me = gpuWorld().rank();
  at::Tensor tokens = at::randn({kTokens, kHidden}, sharedGenerator(500 + me), at::kDouble);
  at::Tensor projection = at::randn({kTokens, kHidden}, sharedGenerator(600 + me), at::kDouble);
  const auto bf16 = at::TensorOptions(at::kBFloat16).device(gpu());
  for (auto [oncePerRank, starve] : {std::pair{true, false}, {false, false}, {true, true}}) {
    INFO(fmt::format("rank {} ep {} oncePerRank {} starve {}", me, ranks, oncePerRank, starve));
    const moe::MoEOptions options = layerOptions(oncePerRank, starve);
    moe::MoEOptions perExpert = options;
    perExpert.groupedMm = false;  // the reference multiplies expert by expert
    Result local = run(gpuWorldPtr(), {}, perExpert, bf16, tokens, projection);
    Result ours = run(gpuWorldPtr(), {.ep = ranks}, options, bf16, tokens, projection);
    // Expert gradients: the local layer holds every expert with the gradient
    // of this rank's tokens; at ep = world size, world rank r holds expert
    // block r with the gradient of every rank's tokens.
    for (auto& [name, grad] : ours.grads) {
      if (!ours.expert.at(name)) continue;
      at::Tensor& full = local.grads.at(name);
      cpuWorld().allReduce(full)->wait();
      full = full.narrow(0, me * grad.size(0), grad.size(0));
    }
    compare(ours, local, 3e-2);
  }
}

#if BULKHEAD_TORCH_CUDA
TEST_CASE("the shared expert on a stream of its own gives the result it gives in line") {
  const int ranks = gpuWorld().size(), me = gpuWorld().rank();
  moe::MoEOptions options{.hidden = 512,
                          .ffnHidden = 256,
                          .router = {.numExperts = 8, .topK = 2, .auxLossCoeff = 0.01},
                          .sharedExpertHidden = 2048,
                          .seed = 17};
  moe::MoEOptions inLine = options;
  inLine.overlapSharedExpert = false;
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), {.ep = ranks}, {.warmup = false});
  const auto bf16 = at::TensorOptions(at::kBFloat16).device(gpu());
  moe::MoELayer beside(options, groups, bf16), reference(inLine, groups, bf16);
  // A spin of about 25 ms on `stream`: work queued behind it runs late.
  auto delay = [](c10::Stream stream) {
    const c10::StreamGuard on(stream);
    at::cuda::sleep(50'000'000);
  };
  auto step = [&](moe::MoELayer& layer, const at::Tensor& tokens, const at::Tensor& projection) {
    for (auto& parameter : layer.parameters()) parameter.tensor.mutable_grad() = at::Tensor();
    // The input is written behind a delay on the layer's stream, and the
    // shared expert's stream is delayed too (from the second step, once the
    // layer has chosen it): a shared expert that read its input before it
    // was written, or a sum that took its output before it was done, would
    // give another result.
    const at::Tensor copied = tokens.to(bf16);
    delay(c10::cuda::getCurrentCUDAStream(gpu().index()));
    at::Tensor input = copied.mul(1).detach().requires_grad_(true);
    if (auto side = layer.sharedExpertStream()) delay(*side);
    moe::MoEOutput out = layer.forward(input);
    ((out.output * projection.to(bf16)).sum() + out.auxLoss).backward();
    Result result{.output = out.output.detach().to(at::kCPU, at::kDouble),
                  .inputGrad = input.grad().to(at::kCPU, at::kDouble)};
    for (auto& parameter : layer.parameters())
      result.grads[parameter.name] = parameter.tensor.grad().to(at::kCPU, at::kDouble);
    return result;
  };
  for (int i = 0; i < 3; ++i) {
    INFO(fmt::format("rank {} ep {} step {}", me, ranks, i));
    at::Tensor tokens = at::randn({4096, 512}, sharedGenerator(700 + 10 * i + me), at::kDouble);
    at::Tensor projection = at::randn({4096, 512}, sharedGenerator(800 + 10 * i + me), at::kDouble);
    Result ours = step(beside, tokens, projection);
    Result serial = step(reference, tokens, projection);
    // The same kernels on the same data, and autograd visits the nodes in the
    // same order: bit for bit the same is expected (a WARN says where the
    // gradients are not). The check allows bf16 rounding; a shared expert out
    // of step with the layer misses by far more.
    CHECK(at::equal(ours.output, serial.output));
    compare(ours, serial, 1e-2);
    for (auto& [name, grad] : serial.grads)
      if (!at::equal(ours.grads.at(name), grad)) WARN(name << ": within bf16 rounding, not bit for bit");
  }
  const c10::Stream current = c10::cuda::getCurrentCUDAStream(gpu().index());
  REQUIRE(beside.sharedExpertStream().has_value());
  CHECK(*beside.sharedExpertStream() != current);
  CHECK(!reference.sharedExpertStream().has_value());
}

TEST_CASE("routing on another device than the tokens is refused before any collective, and dispatch goes on") {
  const int ranks = gpuWorld().size(), me = gpuWorld().rank();
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), {.ep = ranks}, {.warmup = false});
  moe::TokenDispatcher dispatcher(groups.ep(), {.numExperts = 4 * ranks});
  const at::Tensor tokens = at::randn({64, 32}, sharedGenerator(900 + me), at::kDouble).to(gpu(), at::kFloat);
  moe::Routing routing;
  routing.indices = std::get<1>(at::randn({64, 4 * ranks}, sharedGenerator(910 + me), at::kDouble).topk(2)).to(gpu());
  routing.weights = at::rand({64, 2}, sharedGenerator(920 + me), at::kDouble).to(gpu(), at::kFloat);
  routing.keep = at::ones({64, 2}, at::kBool);  // on the CPU: a kernel would read a host pointer
  try {
    dispatcher.dispatch(tokens, routing);
    FAIL("routing keep flags on the CPU were accepted beside CUDA tokens");
  } catch (const ConfigError& error) {
    CHECK(std::string(error.what()).find("routing keep on cpu") != std::string::npos);
  }
  routing.keep = routing.keep.to(gpu());
  moe::DispatchPlan plan = dispatcher.dispatch(tokens, routing);  // every rank raised alike: none waits
  CHECK(dispatcher.combine(plan, plan.expertInput).sizes() == tokens.sizes());
}
#endif  // BULKHEAD_TORCH_CUDA
