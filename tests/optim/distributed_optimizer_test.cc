// The distributed optimizer's update equals plain AdamW's on the gathered
// parameters, step after step: dense parameters sharded over dp 4, expert
// parameters over expert dp 2 (ep 2) and over two optimizer instances,
// parameters with fewer rows than ranks, 1-D and 0-D parameters; and bf16
// parameters with float32 master weights.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include "optim/adamw.h"
#include "optim/distributed_optimizer.h"
#include "optim/lr_schedule.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"
#include "tests/support/parallel_helpers.h"

using namespace bulkhead;
using namespace bulkhead::parallel;
using namespace bulkhead::testing;
using bulkhead::optim::AdamW;
using bulkhead::optim::DistributedOptimizer;

namespace {

// A global parameter of the test model and how this rank holds it.
struct Spec {
  std::string name;
  std::vector<int64_t> shape;  // global
  ParamGroup group = ParamGroup::Dense;
};

const optim::AdamWOptions kAdamW{
    .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weightDecay = 0.1, .decays = [](const Parameter& p) {
      return p.tensor.dim() >= 2;
    }};
const optim::LrSchedule kSchedule{.peak = 0.05, .min = 0.005, .warmupSteps = 2, .totalSteps = 5};

// Expert parameters: this rank's ep coordinate holds global experts
// [ep * E / ep_size, ...) along dim 0.
int64_t expertRows(const Spec& spec, const ProcessGroups& groups) { return spec.shape[0] / groups.ep()->size(); }

Parameter localParameter(const Spec& spec, const ProcessGroups& groups, const at::Tensor& global) {
  std::vector<int64_t> offsets(spec.shape.size(), 0);
  std::vector<int64_t> shape = spec.shape;
  int replica = groups.dpCp()->rank();
  if (spec.group == ParamGroup::Expert) {
    shape[0] = expertRows(spec, groups);
    offsets[0] = groups.ep()->rank() * shape[0];
    replica = groups.expertDp()->rank();
  }
  at::Tensor local = sliceOf(global, offsets, shape).clone().set_requires_grad(true);
  return {.name = spec.name, .tensor = local, .shard = {spec.shape, offsets, replica}, .group = spec.group};
}

// World rank q's gradient for its local piece of `spec` at `step`.
at::Tensor gradOf(int q, int step, const Spec& spec, at::IntArrayRef localShape) {
  return seeded(localShape, q, step, 0, spec.name);
}

// Runs `steps` steps of the distributed optimizer and of plain AdamW on the
// gathered parameters (every rank computes the gathered gradient alone from
// every rank's seeded gradient), checking the parameters after each.
void compareWithPlain(const std::vector<Spec>& specs, const LayoutOptions& layoutOptions, int steps) {
  ProcessGroups groups = makeGroups(layoutOptions);
  const Layout& layout = groups.layout();
  int dpSize = groups.dpCp()->size();

  std::vector<Parameter> local, global;
  for (const Spec& spec : specs) {
    at::Tensor initial = seeded(spec.shape, 100, 0, 0, spec.name);
    local.push_back(localParameter(spec, groups, initial));
    global.push_back({.name = spec.name,
                      .tensor = initial.clone().set_requires_grad(true),
                      .shard = ShardInfo::whole(spec.shape),
                      .group = spec.group});
  }
  DistributedOptimizer distributed(local, groups, {.adamw = kAdamW});
  AdamW plain(global, kAdamW);

  for (int step = 0; step < steps; ++step) {
    INFO(fmt::format("step {}", step + 1));
    for (size_t i = 0; i < specs.size(); ++i) {
      const Spec& spec = specs[i];
      local[i].tensor.mutable_grad() = gradOf(world().rank(), step, spec, local[i].tensor.sizes());
      // The gathered gradient: dense, the mean over dp; expert, each slice's
      // sum over its expert-dp replicas divided by the dense dp size.
      at::Tensor sum = at::zeros(spec.shape, at::kDouble);
      for (int q = 0; q < layout.worldSize(); ++q) {
        std::vector<int64_t> offsets(spec.shape.size(), 0), shape = spec.shape;
        if (spec.group == ParamGroup::Expert) {
          shape[0] = expertRows(spec, groups);
          offsets[0] = layout.coordinates(q).ep * shape[0];
        }
        sliceOf(sum, offsets, shape).add_(gradOf(q, step, spec, shape));
      }
      global[i].tensor.mutable_grad() = sum / dpSize;
    }
    double lr = kSchedule.at(distributed.stepCount());
    double norm = distributed.step(lr);
    plain.step(lr);

    double normWant = 0;
    for (const Parameter& p : global) normWant += p.tensor.grad().square().sum().item<double>();
    CHECK(std::abs(norm - std::sqrt(normWant)) <= 1e-12 * std::sqrt(normWant));
    for (size_t i = 0; i < specs.size(); ++i) {
      INFO(specs[i].name);
      at::Tensor want = sliceOf(global[i].tensor, local[i].shard.offsets, local[i].tensor.sizes());
      CHECK(relativeError(local[i].tensor, want) <= 1e-12);
      CHECK_FALSE(at::equal(local[i].tensor, sliceOf(seeded(specs[i].shape, 100, 0, 0, specs[i].name),
                                                     local[i].shard.offsets, local[i].tensor.sizes())));
    }
  }
  CHECK(distributed.stepCount() == steps);
}

}  // namespace

