// Bulkhead's MoE layer on GPUs (NCCL, bf16): forward + backward step time,
// and the bandwidth of its dispatch + combine beside raw NCCL all-to-alls of
// exactly the same rows (same splits, same GPUs, same run). Printed as
// "KEY value" lines for bench/run_moe_bench.sh, which puts them beside the
// PyTorch reference (bench/torch_moe.py). It also times the step's own floor:
// the layer's grouped expert products alone on the same rows (forward and
// backward), and prints the step over that floor and both in TFLOP/s.
//
//   mpirun -np 2 bulkhead-moe-bench [--tokens 4096] [--hidden 2048] [--experts 64]
//                                   [--topk 8] [--ffn 768] [--iters 20] [--per-slot] [--capacity 0]
//                                   [--shared-ffn 0] [--shared-in-line] [--shared-rounds 0]
//                                   [--profile trace.json] [--step-only] [--graph]
//
// --graph: the step captured once in a CUDA graph and each timed step one
// replay (EAGER_STEP_MS: the same layer's eager step); with --capacity the
// layer has static shapes (at ep > 1 its capacity-padded exchanges are
// captured too), dropless at one rank it groups its slots on the device (bf16
// at ep 1 reads nothing back to the host).
//
// --step-only: print STEP_MS, PEAK_ALLOCATED_MB and where one step's memory
// goes (MEMORY_MB, each rank), write the profile if asked, and stop: for quick
// alternating runs of two builds.
//
// --shared-rounds R (with --shared-ffn): the step with the shared expert beside
// the routed path against the same layer running it in line, in R alternating
// rounds in this one process; prints each round and the medians, then stops.
//
// The raw reference is bare NCCL (bench/raw_nccl.h): no ledger,
// watchdog or per-operation deadline.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#if BULKHEAD_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <functional>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_check.h"
#include "bench/raw_nccl.h"
#include "bench/timed_communicator.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "moe/all_to_all_autograd.h"
#include "moe/moe_layer.h"
#include "moe/static_dispatch.h"
#include "parallel/process_groups.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/env.h"
#include "runtime/errors.h"

using namespace bulkhead;

namespace {

struct Options {
  int tokens = 4096, hidden = 2048, experts = 64, topK = 8, ffn = 768, iterations = 20;
  double capacity = 0;        // expert capacity factor (0: dropless)
  bool graph = false;         // static shapes, the step captured in a CUDA graph and replayed
  int sharedFfn = 0;          // a shared expert of this hidden size (0: none)
  bool sharedInLine = false;  // run it on the layer's stream, not beside it
  int sharedRounds = 0;       // beside against in line, alternating rounds
  bool perSlot = false;
  bool packed = false;  // static shapes: packed rows for grouped products, not padded ones
  bool stepOnly = false;
  int memorySteps = 0;  // with --step-only: memory after each of this many more steps
  std::string profile;  // Chrome trace of 5 steps, rank 0's; rank r's gets ".rank<r>" (bench/profile_summary.py)
};

void addFlags(CLI::App& app, Options& o) {
  const CLI::Validator positive = cli::positive();
  app.add_option("--tokens", o.tokens, "tokens per rank")->check(positive);
  app.add_option("--hidden", o.hidden, "model width")->check(positive);
  app.add_option("--experts", o.experts, "experts")->check(positive);
  app.add_option("--topk", o.topK, "experts per token")->check(positive);
  app.add_option("--ffn", o.ffn, "expert hidden size")->check(positive);
  app.add_option("--iters", o.iterations, "timed steps")->check(positive);
  app.add_option("--capacity", o.capacity, "expert capacity factor (0: dropless)")->check(CLI::NonNegativeNumber);
  app.add_flag("--graph", o.graph,
               "the step captured in a CUDA graph and replayed, at one rank: with --capacity, static shapes; "
               "dropless, the slots grouped on the device");
  app.add_option("--shared-ffn", o.sharedFfn, "a shared expert of this hidden size (0: none)")
      ->check(cli::nonNegative());
  app.add_flag("--shared-in-line", o.sharedInLine, "run the shared expert on the layer's stream");
  app.add_option("--shared-rounds", o.sharedRounds, "shared expert beside against in line, alternating rounds")
      ->check(cli::nonNegative());
  app.add_flag("--packed", o.packed,
               "with --graph and a capacity: pack the kept rows for grouped products instead of padding each "
               "expert's capacity for batched ones");
  app.add_flag("--per-slot", o.perSlot, "dispatch once per selected expert, not once per rank");
  app.add_flag("--step-only", o.stepOnly, "time the step and its memory only");
  app.add_option("--memory-steps", o.memorySteps, "with --step-only: memory after each of this many more steps")
      ->check(cli::nonNegative());
  app.add_option("--profile", o.profile, "Chrome trace of 5 steps (rank r > 0 writes FILE.rank<r>)");
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Median wall time of `iterations` runs of `body`, each followed by a device sync.
double medianMs(int iterations, const std::function<void()>& body) {
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    body();
    BENCH_CHECK(cudaDeviceSynchronize());
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return median(std::move(times));
}

// Median time of `iterations` runs of `body` on the GPU: CUDA events on the
// default stream around each run (the host's issue cost counts where the
// stream would otherwise sit idle).
double medianEventMs(int iterations, const std::function<void()>& body) {
  cudaEvent_t start, end;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&end));
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) {
    BENCH_CHECK(cudaEventRecord(start, nullptr));
    body();
    BENCH_CHECK(cudaEventRecord(end, nullptr));
    BENCH_CHECK(cudaEventSynchronize(end));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start, end));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return median(std::move(times));
}

}  // namespace

