#include "examples/train_moe/hf_model.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstdio>
#include <optional>

#include "runtime/errors.h"

namespace bulkhead::examples {

HfChunk::HfChunk(const models::DecoderConfig& config, const parallel::ProcessGroups& groups, const ModelPart& part,
                 const HfModelOptions& options)
    : part_(part),
      decoder_(config, groups,
               {.dtype = options.dtype,
                .seed = options.seed,
                .initStd = options.weights.empty() ? 0.02 : 0.0,  // loaded: nothing drawn, no global tensor held
                .float32Internals = options.float32Internals,
                .recompute = options.recompute,
                .firstLayer = part.firstLayer,
                .endLayer = part.endLayer,
                .first = part.first,
                .last = part.last}) {
  if (!options.weights.empty()) loaded_ = models::loadHfWeights(decoder_, options.weights);
}

ModelOutput HfChunk::forwardPart(const TokenBatch& batch, const at::Tensor& input) {
  models::DecoderOutput out = decoder_.forward(part_.first ? batch.ids : input);
  if (!part_.last) return {out.output, out.auxLoss};
  const at::Tensor losses = decoder_.tokenLosses(out.output, batch.targets);
  if (!batch.lossMask.defined()) return {losses.mean(), out.auxLoss};
  const at::Tensor mask = batch.lossMask.to(losses.scalar_type()).view(losses.sizes());
  return {(losses * mask).sum() / mask.sum().clamp_min(1), out.auxLoss};
}

models::DecoderConfig hfConfig(const HfOptions& hf) {
  return models::loadDecoderConfig(hf.model.empty() ? hf.modelConfig : hf.model + "/config.json");
}

std::unique_ptr<StagedModel> makeStagedModel(const TrainOptions& options, const ModelConfig& builtIn,
                                             const parallel::ProcessGroups& groups, StagedOptions staged) {
  if (!options.hf.any()) return std::make_unique<StagedModel>(builtIn, groups, staged);
  const models::DecoderConfig config = hfConfig(options.hf);
  const HfModelOptions hf{.weights = options.hf.model,
                          .dtype = builtIn.dtype,
                          .seed = builtIn.seed,
                          .float32Internals = options.hf.float32Internals,
                          .recompute = options.hf.recompute};
  std::optional<models::HfLoadReport> first;
  auto model = std::make_unique<StagedModel>(
      config.layers, /*tied=*/false,
      [&](const ModelPart& part) {
        auto chunk = std::make_unique<HfChunk>(config, groups, part, hf);
        if (!first) first = chunk->loaded();
        return chunk;
      },
      groups, staged);
  if (groups.world()->rank() == 0) {
    fmt::print("model: {} from {} ({:.3g}B parameters, {:.3g}B active)\n", config.modelType,
               options.hf.model.empty() ? options.hf.modelConfig + ", random weights" : options.hf.model,
               models::parameterCount(config) / 1e9, models::activeParameterCount(config) / 1e9);
    if (!options.hf.model.empty() && first)
      fmt::print("loaded {}: {} tensors, {:.1f} MB of the folder's {:.1f} MB read on rank 0 in {:.2f} s\n",
                 options.hf.model, first->tensors, first->bytesRead / 1e6, first->folderBytes / 1e6, first->seconds);
    std::fflush(stdout);
  }
  return model;
}

int64_t modelVocab(const TrainOptions& options) {
  return options.hf.any() ? hfConfig(options.hf).vocab : options.model.vocab;
}

double modelFlopsPerToken(const TrainOptions& options, int64_t sequence) {
  if (!options.hf.any()) return trainingFlopsPerToken(options.model, sequence);
  const models::DecoderConfig c = hfConfig(options.hf);
  const double h = static_cast<double>(c.hidden), s = static_cast<double>(sequence);
  const double q = static_cast<double>(c.heads * c.headDim), kv = static_cast<double>(c.kvHeads * c.headDim);
  const double attention = 2 * h * (2 * q + 2 * kv) + 2 * s * q;
  double layers = 0;
  for (bool moe : c.moeLayers)
    layers += attention + (moe ? 2 * h * c.experts + c.topK * 6 * h * static_cast<double>(c.moeIntermediate)
                               : 6 * h * static_cast<double>(c.intermediate));
  return 3 * (layers + 2 * h * static_cast<double>(c.vocab));
}

}  // namespace bulkhead::examples
