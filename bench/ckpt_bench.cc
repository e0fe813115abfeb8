// Bulkhead's checkpoint save and load on an MoE-like state (bench/run_ckpt_bench.sh runs it beside
// torch.distributed.checkpoint and dd on the same disk). Per rank, on its GPU: 12 layers x (E/world
// experts of bf16 [1536 x 1024] and [1024 x 768]) + a bf16 [3072 x 1024] dense matrix per layer;
// with E = 64 and 2 ranks, about 3.8 GB in all. Expert weights are one key per layer and matrix,
// [64, ...] sliced by ep; the dense matrix is [world * 3072, 1024] sliced by rank.
//
//   mpirun -np 2 bulkhead-ckpt-bench --dir DIR --phase save [--iters 4]   blocking and total time per save
//   mpirun -np 2 bulkhead-ckpt-bench --dir DIR --phase load               load of `latest`, checked bitwise
//   mpirun -np 1 bulkhead-ckpt-bench --dir DIR --phase load --saved-world 2
//       a resharding load: the checkpoint was saved by 2 ranks, is loaded by 1 (experts and the dense
//       rows split over the loading ranks), and checked bitwise against the saving ranks' values
//
// Rank 0 prints "BULKHEAD_RESULT phase=reserve seconds=S" (allocating the pinned staging memory
// before the first save, Checkpointer::reserve), "BULKHEAD_RESULT phase=save iter=i blocking=S
// total=S bytes=B" per save (the slowest rank's times) and "BULKHEAD_RESULT phase=load seconds=S
// bytes=B equal=1".
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "checkpoint/checkpointer.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "runtime/errors.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;