// What the caching allocator has handed out on `device`, in MB: now, and at
// most since the last reset (`reset` resets first); -1 where libtorch has no CUDA.
struct AllocatedMb {
  double now = -1, peak = -1;
};
AllocatedMb allocatedMb(int device, bool reset = false) {
#if BULKHEAD_TORCH_CUDA
  namespace allocator = c10::cuda::CUDACachingAllocator;
  const auto index = static_cast<c10::DeviceIndex>(device);
  if (reset) allocator::resetPeakStats(index);
  const auto stats = allocator::getDeviceStats(index);
  const auto& bytes = stats.allocated_bytes[0];  // [0]: both pools together
  return {.now = static_cast<double>(bytes.current) / 1e6, .peak = static_cast<double>(bytes.peak) / 1e6};
#else
  (void)device, (void)reset;
  return {};
#endif
}

int main(int argc, char** argv) {
  cli::App app(
      "The MoE layer's forward + backward step on GPUs (NCCL, bf16), and its exchanges beside raw NCCL "
      "moving the same rows (bench/run_moe_bench.sh).",
      "bulkhead-moe-bench");
  Options options;
  addFlags(app, options);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init({.backend = Backend::Nccl});
    const int ranks = runtime->world().size(), me = runtime->world().rank();
    auto groups = parallel::ProcessGroups::create(runtime->worldPtr(), parallel::LayoutOptions{.ep = ranks});
    const auto tensorOptions = at::TensorOptions().dtype(at::kBFloat16).device(runtime->device());
    moe::MoEOptions layerOptions{
        .hidden = options.hidden,
        .ffnHidden = options.ffn,
        .router = {.numExperts = options.experts, .topK = options.topK, .capacityFactor = options.capacity},
        .oncePerRank = !options.perSlot,
        .sharedExpertHidden = options.sharedFfn,
        .overlapSharedExpert = !options.sharedInLine,
        .staticShapes = options.graph && options.capacity > 0,
        .packedStaticRows = options.packed};
    if (options.graph && ranks > 1 && options.capacity <= 0)
      throw ConfigError("--graph at ep > 1 needs --capacity: dropless dispatch there reads its counts on the host");
    moe::MoELayer layer(layerOptions, groups, tensorOptions);

    at::manual_seed(1000 + me);
    at::Tensor input = at::randn({options.tokens, options.hidden}, tensorOptions).requires_grad_(true);
    at::Tensor gradOutput = at::randn_like(input);

    auto stepOf = [&](moe::MoELayer& stepped) {
      return [&] {
        moe::MoEOutput out = stepped.forward(input);
        torch::autograd::backward({out.output, out.auxLoss}, {gradOutput, at::ones_like(out.auxLoss)});
      };
    };
    auto eagerStep = stepOf(layer);
    for (int i = 0; i < 3; ++i) eagerStep();
    // --graph: the same step captured once, each timed step one replay.
    std::optional<CapturedGraph> graph;
    if (options.graph)  // the captured exchanges checked across ranks at capture
      graph.emplace(runtime->device(), eagerStep,
                    GraphOptions{.name = "moe-bench", .store = runtime->store(), .comms = {runtime->worldPtr()}});
    std::function<void()> step = eagerStep;
    if (graph) step = [&] { graph->launch(); };
    // The same layer's eager step, beside the replays.
    const double eagerStepMs = graph ? medianMs(options.iterations, eagerStep) : 0;
    if (options.sharedRounds > 0) {
      if (options.sharedFfn <= 0) throw ConfigError("--shared-rounds needs --shared-ffn");
      moe::MoEOptions otherOptions = layerOptions;  // the shared expert the other way
      otherOptions.overlapSharedExpert = !layerOptions.overlapSharedExpert;
      moe::MoELayer other(otherOptions, groups, tensorOptions);
      auto otherStep = stepOf(other);
      for (int i = 0; i < 3; ++i) otherStep();
      std::vector<double> beside, inLine;
      for (int round = 0; round < options.sharedRounds; ++round) {
        const double mine = medianMs(options.iterations, step), theirs = medianMs(options.iterations, otherStep);
        beside.push_back(layerOptions.overlapSharedExpert ? mine : theirs);
        inLine.push_back(layerOptions.overlapSharedExpert ? theirs : mine);
      }
      if (me == 0) {
        for (int round = 0; round < options.sharedRounds; ++round)
          fmt::print("SHARED_ROUND {} beside {:.3f} in-line {:.3f}\n", round + 1, beside[round], inLine[round]);
        fmt::print("SHARED_BESIDE_MS {:.3f}\nSHARED_IN_LINE_MS {:.3f}\n", median(beside), median(inLine));
      }
      runtime->shutdown();
      return 0;
    }
    const int device = input.device().index();
    allocatedMb(device, /*reset=*/true);
    const double stepMs = medianMs(options.iterations, step);
    const double peakMb = allocatedMb(device).peak;  // of the timed steps
    if (!options.profile.empty()) {
      // Kernels and ATen ops of 5 steps, each step a "step" range in the trace.
      namespace profiler = torch::autograd::profiler;
      const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
      const std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CPU,
                                                                     torch::profiler::impl::ActivityType::CUDA};
      profiler::prepareProfiler(config, activities);
      profiler::enableProfiler(config, activities);
      for (int i = 0; i < 5; ++i) {
        RECORD_USER_SCOPE("step");
        step();
        BENCH_CHECK(cudaDeviceSynchronize());
      }
      auto trace = profiler::disableProfiler();
      // Every rank's trace: a rank that waits in its exchanges waits for another one.
      trace->save(me == 0 ? options.profile : fmt::format("{}.rank{}", options.profile, me));
    }
    if (options.stepOnly) {
      // Where one step's memory goes, on each rank: held between steps, kept by
      // the forward for the backward, and the peaks.
      const AllocatedMb rest = allocatedMb(device, /*reset=*/true);
      moe::MoEOutput out = layer.forward(input);
      BENCH_CHECK(cudaDeviceSynchronize());
      const AllocatedMb forward = allocatedMb(device);
      torch::autograd::backward({out.output, out.auxLoss}, {gradOutput, at::ones_like(out.auxLoss)});
      BENCH_CHECK(cudaDeviceSynchronize());
      const AllocatedMb whole = allocatedMb(device);
      fmt::print(
          "MEMORY_MB rank {} between_steps {:.1f} after_forward {:.1f} forward_peak {:.1f} step_peak {:.1f} "
          "after_step {:.1f}\n",
          me, rest.now, forward.now, forward.peak, whole.peak, whole.now);
      // Whether memory held between steps settles: right after each step's
      // device sync, and again 20 ms later (the NCCL watchdog polls every 2 ms).
      for (int i = 0; i < options.memorySteps; ++i) {
        step();
        BENCH_CHECK(cudaDeviceSynchronize());
        const double synced = allocatedMb(device).now;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        fmt::print("MEMORY_STEP rank {} step {} synced {:.1f} settled {:.1f}\n", me, i, synced,
                   allocatedMb(device).now);
      }
      if (me == 0) fmt::print("STEP_MS {:.3f}\nPEAK_ALLOCATED_MB {:.1f}\n", stepMs, peakMb);
      runtime->shutdown();
      return 0;
    }

    // Correctness beside a layer holding all experts on this GPU (ep 1).
    auto local = parallel::ProcessGroups::create(runtime->worldPtr(), parallel::LayoutOptions{}, {.warmup = false});
    moe::MoELayer reference(layerOptions, local, tensorOptions);
    double relative = 0;
    {
      c10::NoGradGuard noGrad;
      at::Tensor ours = layer.forward(input).output.to(at::kFloat);
      at::Tensor theirs = reference.forward(input).output.to(at::kFloat);
      relative = ((ours - theirs).abs().max() / theirs.abs().max()).item<double>();
    }

    // Dispatch + combine alone, and raw NCCL moving the same rows. The
    // dispatcher's ep group is timed: its exchanges (counts, tokens with their
    // routing, results) are measured where they run, inside these dispatches.
    auto timedEp = std::make_shared<bench::TimedCommunicator>(groups.ep());
    moe::TokenDispatcher dispatcher(timedEp, {.numExperts = options.experts, .oncePerRank = !options.perSlot});
    at::Tensor tokens = input.detach();
    moe::Routing routing = layer.router().route(tokens);
    moe::DispatchPlan plan = dispatcher.dispatch(tokens, routing);
    auto roundTrip = [&] {
      c10::NoGradGuard noGrad;
      moe::DispatchPlan p = dispatcher.dispatch(tokens, routing);
      dispatcher.combine(p, p.expertInput);
    };
    for (int i = 0; i < 3; ++i) roundTrip();
    timedEp->collect();
    std::vector<double> wall, inExchanges;
    std::vector<std::vector<double>> perExchange;  // [exchange][iteration]
    for (int i = 0; i < options.iterations; ++i) {
      wall.push_back(medianMs(1, roundTrip));
      std::vector<double> times = timedEp->collect();
      perExchange.resize(times.size());
      for (size_t e = 0; e < times.size(); ++e) perExchange[e].push_back(times[e]);
      inExchanges.push_back(std::accumulate(times.begin(), times.end(), 0.0));
    }
    const double oursMs = median(wall), exchangesMs = median(inExchanges);
    std::vector<std::string> eachExchangeMs;
    for (auto& times : perExchange) eachExchangeMs.push_back(fmt::format("{:.3f}", median(times)));
    // Where a step's time goes (each phase alone, synced): printed for study.
    const double routeMs = medianMs(options.iterations, [&] { layer.router().route(tokens); });
    const double dispatchMs = medianMs(options.iterations, [&] {
      c10::NoGradGuard noGrad;
      dispatcher.dispatch(tokens, routing);
    });
    timedEp->collect();
    const double forwardMs = medianMs(options.iterations, [&] {
      c10::NoGradGuard noGrad;
      layer.forward(input);
    });

    const nccl::RawNccl raw(runtime->cpuWorld(), Deadline::afterSeconds(env::kInitTimeout.seconds()));
    const int64_t sent = std::accumulate(plan.sendSplits.begin(), plan.sendSplits.end(), int64_t{0});
    const int64_t received = std::accumulate(plan.recvSplits.begin(), plan.recvSplits.end(), int64_t{0});
    at::Tensor sendRows = at::randn({sent, options.hidden}, tensorOptions);
    at::Tensor recvRows = at::empty({received, options.hidden}, tensorOptions);
    auto rawRoundTrip = [&] {  // on the default stream, as the dispatcher's exchanges run in this bench
      raw.exchangeRows(sendRows, recvRows, plan.sendSplits, plan.recvSplits, nullptr);
      raw.exchangeRows(recvRows, sendRows, plan.recvSplits, plan.sendSplits, nullptr);
    };
    for (int i = 0; i < 3; ++i) rawRoundTrip();
    const double rawMs = medianMs(options.iterations, rawRoundTrip);
    // The same round trip timed as the dispatcher's exchanges are (CUDA events
    // on the default stream), for the exchange ratio.
    const double rawEventsMs = medianEventMs(options.iterations, rawRoundTrip);
    // An approximate floor under the local passes between the exchanges:
    // expanding the received rows into expert rows (ordering them by expert,
    // per slot) and summing the expert rows back read and write the received
    // rows and the expert rows, once each way. Timed as one device copy of
    // that many rows (rank 0's counts). A dispatcher that sends each token
    // once per rank and feeds grouped GEMMs contiguous rows per expert cannot
    // skip these passes; the bound estimates the bw ratio it reaches at best
    // unless it overlaps them with the exchanges. Approximate: received rows
    // fresh from the exchange may still sit in L2, which the copy's do not.
    const int64_t expertRows = plan.expertInput.size(0);
    // The step's own floor: the layer's grouped expert products alone (the
    // same kernels, rows and counts, forward and backward: input and weight
    // gradients), and the model FLOPs of both (router and experts, x3 for the
    // backward).
    // Static shapes pad every expert's capacity of rows (batched products), unless packed (T x k
    // rows, the dropless count, through grouped products).
    const int64_t capacity = moe::staticCapacity(layerOptions.router, options.tokens);
    const bool padded =
        layerOptions.staticShapes && !(layerOptions.packedStaticRows && layer.experts().groupedFor(plan.expertInput));
    const int64_t productRows = padded ? capacity * options.experts : expertRows;
    const std::vector<int64_t> productCounts =
        padded ? std::vector<int64_t>(static_cast<size_t>(options.experts), capacity) : plan.tokensPerLocalExpert;
    const at::Tensor productEnds =
        padded ? at::arange(1, options.experts + 1, tensorOptions.dtype(at::kInt)) * static_cast<int>(capacity)
               : plan.expertRowEnds;
    at::Tensor floorRows = at::randn({productRows, options.hidden}, tensorOptions).requires_grad_(true);
    at::Tensor floorGrad = at::randn({productRows, options.hidden}, tensorOptions);
    // Padded, the activation skips each expert's rows after its kept ones, as in the step.
    const at::Tensor floorKept =
        padded && tensorOptions.device().is_cuda() && ranks == 1  // at ep > 1 the kept rows are no prefix
            ? at::tensor(plan.tokensPerLocalExpert, at::kLong).clamp_max(capacity).to(tensorOptions.device(), at::kInt)
            : at::Tensor();
    auto products = [&] {
      at::Tensor out = padded ? layer.experts().forwardPadded(floorRows, floorKept)
                              : layer.experts().forward(floorRows, productCounts, productEnds);
      torch::autograd::backward({out}, {floorGrad});
    };
    for (int i = 0; i < 3; ++i) products();
    const double floorMs = medianMs(options.iterations, products);
    // The step counts the rows the routing kept; the products, every row they multiply (padding too).
    const double productFlops = 3.0 * 6.0 * static_cast<double>(productRows) * options.hidden * options.ffn;
    const double stepFlops = 3.0 * 6.0 * static_cast<double>(expertRows) * options.hidden * options.ffn +
                             3.0 * 2.0 * static_cast<double>(options.tokens) * options.hidden * options.experts;
    at::Tensor copyFrom = at::randn({expertRows + received, options.hidden}, tensorOptions);
    at::Tensor copyTo = at::empty_like(copyFrom);
    const double localFloorMs = medianEventMs(options.iterations, [&] { copyTo.copy_(copyFrom); });
    // The same rows through Bulkhead's communicator alone (deadline, ledger; no index work):
    // what the transport costs beside raw NCCL, apart from the dispatcher's planning.
    auto exchangeRoundTrip = [&] {
      at::Tensor there = moe::exchangeRows(*groups.ep(), sendRows, plan.sendSplits, plan.recvSplits);
      moe::exchangeRows(*groups.ep(), there, plan.recvSplits, plan.sendSplits);
    };
    for (int i = 0; i < 3; ++i) exchangeRoundTrip();
    const double exchangeMs = medianMs(options.iterations, exchangeRoundTrip);

    const double bytes = static_cast<double>(sent + received) * options.hidden * 2;
    if (me == 0) {
      fmt::print("MODE {}\n", options.perSlot ? "per-slot" : "once-per-rank");
      fmt::print("CAPACITY {}\n", options.capacity > 0 ? fmt::format("{:g}", options.capacity) : "dropless");
      fmt::print("EXECUTION {}{}\n", options.graph ? "graph" : "eager",
                 layerOptions.staticShapes ? (padded ? "/padded" : "/packed") : "");
      fmt::print("EXPERT_PRODUCTS_MS {:.3f}\n", floorMs);
      fmt::print("STEP_OVER_PRODUCTS {:.2f}\n", stepMs / floorMs);
      fmt::print("STEP_TFLOPS {:.1f}\n", stepFlops / stepMs / 1e9);
      fmt::print("PRODUCTS_TFLOPS {:.1f}\n", productFlops / floorMs / 1e9);
      fmt::print("STEP_MS {:.3f}\n", stepMs);
      if (graph) fmt::print("EAGER_STEP_MS {:.3f}\n", eagerStepMs);
      fmt::print("PEAK_ALLOCATED_MB {:.1f}\n", peakMb);
      fmt::print("ROWS_SENT {}\n", sent);
      fmt::print("DISPATCH_COMBINE_MS {:.3f}\n", oursMs);
      fmt::print("RAW_ALLTOALL_MS {:.3f}\n", rawMs);
      fmt::print("RAW_ALLTOALL_EVENTS_MS {:.3f}\n", rawEventsMs);
      fmt::print("EXCHANGE_ONLY_MS {:.3f}\n", exchangeMs);
      fmt::print("DISPATCHER_EXCHANGES_MS {:.3f}\n", exchangesMs);
      fmt::print("DISPATCHER_EXCHANGES {}\n", fmt::join(eachExchangeMs, " "));
      fmt::print("DISPATCH_COMBINE_GBPS {:.1f}\n", bytes / oursMs / 1e6);
      fmt::print("RAW_ALLTOALL_GBPS {:.1f}\n", bytes / rawMs / 1e6);
      fmt::print("EXPERT_ROWS {}\n", expertRows);
      fmt::print("LOCAL_PASSES_FLOOR_MS {:.3f}\n", localFloorMs);
      fmt::print("BW_RATIO_BOUND {:.2f}\n", rawMs / (rawMs + localFloorMs));
      fmt::print("MAX_REL_DIFF_VS_EP1 {:.4g}\n", relative);
      fmt::print("PHASES_MS route {:.3f} dispatch {:.3f} combine {:.3f} forward {:.3f} backward {:.3f}\n", routeMs,
                 dispatchMs, oursMs - dispatchMs, forwardMs, stepMs - forwardMs);
    }
    runtime->shutdown();
    return 0;
  });
}
