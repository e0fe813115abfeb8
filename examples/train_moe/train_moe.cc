// train_moe: trains a small MoE transformer language model on an indexed
// dataset (Megatron-LM's .bin/.idx, read in Megatron's sample order) or on
// generated text, with periodic async checkpoints, exact resume, and a clean stop on SIGTERM or
// SIGINT (it saves, then exits). The README's main job.
//
//   mpirun -np 4 train_moe --ep 2 --steps 200 --ckpt-dir /tmp/ckpt --ckpt-interval 50
//   mpirun -np 4 train_moe --ep 2 --steps 400 --ckpt-dir /tmp/ckpt --resume latest
//   mpirun -np 4 train_moe --ep 2 --data-path /data/corpus_text_document --split 969,30,1 --vocab 50304
//
// Flags: see usage() below. Rank 0 prints one line per logging interval: step,
// loss, tokens/s, step time, grad norm, expert load imbalance, dropped slots, and the
// updates skipped for a gradient norm that was not finite (once there are any).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <string>

#include "checkpoint/checkpointer.h"
#include "examples/train_moe/captured_step.h"
#include "examples/train_moe/data.h"
#include "examples/train_moe/hf_eval.h"
#include "examples/train_moe/hf_model.h"
#include "examples/train_moe/model.h"
#include "examples/train_moe/staged_model.h"
#include "examples/train_moe/step_profile.h"
#include "examples/train_moe/train_options.h"
#include "examples/train_moe/training_data.h"
#include "launch/init.h"
#include "launch/recovery.h"
#include "models/hf_export.h"
#include "optim/distributed_optimizer.h"
#include "optim/lr_schedule.h"
#include "parallel/process_groups.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/nccl/nccl_backend.h"
#include "runtime/progress_bar.h"

using namespace bulkhead;
using examples::TrainOptions;

