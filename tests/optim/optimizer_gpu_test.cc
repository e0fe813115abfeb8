// The distributed optimizer on GPUs (its multi-tensor kernels: the gradients'
// conversion into the float32 input, the norm, AdamW, the copy back into the
// parameters; on one GPU the update reading the bf16 gradients as they are and
// writing the parameters itself) against the same optimizer on the CPU (one
// operation per piece) over the mpi world: bf16 parameters with float32 master
// weights (and float32 or bf16 moments), the clip active, a parameter
// without a gradient, dp = every GPU.
// One rank per GPU.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "optim/distributed_optimizer.h"
#include "parallel/process_groups.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  parallel::ParamGroup group = parallel::ParamGroup::Dense;
};

const std::vector<Spec> kSpecs{{"attn.weight", {96, 64}},  // decays
                               {"norm.weight", {64}},      // does not
                               {"moe.experts.w13", {4, 2, 24, 64}, parallel::ParamGroup::Expert},
                               {"moe.router.weight", {4, 64}},
                               {"unused.weight", {5, 7}}};  // never gets a gradient: its weight decay alone

struct Side {
  parallel::ProcessGroups groups;
  std::vector<parallel::Parameter> params;
  std::unique_ptr<optim::DistributedOptimizer> optimizer;

  Side(const CommunicatorPtr& world, const c10::Device& device, at::ScalarType moments = at::kFloat)
      : groups(parallel::ProcessGroups::create(world, parallel::LayoutOptions{}, {.warmup = false})) {
    const int replica = groups.dpCp()->rank();
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      // The same values on every rank (dense replicas must agree), drawn in float32, held in bf16.
      at::Tensor value = at::randn(kSpecs[i].shape, sharedGenerator(700 + static_cast<int>(i)), at::kFloat) * 0.5;
      params.push_back(
          {.name = kSpecs[i].name,
           .tensor = value.to(at::TensorOptions(at::kBFloat16).device(device)).set_requires_grad(true),
           .shard = parallel::ShardInfo::whole(
               kSpecs[i].shape, kSpecs[i].group == parallel::ParamGroup::Expert ? groups.expertDp()->rank() : replica),
           .group = kSpecs[i].group});
    }
    optimizer = std::make_unique<optim::DistributedOptimizer>(
        params, groups,
        optim::DistributedOptimizerOptions{
            .adamw = {.weightDecay = 0.1, .momentType = moments}});  // matrices and expert weights decay
  }

  // This rank's step-`step` gradients (another draw on every rank); `poison`: one of them NaN.
  void setGradients(int step, int rank, bool poison = false) {
    for (size_t i = 0; i + 1 < params.size(); ++i) {
      at::Tensor grad = at::randn(kSpecs[i].shape, sharedGenerator(1000 * step + 10 * rank + static_cast<int>(i)));
      if (poison && i == 0) grad[0][0] = std::numeric_limits<float>::quiet_NaN();
      params[i].tensor.mutable_grad() = grad.to(params[i].tensor.options());
    }
  }
  // The gradients above, then one update.
  double step(int step, int rank) {
    setGradients(step, rank);
    const double norm = optimizer->step(1e-2, {.maxGradNorm = 1.0});
    optimizer->zeroGrad();
    return norm;
  }
};

// bf16 values within one rounding of each other where they straddle one, and few of those.
void checkBf16Close(const at::Tensor& ours, const at::Tensor& theirs) {
  CHECK((ours - theirs).abs().max().item<double>() <= theirs.abs().max().item<double>() / 128);
  CHECK((ours - theirs).ne(0).to(at::kDouble).mean().item<double>() < 0.01);
}

