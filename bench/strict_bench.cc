// The cost of strict mode (BULKHEAD_STRICT): the same all-reduces with the
// cross-rank fingerprint check off and on, alternating, in one run, on the
// backend init picks (mpi on CPUs, nccl on GPUs). Each call is waited on, so
// the figures are per-call latencies as a training loop would see them.
// Then the cost of a checked region's end (runtime/diagnosis/checked_region.h) for
// regions of 1 to 256 collectives, beside one exchange through the same store.
//
//   mpirun -np 4 bulkhead-strict-bench [--out bench/results/strict.md]
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_check.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "runtime/diagnosis/checked_region.h"
#include "runtime/errors.h"

using namespace bulkhead;

namespace {

double microsPerCall(Communicator& world, at::Tensor& t, int calls) {
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) world.allReduce(t)->wait();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / calls;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The largest of every rank's value.
double maxOver(Communicator& world, double value, c10::Device device) {
  at::Tensor t = at::tensor({value}, at::kDouble).to(device);
  world.allReduce(t, {.op = ReduceOp::Max})->wait();
  return t.cpu().item<double>();
}

// A checked region's end() beside the least any cross-rank agreement through
// the store costs: one setAndGather of a short value among the same ranks (a
// rank waits there for the slowest). Both follow a waited all-reduce, so the
// ranks arrive alike. Median microseconds of 100, slowest rank.
std::string regionTable(Runtime& runtime) {
  Communicator& world = runtime.world();
  at::Tensor t = at::randn({2}, at::TensorOptions().device(runtime.device()));
  std::vector<double> exchanges;
  for (int i = 0; i < 100; ++i) {
    Store::SetAndGather round{.key = fmt::format("bench/exchange/{}/{}", i, world.rank()), .value = "x"};
    for (int r = 0; r < world.size(); ++r) round.keys.push_back(fmt::format("bench/exchange/{}/{}", i, r));
    world.allReduce(t)->wait();
    auto start = std::chrono::steady_clock::now();
    runtime.store()->setAndGather(round, Deadline::afterSeconds(30));
    exchanges.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  const double exchange = maxOver(world, median(exchanges), runtime.device());
  std::string table = fmt::format(
      "\n## Checked region cost\n\nend() of a region of N waited all-reduces (fp32, 2 elements) beside one "
      "exchange through the store alone (setAndGather of one byte per rank, after a waited all-reduce): {:.1f} us. "
      "Median of 100, slowest rank.\n\n"
      "| collectives in the region | end() us | end() / exchange alone |\n|---:|---:|---:|\n",
      exchange);
  for (int collectives : {1, 16, 256}) {
    std::vector<double> ends;
    for (int i = 0; i < 100; ++i) {
      CheckedRegion region(runtime.store(), {runtime.worldPtr()}, {.name = fmt::format("bench{}", collectives)});
      for (int c = 0; c < collectives; ++c) world.allReduce(t)->wait();
      ends.push_back(region.end().checkSeconds * 1e6);
    }
    const double end = maxOver(world, median(ends), runtime.device());
    table += fmt::format("| {} | {:.1f} | {:.2f} |\n", collectives, end, end / exchange);
  }
  return table;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app(
      "The cost of strict mode (the same all-reduces with the cross-rank fingerprint check off and on) "
      "and of a checked region's end.",
      "bulkhead-strict-bench");
  std::string out;
  app.add_option("--out", out, "also write the table to this file");
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init();
    Communicator& world = runtime->world();
    auto& monitor = *runtime->monitor();
    std::string table = fmt::format(
        "# Strict mode cost\n\n{} ranks, backend {}, all-reduce fp32 waited per call, median of 5 alternating "
        "rounds.\n\n"
        "| bytes | off us/call | strict us/call | added us/call |\n|---:|---:|---:|---:|\n",
        world.size(), world.backend());
    for (int64_t bytes : {int64_t{8}, int64_t{64} << 10, int64_t{1} << 20}) {
      at::Tensor t = at::randn({bytes / 4}, at::TensorOptions().device(runtime->device()));
      int calls = bytes >= (1 << 20) ? 50 : 300;
      std::vector<double> off, on;
      for (int round = 0; round < 5; ++round) {
        monitor.setStrict(false);
        off.push_back(microsPerCall(world, t, calls));
        monitor.setStrict(true);
        on.push_back(microsPerCall(world, t, calls));
      }
      monitor.setStrict(false);
      at::Tensor stats = at::tensor({median(off), median(on)}, at::kDouble).to(runtime->device());
      world.allReduce(stats, {.op = ReduceOp::Max})->wait();
      stats = stats.cpu();
      double a = stats[0].item<double>(), b = stats[1].item<double>();
      table += fmt::format("| {} | {:.1f} | {:.1f} | {:.1f} |\n", bytes, a, b, b - a);
    }
    table += regionTable(*runtime);
    if (world.rank() == 0) {
      bench::report(table, out);
    }
    return 0;
  });
}