TEST_CASE("distributed optimizer equals plain AdamW: dense parameters over dp") {
  std::vector<Spec> specs{{"a.weight", {9, 5}},  // rows that do not divide evenly
                          {"b.bias", {5}},       // 1-D: rows are elements
                          {"c.small", {3, 7}},   // fewer rows than ranks
                          {"d.scale", {}},       // 0-D
                          {"e.table", {13, 2, 3}}};
  compareWithPlain(specs, {}, 3);
}

TEST_CASE("distributed optimizer equals plain AdamW: expert parameters over expert dp") {
  if (world().size() % 2 != 0) return;
  std::vector<Spec> specs{{"dense.weight", {6, 3}},
                          {"dense.bias", {3}},
                          {"experts.w1", {4, 3, 2}, ParamGroup::Expert},
                          {"experts.b1", {4, 3}, ParamGroup::Expert},
                          {"router.weight", {4, 3}}};
  compareWithPlain(specs, {.ep = 2}, 3);
}

TEST_CASE("distributed optimizer equals plain AdamW with two optimizer instances over expert dp") {
  // 4 ranks: expert dp 4 split into 2 parts of 2 (ep 1), and expert dp 2 into 2 parts of 1 (ep 2).
  if (world().size() != 4) return;
  std::vector<Spec> specs{{"dense.weight", {6, 3}},
                          {"experts.w1", {4, 3, 2}, ParamGroup::Expert},
                          {"experts.b1", {4, 5}, ParamGroup::Expert}};
  for (int ep : {1, 2}) {
    INFO("ep " << ep);
    compareWithPlain(specs, {.ep = ep, .optimizerInstances = 2}, 3);
    // The exported state: every element of each expert moment written exactly once across the world.
    ProcessGroups groups = makeGroups({.ep = ep, .optimizerInstances = 2});
    std::vector<Parameter> local;
    for (const Spec& spec : specs)
      local.push_back(localParameter(spec, groups, seeded(spec.shape, 100, 0, 0, spec.name)));
    DistributedOptimizer distributed(local, groups, {.adamw = kAdamW});
    at::Tensor written = at::zeros({static_cast<int64_t>(specs.size())}, at::kDouble);
    for (const ShardedTensor& state : distributed.state())
      for (size_t i = 0; i < specs.size(); ++i)
        if (state.key == "optim." + specs[i].name + ".exp_avg" && state.shard.replicaId == 0)
          written[i] += static_cast<double>(state.local.numel());
    world().allReduce(written)->wait();
    int64_t held = 0;  // elements of moments (float64: no distinct master) every instance must hold
    for (size_t i = 0; i < specs.size(); ++i) {
      INFO(specs[i].name);
      int64_t numel = 1;
      for (int64_t extent : specs[i].shape) numel *= extent;
      CHECK(written[i].item<double>() == static_cast<double>(numel));
      held += 2 * numel * (specs[i].group == ParamGroup::Expert ? 2 : 1);
    }
    // Each instance holds the whole expert state: twice the elements of one sharding over all of expert dp.
    at::Tensor elements = at::full({1}, static_cast<double>(distributed.stateElements()), at::kDouble);
    world().allReduce(elements)->wait();
    CHECK(elements.item<double>() == static_cast<double>(held));
  }
}

