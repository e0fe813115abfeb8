#include "optim/adamw.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <cmath>

#include "optim/parameter_checks.h"
#include "runtime/errors.h"

namespace bulkhead::optim {

at::ScalarType masterType(at::ScalarType paramType) {
  return (paramType == at::kBFloat16 || paramType == at::kHalf) ? at::kFloat : paramType;
}

at::ScalarType momentTypeFor(at::ScalarType master, const AdamWOptions& options) {
  if (options.momentType != at::kFloat && options.momentType != at::kBFloat16)
    throw ConfigError(fmt::format("AdamW: moments of dtype {} are not kept", c10::toString(options.momentType)),
                      {.expected = "AdamWOptions::momentType float32 or bfloat16"});
  return master == at::kFloat ? options.momentType : master;
}

double weightDecayFor(const parallel::Parameter& param, const AdamWOptions& options) {
  const bool decays = options.decays ? options.decays(param) : param.shard.globalShape.size() >= 2;
  return decays ? options.weightDecay : 0.0;
}

void adamwUpdate(at::Tensor master, const at::Tensor& grad, at::Tensor expAvg, at::Tensor expAvgSq, int64_t step,
                 double lr, double weightDecay, const AdamWOptions& options) {
  c10::NoGradGuard noGrad;
  const at::ScalarType type = master.scalar_type();
  at::Tensor g = grad.to(type).reshape(master.sizes());
  // Moments kept in another dtype are updated in the master's, rounded back once.
  at::Tensor m = expAvg.scalar_type() == type ? expAvg : expAvg.to(type);
  at::Tensor v = expAvgSq.scalar_type() == type ? expAvgSq : expAvgSq.to(type);
  if (weightDecay != 0.0) master.mul_(1.0 - lr * weightDecay);
  m.mul_(options.beta1).add_(g, 1.0 - options.beta1);
  v.mul_(options.beta2).addcmul_(g, g, 1.0 - options.beta2);
  double correction1 = 1.0 - std::pow(options.beta1, static_cast<double>(step));
  double correction2 = 1.0 - std::pow(options.beta2, static_cast<double>(step));
  at::Tensor denominator = v.sqrt().div_(std::sqrt(correction2)).add_(options.eps);
  master.addcdiv_(m, denominator, -lr / correction1);
  if (!m.is_same(expAvg)) expAvg.copy_(m);
  if (!v.is_same(expAvgSq)) expAvgSq.copy_(v);
}

AdamW::AdamW(std::vector<parallel::Parameter> params, AdamWOptions options, int worldRank)
    : params_(std::move(params)), options_(std::move(options)), worldRank_(worldRank) {
  c10::NoGradGuard noGrad;
  if (!params_.empty()) detail::checkParameters(params_, params_.front().tensor.device(), worldRank_, "AdamW");
  for (const parallel::Parameter& param : params_) {
    at::ScalarType type = masterType(param.tensor.scalar_type());
    at::Tensor master = type == param.tensor.scalar_type() ? param.tensor.detach() : param.tensor.detach().to(type);
    masters_.push_back(master);
    const at::ScalarType moments = momentTypeFor(type, options_);
    expAvg_.push_back(at::zeros_like(master, moments));
    expAvgSq_.push_back(at::zeros_like(master, moments));
    decay_.push_back(weightDecayFor(param, options_));
  }
  stepTensor_ = at::zeros({1}, at::kLong);
}

void AdamW::step(double lr) {
  c10::NoGradGuard noGrad;
  ++step_;
  stepTensor_.fill_(step_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& tensor = params_[i].tensor;
    at::Tensor grad = tensor.grad().defined() ? tensor.grad() : at::zeros_like(masters_[i]);
    adamwUpdate(masters_[i], grad, expAvg_[i], expAvgSq_[i], step_, lr, decay_[i], options_);
    if (masters_[i].scalar_type() != tensor.scalar_type()) tensor.detach().copy_(masters_[i]);
  }
}

void AdamW::zeroGrad() {
  for (const parallel::Parameter& param : params_) param.tensor.mutable_grad() = at::Tensor();
}

std::vector<parallel::ShardedTensor> AdamW::state() {
  std::vector<parallel::ShardedTensor> state;
  for (size_t i = 0; i < params_.size(); ++i) {
    const parallel::Parameter& param = params_[i];
    std::string prefix = "optim." + param.name;
    if (masters_[i].scalar_type() != param.tensor.scalar_type())
      state.push_back({prefix + ".master", masters_[i], param.shard});
    state.push_back({prefix + ".exp_avg", expAvg_[i], param.shard});
    state.push_back({prefix + ".exp_avg_sq", expAvgSq_[i], param.shard});
  }
  state.push_back({"optim.step", stepTensor_, {{1}, {0}, worldRank_}});
  return state;
}

void AdamW::afterLoad() {
  step_ = stepTensor_.item<int64_t>();
  if (step_ < 0)
    throw CheckpointError(fmt::format("AdamW: the loaded optim.step is {}; a step count cannot be negative", step_),
                          {.rank = worldRank_, .expected = "optim.step >= 0"});
}

}  // namespace bulkhead::optim
