#include "optim/clip.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "parallel/process_groups.h"
#include "parallel/tensor_parallel.h"

namespace bulkhead::optim {

double clipScale(double norm, double maxNorm) {
  return maxNorm > 0.0 && norm > maxNorm ? maxNorm / (norm + 1e-6) : 1.0;
}

bool countsOnThisTpRank(const parallel::Parameter& param, const parallel::ProcessGroups& groups) {
  if (param.pipelineCopy) return false;
  if (!param.tpReplicated) return true;
  const CommunicatorPtr& tp = param.group == parallel::ParamGroup::Expert ? groups.expertTp() : groups.tp();
  return tp->rank() == 0;
}

void addSquares(at::Tensor& total, const at::Tensor& values) {
  if (values.numel() == 0) return;
  // float64 stays exact; other dtypes square in float32 and sum in float64.
  at::Tensor x = values.scalar_type() == at::kDouble ? values : values.to(at::kFloat);
  total.add_(x.square().sum(at::kDouble));
}

double worldNorm(at::Tensor partial, const parallel::ProcessGroups& groups, Deadline deadline) {
  const CommunicatorPtr& world = groups.world();
  at::Tensor sum = partial.reshape({1}).to(world->device(), at::kDouble).contiguous();
  if (world->size() > 1) world->allReduce(sum, {.op = ReduceOp::Sum, .deadline = deadline})->wait(deadline);
  return std::sqrt(sum.item<double>());
}

double clipGradNorm(const std::vector<parallel::Parameter>& params, const parallel::ProcessGroups& groups,
                    double maxNorm, ClipOptions options) {
  c10::NoGradGuard noGrad;
  Deadline deadline = options.deadline.value_or(parallel::collectiveDeadline(std::nullopt));
  at::Tensor total = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(groups.world()->device()));
  for (const parallel::Parameter& param : params) {
    const at::Tensor& grad = param.tensor.grad();
    if (!grad.defined()) continue;
    bool expert = param.group == parallel::ParamGroup::Expert;
    bool firstReplica = (expert ? groups.expertDp() : groups.dpCp())->rank() == 0;
    if (firstReplica && countsOnThisTpRank(param, groups)) addSquares(total, grad);
  }
  double norm = worldNorm(total, groups, deadline);
  if (!std::isfinite(norm)) return norm;  // nothing to scale by: the caller skips the step
  double scale = clipScale(norm, maxNorm);
  if (scale < 1.0)
    for (const parallel::Parameter& param : params)
      if (param.tensor.grad().defined()) param.tensor.mutable_grad().mul_(scale);
  return norm;
}

}  // namespace bulkhead::optim
