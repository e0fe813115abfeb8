// CUDA graphs of a MoE layer step: a layer with static shapes (capacity mode)
// captured forward and backward replays to what the same layer computes
// eagerly, for 1,000 replays with new inputs; a replay past its deadline is a
// TimeoutError; dropless at ep 1 in bf16 keeps its counts on the device (the
// dispatcher's results bit for bit) and captures; a layer whose dispatch reads
// counts on the host refuses capture, saying to set a capacity.
// With two GPUs or more: the layer at ep over every GPU, and at tp 2, its
// exchanges and all-reduces captured, replays to its eager results 1,000
// times; NCCL all-reduces captured in a graph replay on every rank; a rank
// that captured other collectives (one more, another capacity, a layer
// skipped) fails at capture on every rank.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <fmt/format.h>

#include <chrono>
#include <string>
#include <vector>

#include "moe/moe_layer.h"
#include "moe/static_dispatch.h"
#include "parallel/process_groups.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

#if BULKHEAD_TORCH_CUDA
using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

constexpr int kTokens = 512, kHidden = 256, kFfn = 128, kExperts = 16, kTopK = 2;

moe::MoEOptions staticOptions() {
  return {.hidden = kHidden,
          .ffnHidden = kFfn,
          .router = {.numExperts = kExperts, .topK = kTopK, .auxLossCoeff = 0.01, .capacityFactor = 1.25},
          .initStd = 0.05,
          .seed = 91,
          .staticShapes = true};
}

// One step of `layer` on `input`: the gradients of the previous step cleared
// in place (so a graph replays into the same tensors), then forward and backward.
struct Step {
  moe::MoELayer& layer;
  at::Tensor input, projection, output;
  void operator()() {
    for (auto& parameter : layer.parameters())
      if (parameter.tensor.grad().defined()) parameter.tensor.mutable_grad().zero_();
    if (input.grad().defined()) input.mutable_grad().zero_();
    moe::MoEOutput out = layer.forward(input);
    torch::autograd::backward({(out.output * projection).sum() + out.auxLoss + out.zLoss});
    output = out.output.detach();
  }
  std::vector<at::Tensor> results() {
    std::vector<at::Tensor> all{output.clone(), input.grad().clone()};
    for (auto& parameter : layer.parameters()) all.push_back(parameter.tensor.grad().clone());
    return all;
  }
};

// Equal within one bf16 rounding of the largest magnitude: a replay and an
// eager step may pick other GEMM kernels, and the capacity path's token
// gradient may sum its rows in another order than the packed one.
bool withinRounding(const at::Tensor& ours, const at::Tensor& theirs) {
  const double scale = theirs.abs().max().item<double>();
  return (ours.to(at::kFloat) - theirs.to(at::kFloat)).abs().max().item<double>() <= scale / 128 + 1e-6;
}

// Discards a communicator a test broke on purpose (its ranks captured calls
// that never run), and goes on: the abort is a fatal error that would end the
// process, taken back as recovery takes one back (runtime/diagnosis/fatal_exit.h).
void discard(const CommunicatorPtr& comm, const std::string& reason) {
  fatal::deferToRecovery(true);
  comm->abort(reason);
  fatal::recovered();
  fatal::deferToRecovery(false);
}

}  // namespace

TEST_CASE("a MoE layer with static shapes captured in a CUDA graph replays to its eager results, 1,000 times") {
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  moe::MoELayer captured(staticOptions(), groups, options), eager(staticOptions(), groups, options);
  at::manual_seed(4242 + gpuWorld().rank());
  Step graphStep{captured, at::randn({kTokens, kHidden}, options).requires_grad_(true),
                 at::randn({kTokens, kHidden}, options)};
  Step eagerStep{eager, at::empty({kTokens, kHidden}, options).requires_grad_(true), graphStep.projection};
  CapturedGraph graph(gpu(), [&] { graphStep(); }, {.name = "moe-test"});
  int checked = 0;
  for (int replay = 0; replay < 1000; ++replay) {
    at::Tensor next = at::randn({kTokens, kHidden}, options) * (1 + replay % 3);
    {
      c10::NoGradGuard noGrad;
      graphStep.input.copy_(next);
      eagerStep.input.copy_(next);
    }
    graph.replay(Deadline::afterSeconds(10));
    eagerStep();
    const bool full = replay % 100 == 0;  // every tensor now and then, the output every time
    auto ours = full ? graphStep.results() : std::vector<at::Tensor>{graphStep.output};
    auto theirs = full ? eagerStep.results() : std::vector<at::Tensor>{eagerStep.output};
    for (size_t i = 0; i < ours.size(); ++i) {
      if (withinRounding(ours[i], theirs[i])) continue;
      FAIL_CHECK(fmt::format("replay {}: tensor {} differs from the eager step's", replay, i));
    }
    checked += static_cast<int>(ours.size());
  }
  CHECK(checked > 1000);
  CHECK(captured.stats().droppedSlots == eager.stats().droppedSlots);
}

