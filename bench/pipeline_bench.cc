// The pipeline bubble of parallel::Pipeline on GPUs (nccl backend, bf16): the
// whole world is one pp group, every stage the same stack of MLP blocks. Each
// step's compute is timed with CUDA events recorded on the default stream from
// PipelineOptions::onStep; the first stage's idle fraction (1 - its busy time
// over the span from its first step's start to its last step's end) is put
// beside the schedule's ideal, (P - 1) / (V M + P - 1). The pipeline makes
// the default stream wait for a unit's receives before the unit's first step
// is issued, so waiting on a neighbour falls between steps: idle, not busy.
// Prints a markdown table row (bench/run_pipeline_bench.sh collects them).
//
//   mpirun -np 4 bulkhead-pipeline-bench [--vpp 1] [--microbatches 4P] [--tokens 4096] [--hidden 2048]
//                                        [--ffn 8192] [--layers-per-stage 8] [--runs 10] [--trace trace.json]
//
// A chunk is L blocks x = x + gelu(x @ W1) @ W2; the last stage returns
// x.float().pow(2).mean(), and the first stage's input requires a gradient as
// the others' do, so every stage costs the same. --trace: a Chrome trace of
// the last timed run, one file per rank (trace.rank<r>.json).
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_check.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "parallel/pipeline.h"
#include "runtime/errors.h"

using namespace bulkhead;
using namespace bulkhead::parallel;

