#pragma once
// A small MoE transformer language model on Bulkhead's layers: a vocabulary-
// parallel byte embedding, then per layer RMSNorm -> causal self-attention
// (heads split over tp: column-parallel q, k, v, row-parallel output) ->
// RMSNorm -> MoE feed-forward (experts over ep, expert-tp = tp), a final
// RMSNorm and a vocabulary-parallel output layer (or the embedding again,
// tied). Every weight starts from a seeded slice of its global tensor, so
// every layout trains the same model.

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

#include "examples/train_moe/data.h"
#include "moe/moe_layer.h"
#include "parallel/linear.h"
#include "parallel/parameter.h"
#include "parallel/process_groups.h"
#include "parallel/vocab_parallel.h"

namespace bulkhead::examples {

struct ModelConfig {
  int64_t vocab = 256;  // bytes
  int hidden = 64;
  int layers = 2;
  int heads = 4;
  int ffn = 96;  // per expert
  int experts = 8;
  int topK = 2;
  int sharedFfn = 0;  // 0: no shared expert
  double auxLossCoeff = 1e-2;
  double zLossCoeff = 1e-3;
  double capacityFactor = 0;  // 0: dropless
  // The router's selection noise (moe::RouterOptions::selectionNoise), keyed by
  // each token's place in the global batch and the step, so every layout and a
  // resumed run draw the same noise. Without it, the tokens of a frequent byte
  // (the space is 18% of the corpus) start on the same two experts and the
  // first layer's load is 2 to 8 times the mean for tens of steps.
  double routerNoise = 0.05;
  // The output layer is the embedding matrix (GPT-2's tying) instead of a
  // layer of its own.
  bool tiedEmbedding = false;
  bool oncePerRank = true;
  // The MoE layers' fixed shapes (moe::MoEOptions::staticShapes; needs a
  // capacity), for a step captured in a CUDA graph.
  bool staticShapes = false;
  uint64_t seed = 1;
  at::ScalarType dtype = at::kFloat;
};

struct ModelOutput {
  at::Tensor loss;     // mean next-byte cross-entropy over this rank's tokens
  at::Tensor auxLoss;  // MoE aux + z losses of all layers (coefficients applied)
};

// The part of the model one pipeline chunk holds: layers [firstLayer,
// endLayer) by global index (so checkpoints do not depend on the pipeline
// size). The first part embeds the bytes; the last applies the final norm and
// the output layer. Tied, a last part that is not also the first holds a copy
// of the embedding (pipelineCopy: its gradient is summed with the first
// part's, and it is counted and saved once).
struct ModelPart {
  int firstLayer = 0, endLayer = -1;  // -1: every layer
  bool first = true, last = true;
};

// One pipeline chunk of the model train_moe trains: a part of the built-in MoETransformer, or of a Hugging
// Face decoder (examples/train_moe/hf_model.h).
class ModelChunk {
 public:
  virtual ~ModelChunk() = default;
  // This part: the first embeds the batch's ids, the others continue from
  // `input` (the previous part's activations); returns the activations, or on
  // the last part the loss, and this part's MoE losses.
  virtual ModelOutput forwardPart(const TokenBatch& batch, const at::Tensor& input) = 0;
  virtual const ModelPart& part() const = 0;
  // The embedding weight on a first part, or tied on a last part (undefined elsewhere).
  virtual at::Tensor embeddingWeight() const = 0;
  virtual std::vector<parallel::Parameter> parameters() const = 0;
  // State that is not trained by gradients (the routers' expert biases).
  virtual std::vector<parallel::ShardedTensor> buffers() const = 0;
  virtual const std::vector<std::unique_ptr<moe::MoELayer>>& moeLayers() const = 0;
};

class MoETransformer : public ModelChunk {
 public:
  MoETransformer(const ModelConfig& config, const parallel::ProcessGroups& groups, ModelPart part = {});
  MoETransformer(const MoETransformer&) = delete;
  MoETransformer& operator=(const MoETransformer&) = delete;

  // batch: [rows, sequence] int64 on the groups' device (the whole model).
  ModelOutput forward(const TokenBatch& batch);
  ModelOutput forwardPart(const TokenBatch& batch, const at::Tensor& input) override;
  const ModelPart& part() const override { return part_; }
  at::Tensor embeddingWeight() const override;

  std::vector<parallel::Parameter> parameters() const override;
  std::vector<parallel::ShardedTensor> buffers() const override;
  const std::vector<std::unique_ptr<moe::MoELayer>>& moeLayers() const override { return moe_; }

 private:
  at::Tensor positions_;  // 0.1 x the sinusoidal table of the last sequence length
  struct Norm {
    std::string name;
    at::Tensor weight;
  };
  at::Tensor norm(const Norm& n, const at::Tensor& x) const;
  at::Tensor attention(int layer, const at::Tensor& x) const;

  ModelConfig config_;
  ModelPart part_;
  parallel::TpGroup tp_;
  std::optional<parallel::VocabParallelEmbedding> embedding_;
  std::optional<parallel::VocabParallelEmbedding> output_;  // the untied output layer, on the last part
  std::vector<parallel::ColumnParallelLinear> q_, k_, v_;
  std::vector<parallel::RowParallelLinear> out_;
  std::vector<Norm> attentionNorm_, moeNorm_;
  Norm finalNorm_;
  std::vector<std::unique_ptr<moe::MoELayer>> moe_;
};

// Model FLOPs of one training step per token (forward and backward, 3x the
// forward's matrix products): q, k, v and out projections, causal attention
// (half of the full score and mix products), the router, top-k SwiGLU
// experts, a shared expert, and the output layer. The same count as
// bench/torch_train_moe.py's, so MFU compares like with like.
double trainingFlopsPerToken(const ModelConfig& config, int64_t sequence);

}  // namespace bulkhead::examples