TEST_CASE(
    "static shapes on a GPU, padded (batched products) and packed (grouped), match the dispatcher's capacity "
    "path") {
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  moe::MoEOptions dynamicOptions = staticOptions();
  dynamicOptions.staticShapes = false;
  moe::MoELayer dynamic(dynamicOptions, groups, options);
  for (bool packedRows : {false, true}) {
    moe::MoEOptions fixedOptions = staticOptions();
    fixedOptions.packedStaticRows = packedRows;
    moe::MoELayer fixed(fixedOptions, groups, options);
    at::manual_seed(77 + gpuWorld().rank());
    Step staticStep{fixed, at::empty({kTokens, kHidden}, options).requires_grad_(true),
                    at::randn({kTokens, kHidden}, options)};
    if (packedRows) REQUIRE(fixed.experts().groupedFor(staticStep.input));  // else packed would run padded
    Step dynamicStep{dynamic, at::empty({kTokens, kHidden}, options).requires_grad_(true), staticStep.projection};
    int64_t dropped = 0;
    for (int round = 0; round < 5; ++round) {
      // A shared direction in every token skews the routing, so capacity drops slots.
      at::Tensor next = at::randn({kTokens, kHidden}, options) + round * at::randn({1, kHidden}, options);
      {
        c10::NoGradGuard noGrad;
        staticStep.input.copy_(next);
        dynamicStep.input.copy_(next);
      }
      staticStep();
      dynamicStep();
      auto ours = staticStep.results(), theirs = dynamicStep.results();
      for (size_t i = 0; i < ours.size(); ++i) {
        if (withinRounding(ours[i], theirs[i])) continue;
        FAIL_CHECK(fmt::format("{} rows, round {}: tensor {} differs", packedRows ? "packed" : "padded", round, i));
      }
      CHECK(fixed.stats().droppedSlots == dynamic.stats().droppedSlots);
      dropped += fixed.stats().droppedSlots;
    }
    CHECK(dropped > 0);
  }
}

TEST_CASE("static shapes on a GPU take an empty batch, padded and packed") {
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  for (bool packedRows : {false, true}) {
    moe::MoEOptions fixedOptions = staticOptions();
    fixedOptions.packedStaticRows = packedRows;
    moe::MoELayer layer(fixedOptions, groups, options);
    at::Tensor empty = at::empty({0, kHidden}, options).requires_grad_(true);
    moe::MoEOutput out = layer.forward(empty);
    CHECK(out.output.sizes() == empty.sizes());
    torch::autograd::backward({out.output.sum() + out.auxLoss + out.zLoss});
    CHECK(empty.grad().sizes() == empty.sizes());
    for (auto& parameter : layer.parameters()) {
      INFO(parameter.name);
      CHECK((!parameter.tensor.grad().defined() || parameter.tensor.grad().abs().sum().item<double>() == 0));
    }
  }
}

TEST_CASE("a graph replay that outlives its deadline raises TimeoutError") {
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  at::Tensor a = at::randn({4096, 4096}, options), b = at::randn({4096, 4096}, options) / 64;
  at::Tensor out = at::empty_like(a);
  // About 200 x 137 GFLOP: tens of milliseconds on any current GPU.
  CapturedGraph graph(gpu(),
                      [&] {
                        at::Tensor x = a;
                        for (int i = 0; i < 200; ++i) x = at::matmul(x, b);
                        out.copy_(x);
                      },
                      {.name = "slow", .warmupRuns = 1});
  const auto started = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(graph.replay(Deadline::after(std::chrono::milliseconds(1))), TimeoutError);
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(1));
  graph.replay(Deadline::afterSeconds(30));  // and it still runs to completion with time to do so
}