namespace {

// bf16 parameters with float32 master weights, their gradients reduced in
// float32 or in bf16 (`inParamDtype`): the quarter steps below sum exactly in
// either.
void checkBf16Masters(bool inParamDtype) {
  INFO("reduced in " << (inParamDtype ? "bf16" : "float32"));
  ProcessGroups groups = makeGroups({});
  int dpSize = groups.dpCp()->size();
  std::vector<Spec> specs{{"w", {5, 4}}, {"v", {7}}};
  std::vector<Parameter> local, global;
  for (const Spec& spec : specs) {
    at::Tensor initial = seeded(spec.shape, 200, 0, 0, spec.name).to(at::kBFloat16);
    local.push_back({.name = spec.name,
                     .tensor = initial.clone().set_requires_grad(true),
                     .shard = ShardInfo::whole(spec.shape, groups.dpCp()->rank())});
    global.push_back(
        {.name = spec.name, .tensor = initial.clone().set_requires_grad(true), .shard = ShardInfo::whole(spec.shape)});
  }
  DistributedOptimizer distributed(local, groups, {.adamw = kAdamW, .reduceInParamDtype = inParamDtype});
  AdamW plain(global, kAdamW);
  CHECK(distributed.stateElements() > 0);

  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < specs.size(); ++i) {
      // Quarter steps in [-2, 2): their mean over dp is exact in bf16, so the
      // plain optimizer's bf16 gradient equals the distributed float32 one.
      local[i].tensor.mutable_grad() = draw(world().rank(), 10 * step + int(i), specs[i].shape, at::kBFloat16);
      at::Tensor sum = at::zeros(specs[i].shape, at::kFloat);
      for (int q = 0; q < world().size(); ++q) sum += draw(q, 10 * step + int(i), specs[i].shape, at::kFloat);
      global[i].tensor.mutable_grad() = (sum / dpSize).to(at::kBFloat16);
    }
    double lr = kSchedule.at(step);
    distributed.step(lr);
    plain.step(lr);
  }
  std::vector<GlobalKey> keys;
  for (const Spec& spec : specs)
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"})
      keys.push_back({"optim." + spec.name + suffix, spec.shape});
  auto state = distributed.state();
  for (const ShardedTensor& piece : state)
    if (piece.key != "optim.step") CHECK(piece.local.scalar_type() == at::kFloat);
  auto globals = assemble(state, keys);
  for (size_t i = 0; i < specs.size(); ++i) {
    INFO(specs[i].name);
    CHECK(plain.master(i).scalar_type() == at::kFloat);
    CHECK(relativeError(globals["optim." + specs[i].name + ".master"], plain.master(i)) <= 1e-6);
    CHECK(relativeError(globals["optim." + specs[i].name + ".exp_avg"], plain.expAvg(i)) <= 1e-6);
    // The bf16 parameter is its master rounded, on every replica.
    CHECK(at::equal(local[i].tensor, globals["optim." + specs[i].name + ".master"].to(at::kBFloat16)));
    CHECK(local[i].tensor.scalar_type() == at::kBFloat16);
  }
}

}  // namespace

TEST_CASE("distributed optimizer keeps float32 master weights for bf16 parameters") {
  checkBf16Masters(/*inParamDtype=*/false);
  checkBf16Masters(/*inParamDtype=*/true);
}

TEST_CASE("replicas passing different parameters fail on every rank before any step") {
  if (world().size() < 2) return;
  ProcessGroups groups = makeGroups({});
  // World rank 1 names its parameter differently.
  std::string name = world().rank() == 1 ? "w.renamed" : "w";
  std::vector<Parameter> params{{.name = name,
                                 .tensor = seeded({3, 2}, 700).set_requires_grad(true),
                                 .shard = ShardInfo::whole({3, 2}, groups.dpCp()->rank())}};
  try {
    DistributedOptimizer optimizer(params, groups);
    FAIL("no ConfigError");
  } catch (const ConfigError& e) {
    std::string message = e.what();
    INFO(message);
    CHECK(message.find(world().rank() == 1 ? "world ranks 0" : "world ranks 1") != std::string::npos);
    CHECK(message.find("dp-cp[0]") != std::string::npos);
  }
  // A parameter without its ShardInfo is refused before any communication.
  std::vector<Parameter> bare{{.name = "x", .tensor = seeded({2}, 701).set_requires_grad(true)}};
  CHECK_THROWS_AS(DistributedOptimizer(bare, groups), ConfigError);
}

TEST_CASE("bf16 gradients reduced in bf16 round their sum to bf16; in float32 they do not") {
  if (world().size() != 4) return;
  ProcessGroups groups = makeGroups({});
  // World rank 0 holds 1, the others 2^-9 each: the float32 sum 1 + 3 * 2^-9 lies between two bf16
  // values (1 and 1 + 2^-7), so a bf16 sum in any order is a bf16 value, and not it.
  const float mine = world().rank() == 0 ? 1.0f : std::ldexp(1.0f, -9);
  const float exact = (1.0f + 3 * std::ldexp(1.0f, -9)) / 4;  // the dp mean, in float32
  for (bool inParamDtype : {false, true}) {
    INFO("reduced in " << (inParamDtype ? "bf16" : "float32"));
    at::Tensor weight = at::zeros({4}, at::kBFloat16).set_requires_grad(true);
    std::vector<Parameter> params{
        {.name = "w", .tensor = weight, .shard = ShardInfo::whole({4}, groups.dpCp()->rank())}};
    DistributedOptimizer optimizer(params, groups, {.adamw = kAdamW, .reduceInParamDtype = inParamDtype});
    weight.mutable_grad() = at::full({4}, mine, at::kBFloat16);
    optimizer.step(1e-3);
    // After one step exp_avg is (1 - beta1) times the reduced gradient.
    for (const ShardedTensor& piece : optimizer.state()) {
      if (piece.key != "optim.w.exp_avg" || piece.local.numel() == 0) continue;
      at::Tensor gradient = piece.local.to(at::kDouble) / (1 - kAdamW.beta1);
      at::Tensor want = at::full_like(gradient, static_cast<double>(exact));
      if (inParamDtype) {
        CHECK((gradient - want).abs().min().item<double>() > 1e-4);
        at::Tensor sum = gradient * 4;  // a bf16 value, within exp_avg's float32 rounding
        CHECK((sum - sum.to(at::kBFloat16).to(at::kDouble)).abs().max().item<double>() <= 1e-6);
      } else {
        CHECK((gradient - want).abs().max().item<double>() <= 1e-7);
      }
    }
  }
}