namespace {

constexpr int kWarmupRuns = 3;

struct Options {
  int vpp = 1;
  int microBatches = 0;  // 0: 4 per rank
  int tokens = 4096, hidden = 2048, ffn = 8192, layersPerStage = 8, runs = 10;
  std::string trace;
};

void addFlags(CLI::App& app, Options& o) {
  const CLI::Validator positive = cli::positive();
  app.add_option("--vpp", o.vpp, "chunks per rank (interleaved 1F1B when above 1, else 1F1B)")->check(positive);
  app.add_option("--microbatches", o.microBatches, "micro-batches per run (0: 4 per rank)")->check(cli::nonNegative());
  app.add_option("--tokens", o.tokens, "tokens per micro-batch")->check(positive);
  app.add_option("--hidden", o.hidden, "model width")->check(positive);
  app.add_option("--ffn", o.ffn, "each block's hidden size")->check(positive);
  app.add_option("--layers-per-stage", o.layersPerStage, "MLP blocks in each chunk")->check(positive);
  app.add_option("--runs", o.runs, "timed runs, after 3 warm-up runs")->check(positive);
  app.add_option("--trace", o.trace, "Chrome trace of the last timed run (rank r writes FILE with .rank<r>)");
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// trace.json -> trace.rank2.json; trace -> trace.rank2.
std::string rankFile(const std::string& file, int rank) {
  std::filesystem::path path(file);
  const std::string name = fmt::format("{}.rank{}{}", path.stem().string(), rank, path.extension().string());
  return path.replace_filename(name).string();
}

// Timing events, owned: destroyed with the pool.
class EventPool {
 public:
  explicit EventPool(size_t size) : events_(size) {
    for (cudaEvent_t& event : events_) BENCH_CHECK(cudaEventCreateWithFlags(&event, cudaEventDefault));
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool() {
    for (cudaEvent_t event : events_) cudaEventDestroy(event);
  }
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

struct StepTime {
  PipelineStep step;
  double beginMs = 0, endMs = 0;  // from the run's start
};

struct RunTime {
  double stepMs = 0, busyMs = 0, spanMs = 0;
  std::vector<StepTime> steps;
  double idle() const { return spanMs > 0 ? 1 - busyMs / spanMs : 0; }
};

// Records one run: an event before it, one before and after each step's
// compute, one after it; all on the legacy default stream (PyTorch's default
// current stream, which the pipeline computes on), read once the run is done.
class RunRecorder {
 public:
  explicit RunRecorder(int steps) : events_(2 * static_cast<size_t>(steps) + 2), expected_(steps) {}

  void start() {
    steps_.clear();
    record(0);
  }
  void onStep(const PipelineStep& step, bool begin) {
    if (begin) {
      if (steps_.size() == static_cast<size_t>(expected_))
        throw Error(fmt::format("the pipeline ran more than the 2 M V = {} steps of this rank", expected_));
      steps_.push_back(step);
    }
    record(2 * steps_.size() + (begin ? 0 : 1));  // step i: [2 + 2i] begin, [3 + 2i] end
  }
  RunTime finish() {
    record(1);
    BENCH_CHECK(cudaDeviceSynchronize());
    RunTime run{.stepMs = elapsed(1)};
    for (size_t i = 0; i < steps_.size(); ++i) {
      StepTime time{steps_[i], elapsed(2 + 2 * i), elapsed(3 + 2 * i)};
      run.busyMs += time.endMs - time.beginMs;
      run.steps.push_back(time);
    }
    if (!run.steps.empty()) run.spanMs = run.steps.back().endMs - run.steps.front().beginMs;
    return run;
  }

 private:
  void record(size_t index) { BENCH_CHECK(cudaEventRecord(events_[index], nullptr)); }  // nullptr: legacy default
  double elapsed(size_t index) const {
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[index]));
    return ms;
  }

  EventPool events_;  // [0] run start, [1] run end, then each step's begin and end
  int expected_;
  std::vector<PipelineStep> steps_;
};

// This rank's chunks: the weights of each, and the first stage's inputs. The
// chunks refer to the rest, so it stays where it was built.
class Stages {
 public:
  Stages(const Options& o, int P, int r, int M, c10::Device device);
  Stages(const Stages&) = delete;
  Stages& operator=(const Stages&) = delete;

  const std::vector<PipelineChunk>& chunks() const { return chunks_; }
  // Each run starts without gradients.
  void zeroGrad() {
    for (auto& blocks : weights_)
      for (auto& [w1, w2] : blocks) {
        w1.mutable_grad() = at::Tensor();
        w2.mutable_grad() = at::Tensor();
      }
  }

 private:
  PipelineOutput forward(int chunk, bool first, bool last, int m, const at::Tensor& input) const {
    // The first stage's input needs a gradient as every other stage's does: the same backward everywhere.
    at::Tensor x = first ? inputs_[m].detach().requires_grad_(true) : input;
    for (const auto& [w1, w2] : weights_[chunk]) x = x + at::matmul(at::gelu(at::matmul(x, w1)), w2);
    if (last) return x.to(at::kFloat).pow(2).mean();
    return x;
  }

  std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> weights_;  // [chunk][block]: W1, W2
  std::vector<at::Tensor> inputs_;                                       // [micro-batch], on the first stage
  std::vector<PipelineChunk> chunks_;
};

Stages::Stages(const Options& o, int P, int r, int M, c10::Device device) {
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(device);
  const int lastStage = P * o.vpp - 1;
  weights_.resize(o.vpp);
  for (int c = 0; c < o.vpp; ++c) {
    const int stage = c * P + r;
    for (int l = 0; l < o.layersPerStage; ++l) {  // seeded by stage and block: the same model at any P
      at::manual_seed(1000 + stage * o.layersPerStage + l);
      at::Tensor w1 = at::randn({o.hidden, o.ffn}, options) / std::sqrt(static_cast<double>(o.hidden));
      at::Tensor w2 = at::randn({o.ffn, o.hidden}, options) / std::sqrt(static_cast<double>(o.ffn));
      weights_[c].emplace_back(w1.requires_grad_(true), w2.requires_grad_(true));
    }
    chunks_.push_back({.forward = [this, c, first = stage == 0, last = stage == lastStage](
                                      int m, const at::Tensor& input) { return forward(c, first, last, m, input); }});
  }
  if (r == 0)
    for (int m = 0; m < M; ++m) {
      at::manual_seed(m);
      inputs_.push_back(at::randn({o.tokens, o.hidden}, options));
    }
}

void writeTrace(const std::string& file, int rank, const RunTime& run) {
  nlohmann::json events = nlohmann::json::array();
  for (const StepTime& t : run.steps)
    events.push_back({{"name", fmt::format("{} c{} m{}", t.step.forward ? "F" : "B", t.step.chunk, t.step.microBatch)},
                      {"ph", "X"},
                      {"ts", t.beginMs * 1e3},
                      {"dur", (t.endMs - t.beginMs) * 1e3},
                      {"pid", rank},
                      {"tid", 0}});
  const std::string path = rankFile(file, rank);
  std::ofstream out(path);
  out << events.dump() << '\n';
  if (!out) throw IoError(fmt::format("cannot write the trace {}", path));
}

// Medians of this rank's timed runs: idle fraction, busy ms, span ms, step ms.
std::vector<double> summarize(const std::vector<RunTime>& runs) {
  std::vector<double> idle, busy, span, step;
  for (const RunTime& run : runs) {
    idle.push_back(run.idle());
    busy.push_back(run.busyMs);
    span.push_back(run.spanMs);
    step.push_back(run.stepMs);
  }
  return {median(idle), median(busy), median(span), median(step)};
}

// Rank 0: the configuration, the table row and every rank's idle fraction.
void report(const Options& o, int P, int M, PipelineSchedule schedule, const at::Tensor& all, c10::Device device) {
  const double* v = all.data_ptr<double>();  // [rank][idle, busy, span, step]
  const double ideal = static_cast<double>(P - 1) / (o.vpp * M + P - 1);
  cudaDeviceProp props;
  BENCH_CHECK(cudaGetDeviceProperties(&props, device.index()));
  fmt::print(
      "bulkhead-pipeline-bench: {} ranks, one {} each, nccl; {} chunk(s) a rank, {} micro-batches of {} tokens, "
      "hidden {}, ffn {}, {} blocks a chunk, bf16; medians of {} runs after {} warm-up\n",
      P, props.name, o.vpp, M, o.tokens, o.hidden, o.ffn, o.layersPerStage, o.runs, kWarmupRuns);
  fmt::print(
      "| P | V | M | schedule | step ms | first stage busy ms | idle fraction (measured) | ideal | "
      "measured - ideal (points) |\n|---:|---:|---:|---|---:|---:|---:|---:|---:|\n");
  fmt::print("| {} | {} | {} | {} | {:.2f} | {:.2f} | {:.3f} | {:.3f} | {:+.1f} |\n", P, o.vpp, M, toString(schedule),
             v[3], v[1], v[0], ideal, 100 * (v[0] - ideal));
  std::vector<std::string> idle;
  for (int r = 0; r < P; ++r) idle.push_back(fmt::format("{:.3f}", v[4 * r]));
  fmt::print("idle fraction per rank (0..{}): {}\n", P - 1, fmt::join(idle, " "));
}

int resolveMicroBatches(const Options& o, int P) {
  const int M = o.microBatches > 0 ? o.microBatches : 4 * P;
  if (o.vpp > 1 && M % P != 0)
    throw ConfigError(
        fmt::format("--microbatches {} is not a multiple of the {} ranks, which the interleaved "
                    "schedule (--vpp {}) needs: pass a multiple of {}",
                    M, P, o.vpp, P));
  return M;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app(
      "The pipeline bubble of parallel::Pipeline on GPUs: idle fraction against the ideal "
      "(bench/run_pipeline_bench.sh).",
      "bulkhead-pipeline-bench");
  Options options;
  addFlags(app, options);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init({.backend = Backend::Nccl});
    const CommunicatorPtr& pp = runtime->worldPtr();  // the whole world is one pp group
    const int P = pp->size(), r = pp->rank(), M = resolveMicroBatches(options, P);
    const auto schedule = options.vpp > 1 ? PipelineSchedule::Interleaved : PipelineSchedule::OneFOneB;
    // The events go to the legacy default stream of the current device: this rank's GPU.
    BENCH_CHECK(cudaSetDevice(runtime->device().index()));
    Stages stages(options, P, r, M, runtime->device());
    RunRecorder recorder(2 * M * options.vpp);
    const std::vector<int64_t> shape{options.tokens, options.hidden};
    Pipeline pipeline(pp, {.schedule = schedule,
                           .microBatches = M,
                           .activationShape = [shape](int) { return shape; },
                           .activationDtype = at::kBFloat16,
                           .onStep = [&](const PipelineStep& step, bool begin) { recorder.onStep(step, begin); }});
    BENCH_CHECK(cudaDeviceSynchronize());
    std::vector<RunTime> runs;
    for (int i = 0; i < kWarmupRuns + options.runs; ++i) {
      stages.zeroGrad();
      recorder.start();
      pipeline.run(stages.chunks());
      RunTime run = recorder.finish();
      if (i >= kWarmupRuns) runs.push_back(std::move(run));
    }
    if (!options.trace.empty()) writeTrace(options.trace, r, runs.back());
    at::Tensor mine = at::tensor(summarize(runs), at::kDouble);
    at::Tensor all = at::empty({4 * P}, at::kDouble);
    runtime->cpuWorld().allGather(mine, all)->wait();
    if (r == 0) report(options, P, M, schedule, all, runtime->device());
    std::fflush(stdout);
    runtime->shutdown();
    return 0;
  });
}