TEST_CASE("dropless at ep 1 with grouped products gives the dispatcher's results bit for bit, from the device alone") {
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  REQUIRE(groups.ep()->size() == 1);
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  at::manual_seed(5150 + gpuWorld().rank());
  at::Tensor gate = (at::randn({kExperts, kHidden}, options) * 0.05).requires_grad_(true);
  moe::Router router({.numExperts = kExperts, .topK = kTopK}, gate);
  moe::GroupedExperts experts({.numExperts = kExperts, .hidden = kHidden, .ffnHidden = kFfn, .initStd = 0.05},
                              /*firstExpert=*/0, kExperts, groups.expertTp(), options);
  moe::TokenDispatcher dispatcher(groups.ep(), {.numExperts = kExperts});
  for (int round = 0; round < 3; ++round) {
    // A shared direction skews the loads, so the groups differ in size.
    at::Tensor base = at::randn({kTokens, kHidden}, options) + round * at::randn({1, kHidden}, options);
    at::Tensor upstream = at::randn({kTokens, kHidden}, options);
    std::vector<std::vector<at::Tensor>> results;
    for (const bool onDevice : {false, true}) {
      at::Tensor tokens = base.clone().requires_grad_(true);
      for (const at::Tensor& w : {gate, experts.w13(), experts.w2()}) w.mutable_grad() = at::Tensor();
      moe::Routing routing = router.select(tokens);
      at::Tensor out;
      if (onDevice) {
        auto plan = moe::droplessDispatch(tokens, routing, kExperts, experts.groupedFor(tokens));
        REQUIRE(plan.has_value());
        CHECK(plan->expertInput.size(0) == kTokens * kTopK);
        out = moe::staticCombine(*plan, routing, experts.forward(plan->expertInput, {}, plan->rowEnds));
      } else {
        moe::DispatchPlan plan = dispatcher.dispatch(tokens, routing);
        out =
            dispatcher.combine(plan, experts.forward(plan.expertInput, plan.tokensPerLocalExpert, plan.expertRowEnds));
      }
      torch::autograd::backward({(out.to(at::kFloat) * upstream.to(at::kFloat)).sum()});
      results.push_back({out.detach(), tokens.grad(), gate.grad(), experts.w13().grad(), experts.w2().grad()});
    }
    for (size_t i = 0; i < results[0].size(); ++i) {
      INFO(fmt::format("round {}, tensor {}", round, i));
      REQUIRE(results[1][i].defined());
      CHECK(results[1][i].abs().max().item<float>() > 0);
      CHECK(at::equal(results[0][i], results[1][i]));
    }
  }
  // Not on the CPU, nor with a capacity: the dispatcher runs there.
  at::Tensor cpuTokens = at::randn({8, kHidden}, at::kFloat);
  moe::Router cpuRouter({.numExperts = kExperts, .topK = kTopK}, at::randn({kExperts, kHidden}, at::kFloat));
  CHECK_FALSE(moe::droplessDispatch(cpuTokens, cpuRouter.select(cpuTokens), kExperts, true).has_value());
  moe::Router capped({.numExperts = kExperts, .topK = kTopK, .capacityFactor = 1.0}, gate);
  at::Tensor tokens = at::randn({kTokens, kHidden}, options);
  CHECK_FALSE(moe::droplessDispatch(tokens, capped.select(tokens), kExperts, true).has_value());
  // No tokens, more experts than the grouping kernels take, or experts that need their counts on the host.
  CHECK(moe::droplessDispatchApplies(tokens, kExperts, true));
  CHECK_FALSE(moe::droplessDispatchApplies(at::empty({0, kHidden}, options), kExperts, true));
  CHECK_FALSE(moe::droplessDispatchApplies(tokens, 4096, true));
  CHECK_FALSE(moe::droplessDispatchApplies(tokens, kExperts, false));
}

