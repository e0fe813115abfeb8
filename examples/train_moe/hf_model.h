#pragma once
// A Hugging Face decoder (bulkhead::models, docs/models.md) as train_moe's model: each pipeline chunk a part
// of a models::Decoder, its loss the mean next-token cross-entropy over this rank's tokens (those the loss
// mask keeps), its weights read from --hf-model's folder (each rank its own slices) or drawn at random
// (--model-config).

#include <memory>
#include <string>

#include "examples/train_moe/model.h"
#include "examples/train_moe/staged_model.h"
#include "examples/train_moe/train_options.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_weights.h"

namespace bulkhead::examples {

struct HfModelOptions {
  std::string weights;  // a Hugging Face folder; empty: random weights
  at::ScalarType dtype = at::kFloat;
  uint64_t seed = 1;
  bool float32Internals = true;  // models::DecoderOptions::float32Internals
  bool recompute = false;        // models::DecoderOptions::recompute
};

class HfChunk : public ModelChunk {
 public:
  HfChunk(const models::DecoderConfig& config, const parallel::ProcessGroups& groups, const ModelPart& part,
          const HfModelOptions& options);
  ModelOutput forwardPart(const TokenBatch& batch, const at::Tensor& input) override;
  const ModelPart& part() const override { return part_; }
  at::Tensor embeddingWeight() const override { return {}; }  // a tied embedding stays within one part
  std::vector<parallel::Parameter> parameters() const override { return decoder_.parameters(); }
  std::vector<parallel::ShardedTensor> buffers() const override { return {}; }
  const std::vector<std::unique_ptr<moe::MoELayer>>& moeLayers() const override { return decoder_.moeLayers(); }
  const models::HfLoadReport& loaded() const { return loaded_; }

 private:
  ModelPart part_;
  models::Decoder decoder_;
  models::HfLoadReport loaded_;
};

// The config of --hf-model's folder or of --model-config.
models::DecoderConfig hfConfig(const HfOptions& hf);

// train_moe's model: the Hugging Face one where --hf-model or --model-config names it, else the built-in one.
// Rank 0 prints the Hugging Face model's shape and what its first chunk read.
std::unique_ptr<StagedModel> makeStagedModel(const TrainOptions& options, const ModelConfig& builtIn,
                                             const parallel::ProcessGroups& groups, StagedOptions staged);
// The vocabulary the data's token ids must stay below.
int64_t modelVocab(const TrainOptions& options);
// Model FLOPs of one training step per token: 3x the forward's matrix products (q, k, v and o projections,
// causal attention over half the sequence on average, the router, the top-k SwiGLU experts or the dense MLP,
// the output layer), counted as trainingFlopsPerToken counts the built-in model's.
double modelFlopsPerToken(const TrainOptions& options, int64_t sequence);

}  // namespace bulkhead::examples
