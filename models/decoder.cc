#include "models/decoder.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "runtime/errors.h"

namespace bulkhead::models {
namespace {

moe::MoEOptions moeOptions(const DecoderConfig& config, const DecoderOptions& options, int layer) {
  return {.name = fmt::format("model.layers.{}.mlp", layer),
          .hidden = static_cast<int>(config.hidden),
          .ffnHidden = static_cast<int>(config.moeIntermediate),
          .router = {.numExperts = config.experts,
                     .topK = config.topK,
                     .scoreFunction = moe::ScoreFunction::Softmax,
                     .normalizeWeights = config.normTopK,
                     .auxLossCoeff = options.auxLossCoeff.value_or(config.routerAuxLossCoef),
                     .zLossCoeff = options.zLossCoeff,
                     .float32Scores = options.float32Internals},
          .oncePerRank = options.oncePerRank,
          .globalAuxLoss = true,
          .initStd = options.initStd,
          .seed = options.seed * 1000 + static_cast<uint64_t>(layer)};
}

}  // namespace

Decoder::Decoder(DecoderConfig config, const parallel::ProcessGroups& groups, DecoderOptions options)
    : config_(std::move(config)),
      options_(options),
      tp_(parallel::TpGroup::dense(groups)),
      rope_(config_.headDim, config_.ropeTheta, options.float32Internals) {
  if (options_.endLayer < 0) options_.endLayer = config_.layers;
  const int rank = groups.world()->rank();
  if (options_.firstLayer < 0 || options_.firstLayer > options_.endLayer || options_.endLayer > config_.layers)
    throw ConfigError(fmt::format("model: layers [{}, {}) are not a part of {} layers", options_.firstLayer,
                                  options_.endLayer, config_.layers),
                      {.rank = rank});
  if (config_.tieEmbeddings && options_.last && !options_.first)
    throw ConfigError("model: tie_word_embeddings with the output layer on another pipeline stage than the embedding",
                      {.rank = rank, .expected = "tie_word_embeddings false, or pp 1"});
  const LayerInit init{.initStd = options_.initStd,
                       .seed = options_.seed,
                       .dtype = options_.dtype,
                       .float32Internals = options_.float32Internals};
  const auto tensorOptions = at::TensorOptions(options_.dtype).device(tp_.comm->device());
  const parallel::VocabEmbeddingOptions vocab{
      .initStd = options_.initStd, .seed = options_.seed, .dtype = options_.dtype};
  if (options_.first || (options_.last && config_.tieEmbeddings))
    embedding_.emplace("model.embed_tokens", config_.vocab, config_.hidden, tp_, vocab);
  if (options_.last && !config_.tieEmbeddings) output_.emplace("lm_head", config_.vocab, config_.hidden, tp_, vocab);
  for (int layer = options_.firstLayer; layer < options_.endLayer; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}", layer);
    Layer entry{.index = layer,
                .inputNorm = normWeight(prefix + ".input_layernorm.weight", config_.hidden, tensorOptions),
                .postNorm = normWeight(prefix + ".post_attention_layernorm.weight", config_.hidden, tensorOptions),
                .attention = std::make_unique<Attention>(prefix + ".self_attn", config_, tp_, init)};
    if (config_.moeLayers[layer]) {
      moe_.push_back(std::make_unique<moe::MoELayer>(moeOptions(config_, options_, layer), groups, tensorOptions));
      entry.moe = moe_.back().get();
    } else {
      entry.dense = std::make_unique<DenseMlp>(prefix + ".mlp", config_.hidden, config_.intermediate, tp_, init);
    }
    layers_.push_back(std::move(entry));
  }
  if (options_.last) finalNorm_ = normWeight("model.norm.weight", config_.hidden, tensorOptions);
}

const parallel::VocabParallelEmbedding& Decoder::outputLayer() const { return output_ ? *output_ : *embedding_; }

parallel::Range Decoder::vocabRange() const { return outputLayer().vocabRange(); }

std::pair<at::Tensor, at::Tensor> Decoder::layerForward(const Layer& layer, const at::Tensor& x,
                                                        const at::Tensor& routingKeys) {
  const at::ScalarType compute = internalType(x.scalar_type(), options_.float32Internals);
  const at::Tensor h = x + layer.attention->forward(rmsNorm(x, layer.inputNorm.weight, config_.rmsEps, compute), rope_);
  const at::Tensor normed = rmsNorm(h, layer.postNorm.weight, config_.rmsEps, compute);
  const auto lossType = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (!layer.moe) return {h + layer.dense->forward(normed), at::zeros({}, x.options().dtype(lossType))};
  moe::MoEOutput out = layer.moe->forward(normed, routingKeys);
  return {h + out.output, (out.auxLoss + out.zLoss).to(lossType)};
}

