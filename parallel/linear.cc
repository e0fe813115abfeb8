#include "parallel/linear.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "parallel/shard_init.h"
#include "runtime/errors.h"

namespace bulkhead::parallel {
namespace {

int64_t blockOf(int64_t features, const TpGroup& group, const std::string& name, const char* what) {
  if (features <= 0 || features % group.size() != 0)
    throw ConfigError(
        fmt::format("{}: {} ({}) must be positive and divisible by the tp size {}", name, what, features, group.size()),
        {.rank = group.rank(), .group = group.comm->name(), .expected = "divisible by tp"});
  return features / group.size();
}

at::TensorOptions optionsFor(const TpGroup& group, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(group.comm->device());
}

}  // namespace

ColumnParallelLinear::ColumnParallelLinear(std::string name, int64_t inFeatures, int64_t outFeatures, TpGroup group,
                                           ColumnParallelOptions options)
    : name_(std::move(name)), group_(std::move(group)), options_(options), in_(inFeatures), out_(outFeatures) {
  int64_t block = blockOf(out_, group_, name_, "output features");
  if (in_ <= 0) throw ConfigError(fmt::format("{}: input features must be positive, got {}", name_, in_));
  outBegin_ = block * group_.rank();
  auto tensorOptions = optionsFor(group_, options_.dtype);
  weight_ = newParameterTensor(name_ + ".weight", options_.seed, {{out_, in_}, {outBegin_, 0}}, {block, in_},
                               options_.initStd, tensorOptions);
  if (options_.bias)
    bias_ = newParameterTensor(name_ + ".bias", options_.seed, {{out_}, {outBegin_}}, {block}, 0.0, tensorOptions);
}

at::Tensor ColumnParallelLinear::forward(const at::Tensor& input) const {
  at::Tensor output = at::linear(copyToTensorParallel(input, group_), weight_, bias_);
  return options_.gatherOutput ? gatherFromTensorParallel(output, group_) : output;
}

std::vector<Parameter> ColumnParallelLinear::parameters() const {
  std::vector<Parameter> params;
  params.push_back({.name = name_ + ".weight",
                    .tensor = weight_,
                    .shard = {{out_, in_}, {outBegin_, 0}, group_.replicaId(false)},
                    .group = group_.paramGroup});
  if (bias_.defined())
    params.push_back({.name = name_ + ".bias",
                      .tensor = bias_,
                      .shard = {{out_}, {outBegin_}, group_.replicaId(false)},
                      .group = group_.paramGroup});
  return params;
}

RowParallelLinear::RowParallelLinear(std::string name, int64_t inFeatures, int64_t outFeatures, TpGroup group,
                                     RowParallelOptions options)
    : name_(std::move(name)), group_(std::move(group)), options_(options), in_(inFeatures), out_(outFeatures) {
  int64_t block = blockOf(in_, group_, name_, "input features");
  if (out_ <= 0) throw ConfigError(fmt::format("{}: output features must be positive, got {}", name_, out_));
  inBegin_ = block * group_.rank();
  auto tensorOptions = optionsFor(group_, options_.dtype);
  weight_ = newParameterTensor(name_ + ".weight", options_.seed, {{out_, in_}, {0, inBegin_}}, {out_, block},
                               options_.initStd, tensorOptions);
  if (options_.bias)
    bias_ = newParameterTensor(name_ + ".bias", options_.seed, ShardInfo::whole({out_}), {out_}, 0.0, tensorOptions);
}

at::Tensor RowParallelLinear::forward(const at::Tensor& input) const {
  at::Tensor local = options_.inputIsParallel ? input : scatterToTensorParallel(input, group_);
  at::Tensor output = reduceFromTensorParallel(at::linear(local, weight_), group_);
  // The bias is added once, after the sum over tp.
  return bias_.defined() ? output + bias_ : output;
}

std::vector<Parameter> RowParallelLinear::parameters() const {
  std::vector<Parameter> params;
  params.push_back({.name = name_ + ".weight",
                    .tensor = weight_,
                    .shard = {{out_, in_}, {0, inBegin_}, group_.replicaId(false)},
                    .group = group_.paramGroup});
  if (bias_.defined())
    params.push_back({.name = name_ + ".bias",
                      .tensor = bias_,
                      .shard = ShardInfo::whole({out_}, group_.replicaId(true)),
                      .group = group_.paramGroup,
                      .tpReplicated = true});
  return params;
}

}  // namespace bulkhead::parallel
