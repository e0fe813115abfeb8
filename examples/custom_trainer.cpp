// A C++ trainer on Bulkhead's API, start to finish: init, a parallel layout and
// its groups, a MoE layer, the distributed optimizer, a checkpoint saved and
// loaded back. It fits a MoE layer to a fixed random teacher MoE layer.
//
//   mpirun -np 4 custom_trainer [--ep 2] [--steps 60] [--ckpt-dir /tmp/custom_ckpt]
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <chrono>
#include <string>

#include "checkpoint/checkpointer.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "moe/moe_layer.h"
#include "optim/distributed_optimizer.h"
#include "optim/lr_schedule.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"

using namespace bulkhead;

// Model weights and optimizer state, each under its global key.
checkpoint::StateDict stateOf(const moe::MoELayer& layer, optim::DistributedOptimizer& optimizer, int64_t step) {
  checkpoint::StateDict state;
  for (const auto& parameter : layer.parameters())
    state.add(parameter.name, parameter.tensor.detach(), parameter.shard);
  for (const auto& slice : optimizer.state()) state.add(slice.key, slice.local, slice.shard);
  state.dataPosition = std::to_string(step);
  return state;
}

int main(int argc, char** argv) {
  // 0. The command line (CLI11, with Bulkhead's --help, --version and exit codes).
  cli::App app("Fits a MoE layer to a teacher layer with Bulkhead's API, saves and loads it back.", "custom_trainer");
  int ep = 2, steps = 60;
  std::string dir;  // default: a folder of this run's own, under /tmp
  app.add_option("--ep", ep, "expert-parallel size")->check(cli::positive());
  app.add_option("--steps", steps, "training steps")->check(cli::positive());
  app.add_option("--ckpt-dir", dir, "checkpoint folder (default: one of its own under /tmp)");
  if (auto code = cli::parse(app, argc, argv)) return *code;

  return guardedMain([&] {
    // 1. The runtime (MPI or NCCL, chosen from the machine) and every group,
    //    built and warmed now rather than at the first collective.
    auto runtime = init();
    auto groups = parallel::ProcessGroups::create(runtime->worldPtr(), parallel::LayoutOptions{.ep = ep});
    const int rank = runtime->world().rank();
    const auto options = at::TensorOptions(at::kFloat).device(runtime->device());

    // 2. A student MoE layer and a teacher with other weights (another seed).
    moe::MoEOptions layerOptions{
        .hidden = 32, .ffnHidden = 64, .router = {.numExperts = 8, .topK = 2}, .globalAuxLoss = true, .initStd = 0.1};
    moe::MoELayer student(layerOptions, groups, options);
    layerOptions.seed = 99;
    moe::MoELayer teacher(layerOptions, groups, options);

    // 3. AdamW with state sharded over dp (dense) and expert dp (experts).
    optim::DistributedOptimizer optimizer(student.parameters(), groups);
    const optim::LrSchedule schedule{.peak = 1e-2, .min = 1e-3, .warmupSteps = 5, .totalSteps = steps};

    auto batch = [&](int64_t step) {
      at::manual_seed(1000 * step + groups.dpCp()->rank());
      return at::randn({64, 32}, options);
    };
    auto lossAt = [&](int64_t step, bool train) {
      at::Tensor x = batch(step);
      at::Tensor target;
      {
        c10::NoGradGuard noGrad;
        target = teacher.forward(x).output;
      }
      moe::MoEOutput out = student.forward(x);
      at::Tensor loss = (out.output - target).pow(2).mean();
      if (train) {
        (loss + out.auxLoss + out.zLoss).backward();
        optimizer.step(schedule.at(step), {.maxGradNorm = 1.0});
        optimizer.zeroGrad();
      }
      at::Tensor mean = loss.detach().reshape({1}).clone();
      groups.dpCp()->allReduce(mean)->wait();
      return mean.item<double>() / groups.dpCp()->size();
    };

    // 4. Train, printing the data-parallel mean loss.
    for (int64_t step = 0; step < steps; ++step) {
      const double loss = lossAt(step, true);
      if (rank == 0 && (step % 10 == 0 || step + 1 == steps)) fmt::print("step {:>3}  loss {:.5f}\n", step, loss);
    }

    // 5. Save (async: returns once tensors are in host memory), wait, load
    //    back into the live tensors, and check the loss is what it was.
    if (dir.empty()) {  // rank 0's clock names it, so a rerun never meets an old step folder
      at::Tensor stamp = at::full({1}, std::chrono::system_clock::now().time_since_epoch().count(), at::kLong);
      runtime->cpuWorld().broadcast(stamp, 0)->wait(Deadline::afterSeconds(30));
      dir = fmt::format("/tmp/bulkhead_custom_trainer_{}", stamp.item<int64_t>());
    }
    auto checkpointer =
        checkpoint::Checkpointer::create({.dir = dir, .keep = 2}, runtime->store(), rank, runtime->world().size());
    checkpointer->save(steps, stateOf(student, optimizer, steps));
    auto saved = checkpointer->wait(Deadline::afterSeconds(60));
    const double before = lossAt(steps, false);
    for (const auto& parameter : student.parameters()) {
      c10::NoGradGuard noGrad;
      parameter.tensor.mul_(0.5);  // disturb, so the load visibly restores
    }
    checkpoint::StateDict targets = stateOf(student, optimizer, 0);
    auto loaded = checkpointer->load(targets, {.step = steps});
    optimizer.afterLoad();
    const double after = lossAt(steps, false);
    if (rank == 0) {
      fmt::print("saved {} ({}), loaded step {}: loss {:.6f} before, {:.6f} after\n", saved.path,
                 saved.ok ? "committed" : saved.error, loaded.step, before, after);
    }
    runtime->shutdown();
    return saved.ok && before == after ? 0 : 1;
  });
}