TEST_CASE("a dropless layer at ep 1 in bf16 captures and replays to its eager results") {
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  moe::MoEOptions dropless = staticOptions();
  dropless.staticShapes = false;
  dropless.router.capacityFactor = 0;
  moe::MoELayer captured(dropless, groups, options), eager(dropless, groups, options);
  at::manual_seed(6060 + gpuWorld().rank());
  Step graphStep{captured, at::randn({kTokens, kHidden}, options).requires_grad_(true),
                 at::randn({kTokens, kHidden}, options)};
  Step eagerStep{eager, at::empty({kTokens, kHidden}, options).requires_grad_(true), graphStep.projection};
  // Capture fails on any read back to the host: passing it shows the layer needs none.
  CapturedGraph graph(gpu(), [&] { graphStep(); }, {.name = "dropless-ep1"});
  for (int replay = 0; replay < 100; ++replay) {
    at::Tensor next = at::randn({kTokens, kHidden}, options) + (replay % 4) * at::randn({1, kHidden}, options);
    {
      c10::NoGradGuard noGrad;
      graphStep.input.copy_(next);
      eagerStep.input.copy_(next);
    }
    graph.replay(Deadline::afterSeconds(10));
    eagerStep();
    auto ours = graphStep.results(), theirs = eagerStep.results();
    for (size_t i = 0; i < ours.size(); ++i)
      if (!withinRounding(ours[i], theirs[i])) FAIL_CHECK(fmt::format("replay {}: tensor {} differs", replay, i));
  }
  CHECK(captured.stats().imbalance > 1);  // the replays' own routing, read back after them
}

TEST_CASE("capturing a layer whose dispatch reads counts on the host is a ConfigError that says to set a capacity") {
  auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), parallel::LayoutOptions{}, {.warmup = false});
  // float32 experts multiply one group at a time, with their counts on the host.
  const auto options = at::TensorOptions().dtype(at::kFloat).device(gpu());
  moe::MoEOptions dropless = staticOptions();
  dropless.staticShapes = false;
  dropless.router.capacityFactor = 0;
  moe::MoELayer layer(dropless, groups, options);
  at::Tensor input = at::randn({kTokens, kHidden}, options);
  try {
    CapturedGraph graph(gpu(), [&] { layer.forward(input); }, {.name = "dropless", .warmupRuns = 1});
    FAIL("capture of a dispatcher layer succeeded");
  } catch (const ConfigError& error) {
    CHECK(std::string(error.what()).find("set a capacity factor") != std::string::npos);
  }
  // The stream is out of capture: eager work goes on.
  CHECK(layer.forward(input).output.sizes() == input.sizes());
}

TEST_CASE("static shapes at ep > 1 and tp > 1, exchanges captured, replay to their eager results, 1,000 times") {
  const int n = gpuWorld().size();
  if (n < 2) {
    WARN("one GPU: a layer spread over ep or tp needs two");
    return;
  }
  // ep over every GPU, and tp 2 (expert tp 2) with ep over the rest.
  std::vector<parallel::LayoutOptions> layouts{{.ep = n}};
  if (n % 2 == 0) layouts.push_back({.tp = 2, .ep = n / 2, .etp = 2});
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  for (const auto& layoutOptions : layouts) {
    auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), layoutOptions);
    const auto& layout = groups.layout();
    INFO(fmt::format("rank {} of {}: {}", gpuWorld().rank(), n, layout.describe()));
    moe::MoELayer captured(staticOptions(), groups, options), eager(staticOptions(), groups, options);
    at::manual_seed(4343 + groups.dp()->rank());  // the same tokens on every rank of a tp group
    Step graphStep{captured, at::randn({kTokens, kHidden}, options).requires_grad_(true),
                   at::randn({kTokens, kHidden}, options)};
    Step eagerStep{eager, at::empty({kTokens, kHidden}, options).requires_grad_(true), graphStep.projection};
    CapturedGraph graph(gpu(), [&] { graphStep(); },
                        {.name = fmt::format("moe-tp{}-ep{}", layout.tp(), layout.ep()),
                         .store = gpuStore(),
                         .comms = {gpuWorldPtr(), groups.ep(), groups.tp(), groups.expertTp()}});
    int differ = 0;
    for (int replay = 0; replay < 1000; ++replay) {
      at::Tensor next = at::randn({kTokens, kHidden}, options) + (replay % 4) * at::randn({1, kHidden}, options);
      {
        c10::NoGradGuard noGrad;
        graphStep.input.copy_(next);
        eagerStep.input.copy_(next);
      }
      graph.replay(Deadline::afterSeconds(20));
      eagerStep();
      const bool full = replay % 100 == 0;
      auto ours = full ? graphStep.results() : std::vector<at::Tensor>{graphStep.output};
      auto theirs = full ? eagerStep.results() : std::vector<at::Tensor>{eagerStep.output};
      for (size_t i = 0; i < ours.size(); ++i) {
        if (withinRounding(ours[i], theirs[i])) continue;
        if (++differ <= 5) FAIL_CHECK(fmt::format("replay {}: tensor {} differs from the eager step's", replay, i));
      }
    }
    CHECK(differ == 0);
    CHECK(captured.stats().droppedSlots == eager.stats().droppedSlots);
    CHECK(captured.stats().droppedSlots > 0);  // the skewed inputs overflowed some expert's capacity
  }
}