namespace {

std::atomic<int> stopSignal{0};
extern "C" void onStopSignal(int signal) { stopSignal.store(signal); }

// Every rank learns whether any rank was asked to stop (an all-reduce on the
// CPU world, so a signal that reached one rank stops all at the same step).
bool agreeToStop(Runtime& runtime) {
  at::Tensor flag = at::full({1}, stopSignal.load() != 0 ? 1 : 0, at::kInt);
  runtime.cpuWorld().allReduce(flag, {.op = ReduceOp::Max})->wait();
  return flag.item<int>() != 0;
}

// `modelConfig`: a Hugging Face model's config.json, saved with its weights so that an export writes it back.
checkpoint::StateDict stateOf(const examples::StagedModel& model, optim::DistributedOptimizer& optimizer,
                              const parallel::Layout& layout, const examples::TrainingData& data, int64_t step,
                              const std::string& modelConfig = "") {
  checkpoint::StateDict state;
  for (const auto& parameter : model.parameters())
    state.add(parameter.name, parameter.tensor.detach(), parameter.shard);
  for (auto& buffer : model.buffers()) state.add(buffer.key, buffer.local, buffer.shard);
  for (auto& slice : optimizer.state()) state.add(slice.key, slice.local, slice.shard);
  state.dataPosition = std::to_string(step);
  if (std::string position = data.state(step); !position.empty()) state.user["data"] = std::move(position);
  state.layout = checkpoint::LayoutRecord::of(layout);
  if (!modelConfig.empty()) state.user[models::kHfConfigKey] = modelConfig;
  return state;
}

// After a load that allowed missing keys: raises when model keys are missing;
// restarts the optimizer and returns true when the checkpoint held no
// optimizer state at all (weights imported from elsewhere).
bool restartIfWeightsOnly(const checkpoint::LoadResult& loaded, optim::DistributedOptimizer& optimizer, int rank) {
  if (loaded.missingKeys.empty()) return false;
  std::set<std::string> optimizerKeys, missingOptimizer;
  for (const auto& slice : optimizer.state()) optimizerKeys.insert(slice.key);
  std::vector<std::string> model;
  for (const auto& key : loaded.missingKeys) {
    if (optimizerKeys.count(key))
      missingOptimizer.insert(key);
    else
      model.push_back(key);
  }
  if (!model.empty())
    throw CheckpointError(fmt::format("{} does not hold {} of the model's tensors, '{}' the first; it was saved from "
                                      "another model (compare `bulkhead-ckpt inspect {}` with this run's flags)",
                                      loaded.path, model.size(), model.front(), loaded.path),
                          {.rank = rank, .expected = "every model tensor in the checkpoint"});
  if (missingOptimizer.size() != optimizerKeys.size())
    throw CheckpointError(
        fmt::format("{} holds only part of the optimizer state ({} of {} keys absent, '{}' the "
                    "first)",
                    loaded.path, missingOptimizer.size(), optimizerKeys.size(), *missingOptimizer.begin()),
        {.rank = rank, .expected = "all of the optimizer state, or none of it"});
  optimizer.restart();
  if (rank == 0)
    log::info("train", "{} holds weights but no optimizer state: the optimizer starts afresh", loaded.path);
  return true;
}

// Rank 0's view of the job: the dp-mean loss, and a bar when on a terminal.
struct Reporter {
  bool leader;
  ProgressBar bar;
  std::ofstream lossLog;
  void line(const std::string& text) {
    if (!leader) return;
    bar.clear();
    std::fputs((text + "\n").c_str(), stdout);
    std::fflush(stdout);
  }
  void progress(int64_t step, int64_t total, double loss) {
    bar.draw(step, total, fmt::format("step {}/{} loss {:.4f}", step, total, loss));
  }
};

// Dense bf16 peak of the GPUs whose figure is known, in FLOP/s; 0 otherwise.
double peakFlops(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  const std::string name = nccl::deviceName(device.index());
  for (const auto& [model, tflops] : {std::pair<const char*, double>{"H100", 989},
                                      {"H200", 989},
                                      {"H800", 989},
                                      {"H20", 148},
                                      {"A100", 312},
                                      {"A800", 312},
                                      {"B200", 2250}})
    if (name.find(model) != std::string::npos) return tflops * 1e12;
  return 0;
}

// "| 212.4 TFLOP/s | MFU 21.5%" of the model FLOPs per second (MFU where the GPU's peak is known).
std::string throughput(double tokensPerSecond, double flopsPerToken, double peak, int ranks) {
  const double flops = tokensPerSecond * flopsPerToken / ranks;  // per GPU
  std::string text = fmt::format(" | {:.1f} TFLOP/s", flops / 1e12);
  if (peak > 0) text += fmt::format(" | MFU {:.1f}%", 100 * flops / peak);
  return text;
}

// Where a generation after a recovery starts from.
struct Resume {
  launch::Recovered recovered;
  std::chrono::steady_clock::time_point caught;  // when the error that led to it was caught
};

// The state a recovery restores: every parameter, buffer and optimizer slice of this rank.
launch::NamedTensors recoveryState(const examples::StagedModel& model, optim::DistributedOptimizer& optimizer) {
  launch::NamedTensors state;
  for (const auto& parameter : model.parameters()) state.emplace_back(parameter.name, parameter.tensor);
  for (auto& buffer : model.buffers()) state.emplace_back(buffer.key, buffer.local);
  for (auto& slice : optimizer.state()) state.emplace_back(slice.key, slice.local);
  return state;
}

// What the snapshots cost this rank, per snapshot.
std::string snapshotCostLine(const launch::SnapshotCost& cost, int64_t every) {
  if (cost.taken == 0) return "snapshots: none taken";
  std::string line = fmt::format("snapshots: {} taken, {}, {:.3f} ms each on the host", cost.taken,
                                 every == 1 ? "one a step" : fmt::format("one every {} steps", every),
                                 1e3 * (cost.hostSeconds - cost.setupSeconds) / static_cast<double>(cost.taken));
  line += fmt::format(" after {:.1f} ms allocating the copies", 1e3 * cost.setupSeconds);
  if (cost.timed > 0)
    line += fmt::format(", {:.3f} ms each on the training stream ({} timed)",
                        1e3 * cost.streamSeconds / static_cast<double>(cost.timed), cost.timed);
  return line;
}

// AdamW with weight decay 0.01, its moments' dtype and gradient reduction as the flags say.
optim::DistributedOptimizerOptions optimizerOptions(const TrainOptions& options) {
  optim::DistributedOptimizerOptions o;
  o.adamw.weightDecay = 0.01;
  if (options.bf16Moments) o.adamw.momentType = at::kBFloat16;
  o.overlapGradReduce = options.gradOverlap && !options.cudaGraph;
  o.reduceInParamDtype = options.gradReduceBf16;
  // The tied embedding's gradients are summed across stages after the backward: reduced at the step.
  if (options.model.tiedEmbedding) o.reduceAtStep.insert("embed.weight");
  return o;
}

// Loads --resume's step (or the latest) into the model and optimizer, starts the data at it, and
// returns it. An imported checkpoint, with weights only, restarts the optimizer.
int64_t loadCheckpoint(checkpoint::Checkpointer& checkpointer, const std::string& which,
                       const examples::StagedModel& model, optim::DistributedOptimizer& optimizer,
                       const parallel::Layout& layout, examples::TrainingData& data, int rank) {
  checkpoint::StateDict targets = stateOf(model, optimizer, layout, data, 0);
  checkpoint::LoadOptions load;
  if (which != "latest") load.step = std::stoll(which);
  load.allowMissing = true;  // an imported checkpoint holds weights only
  auto loaded = checkpointer.load(targets, load);
  const bool weightsOnly = restartIfWeightsOnly(loaded, optimizer, rank);
  if (!weightsOnly) optimizer.afterLoad();
  // An imported checkpoint has no data position: it goes on from the step it was saved as.
  const int64_t step = loaded.dataPosition.empty() ? loaded.step : std::stoll(loaded.dataPosition);
  data.start(step, &loaded.user);
  if (rank == 0) {
    log::info("train", "resumed from {} (step {}, saved as {}) in {:.2f} s", loaded.path, step,
              loaded.layout ? loaded.layout->text() : "?", loaded.seconds);
  }
  return step;
}

// The validation loss after `completed` steps: evaluation e reads the valid split's global batches
// [(e - 1) iters, e iters), the same in every layout and after a resume.
double validationLoss(examples::StagedModel& model, const examples::TrainingData& data, const Communicator& dp,
                      const TrainOptions& options, const c10::Device& device, int64_t completed) {
  const int64_t e = completed / options.data.evalInterval;
  double sum = 0;
  for (int64_t i = 0; i < data.evalIters(); ++i) {
    std::vector<examples::TokenBatch> microBatches;
    for (int m = 0; m < options.microBatches; ++m)
      microBatches.push_back(data.valid()->batch((e - 1) * data.evalIters() + i, m * dp.size() + dp.rank(),
                                                 options.microBatches * dp.size(), device));
    sum += model.evaluate(microBatches).get();
  }
  return sum / static_cast<double>(data.evalIters());
}

// Trains on the runtime's current worlds until the last step: one generation
// of the job, or all of it when nothing fails.
void train(Runtime& runtime, const TrainOptions& options, launch::Recovery& recovery,
           const std::optional<Resume>& resume) {
  auto groups = parallel::ProcessGroups::create(
      runtime.worldPtr(),
      parallel::LayoutOptions{.tp = options.tp, .pp = options.pp, .ep = options.ep, .etp = options.tp},
      {.localSize = runtime.info().localSize});
  const auto& layout = groups.layout();
  const int rank = runtime.world().rank();
  const c10::Device device = runtime.device();
  if (options.model.dtype == at::kBFloat16 && !device.is_cuda())
    log::warn("train", "bf16 on CPU is slow; float32 or float64 are the CPU dtypes");

  if (const int parts = options.microBatches * groups.dpCp()->size(); options.globalBatch % parts != 0)
    throw ConfigError(fmt::format("--batch {} does not split into {} micro-batches on each of {} data-parallel ranks",
                                  options.globalBatch, options.microBatches, groups.dpCp()->size()),
                      {.rank = rank, .expected = fmt::format("--batch a multiple of {}", parts)});
  if (options.cudaGraph) examples::checkCapturable(groups, options.model.capacityFactor);
  examples::ModelConfig config = options.model;
  config.staticShapes = options.cudaGraph || options.staticShapes;
  const std::unique_ptr<examples::StagedModel> built = examples::makeStagedModel(
      options, config, groups, {.virtualStages = options.virtualStages, .microBatches = options.microBatches});
  examples::StagedModel& model = *built;
  const std::string modelConfig = options.hf.any() ? examples::hfConfig(options.hf).text : "";
  optim::DistributedOptimizer optimizer(model.parameters(), groups, optimizerOptions(options));
  const optim::LrSchedule schedule{
      .peak = options.lr, .min = options.lr / 10, .warmupSteps = options.warmup, .totalSteps = options.steps};
  schedule.validate();
  examples::TrainingData data(
      options.data,
      {.sequence = options.sequence,
       .globalBatch = options.globalBatch,
       .steps = options.steps,
       .vocab = examples::modelVocab(options),
       .seed = options.model.seed,
       .vocabHint = options.hf.any() ? "a dataset tokenized for this model: every id below its vocab_size"
                                     : "--vocab above every id of the dataset"},
      rank);
  if (options.cudaGraph && options.data.eodMaskLoss)
    throw ConfigError("--eod-mask-loss with --cuda-graph: the captured step has no loss mask", {.rank = rank});

  std::unique_ptr<checkpoint::Checkpointer> checkpointer;
  if (!options.checkpointDir.empty()) {
    checkpointer = checkpoint::Checkpointer::create({.dir = options.checkpointDir, .keep = options.keep},
                                                    runtime.store(), rank, runtime.world().size());
    // Pinned staging memory now, not inside the first save (which training waits for).
    checkpointer->reserve(stateOf(model, optimizer, layout, data, 0, modelConfig));
  }
  int64_t step = 0;
  int64_t savedStep = -1;  // the step the folder already holds from this run (or the load)
  if (resume) {            // the snapshot of the step every rank has, from this rank's memory or its holder's
    recovery.restore(recoveryState(model, optimizer));
    optimizer.afterLoad();
    step = resume->recovered.step;
    data.start(step, nullptr);
  } else if (!options.resume.empty()) {
    if (!checkpointer) throw ConfigError("--resume needs --ckpt-dir", {.rank = rank, .expected = "--ckpt-dir DIR"});
    step = loadCheckpoint(*checkpointer, options.resume, model, optimizer, layout, data, rank);
    savedStep = step;
  } else {
    data.start(step, nullptr);
  }
  const examples::BatchSource& batches = data.train();
  if (!resume) recovery.snapshot(step, recoveryState(model, optimizer));  // with spares: the first snapshot
  const int64_t lastStep = options.stopAfter > 0 ? std::min(options.steps, options.stopAfter) : options.steps;
  std::signal(SIGTERM, onStopSignal);
  std::signal(SIGINT, onStopSignal);
  // A bar only for a person at a terminal; elsewhere the step lines at the log interval are the plain lines.
  Reporter reporter{.leader = rank == 0,
                    .bar = ProgressBar({.stream = stdout, .plainInterval = {}, .enabled = rank == 0})};
  if (rank == 0 && !options.lossLog.empty()) reporter.lossLog.open(options.lossLog, std::ios::app);
  reporter.line(fmt::format("train_moe: {} ranks (tp {} pp {} ep {} dp {} expert-dp {}), {} on {}, steps {}..{} of {}",
                            runtime.world().size(), layout.tp(), layout.pp(), layout.ep(), layout.dp(), layout.edp(),
                            c10::toString(options.model.dtype), device.str(), step, lastStep, options.steps));
  if (resume)
    reporter.line(
        fmt::format("recovered: generation {}, rank(s) [{}] taken by spares, resuming from step {} ({:.1f} "
                    "s after the error)",
                    resume->recovered.generation, fmt::join(resume->recovered.replaced, ", "), resume->recovered.step,
                    resume->recovered.seconds));

  auto save = [&](int64_t completed) {
    if (completed == savedStep) return;  // a committed step folder is never replaced
    savedStep = completed;
    auto start = std::chrono::steady_clock::now();
    checkpointer->save(completed, stateOf(model, optimizer, layout, data, completed, modelConfig));
    const double blocked = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    reporter.line(fmt::format("checkpoint step {}: training blocked {:.1f} ms (writing continues in the background)",
                              completed, blocked * 1e3));
  };

  const auto& dp = groups.dpCp();
  const double flopsPerToken = examples::modelFlopsPerToken(options, options.sequence);
  const double peak = peakFlops(device);
  double windowSeconds = 0;
  int64_t windowSteps = 0;
  // A step whose loss and gradient norm the host reads while the next step runs on the device.
  struct Queued {
    int64_t step;
    examples::StepLoss loss;
    optim::StepNorm gradNorm;
  };
  std::optional<Queued> queued;
  int64_t skipped = 0;  // updates not taken for a norm that was not finite (the optimizer logs each)
  auto report = [&](Queued& done) {
    const double meanLoss = done.loss.get(), gradNorm = done.gradNorm.get();
    if (!std::isfinite(gradNorm)) ++skipped;
    if (reporter.lossLog.is_open())
      reporter.lossLog << fmt::format("{} {:.17g} {:.17g}\n", done.step, meanLoss, gradNorm) << std::flush;
    if ((done.step + 1) % options.logInterval != 0 && done.step + 1 != lastStep)
      return reporter.progress(done.step + 1, lastStep, meanLoss);
    const moe::MoELayer* layer = model.firstMoeLayer();  // its stats: of the latest forward
    const moe::MoEStats stats = layer ? layer->stats() : moe::MoEStats{};
    const double tokensPerSecond = batches.tokensPerStep() * windowSteps / windowSeconds;
    reporter.line(fmt::format(
        "step {:>5} | loss {:.4f} | {:>8.0f} tok/s | step {:>7.1f} ms{} | grad norm {:.3f} | imbalance {:.2f} | "
        "dropped {}{}",
        done.step + 1, meanLoss, tokensPerSecond, 1e3 * windowSeconds / windowSteps,
        device.is_cuda() ? throughput(tokensPerSecond, flopsPerToken, peak, runtime.world().size()) : "", gradNorm,
        stats.imbalance, stats.droppedSlots, skipped > 0 ? fmt::format(" | skipped updates {}", skipped) : ""));
    windowSeconds = 0;
    windowSteps = 0;
  };
  std::unique_ptr<examples::CapturedStep> captured;  // with --cuda-graph, from the first step
  examples::StepProfile profile(options.profile);
  const int64_t profileFrom = step + 10, profileTo = step + 15;
  for (; step < lastStep; ++step) {
    if (profile.enabled() && step == profileFrom) profile.start();
    if (profile.enabled() && step == profileTo) profile.stop(rank);
    examples::StepRange range(profile.enabled() && step >= profileFrom && step < profileTo);
    auto start = std::chrono::steady_clock::now();
    // Micro-batch m of every dp rank together is the same slice of the global batch in
    // any layout (rows [m B / M, (m + 1) B / M)), so the MoE losses, which are not
    // linear in the batch, see the same tokens whatever dp is.
    std::vector<examples::TokenBatch> microBatches;
    for (int m = 0; m < options.microBatches; ++m) {
      const int slot = m * dp->size() + dp->rank(), slots = options.microBatches * dp->size();
      microBatches.push_back(batches.batch(step, slot, slots, device));
      data.log(step, slot, slots, microBatches.back());
    }
    // The data-parallel mean of the loss (every rank's batch is the same size).
    if (options.cudaGraph && !captured)
      captured = std::make_unique<examples::CapturedStep>(model, groups, runtime.store(), microBatches);
    examples::StepLoss loss = captured ? captured->run(microBatches) : model.forwardBackward(microBatches);
    optim::StepNorm gradNorm = optimizer.launchStep(schedule.at(step), {.maxGradNorm = options.clip});
    if (!captured) optimizer.zeroGrad();  // a graph's gradients stay: each replay writes them
    if (queued) report(*queued);          // the step before, done or nearly so on the device
    if (data.evaluatesAfter(step + 1)) {
      const double validLoss = validationLoss(model, data, *dp, options, device, step + 1);
      reporter.line(fmt::format("validation after step {:>5} | loss {:.6f} | ppl {:.2f} | {} batches", step + 1,
                                validLoss, std::exp(validLoss), data.evalIters()));
    }
    queued.emplace(Queued{step, std::move(loss), std::move(gradNorm)});
    const bool snapshot = recovery.due(step + 1);
    if (snapshot) {  // the snapshot, and the step's wait for its loss, which it reports at once
      recovery.afterStep(step + 1, recoveryState(model, optimizer));
      queued->loss.get();
      queued->gradNorm.get();
    }
    windowSeconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++windowSteps;
    if (snapshot) {  // each step up to a snapshot reported once it is taken, so a recovery loses no line
      report(*queued);
      queued.reset();
      if (resume && step == resume->recovered.step)
        reporter.line(
            fmt::format("recovery: step {} done {:.1f} s after the error was caught", step + 1,
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - resume->caught).count()));
    }

    const bool last = step + 1 == lastStep;
    if (checkpointer && options.checkpointInterval > 0 && (step + 1) % options.checkpointInterval == 0 && !last)
      save(step + 1);
    if (agreeToStop(runtime)) {
      report(*queued);
      queued.reset();
      reporter.line(fmt::format("signal {} received: saving step {} and stopping", stopSignal.load(), step + 1));
      ++step;
      break;
    }
  }
  if (queued) report(*queued);
  profile.stop(rank);
  if (const double peakGiB = device.is_cuda() ? examples::peakDeviceMemoryGiB(device.index()) : -1; peakGiB >= 0)
    reporter.line(fmt::format("peak device memory {:.2f} GiB allocated", peakGiB));
  if (recovery.enabled()) reporter.line(snapshotCostLine(recovery.snapshotCost(), options.snapshotEvery));
  if (checkpointer) {
    save(step);
    auto result = checkpointer->wait(Deadline::afterSeconds(env::kCheckpointTimeout.seconds() + 10));
    reporter.line(
        result.ok
            ? fmt::format("checkpoint step {} committed in {:.2f} s: {}", result.step, result.totalSeconds, result.path)
            : fmt::format("checkpoint step {} failed ({}): {}", result.step, result.errorKind, result.error));
  }
  if (options.printDigest) reporter.line(examples::parameterDigest(model.parameters(), runtime.cpuWorld()));
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app(
      "Trains a MoE transformer language model on an indexed dataset or generated text, with checkpoints and resume.",
      "train_moe");
  TrainOptions options;
  examples::addTrainFlags(app, options);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init({.backend = options.backend, .spares = options.spares});
    examples::checkHfFlags(options, runtime->info().rank);
    if (options.steps == 0) {  // evaluate given tokens
      examples::evaluateHfModel(*runtime, options);
      runtime->shutdown();
      return 0;
    }
    launch::Recovery recovery(*runtime,
                              {.snapshotEvery = options.snapshotEvery, .stageOnDevice = !options.snapshotInPlace});
    std::optional<Resume> resume;
    if (runtime->isSpare()) {  // waits for a rank to replace, or the job's end
      auto turn = recovery.awaitTurn();
      if (!turn) return 0;
      resume = Resume{
          *turn, std::chrono::steady_clock::now() - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                        std::chrono::duration<double>(turn->seconds))};
    }
    for (;;) {
      try {
        train(*runtime, options, recovery, resume);
        break;
      } catch (const Error&) {
        const auto caught = std::chrono::steady_clock::now();
        resume = Resume{recovery.recover(std::current_exception()), caught};  // rethrows what it cannot recover
      }
    }
    runtime->shutdown();
    return 0;
  });
}
