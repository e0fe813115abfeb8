#include "examples/train_moe/model.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>

#include "runtime/errors.h"

namespace bulkhead::examples {
namespace {

// Fixed sinusoidal positions [sequence, hidden]: no parameters to shard.
at::Tensor positions(int64_t sequence, int64_t hidden, const at::TensorOptions& options) {
  at::Tensor position = at::arange(sequence, options.dtype(at::kDouble)).unsqueeze(1);
  at::Tensor frequency = at::exp(at::arange(0, hidden, 2, options.dtype(at::kDouble)) * (-std::log(10000.0) / hidden));
  at::Tensor table = at::zeros({sequence, hidden}, options.dtype(at::kDouble));
  table.slice(1, 0, hidden, 2).copy_(at::sin(position * frequency));
  table.slice(1, 1, hidden, 2).copy_(at::cos(position * frequency));
  return table.to(options.dtype());
}

// The tied embedding's init std. Inputs are the token embedding scaled up by
// sqrt(hidden), so the residual stream starts as the token's own embedding,
// and the output layer is the same matrix: a token's logit for itself starts
// near |e|^2 / rms(e) = std * hidden. 0.02 (GPT-2's) keeps that at 1.28 up to
// a width of 64; wider, the std shrinks as 1 / hidden (as muP scales the
// output layer with the width), so the first loss stays near ln(vocab) at any
// width instead of growing with it (19.5 at 1,024 with 0.02).
double tiedEmbeddingStd(int hidden) { return 0.02 * std::min(1.0, 64.0 / hidden); }

}  // namespace

MoETransformer::MoETransformer(const ModelConfig& config, const parallel::ProcessGroups& groups, ModelPart part)
    : config_(config), part_(part), tp_(parallel::TpGroup::dense(groups)) {
  if (part_.endLayer < 0) part_.endLayer = config.layers;
  if (part_.firstLayer < 0 || part_.firstLayer > part_.endLayer || part_.endLayer > config.layers)
    throw ConfigError(fmt::format("model: layers [{}, {}) are not a part of {} layers", part_.firstLayer,
                                  part_.endLayer, config.layers),
                      {.rank = groups.world()->rank()});
  // Untied (the default): unit-size token embeddings, and an output layer
  // that starts at zero, so the first loss is ln(vocab) at any width and the
  // logits grow only as the output layer learns. Tied: one matrix both ways,
  // a copy of it on the last stage (see tiedEmbeddingStd).
  const bool embeds = part_.first || (part_.last && config.tiedEmbedding);
  if (embeds)
    embedding_.emplace(
        "embed", config.vocab, config.hidden, tp_,
        parallel::VocabEmbeddingOptions{.initStd = config.tiedEmbedding ? tiedEmbeddingStd(config.hidden) : 1.0,
                                        .seed = config.seed,
                                        .dtype = config.dtype});
  if (part_.last && !config.tiedEmbedding)
    output_.emplace("output", config.vocab, config.hidden, tp_,
                    parallel::VocabEmbeddingOptions{.initStd = 0, .seed = config.seed, .dtype = config.dtype});
  if (config.heads % tp_.size() != 0 || config.hidden % config.heads != 0) {
    throw ConfigError(fmt::format("model: {} heads of hidden size {} do not split over tp {}", config.heads,
                                  config.hidden, tp_.size()),
                      {.rank = groups.world()->rank(), .expected = "heads a multiple of tp, hidden of heads"});
  }
  const auto device = tp_.comm->device();
  auto normWeight = [&](std::string name) {
    return Norm{std::move(name),
                at::ones({config.hidden}, at::TensorOptions(config.dtype).device(device)).set_requires_grad(true)};
  };
  const double projectionStd = 0.02 / std::sqrt(2.0 * config.layers);
  for (int layer = part_.firstLayer; layer < part_.endLayer; ++layer) {
    const std::string prefix = fmt::format("layers.{}", layer);
    const uint64_t layerSeed = config.seed * 1000 + static_cast<uint64_t>(layer);
    const parallel::ColumnParallelOptions column{.bias = false, .seed = config.seed, .dtype = config.dtype};
    q_.emplace_back(prefix + ".attn.q", config.hidden, config.hidden, tp_, column);
    k_.emplace_back(prefix + ".attn.k", config.hidden, config.hidden, tp_, column);
    v_.emplace_back(prefix + ".attn.v", config.hidden, config.hidden, tp_, column);
    out_.emplace_back(prefix + ".attn.out", config.hidden, config.hidden, tp_,
                      parallel::RowParallelOptions{
                          .bias = false, .initStd = projectionStd, .seed = config.seed, .dtype = config.dtype});
    attentionNorm_.push_back(normWeight(prefix + ".attn_norm.weight"));
    moeNorm_.push_back(normWeight(prefix + ".moe_norm.weight"));
    moe::MoEOptions options{.name = prefix + ".moe",
                            .hidden = config.hidden,
                            .ffnHidden = config.ffn,
                            .router = {.numExperts = config.experts,
                                       .topK = config.topK,
                                       .auxLossCoeff = config.auxLossCoeff,
                                       .zLossCoeff = config.zLossCoeff,
                                       .capacityFactor = config.capacityFactor,
                                       .selectionNoise = config.routerNoise,
                                       .noiseSeed = layerSeed},
                            .oncePerRank = config.oncePerRank,
                            .globalAuxLoss = true,
                            .sharedExpertHidden = config.sharedFfn,
                            .initStd = projectionStd,
                            .seed = layerSeed,
                            .staticShapes = config.staticShapes};
    moe_.push_back(std::make_unique<moe::MoELayer>(options, groups, at::TensorOptions(config.dtype).device(device)));
  }
  if (part_.last) finalNorm_ = normWeight("final_norm.weight");
}

at::Tensor MoETransformer::embeddingWeight() const { return embedding_ ? embedding_->weight() : at::Tensor(); }

at::Tensor MoETransformer::norm(const Norm& n, const at::Tensor& x) const {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  // On a GPU: one fused kernel each way (statistics in float32) instead of
  // five broadcasting passes. The CPU keeps the explicit form.
  if (x.is_cuda()) return at::rms_norm(x, {x.size(-1)}, n.weight, 1e-6);
#endif
  return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * n.weight;
}

at::Tensor MoETransformer::attention(int layer, const at::Tensor& x) const {
  const int64_t batch = x.size(0), sequence = x.size(1);
  const int64_t localHeads = config_.heads / tp_.size(), headDim = config_.hidden / config_.heads;
  auto heads = [&](const at::Tensor& t) { return t.view({batch, sequence, localHeads, headDim}).transpose(1, 2); };
  at::Tensor q = heads(q_[layer].forward(x)), k = heads(k_[layer].forward(x)), v = heads(v_[layer].forward(x));
  at::Tensor mixed;
#if TORCH_VERSION_MAJOR >= 2
  // On a GPU: fused causal attention (flash or memory-efficient kernels), no
  // [sequence x sequence] scores in memory. The CPU keeps the explicit form,
  // whose float64 results do not depend on the libtorch version.
  if (x.is_cuda()) mixed = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#endif
  if (!mixed.defined()) {
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(headDim));
    at::Tensor future = at::ones({sequence, sequence}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    const auto softmaxType = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    mixed = at::matmul(at::softmax(scores, -1, softmaxType).to(x.scalar_type()), v);
  }
  return out_[layer].forward(mixed.transpose(1, 2).reshape({batch, sequence, localHeads * headDim}));
}

ModelOutput MoETransformer::forward(const TokenBatch& batch) { return forwardPart(batch, at::Tensor()); }

ModelOutput MoETransformer::forwardPart(const TokenBatch& batch, const at::Tensor& input) {
  const at::Tensor &ids = batch.ids, &targets = batch.targets;
  at::Tensor x = input;
  if (part_.first) {
    // Token embeddings scaled up to unit size, positions kept smaller, so the
    // token identity is not drowned by the position signal after each norm.
    const at::TensorOptions options = embedding_->weight().options();
    if (!positions_.defined() || positions_.size(0) != ids.size(1) || positions_.options().dtype() != options.dtype() ||
        positions_.device() != options.device())
      positions_ = 0.1 * positions(ids.size(1), config_.hidden, options);
    const double scale = config_.tiedEmbedding ? std::sqrt(static_cast<double>(config_.hidden)) : 1.0;
    x = embedding_->forward(ids) * scale + positions_;
  }
  at::Tensor aux = at::zeros({}, x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  for (size_t i = 0; i < moe_.size(); ++i) {
    x = x + attention(static_cast<int>(i), norm(attentionNorm_[i], x));
    moe::MoEOutput out = moe_[i]->forward(norm(moeNorm_[i], x), batch.keys);
    x = x + out.output;
    aux = aux + out.auxLoss + out.zLoss;
  }
  if (!part_.last) return {x, aux};
  const parallel::VocabParallelEmbedding& output = output_ ? *output_ : *embedding_;
  at::Tensor logits = output.logits(norm(finalNorm_, x));
  at::Tensor losses = parallel::vocabParallelCrossEntropy(logits, targets, output.vocabRange().begin, tp_);
  if (!batch.lossMask.defined()) return {losses.mean(), aux};
  // The mean over the targets that count, as Megatron's per-micro-batch loss (no host read).
  const at::Tensor mask = batch.lossMask.to(losses.scalar_type()).view(losses.sizes());
  return {(losses * mask).sum() / mask.sum().clamp_min(1), aux};
}

double trainingFlopsPerToken(const ModelConfig& c, int64_t sequence) {
  const double h = c.hidden, f = c.ffn, s = static_cast<double>(sequence);
  const double attention = 8 * h * h + 2 * s * h;  // projections; QK^T and AV over half the sequence on average
  const double moe = 2 * h * c.experts + c.topK * 6 * h * f + 6 * h * c.sharedFfn;
  const double output = 2 * h * static_cast<double>(c.vocab);
  return 3 * (c.layers * (attention + moe) + output);
}

// In forward order, which the distributed optimizer's buckets follow backwards.
std::vector<parallel::Parameter> MoETransformer::parameters() const {
  std::vector<parallel::Parameter> all, embedding;
  if (embedding_) {
    for (parallel::Parameter parameter : embedding_->parameters()) {
      if (!part_.first) {  // the last stage's copy: the first stage's is saved and counted
        parameter.pipelineCopy = true;
        parameter.shard.replicaId += 1 << 16;
      }
      embedding.push_back(std::move(parameter));
    }
  }
  auto append = [&](std::vector<parallel::Parameter> more) { all.insert(all.end(), more.begin(), more.end()); };
  if (part_.first) append(embedding);
  auto appendNorm = [&](const Norm& n) {
    all.push_back({.name = n.name,
                   .tensor = n.weight,
                   .shard = parallel::ShardInfo::whole(n.weight.sizes(), tp_.replicaId(true)),
                   .group = parallel::ParamGroup::Dense,
                   .tpReplicated = true});
  };
  for (size_t layer = 0; layer < moe_.size(); ++layer) {
    appendNorm(attentionNorm_[layer]);
    append(q_[layer].parameters());
    append(k_[layer].parameters());
    append(v_[layer].parameters());
    append(out_[layer].parameters());
    appendNorm(moeNorm_[layer]);
    append(moe_[layer]->parameters());
  }
  if (part_.last) appendNorm(finalNorm_);
  if (output_) append(output_->parameters());
  if (!part_.first) append(embedding);  // the tied copy, the last stage's output layer
  return all;
}

std::vector<parallel::ShardedTensor> MoETransformer::buffers() const {
  std::vector<parallel::ShardedTensor> all;
  for (const auto& layer : moe_) {
    const at::Tensor& bias = layer->router().bias();
    all.push_back(
        {layer->options().name + ".router.bias", bias, parallel::ShardInfo::whole(bias.sizes(), tp_.replicaId(true))});
  }
  return all;
}

}  // namespace bulkhead::examples
