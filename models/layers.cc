#include "models/layers.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

#include "parallel/shard_init.h"
#include "runtime/errors.h"

namespace bulkhead::models {

at::ScalarType internalType(at::ScalarType model, bool float32Internals) {
  return float32Internals ? at::kFloat : at::promoteTypes(model, at::kFloat);
}

at::Tensor rmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType compute) {
  const at::Tensor h = x.to(compute);
  const at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (h * at::rsqrt(variance + eps)).to(x.scalar_type());
}

parallel::Parameter NormWeight::parameter(const parallel::TpGroup& tp) const {
  return {.name = name,
          .tensor = weight,
          .shard = parallel::ShardInfo::whole(weight.sizes(), tp.replicaId(true)),
          .group = parallel::ParamGroup::Dense,
          .tpReplicated = true};
}

NormWeight normWeight(std::string name, int64_t size, const at::TensorOptions& options) {
  return {std::move(name), at::ones({size}, options).set_requires_grad(true)};
}

void Rope::refresh(int64_t sequence, const at::TensorOptions& options) const {
  if (cos_.defined() && cos_.size(0) == sequence && cos_.scalar_type() == options.dtype().toScalarType() &&
      cos_.device() == options.device())
    return;
  // As transformers computes them: float32 inverse frequencies 1 / theta^(2i / d), float32 angles and
  // their cos and sin, then cast to the model's dtype.
  const at::ScalarType compute = internalType(options.dtype().toScalarType(), float32_);
  const at::Tensor exponents = at::arange(0, headDim_, 2, at::TensorOptions(at::kLong)).to(compute) / headDim_;
  const at::Tensor inverse = at::reciprocal(at::pow(theta_, exponents));
  const at::Tensor positions = at::arange(sequence, at::TensorOptions(at::kLong)).to(compute);
  const at::Tensor angles = at::matmul(inverse.unsqueeze(1), positions.unsqueeze(0)).t();  // [sequence, d / 2]
  const at::Tensor both = at::cat({angles, angles}, -1);
  cos_ = both.cos().to(options);
  sin_ = both.sin().to(options);
}

void Rope::apply(at::Tensor& q, at::Tensor& k) const {
  refresh(q.size(2), q.options());
  auto rotate = [&](const at::Tensor& x) {
    const int64_t half = x.size(-1) / 2;
    const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
    return x * cos_ + rotated * sin_;
  };
  q = rotate(q);
  k = rotate(k);
}

KvProjection::KvProjection(const std::string& name, const DecoderConfig& config, const parallel::TpGroup& tp,
                           const LayerInit& init)
    : tp_(tp), name_(name) {
  const int64_t rows = static_cast<int64_t>(config.kvHeads) * config.headDim;
  if (config.kvHeads % tp.size() == 0) {
    split_.emplace(name, config.hidden, rows, tp,
                   parallel::ColumnParallelOptions{
                       .bias = config.attentionBias, .initStd = init.initStd, .seed = init.seed, .dtype = init.dtype});
    localHeads_ = config.kvHeads / tp.size();
    return;
  }
  if (tp.size() % config.kvHeads != 0 || config.heads % tp.size() != 0)
    throw ConfigError(
        fmt::format("{}: {} kv heads neither split over tp {} nor replicate evenly across it", name, config.kvHeads,
                    tp.size()),
        {.rank = tp.rank(), .group = tp.comm->name(), .expected = "tp a divisor or a multiple of the kv heads"});
  // Each kv head serves tp / kvHeads consecutive tp ranks.
  localHeads_ = 1;
  rowBegin_ = static_cast<int64_t>(tp.rank() / (tp.size() / config.kvHeads)) * config.headDim;
  rows_ = config.headDim;
  const auto options = at::TensorOptions(init.dtype).device(tp.comm->device());
  weight_ = parallel::newParameterTensor(name + ".weight", init.seed, parallel::ShardInfo::whole({rows, config.hidden}),
                                         {rows, config.hidden}, init.initStd, options);
  if (config.attentionBias)
    bias_ = parallel::newParameterTensor(name + ".bias", init.seed, parallel::ShardInfo::whole({rows}), {rows}, 0.0,
                                         options);
}

at::Tensor KvProjection::forward(const at::Tensor& x) const {
  if (split_) return split_->forward(x);
  // The whole projection's gradient is summed over tp, where each rank adds its kv head's share.
  const at::Tensor weight = parallel::copyToTensorParallel(weight_, tp_).narrow(0, rowBegin_, rows_);
  const at::Tensor bias =
      bias_.defined() ? parallel::copyToTensorParallel(bias_, tp_).narrow(0, rowBegin_, rows_) : at::Tensor();
  return at::linear(parallel::copyToTensorParallel(x, tp_), weight, bias);
}

std::vector<parallel::Parameter> KvProjection::parameters() const {
  if (split_) return split_->parameters();
  std::vector<parallel::Parameter> params;
  for (const auto& [suffix, tensor] : {std::pair{".weight", weight_}, std::pair{".bias", bias_}}) {
    if (!tensor.defined()) continue;
    params.push_back({.name = name_ + suffix,
                      .tensor = tensor,
                      .shard = parallel::ShardInfo::whole(tensor.sizes(), tp_.replicaId(true)),
                      .group = parallel::ParamGroup::Dense,
                      .tpReplicated = true});
  }
  return params;
}