// A layer whose forward keeps only its input (DecoderOptions::recompute): the backward runs the layer again
// with autograd on, then that graph's backward, which accumulates the layer's parameter gradients as a plain
// backward would and returns the input's.
struct RecomputedLayer : torch::autograd::Function<RecomputedLayer> {
  // The routing keys travel as a pointer, not a tensor input: they may be undefined, and have no gradient.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor* routingKeys, Decoder* model, int64_t layer) {
    ctx->save_for_backward({x});
    if (routingKeys->defined()) ctx->saved_data["keys"] = *routingKeys;
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["layer"] = layer;
    auto [y, aux] = model->layerForward(model->layers_[static_cast<size_t>(layer)], x, *routingKeys);
    return {y, aux};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto* model = reinterpret_cast<Decoder*>(ctx->saved_data["model"].toInt());
    const auto layer = static_cast<size_t>(ctx->saved_data["layer"].toInt());
    const at::Tensor input = saved[0].detach().requires_grad_(true);
    const auto keys = ctx->saved_data.find("keys");
    const at::Tensor routingKeys = keys == ctx->saved_data.end() ? at::Tensor() : keys->second.toTensor();
    std::vector<at::Tensor> outputs, outputGrads;
    {
      const at::AutoGradMode enable(true);
      auto [y, aux] = model->layerForward(model->layers_[layer], input, routingKeys);
      for (auto [out, grad] : {std::pair{y, grads[0]}, std::pair{aux, grads[1]}}) {
        if (!out.requires_grad() || !grad.defined()) continue;
        outputs.push_back(out);
        outputGrads.push_back(grad);
      }
    }
    if (!outputs.empty()) torch::autograd::backward(outputs, outputGrads);
    return {input.grad(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

DecoderOutput Decoder::forward(const at::Tensor& idsOrInput, const at::Tensor& routingKeys) {
  at::Tensor x = options_.first ? embedding_->forward(idsOrInput) : idsOrInput;
  const auto lossType = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::ScalarType compute = internalType(x.scalar_type(), options_.float32Internals);
  at::Tensor aux = at::zeros({}, x.options().dtype(lossType));
  // Recomputation needs an input that requires grad: a Function's outputs require grad only through its inputs.
  const bool recompute = options_.recompute && at::GradMode::is_enabled() && x.requires_grad();
  for (size_t i = 0; i < layers_.size(); ++i) {
    at::Tensor layerAux;
    if (recompute) {
      auto out = RecomputedLayer::apply(x, &routingKeys, this, static_cast<int64_t>(i));
      x = out[0];
      layerAux = out[1];
    } else {
      std::tie(x, layerAux) = layerForward(layers_[i], x, routingKeys);
    }
    aux = aux + layerAux;
  }
  if (!options_.last) return {x, aux};
  return {outputLayer().logits(rmsNorm(x, finalNorm_->weight, config_.rmsEps, compute)), aux};
}

at::Tensor Decoder::tokenLosses(const at::Tensor& logits, const at::Tensor& targets) const {
  return parallel::vocabParallelCrossEntropy(logits, targets, vocabRange().begin, tp_);
}

// In forward order.
std::vector<parallel::Parameter> Decoder::parameters() const {
  std::vector<parallel::Parameter> all;
  auto append = [&](std::vector<parallel::Parameter> more) { all.insert(all.end(), more.begin(), more.end()); };
  if (options_.first) append(embedding_->parameters());
  for (const Layer& layer : layers_) {
    all.push_back(layer.inputNorm.parameter(tp_));
    append(layer.attention->parameters());
    all.push_back(layer.postNorm.parameter(tp_));
    append(layer.moe ? layer.moe->parameters() : layer.dense->parameters());
  }
  if (finalNorm_) all.push_back(finalNorm_->parameter(tp_));
  if (output_) append(output_->parameters());
  return all;
}

at::Tensor forwardOverStages(Decoder& model, const parallel::ProcessGroups& groups, const at::Tensor& ids) {
  const DecoderOptions& part = model.options();
  const int stage = groups.pp()->rank();
  at::Tensor input = ids;
  if (!part.first) {
    input = at::empty({ids.size(0), ids.size(1), model.config().hidden},
                      at::TensorOptions(part.dtype).device(groups.world()->device()));
    groups.pp()->recv(input, stage - 1)->wait();
  }
  const at::Tensor out = model.forward(input).output.contiguous();
  if (part.last) return out;
  groups.pp()->send(out, stage + 1)->wait();
  return {};
}

}  // namespace bulkhead::models
