#include "examples/train_moe/hf_eval.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/safetensors.h"
#include "examples/train_moe/hf_model.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_weights.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"

namespace bulkhead::examples {
namespace {

at::Tensor readTokens(const std::string& path, int64_t vocab, int rank) {
  const checkpoint::SafetensorsFile file(path);
  const checkpoint::SafetensorsTensor* ids = file.find("input_ids");
  const std::string want = "a safetensors file holding input_ids, int64 [rows, seq] with seq of at least 2";
  if (ids == nullptr)
    throw ConfigError(fmt::format("--tokens {}: no tensor 'input_ids'", path), {.rank = rank, .expected = want});
  if (ids->dtype != at::kLong || ids->shape.size() != 2 || ids->shape[0] < 1 || ids->shape[1] < 2)
    throw ConfigError(
        fmt::format("--tokens {}: input_ids is {} [{}]", path, c10::toString(ids->dtype), fmt::join(ids->shape, ", ")),
        {.rank = rank, .expected = want});
  const at::Tensor tokens = file.read(*ids);
  const int64_t low = tokens.min().item<int64_t>(), high = tokens.max().item<int64_t>();
  if (low < 0 || high >= vocab)
    throw ConfigError(fmt::format("--tokens {}: ids run from {} to {}, outside the model's vocabulary [0, {})", path,
                                  low, high, vocab),
                      {.rank = rank, .expected = "ids the model's tokenizer wrote (below vocab_size)"});
  return tokens;
}

// Where a rank sits, as the logits writer needs to know: its pipeline stage, dp and tp ranks, and the
// vocabulary block its logits cover (on the last stage).
struct Place {
  int64_t stage, dp, tp, last, vocabBegin, vocabLength;
};

std::vector<Place> places(Communicator& cpuWorld, const Place& mine) {
  at::Tensor all = at::empty({cpuWorld.size(), 6}, at::kLong);
  cpuWorld.allGather(at::tensor({mine.stage, mine.dp, mine.tp, mine.last, mine.vocabBegin, mine.vocabLength}), all)
      ->wait();
  std::vector<Place> result;
  for (int r = 0; r < cpuWorld.size(); ++r) {
    const auto p = all[r];
    result.push_back({p[0].item<int64_t>(), p[1].item<int64_t>(), p[2].item<int64_t>(), p[3].item<int64_t>(),
                      p[4].item<int64_t>(), p[5].item<int64_t>()});
  }
  return result;
}

// Rank 0 writes logits [rows, seq, vocab], a row at a time: for each dp rank's rows in order, the vocabulary
// blocks of its tp ranks on the last stage, received over the CPU world (or its own). `block`: this rank's
// logits [its rows, seq, its vocabulary block] on the host, undefined outside the last stage.
void writeLogits(Runtime& runtime, const std::string& path, const at::Tensor& block, const Place& mine,
                 std::vector<int64_t> shape, at::ScalarType dtype) {
  Communicator& cpu = runtime.cpuWorld();
  const std::vector<Place> all = places(cpu, mine);
  if (cpu.rank() != 0) {
    if (block.defined())
      for (int64_t r = 0; r < block.size(0); ++r)
        cpu.send(block[r].contiguous(), 0, {.label = fmt::format("logits row {}", r)})->wait();
    return;
  }
  int64_t dp = 0, tp = 0;
  for (const Place& p : all) dp = std::max(dp, p.dp + 1), tp = std::max(tp, p.tp + 1);
  std::vector<int> source(static_cast<size_t>(dp * tp), -1);
  for (int r = 0; r < static_cast<int>(all.size()); ++r)
    if (all[r].last) source[static_cast<size_t>(all[r].dp * tp + all[r].tp)] = r;
  checkpoint::SafetensorsWriter writer(path, {{.name = "logits", .dtype = dtype, .shape = shape}}, {{"format", "pt"}});
  const int64_t rowsPerRank = shape[0] / dp, sequence = shape[1];
  for (int64_t d = 0; d < dp; ++d) {
    for (int64_t row = 0; row < rowsPerRank; ++row) {
      std::vector<at::Tensor> pieces;
      for (int64_t t = 0; t < tp; ++t) {
        const int from = source[static_cast<size_t>(d * tp + t)];
        if (from == 0) {
          pieces.push_back(block[row]);
          continue;
        }
        at::Tensor piece = at::empty({sequence, all[from].vocabLength}, at::TensorOptions(dtype));
        cpu.recv(piece, from, {.label = fmt::format("logits row {}", row)})->wait();
        pieces.push_back(piece);
      }
      const at::Tensor whole = at::cat(pieces, -1).contiguous();
      writer.append(whole.data_ptr(), static_cast<int64_t>(whole.nbytes()));
    }
  }
  writer.finish();
}

// --ckpt-dir DIR --resume latest|STEP: the weights a training run saved there, at any layout, over those read.
void loadTrained(Runtime& runtime, const TrainOptions& options, models::Decoder& model) {
  const int rank = runtime.world().rank();
  auto checkpointer =
      checkpoint::Checkpointer::create({.dir = options.checkpointDir}, runtime.store(), rank, runtime.world().size());
  checkpoint::StateDict weights;
  for (const parallel::Parameter& p : model.parameters()) weights.add(p.name, p.tensor.detach(), p.shard);
  checkpoint::LoadOptions load{.resume = false};
  if (options.resume != "latest") load.step = std::stoll(options.resume);
  const checkpoint::LoadResult loaded = checkpointer->load(weights, load);
  if (rank == 0) fmt::print("loaded the weights of step {} from {}\n", loaded.step, loaded.path);
}

}  // namespace

void checkHfFlags(const TrainOptions& options, int rank) {
  const HfOptions& hf = options.hf;
  auto refuse = [&](const std::string& what, const std::string& expected) {
    throw ConfigError(what, {.rank = rank, .expected = expected});
  };
  if (!hf.model.empty() && !hf.modelConfig.empty())
    refuse("--hf-model and --model-config both given", "one: a folder with weights, or a config.json alone");
  if (options.steps == 0 && hf.tokens.empty())
    refuse("--steps 0 without --tokens: nothing to train or evaluate", "--steps N, or --tokens FILE to evaluate");
  if (!hf.tokens.empty() && options.steps != 0)
    refuse(fmt::format("--tokens with --steps {}: the tokens are evaluated without training", options.steps),
           "--steps 0 with --tokens");
  if (!hf.tokens.empty() && !hf.any()) refuse("--tokens without a model", "--hf-model DIR or --model-config FILE");
  if (options.steps == 0 && !options.resume.empty() && options.checkpointDir.empty())
    refuse("--resume without --ckpt-dir", "--ckpt-dir DIR --resume latest|STEP");
  if (options.steps == 0 && !options.resume.empty() && options.resume != "latest" &&
      options.resume.find_first_not_of("0123456789") != std::string::npos)
    refuse(fmt::format("--resume {}", options.resume), "--resume latest or a step number");
  if (!hf.logitsOut.empty() && hf.tokens.empty())
    refuse("--logits-out without --tokens", "--tokens FILE --steps 0 --logits-out OUT");
  if (hf.recompute && !hf.any())
    refuse("--recompute with the built-in model", "--recompute with --hf-model DIR or --model-config FILE");
  if (hf.any() && (options.cudaGraph || options.staticShapes))
    refuse("--cuda-graph or --static-shapes with a Hugging Face model: its MoE layers are dropless (no --capacity)",
           "neither flag with --hf-model or --model-config");
}

void evaluateHfModel(Runtime& runtime, const TrainOptions& options) {
  const HfOptions& hf = options.hf;
  const int rank = runtime.world().rank();
  const models::DecoderConfig config = hfConfig(hf);
  const at::Tensor ids = readTokens(hf.tokens, config.vocab, rank);
  auto groups = parallel::ProcessGroups::create(
      runtime.worldPtr(),
      parallel::LayoutOptions{.tp = options.tp, .pp = options.pp, .ep = options.ep, .etp = options.tp},
      {.localSize = runtime.info().localSize});
  const int dp = groups.dp()->size(), stage = groups.pp()->rank(), stages = options.pp;
  const int64_t rows = ids.size(0), sequence = ids.size(1);
  if (rows % dp != 0)
    throw ConfigError(
        fmt::format("--tokens {} has {} rows, which do not split over {} data-parallel ranks", hf.tokens, rows, dp),
        {.rank = rank, .expected = fmt::format("a multiple of {} rows, or fewer ranks", dp)});
  if (config.layers < stages)
    throw ConfigError(fmt::format("{} layers do not fill {} pipeline stages", config.layers, stages),
                      {.rank = rank, .expected = fmt::format("--pp at most {}", config.layers)});
  const at::ScalarType dtype = options.model.dtype;
  models::Decoder model(config, groups,
                        {.dtype = dtype,
                         .seed = options.model.seed,
                         .initStd = hf.model.empty() && options.resume.empty() ? 0.02 : 0.0,  // else loaded next
                         .float32Internals = hf.float32Internals,
                         .firstLayer = stage * config.layers / stages,
                         .endLayer = (stage + 1) * config.layers / stages,
                         .first = stage == 0,
                         .last = stage == stages - 1});
  const auto& layout = groups.layout();
  if (rank == 0)
    fmt::print("train_moe: {} ({:.3g}B parameters, {:.3g}B active) on {} ranks (tp {} pp {} ep {} dp {}), {} on {}\n",
               config.modelType, models::parameterCount(config) / 1e9, models::activeParameterCount(config) / 1e9,
               runtime.world().size(), layout.tp(), layout.pp(), layout.ep(), layout.dp(), c10::toString(dtype),
               runtime.device().str());
  if (!hf.model.empty()) {
    const models::HfLoadReport report = models::loadHfWeights(model, hf.model);
    if (rank == 0)
      fmt::print("loaded {}: {} tensors, {:.1f} MB of the folder's {:.1f} MB read on rank 0 in {:.2f} s\n", hf.model,
                 report.tensors, report.bytesRead / 1e6, report.folderBytes / 1e6, report.seconds);
  }
  if (!options.resume.empty()) loadTrained(runtime, options, model);
  const at::NoGradGuard noGrad;
  const int64_t rowsHere = rows / dp;
  const at::Tensor mine = ids.narrow(0, groups.dp()->rank() * rowsHere, rowsHere).to(runtime.device());
  const at::Tensor logits = models::forwardOverStages(model, groups, mine);
  // The LM loss: the last stage's ranks compute their rows' per-token losses (over tp), its tp-rank-0 ranks
  // add theirs, the world sums them.
  at::Tensor sum = at::zeros({1}, at::kDouble);
  if (logits.defined()) {
    const at::Tensor losses =
        model.tokenLosses(logits.narrow(1, 0, sequence - 1).contiguous(), mine.narrow(1, 1, sequence - 1).contiguous());
    if (groups.tp()->rank() == 0) sum += losses.sum().to(at::kDouble).cpu();
  }
  runtime.cpuWorld().allReduce(sum)->wait();
  const int64_t predicted = rows * (sequence - 1);
  if (rank == 0)
    fmt::print("lm loss {:.12f} over {} predicted tokens ({} rows of {})\n", sum.item<double>() / predicted, predicted,
               rows, sequence);
  if (hf.logitsOut.empty()) return;
  const at::ScalarType out = hf.logitsDtype.value_or(dtype);
  const parallel::Range vocab = logits.defined() ? model.vocabRange() : parallel::Range{};
  const Place place{stage,       groups.dp()->rank(), groups.tp()->rank(), logits.defined() ? 1 : 0,
                    vocab.begin, vocab.length};
  writeLogits(runtime, hf.logitsOut, logits.defined() ? logits.to(at::kCPU, out).contiguous() : at::Tensor(), place,
              {rows, sequence, config.vocab}, out);
  if (rank == 0)
    fmt::print("logits [{}, {}, {}] {} written to {}\n", rows, sequence, config.vocab, c10::toString(out),
               hf.logitsOut);
}

}  // namespace bulkhead::examples