// Every state tensor and parameter of the GPU side within the kernels' roundings of the CPU side's:
// float32 state within `tolerance` of its largest value.
void checkAgree(Side& gpuSide, Side& cpuSide, double tolerance = 1e-5) {
  auto gpuState = gpuSide.optimizer->state(), cpuState = cpuSide.optimizer->state();
  REQUIRE(gpuState.size() == cpuState.size());
  for (size_t i = 0; i < gpuState.size(); ++i) {
    INFO(gpuState[i].key);
    REQUIRE(gpuState[i].key == cpuState[i].key);
    REQUIRE(gpuState[i].local.scalar_type() == cpuState[i].local.scalar_type());
    const at::Tensor ours = gpuState[i].local.cpu().to(at::kDouble), theirs = cpuState[i].local.to(at::kDouble);
    if (gpuState[i].local.scalar_type() == at::kBFloat16) {  // bf16 moments: rounded from float32 alike
      checkBf16Close(ours, theirs);
      continue;
    }
    // The float32 state within a few roundings of the CPU's (the kernels order their float operations otherwise).
    CHECK((ours - theirs).abs().max().item<double>() <= tolerance * (theirs.abs().max().item<double>() + 1e-3));
  }
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    INFO(kSpecs[i].name);
    const at::Tensor ours = gpuSide.params[i].tensor.detach().cpu().to(at::kDouble);
    const at::Tensor theirs = cpuSide.params[i].tensor.detach().to(at::kDouble);
    // The bf16 parameters: the masters rounded, one bf16 step apart at most where they straddle a rounding.
    checkBf16Close(ours, theirs);
  }
}

}  // namespace

TEST_CASE("the distributed optimizer's GPU kernels match its CPU step: bf16 parameters, float32 masters, the clip") {
  const int me = gpuWorld().rank();
  Side gpuSide(gpuWorldPtr(), gpu()), cpuSide(cpuWorldPtr(), c10::Device(c10::kCPU));
  for (int step = 1; step <= 5; ++step) {
    INFO(fmt::format("rank {}, step {}", me, step));
    const double gpuNorm = gpuSide.step(step, me), cpuNorm = cpuSide.step(step, me);
    CHECK(gpuNorm > 1.0);  // the clip scales every step
    CHECK(std::abs(gpuNorm - cpuNorm) <= 1e-5 * cpuNorm);
    checkAgree(gpuSide, cpuSide);
  }
}

TEST_CASE("the distributed optimizer's GPU kernels match its CPU step with bf16 moments") {
  const int me = gpuWorld().rank();
  Side gpuSide(gpuWorldPtr(), gpu(), at::kBFloat16), cpuSide(cpuWorldPtr(), c10::Device(c10::kCPU), at::kBFloat16);
  for (int step = 1; step <= 5; ++step) {
    INFO(fmt::format("rank {}, step {}", me, step));
    const double gpuNorm = gpuSide.step(step, me), cpuNorm = cpuSide.step(step, me);
    CHECK(std::abs(gpuNorm - cpuNorm) <= 1e-5 * cpuNorm);
    // A moment that rounds the other way on one side moves that element's update by 2^-8 of it.
    checkAgree(gpuSide, cpuSide, 2e-4);
  }
  for (const auto& entry : gpuSide.optimizer->state())
    if (entry.key.find(".exp_avg") != std::string::npos) CHECK(entry.local.scalar_type() == at::kBFloat16);
}

TEST_CASE("steps queued on a GPU: a non-finite norm skips its update on every rank, counted once read") {
  const int me = gpuWorld().rank(), poisoner = gpuWorld().size() - 1;
  Side gpuSide(gpuWorldPtr(), gpu()), cpuSide(cpuWorldPtr(), c10::Device(c10::kCPU));
  std::vector<optim::StepNorm> queued;
  std::vector<double> cpuNorms;
  for (int step = 1; step <= 3; ++step) {  // the second step's gradients hold a NaN on one rank
    const bool poison = step == 2 && me == poisoner;
    gpuSide.setGradients(step, me, poison);
    queued.push_back(gpuSide.optimizer->launchStep(1e-2, {.maxGradNorm = 1.0}));
    gpuSide.optimizer->zeroGrad();
    cpuSide.setGradients(step, me, poison);
    cpuNorms.push_back(cpuSide.optimizer->step(1e-2, {.maxGradNorm = 1.0}));
    cpuSide.optimizer->zeroGrad();
  }
  for (size_t s = 0; s < queued.size(); ++s) {  // read only now, after all three were queued
    INFO(fmt::format("rank {}, step {}", me, s + 1));
    const double norm = queued[s].get();
    if (s == 1) {
      CHECK(std::isnan(norm));
      CHECK(std::isnan(cpuNorms[s]));
    } else {
      CHECK(std::abs(norm - cpuNorms[s]) <= 1e-5 * cpuNorms[s]);
    }
  }
  CHECK(gpuSide.optimizer->stepCount() == 2);
  CHECK(gpuSide.optimizer->skippedSteps() == 1);
  CHECK(cpuSide.optimizer->stepCount() == 2);
  checkAgree(gpuSide, cpuSide);  // the skipped step changed nothing on either side
}
