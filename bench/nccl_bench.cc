// Bulkhead's nccl backend beside raw NCCL calls, in one run, on the same GPUs,
// the same stream and the same buffers: all-reduce and all-to-all from 8 B to
// 1 GiB (bf16). Prints a table and writes it as markdown to --out.
//
//   mpirun -np 2 bulkhead-nccl-bench [--max-bytes 1G] [--out bench/results/nccl.md]
//
// The reference is bare NCCL (bench/raw_nccl.h): no ledger, watchdog or
// per-operation deadline.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_check.h"
#include "bench/raw_nccl.h"
#include "bench/stream_timing.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "runtime/env.h"
#include "runtime/errors.h"

using namespace bulkhead;
using bench::median;
using bench::timeLoop;

namespace {

struct Options {
  int64_t maxBytes = int64_t{1} << 30;
  std::string out;
};

void addFlags(CLI::App& app, Options& options) {
  cli::addBytes(app, "--max-bytes", options.maxBytes, "largest message per rank");
  app.add_option("--out", options.out, "also write the table to this file");
}

// Host clock around single operations, each waited to completion.
double timeEach(int iterations, const std::function<void()>& launchAndWait) {
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) launchAndWait();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iterations;
}

struct Row {
  std::string op;
  int64_t bytes;
  double rawUs, bulkheadUs, rawBusBw, bulkheadBusBw;
};

}  // namespace

int main(int argc, char** argv) {
  cli::App app("The nccl backend against raw NCCL: bandwidth and per-call overhead (bench/run_nccl_bench.sh).",
               "bulkhead-nccl-bench");
  Options options;
  addFlags(app, options);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init({.backend = Backend::Nccl});
    Communicator& world = runtime->world();
    Communicator& cpu = runtime->cpuWorld();
    int n = world.size(), me = world.rank();

    // The reference: a plain blocking NCCL communicator over the same ranks.
    nccl::RawNccl raw(cpu, Deadline::afterSeconds(env::kInitTimeout.seconds()));
    cudaStream_t stream;
    BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    auto device = runtime->device();
    int64_t maxElements = options.maxBytes / 2;
    at::Tensor a = at::randn({maxElements}, at::TensorOptions().dtype(at::kBFloat16).device(device));
    at::Tensor b = at::empty({maxElements}, at::TensorOptions().dtype(at::kBFloat16).device(device));
    BENCH_CHECK(cudaDeviceSynchronize());

    std::vector<Row> rows;
    for (const std::string op : {"all_reduce", "all_to_all"}) {
      for (int64_t bytes = 8; bytes <= options.maxBytes; bytes *= 2) {
        int64_t elements = bytes / 2;
        if (op == "all_to_all") elements -= elements % n;
        if (elements == 0) continue;
        at::Tensor x = a.narrow(0, 0, elements), y = b.narrow(0, 0, elements);
        std::function<void()> rawLaunch, ours;
        if (op == "all_reduce") {
          rawLaunch = [&] { raw.allReduceSum(x, stream); };
          ours = [&] { world.allReduce(x, {.stream = stream}); };
        } else {
          // One chunk of elements / n to and from each rank (views made once, outside the timed launches).
          rawLaunch = [&, xs = x.view({n, -1}), ys = y.view({n, -1}), one = std::vector<int64_t>(n, 1)] {
            raw.exchangeRows(xs, ys, one, one, stream);
          };
          ours = [&] { world.allToAll(x, y, {}, {}, {.stream = stream}); };
        }
        int iterations = static_cast<int>(std::clamp<int64_t>((int64_t{4} << 30) / bytes, 5, 500));
        timeLoop(stream, 5, rawLaunch);
        timeLoop(stream, 5, ours);
        std::vector<double> rawTimes, ourTimes;
        for (int round = 0; round < 7; ++round) {  // alternate, so drift hits both alike
          rawTimes.push_back(timeLoop(stream, iterations, rawLaunch));
          ourTimes.push_back(timeLoop(stream, iterations, ours));
        }
        double rawUs = median(rawTimes), ourUs = median(ourTimes);
        double factor = op == "all_reduce" ? 2.0 * (n - 1) / n : double(n - 1) / n;
        double payload = static_cast<double>(elements) * 2;
        rows.push_back(
            {op, elements * 2, rawUs, ourUs, payload / rawUs / 1e3 * factor, payload / ourUs / 1e3 * factor});
      }
    }

    // One operation at a time, each waited to completion: latency as a caller sees it.
    at::Tensor tiny = a.narrow(0, 0, 4);
    auto rawOnce = [&] {
      raw.allReduceSum(tiny, stream);
      cudaStreamSynchronize(stream);
    };
    auto ourOnce = [&] { world.allReduce(tiny, {.stream = stream})->wait(); };
    timeEach(200, rawOnce);
    timeEach(200, ourOnce);
    std::vector<double> rawOnceUs, ourOnceUs;
    for (int round = 0; round < 7; ++round) {
      rawOnceUs.push_back(timeEach(500, rawOnce));
      ourOnceUs.push_back(timeEach(500, ourOnce));
    }
    double rawLatency = median(rawOnceUs), ourLatency = median(ourOnceUs);
    BENCH_CHECK(cudaStreamSynchronize(stream));

    if (me == 0) {
      cudaDeviceProp props;
      cudaGetDeviceProperties(&props, device.index());
      const std::string version = nccl::RawNccl::version();
      std::string text = fmt::format(
          "# Bulkhead nccl backend vs raw NCCL\n\n{} ranks, one {} each, NCCL {}, bf16, back-to-back launches on "
          "one stream timed with CUDA events (median of 7 alternating rounds).\n\n"
          "| op | bytes | raw us | bulkhead us | raw busbw GB/s | bulkhead busbw GB/s | bulkhead / raw |\n"
          "|---|---:|---:|---:|---:|---:|---:|\n",
          n, props.name, version);
      double worstLarge[2] = {1e9, 1e9};
      for (const Row& row : rows) {
        double ratio = row.bulkheadBusBw / row.rawBusBw;
        text += fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.3f} |\n", row.op, row.bytes, row.rawUs,
                            row.bulkheadUs, row.rawBusBw, row.bulkheadBusBw, ratio);
        if (row.bytes >= (16 << 20)) {
          double& worst = worstLarge[row.op == "all_reduce" ? 0 : 1];
          worst = std::min(worst, ratio);
        }
      }
      const Row& smallest = rows.front();
      text += fmt::format(
          "\nFrom 16 MiB up, the lowest bulkhead/raw bus-bandwidth ratio: all_reduce {:.3f}, all_to_all {:.3f}.\n"
          "Added latency at 8 B, back-to-back: {:.2f} us ({:.2f} vs {:.2f} us per all-reduce).\n"
          "Added latency at 8 B, one all-reduce at a time waited on the host: {:.2f} us ({:.2f} vs {:.2f} us).\n",
          worstLarge[0], worstLarge[1], smallest.bulkheadUs - smallest.rawUs, smallest.bulkheadUs, smallest.rawUs,
          ourLatency - rawLatency, ourLatency, rawLatency);
      bench::report(text, options.out);
    }
    return 0;
  });
}
