#pragma once
// A Qwen3-MoE or Mixtral causal language model over Bulkhead's process groups, built from a
// DecoderConfig (docs/models.md):
//   embed_tokens -> per layer: x + attention(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))
//   -> norm -> lm_head (or embed_tokens again, tied)
// where mlp is a MoE block (experts over ep, expert-tp = tp) or a dense SwiGLU MLP, as the config says.
//
// Contract:
// - Parameters carry transformers' names ("model.layers.3.self_attn.q_proj.weight") and global shapes.
//   A MoE block's router and experts are "model.layers.{i}.mlp.router.weight" [E, H] and
//   "...mlp.experts.w13" [E, 2, F, H] (gate then up) and "...mlp.experts.w2" [E, H, F].
// - The vocabulary is split over tp (the first vocab % tp ranks hold a row more), and the logits stay split.
// - A part holds layers [firstLayer, endLayer) by global index (pipeline stages); the first embeds, the last
//   applies the final norm and the output layer.

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "models/config.h"
#include "models/layers.h"
#include "moe/moe_layer.h"
#include "parallel/process_groups.h"
#include "parallel/vocab_parallel.h"

namespace bulkhead::models {

struct DecoderOptions {
  at::ScalarType dtype = at::kFloat;
  uint64_t seed = 1;
  // transformers' initializer_range default. 0: every weight zeros (norms ones), drawn from nothing, for
  // weights loaded next: the process then holds its own share and no global tensor.
  double initStd = 0.02;
  // RMSNorms, RoPE tables and softmaxes (attention and router) in float32, as transformers computes them
  // even for a float64 model; false: in float64 for a float64 model (layers.h internalType()).
  bool float32Internals = true;
  // MoE: the aux-loss coefficient (the config's router_aux_loss_coef when unset) and z-loss.
  std::optional<double> auxLossCoeff;
  double zLossCoeff = 0;
  bool oncePerRank = true;
  // Activation recomputation per layer: a layer's forward under autograd keeps only its input; the backward
  // runs the layer's forward again (its collectives too, in the same order on every rank) and then its
  // backward. Gradients are the same as without; memory holds one layer's activations, not every layer's.
  bool recompute = false;
  int firstLayer = 0, endLayer = -1;  // -1: every layer
  bool first = true, last = true;
};

struct DecoderOutput {
  at::Tensor output;  // the last part: this rank's block of the logits [batch, sequence, vocab block]; else activations
  at::Tensor auxLoss;  // the MoE blocks' aux and z losses, coefficients applied
};

class Decoder {
 public:
  Decoder(DecoderConfig config, const parallel::ProcessGroups& groups, DecoderOptions options = {});
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // ids [batch, sequence] int64 (the first part), or the previous part's activations.
  DecoderOutput forward(const at::Tensor& idsOrInput, const at::Tensor& routingKeys = {});
  // Per-token cross-entropy [batch, sequence] of this rank's logits block against targets, over tp.
  at::Tensor tokenLosses(const at::Tensor& logits, const at::Tensor& targets) const;
  // The vocabulary rows this rank's logits cover.
  parallel::Range vocabRange() const;

  std::vector<parallel::Parameter> parameters() const;
  const DecoderConfig& config() const { return config_; }
  const DecoderOptions& options() const { return options_; }
  const std::vector<std::unique_ptr<moe::MoELayer>>& moeLayers() const { return moe_; }

 private:
  struct Layer {
    int index;
    NormWeight inputNorm, postNorm;
    std::unique_ptr<Attention> attention;
    std::unique_ptr<DenseMlp> dense;  // or a MoE block in moe_
    moe::MoELayer* moe = nullptr;
  };
  const parallel::VocabParallelEmbedding& outputLayer() const;
  // One layer: the residual stream after it, and its MoE losses (a zero scalar for a dense layer).
  std::pair<at::Tensor, at::Tensor> layerForward(const Layer& layer, const at::Tensor& x,
                                                 const at::Tensor& routingKeys);
  friend struct RecomputedLayer;

  DecoderConfig config_;
  DecoderOptions options_;
  parallel::TpGroup tp_;
  Rope rope_;
  std::optional<parallel::VocabParallelEmbedding> embedding_, output_;
  std::vector<Layer> layers_;
  std::vector<std::unique_ptr<moe::MoELayer>> moe_;
  std::optional<NormWeight> finalNorm_;
};

// The forward of the whole model over the pipeline stages, for evaluation: each stage receives the previous
// stage's activations over pp, runs its part and sends its own on. `ids` [batch, sequence] on every stage.
// Returns this rank's logits block on the last stage, an undefined tensor elsewhere. Collective over pp.
at::Tensor forwardOverStages(Decoder& model, const parallel::ProcessGroups& groups, const at::Tensor& ids);

}  // namespace bulkhead::models