namespace {

int localHeadsOf(const std::string& prefix, const DecoderConfig& config, const parallel::TpGroup& tp) {
  if (config.heads % tp.size() != 0)
    throw ConfigError(
        fmt::format("{}: {} attention heads do not split over tp {}", prefix, config.heads, tp.size()),
        {.rank = tp.rank(), .group = tp.comm->name(), .expected = "num_attention_heads a multiple of tp"});
  return config.heads / tp.size();
}

parallel::ColumnParallelOptions column(bool bias, const LayerInit& init) {
  return {.bias = bias, .initStd = init.initStd, .seed = init.seed, .dtype = init.dtype};
}

parallel::RowParallelOptions row(bool bias, const LayerInit& init, double std) {
  return {.bias = bias, .initStd = std, .seed = init.seed, .dtype = init.dtype};
}

}  // namespace

Attention::Attention(const std::string& prefix, const DecoderConfig& config, const parallel::TpGroup& tp,
                     const LayerInit& init)
    : tp_(tp),
      headDim_(config.headDim),
      eps_(config.rmsEps),
      float32Internals_(init.float32Internals),
      localHeads_(localHeadsOf(prefix, config, tp)),
      q_(prefix + ".q_proj", config.hidden, config.heads * config.headDim, tp, column(config.attentionBias, init)),
      k_(prefix + ".k_proj", config, tp, init),
      v_(prefix + ".v_proj", config, tp, init),
      o_(prefix + ".o_proj", config.heads * config.headDim, config.hidden, tp,
         row(config.attentionBias, init, init.initStd / std::sqrt(2.0 * config.layers))) {
  if (config.qkNorm) {
    const auto options = at::TensorOptions(init.dtype).device(tp.comm->device());
    qNorm_ = normWeight(prefix + ".q_norm.weight", config.headDim, options);
    kNorm_ = normWeight(prefix + ".k_norm.weight", config.headDim, options);
  }
}

at::Tensor Attention::forward(const at::Tensor& x, const Rope& rope) const {
  const int64_t batch = x.size(0), sequence = x.size(1);
  const at::ScalarType compute = internalType(x.scalar_type(), float32Internals_);
  auto heads = [&](const at::Tensor& t, const std::optional<NormWeight>& norm) {
    at::Tensor h = t.view({batch, sequence, -1, headDim_});
    if (norm) h = rmsNorm(h, parallel::copyToTensorParallel(norm->weight, tp_), eps_, compute);
    return h.transpose(1, 2);
  };
  at::Tensor q = heads(q_.forward(x), qNorm_), k = heads(k_.forward(x), kNorm_), v = heads(v_.forward(x), {});
  rope.apply(q, k);
  const int64_t repeat = localHeads_ / k_.localHeads();
  auto repeated = [&](const at::Tensor& t) {
    if (repeat == 1) return t;
    return t.unsqueeze(2)
        .expand({batch, t.size(1), repeat, sequence, headDim_})
        .reshape({batch, localHeads_, sequence, headDim_});
  };
  k = repeated(k);
  v = repeated(v);
  at::Tensor mixed;
#if TORCH_VERSION_MAJOR >= 2
  // On a GPU: fused causal attention. The CPU keeps transformers' eager form.
  if (x.is_cuda() && x.scalar_type() != at::kDouble)
    mixed = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#endif
  if (!mixed.defined()) {
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) * std::pow(static_cast<double>(headDim_), -0.5);
    const at::Tensor future = at::ones({sequence, sequence}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    mixed = at::matmul(at::softmax(scores, -1, compute).to(x.scalar_type()), v);
  }
  return o_.forward(mixed.transpose(1, 2).reshape({batch, sequence, localHeads_ * headDim_}));
}

std::vector<parallel::Parameter> Attention::parameters() const {
  std::vector<parallel::Parameter> all;
  auto append = [&](std::vector<parallel::Parameter> more) { all.insert(all.end(), more.begin(), more.end()); };
  append(q_.parameters());
  append(k_.parameters());
  append(v_.parameters());
  append(o_.parameters());
  if (qNorm_) all.push_back(qNorm_->parameter(tp_));
  if (kNorm_) all.push_back(kNorm_->parameter(tp_));
  return all;
}

DenseMlp::DenseMlp(const std::string& prefix, int64_t hidden, int64_t intermediate, const parallel::TpGroup& tp,
                   const LayerInit& init)
    : gate_(prefix + ".gate_proj", hidden, intermediate, tp, column(false, init)),
      up_(prefix + ".up_proj", hidden, intermediate, tp, column(false, init)),
      down_(prefix + ".down_proj", intermediate, hidden, tp, row(false, init, init.initStd)) {}

at::Tensor DenseMlp::forward(const at::Tensor& x) const {
  return down_.forward(at::silu(gate_.forward(x)) * up_.forward(x));
}

std::vector<parallel::Parameter> DenseMlp::parameters() const {
  std::vector<parallel::Parameter> all = gate_.parameters();
  for (auto& p : up_.parameters()) all.push_back(p);
  for (auto& p : down_.parameters()) all.push_back(p);
  return all;
}

}  // namespace bulkhead::models
