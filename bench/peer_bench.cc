// The all-reduce through peer memory (docs/design.md#peer-all-reduce) beside
// NCCL, in one run, on the same GPUs, stream and buffers: bf16 sums from 8 B
// to --max-bytes, back-to-back launches timed with CUDA events, and one call
// at a time waited on the host. Three columns: bare NCCL (bench/raw_nccl.h),
// the nccl backend's NCCL path (the world), and its peer path (a group that
// BULKHEAD_PEER_ALL_REDUCE names, set here). Every size is checked once
// against the exact sum before it is timed.
//
//   mpirun -np 2|4 bulkhead-peer-bench [--max-bytes 64M] [--out FILE]
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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
  int64_t maxBytes = int64_t{64} << 20;
  std::string out;
};

// Medians of 7 alternating rounds, one value a launcher.
std::vector<double> alternate(int iterations, const std::vector<std::function<double(int)>>& timers) {
  std::vector<std::vector<double>> times(timers.size());
  for (const auto& timer : timers) timer(std::max(2, iterations / 10));  // warm
  for (int round = 0; round < 7; ++round)
    for (size_t t = 0; t < timers.size(); ++t) times[t].push_back(timers[t](iterations));
  std::vector<double> medians;
  for (auto& values : times) medians.push_back(median(values));
  return medians;
}

struct Row {
  int64_t bytes;
  double raw, nccl, peer;  // us a launch
};

// Sums rank-seeded integers through `group` and compares with the exact sum.
void checkSum(Communicator& group, int64_t elements, c10::Device device) {
  const int n = group.size();
  at::Tensor want = at::zeros({elements}, at::TensorOptions().dtype(at::kBFloat16).device(device)), mine;
  for (int r = 0; r < n; ++r) {
    at::Tensor values = at::arange(elements, at::TensorOptions().dtype(at::kLong).device(device)).remainder(7 + r) - 3;
    want += values.to(at::kBFloat16);
    if (r == group.rank()) mine = values.to(at::kBFloat16);
  }
  group.allReduce(mine)->wait();
  if (!at::equal(mine, want))
    throw CommError(fmt::format("the sum of {} elements through {} is wrong", elements, group.name()));
}

std::string table(const std::vector<Row>& rows, int n, const std::string& gpu, double rawOnce, double peerOnce) {
  std::string text = fmt::format(
      "# Peer-memory all-reduce vs NCCL\n\n{} ranks, one {} each, NCCL {}, bf16 sums, back-to-back launches on one "
      "stream timed with CUDA events (median of 7 alternating rounds). busbw = 2 (n-1)/n x bytes / time.\n\n"
      "| bytes | NCCL us | bulkhead NCCL us | bulkhead peer us | peer / NCCL | NCCL busbw GB/s | peer busbw GB/s |\n"
      "|---:|---:|---:|---:|---:|---:|---:|\n",
      n, gpu, nccl::RawNccl::version());
  const double factor = 2.0 * (n - 1) / n;
  for (const Row& row : rows)
    text += fmt::format("| {} | {:.2f} | {:.2f} | {:.2f} | {:.3f} | {:.2f} | {:.2f} |\n", row.bytes, row.raw, row.nccl,
                        row.peer, row.peer / row.raw, factor * row.bytes / row.raw / 1e3,
                        factor * row.bytes / row.peer / 1e3);
  text +=
      fmt::format("\nOne 8 KiB all-reduce at a time, waited on the host: NCCL {:.2f} us, peer {:.2f} us ({:.3f}).\n",
                  rawOnce, peerOnce, peerOnce / rawOnce);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("The peer-memory all-reduce beside NCCL (bench/run_peer_bench.sh).", "bulkhead-peer-bench");
  Options options;
  cli::addBytes(app, "--max-bytes", options.maxBytes, "largest message per rank");
  app.add_option("--out", options.out, "also write the table to this file");
  if (auto code = cli::parse(app, argc, argv)) return *code;
  // The group "bench" takes the peer path for every size measured; the world stays on NCCL.
  setenv("BULKHEAD_PEER_ALL_REDUCE", "bench", 1);
  setenv("BULKHEAD_PEER_ALL_REDUCE_BYTES", std::to_string(options.maxBytes).c_str(), 1);
  return guardedMain([&] {
    auto runtime = init({.backend = Backend::Nccl});
    Communicator& world = runtime->world();
    const int n = world.size();
    auto peerGroup = world.split(0, world.rank(), "bench");
    nccl::RawNccl raw(runtime->cpuWorld(), Deadline::afterSeconds(env::kInitTimeout.seconds()));
    cudaStream_t stream;
    BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const c10::Device device = runtime->device();
    at::Tensor buffer = at::randn({options.maxBytes / 2}, at::TensorOptions().dtype(at::kBFloat16).device(device));
    BENCH_CHECK(cudaDeviceSynchronize());

    std::vector<Row> rows;
    for (int64_t bytes = 8; bytes <= options.maxBytes; bytes *= 2) {
      const int64_t elements = bytes / 2;
      checkSum(*peerGroup, elements, device);
      at::Tensor x = buffer.narrow(0, 0, elements);
      const int iterations = static_cast<int>(std::clamp<int64_t>((int64_t{4} << 30) / bytes, 20, 2000));
      const std::vector<double> us =
          alternate(iterations,
                    {[&](int k) { return timeLoop(stream, k, [&] { raw.allReduceSum(x, stream); }); },
                     [&](int k) { return timeLoop(stream, k, [&] { world.allReduce(x, {.stream = stream}); }); },
                     [&](int k) { return timeLoop(stream, k, [&] { peerGroup->allReduce(x, {.stream = stream}); }); }});
      rows.push_back({bytes, us[0], us[1], us[2]});
    }

    // One call at a time, waited on the host.
    at::Tensor small = buffer.narrow(0, 0, 4096);
    auto once = [&](const std::function<void()>& call) {
      return [&, call](int k) {
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < k; ++i) call();
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / k;
      };
    };
    const std::vector<double> waited =
        alternate(500, {once([&] {
                          raw.allReduceSum(small, stream);
                          BENCH_CHECK(cudaStreamSynchronize(stream));
                        }),
                        once([&] { peerGroup->allReduce(small, {.stream = stream})->wait(); })});
    BENCH_CHECK(cudaStreamSynchronize(stream));
    if (world.rank() != 0) return 0;
    cudaDeviceProp props;
    BENCH_CHECK(cudaGetDeviceProperties(&props, device.index()));
    const std::string text = table(rows, n, props.name, waited[0], waited[1]);
    bench::report(text, options.out);
    return 0;
  });
}
