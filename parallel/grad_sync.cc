#include "parallel/grad_sync.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>
#include <utility>

#include "parallel/process_groups.h"
#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::parallel {

int64_t gradientDivisor(const ProcessGroups& groups) { return groups.dpCp()->size(); }

namespace {

struct Bucket {
  CommunicatorPtr comm;
  int64_t divisor = 1;
  std::vector<at::Tensor> grads;
  int64_t bytes = 0;
  at::Tensor flat;
  WorkPtr work;
};

// bf16 and fp16 gradients are summed in float32, as the distributed optimizer
// sums them: in their own 8 or 11 bits of mantissa every addition rounds, and
// the error grows with the number of replicas.
at::ScalarType reductionType(at::ScalarType gradType) {
  return gradType == at::kBFloat16 || gradType == at::kHalf ? at::kFloat : gradType;
}

}  // namespace

void syncGradients(const std::vector<Parameter>& params, const ProcessGroups& groups, GradSyncOptions options) {
  Deadline deadline = options.deadline.value_or(collectiveDeadline(std::nullopt));
  int64_t divisor = gradientDivisor(groups);

  // Buckets per (group, dtype), each filled in the callers' parameter order.
  std::map<std::pair<int, int>, std::vector<Bucket>> buckets;
  for (const Parameter& param : params) {
    at::Tensor& grad = param.tensor.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(param.tensor, at::MemoryFormat::Contiguous);
    bool expert = param.group == ParamGroup::Expert;
    const CommunicatorPtr& comm = expert ? groups.expertDp() : groups.dpCp();
    if (grad.device() != comm->device())
      throw ConfigError(fmt::format("syncGradients: the gradient of {} must be on {} (it is on {})", param.name,
                                    comm->device().str(), grad.device().str()),
                        {.rank = comm->rank(), .group = comm->name(), .expected = "gradients on the device"});
    auto& list = buckets[{expert ? 1 : 0, static_cast<int>(grad.scalar_type())}];
    int64_t bytes = grad.numel() * static_cast<int64_t>(grad.element_size());
    if (list.empty() || (list.back().bytes > 0 && list.back().bytes + bytes > options.bucketBytes))
      list.push_back({.comm = comm, .divisor = expert ? options.expertDivisor.value_or(divisor) : divisor});
    list.back().grads.push_back(grad);
    list.back().bytes += bytes;
  }

  for (auto& [key, list] : buckets) {
    for (Bucket& bucket : list) {
      const at::Tensor& first = bucket.grads.front();
      int64_t elements = 0;
      for (const at::Tensor& grad : bucket.grads) elements += grad.numel();
      bucket.flat = at::empty({elements}, first.options().dtype(reductionType(first.scalar_type())));
      int64_t offset = 0;
      for (const at::Tensor& grad : bucket.grads) {
        bucket.flat.narrow(0, offset, grad.numel()).copy_(grad.reshape({-1}));
        offset += grad.numel();
      }
      if (bucket.comm->size() > 1)
        bucket.work = bucket.comm->allReduce(bucket.flat, {.op = ReduceOp::Sum, .deadline = deadline});
    }
  }
  for (auto& [key, list] : buckets) {
    for (Bucket& bucket : list) {
      if (bucket.work) bucket.work->wait(deadline);
      if (bucket.divisor != 1) bucket.flat.div_(bucket.divisor);
      int64_t offset = 0;
      for (at::Tensor& grad : bucket.grads) {
        grad.copy_(bucket.flat.narrow(0, offset, grad.numel()).view(grad.sizes()));
        offset += grad.numel();
      }
    }
  }
}

}  // namespace bulkhead::parallel