TEST_CASE("a rank that captured other exchanges (another capacity, a skipped layer) fails at capture on every rank") {
  const int me = gpuWorld().rank(), n = gpuWorld().size();
  if (n < 2) {
    WARN("one GPU: the cross-rank capture check needs two ranks");
    return;
  }
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  const bool odd = me == n - 1;
  for (const std::string name : {"capacity-differs", "layer-skipped"}) {
    // Fresh groups: captured calls that never run leave NCCL's state of them unlike their peers'.
    auto groups = parallel::ProcessGroups::create(gpuWorldPtr(), parallel::LayoutOptions{.ep = n}, {.warmup = false});
    moe::MoEOptions layerOptions = staticOptions();
    if (name == "capacity-differs" && odd) layerOptions.router.capacityFactor = 2.0;
    moe::MoELayer layer(layerOptions, groups, options);
    at::Tensor input = at::randn({kTokens, kHidden}, options);
    try {
      CapturedGraph graph(gpu(),
                          [&] {
                            c10::NoGradGuard noGrad;
                            layer.forward(input);
                            if (name == "layer-skipped" && !odd) layer.forward(input);  // the last rank skips it
                          },
                          {.name = name, .warmupRuns = 0, .store = gpuStore(), .comms = {gpuWorldPtr(), groups.ep()}});
      FAIL_CHECK(name << ": the capture passed");
    } catch (const DesyncError& error) {
      const std::string text = error.what();
      INFO(text);
      CHECK(text.find(fmt::format("checked region 'graph-{}'", name)) != std::string::npos);
      CHECK(text.find(fmt::format("group {} ", groups.ep()->name())) != std::string::npos);
      CHECK(text.find("diverged at collective") != std::string::npos);
      CHECK(text.find("all_to_all") != std::string::npos);
      CHECK(text.find(fmt::format("rank {}", n - 1)) != std::string::npos);
      CHECK(text.find("seq ") != std::string::npos);
    }
    discard(groups.ep(), "a capture check failed");
  }
}

TEST_CASE("NCCL collectives captured in a graph replay on every rank; one captured more fails at capture") {
  const int me = gpuWorld().rank(), n = gpuWorld().size();
  if (n < 2) {
    WARN("one GPU: the cross-rank capture check needs two ranks");
    return;
  }
  const auto options = at::TensorOptions().dtype(at::kFloat).device(gpu());
  at::Tensor x = at::empty({1024}, options);
  auto pair = gpuWorld().split(0, me, "graph-pair");
  CapturedGraph graph(gpu(),
                      [&] {
                        x.fill_(me + 1);
                        pair->allReduce(x);
                      },
                      {.name = "pair", .store = gpuStore(), .comms = {pair}});
  for (int i = 0; i < 100; ++i) {
    graph.replay(Deadline::afterSeconds(20));
    CHECK(x.eq(n * (n + 1) / 2).all().item<bool>());
  }
  // A fresh communicator: captured calls that never run leave its NCCL state
  // unlike its peers', so it is aborted afterwards.
  auto extra = gpuWorld().split(0, me, "graph-extra");
  try {
    CapturedGraph mismatched(gpu(),
                             [&] {
                               extra->allReduce(x);
                               if (me == n - 1) extra->allReduce(x);
                             },
                             {.name = "extra", .warmupRuns = 0, .store = gpuStore(), .comms = {extra}});
    FAIL_CHECK("the capture passed although one rank captured one collective more");
  } catch (const DesyncError& error) {
    const std::string text = error.what();
    INFO(text);
    CHECK(text.find("checked region 'graph-extra' #1") != std::string::npos);
    CHECK(text.find("diverged at collective 2 of the region") != std::string::npos);
    CHECK(text.find(fmt::format("rank {} issued all_reduce float32 [1024] sum", n - 1)) != std::string::npos);
  }
  discard(extra, "a capture check failed");
}
#endif