namespace {

struct Options {
  std::string dir;
  std::string phase = "save";
  int iters = 4;
  int layers = 12;
  int experts = 64;
  int savedWorld = 0;  // ranks that saved the checkpoint a load reads (0: this job's)
  double timeout = 600;
};

void addFlags(CLI::App& app, Options& options) {
  app.add_option("--dir", options.dir, "checkpoint folder")->required();
  app.add_option("--phase", options.phase, "save or load")->check(CLI::IsMember({"save", "load"}));
  app.add_option("--iters", options.iters, "saves")->check(cli::positive());
  app.add_option("--layers", options.layers, "layers of the state")->check(cli::positive());
  app.add_option("--experts", options.experts, "experts per layer")->check(cli::positive());
  app.add_option("--timeout", options.timeout, "seconds for each save or load")->check(cli::positive());
  app.add_option("--saved-world", options.savedWorld, "ranks that saved the checkpoint a load reads (0: this job's)")
      ->check(cli::nonNegative());
}

// The state of `rank` of `world`, seeded so that a load regenerates what the save wrote. The
// global shapes are those of a job of `savedWorld` ranks (the dense rows grow with it); every
// tensor is split over the ranks along its first dimension.
StateDict build(const Options& options, int rank, int world, int savedWorld, c10::Device device, bool values) {
  at::manual_seed(1234 + rank);
  auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(device);
  if (options.experts % world != 0 || savedWorld * 3072 % world != 0)
    throw ConfigError(fmt::format("{} experts and {} dense rows do not split over {} ranks", options.experts,
                                  savedWorld * 3072, world));
  int64_t local = options.experts / world, rows = int64_t{savedWorld} * 3072 / world;
  StateDict state;
  auto make = [&](at::IntArrayRef shape) { return values ? at::randn(shape, bf16) : at::zeros(shape, bf16); };
  for (int l = 0; l < options.layers; ++l) {
    std::string p = fmt::format("layers.{}.", l);
    state.add(p + "experts.w1", make({local, 1536, 1024}), {{options.experts, 1536, 1024}, {rank * local, 0, 0}, 0});
    state.add(p + "experts.w2", make({local, 1024, 768}), {{options.experts, 1024, 768}, {rank * local, 0, 0}, 0});
    state.add(p + "dense", make({rows, 1024}), {{int64_t{savedWorld} * 3072, 1024}, {rank * rows, 0}, 0});
  }
  return state;
}

// What `rank` of `world` must hold after loading a checkpoint saved by `savedWorld` ranks: the
// saving ranks' values, regenerated one rank at a time, cut to this rank's slices.
StateDict expectedAfterLoad(const Options& options, int rank, int world, int savedWorld, c10::Device device) {
  if (savedWorld == world) return build(options, rank, world, savedWorld, device, true);
  StateDict expected = build(options, rank, world, savedWorld, device, false);
  for (int saver = 0; saver < savedWorld; ++saver) {
    StateDict saved = build(options, saver, savedWorld, savedWorld, device, true);
    for (size_t i = 0; i < saved.tensors.size(); ++i) {
      const auto& from = saved.tensors[i];
      auto& into = expected.tensors[i];
      int64_t begin = std::max(from.shard.offsets[0], into.shard.offsets[0]);
      int64_t end = std::min(from.shard.offsets[0] + from.local.size(0), into.shard.offsets[0] + into.local.size(0));
      if (begin < end)
        into.local.narrow(0, begin - into.shard.offsets[0], end - begin)
            .copy_(from.local.narrow(0, begin - from.shard.offsets[0], end - begin));
    }
  }
  return expected;
}

int64_t bytesOf(const StateDict& state) {
  int64_t bytes = 0;
  for (const auto& entry : state.tensors) bytes += entry.local.numel() * entry.local.element_size();
  return bytes;
}

// The slowest rank's value (the CPU world, whatever the backend).
double slowest(Runtime& runtime, double value) {
  at::Tensor t = at::tensor({value}, at::kDouble);
  runtime.cpuWorld().allReduce(t, {.op = ReduceOp::Max, .deadline = Deadline::afterSeconds(120)})->wait();
  return t.item<double>();
}

void sync(Runtime& runtime) {
  at::Tensor t = at::ones({1}, at::TensorOptions().device(runtime.device()));
  runtime.world().allReduce(t, {.deadline = Deadline::afterSeconds(120)})->wait();  // after the queued GPU work
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Checkpoint save and load of an MoE-like state (bench/run_ckpt_bench.sh).", "bulkhead-ckpt-bench");
  Options options;
  addFlags(app, options);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init();
    int rank = runtime->world().rank(), world = runtime->world().size();
    auto ckpt = Checkpointer::create({.dir = options.dir, .keep = 2, .timeoutSeconds = options.timeout},
                                     runtime->store(), rank, world);
    const int savedWorld = options.savedWorld > 0 ? options.savedWorld : world;
    StateDict state = build(options, rank, world, savedWorld, runtime->device(), options.phase == "save");
    int64_t bytes = static_cast<int64_t>(slowest(*runtime, static_cast<double>(bytesOf(state)))) * world;
    if (options.phase == "save") {
      auto reserving = std::chrono::steady_clock::now();
      ckpt->reserve(state);  // the staging memory, once, before the first save
      double reserve =
          slowest(*runtime, std::chrono::duration<double>(std::chrono::steady_clock::now() - reserving).count());
      if (rank == 0) std::printf("BULKHEAD_RESULT phase=reserve seconds=%.4f\n", reserve);
      for (int i = 0; i < options.iters; ++i) {
        sync(*runtime);
        auto started = std::chrono::steady_clock::now();
        SaveHandle handle = ckpt->save(i + 1, state);
        double blocking = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        SaveResult result = handle.wait(Deadline::afterSeconds(options.timeout + 60));
        if (!result.ok) throw CheckpointError(fmt::format("save {} failed: {}", i + 1, result.error));
        blocking = slowest(*runtime, blocking);
        double total = slowest(*runtime, result.totalSeconds);
        if (rank == 0)
          std::printf("BULKHEAD_RESULT phase=save iter=%d blocking=%.4f total=%.4f bytes=%lld\n", i, blocking, total,
                      static_cast<long long>(bytes));
        std::fflush(stdout);
      }
    } else {
      sync(*runtime);
      auto started = std::chrono::steady_clock::now();
      LoadResult loaded = ckpt->load(state);
      sync(*runtime);
      double seconds =
          slowest(*runtime, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
      StateDict expected = expectedAfterLoad(options, rank, world, savedWorld, runtime->device());
      bool equal = true;
      for (size_t i = 0; i < state.tensors.size(); ++i)
        equal = equal && at::equal(state.tensors[i].local, expected.tensors[i].local);
      double allEqual = -slowest(*runtime, equal ? -1.0 : 0.0);
      if (rank == 0)
        std::printf("BULKHEAD_RESULT phase=load step=%lld seconds=%.4f bytes=%lld equal=%d saved_world=%d world=%d\n",
                    static_cast<long long>(loaded.step), seconds, static_cast<long long>(bytes), allEqual > 0 ? 1 : 0,
                    savedWorld, world);
      std::fflush(stdout);
    }
    ckpt.reset();
    runtime->shutdown();
    return 0;
  });
}
