#include "parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include "parallel/process_groups.h"
#include "parallel/tensor_parallel_detail.h"
#include "runtime/env.h"
#include "runtime/errors.h"

namespace bulkhead::parallel {

TpGroup TpGroup::dense(const ProcessGroups& groups, std::optional<std::chrono::milliseconds> timeout) {
  return {.comm = groups.tp(), .dpReplica = groups.dpCp()->rank(), .timeout = timeout};
}

TpGroup TpGroup::expert(const ProcessGroups& groups, std::optional<std::chrono::milliseconds> timeout) {
  return {.comm = groups.expertTp(),
          .dpReplica = groups.expertDp()->rank(),
          .timeout = timeout,
          .paramGroup = ParamGroup::Expert};
}

Deadline TpGroup::deadline() const { return collectiveDeadline(timeout); }

void refuseDoubleBackward(const char* what) {
  // The engine runs a backward with grad mode on exactly when the caller asked
  // for a graph of the gradients.
  if (c10::GradMode::is_enabled())
    throw ConfigError(fmt::format("{}: no double backward (create_graph): its gradients carry no graph, so "
                                  "second-order terms would be silently left out",
                                  what),
                      {.expected = "a first-order backward"});
}

Deadline collectiveDeadline(std::optional<std::chrono::milliseconds> timeout) {
  if (timeout) return Deadline::after(*timeout);
  return Deadline::afterSeconds(env::kCollectiveTimeout.seconds());
}

namespace detail {

namespace {
// The group rides in the autograd context (which holds only IValues) as a capsule.
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(TpGroup g) : group(std::move(g)) {}
  TpGroup group;
};
}  // namespace

c10::IValue holdGroup(const TpGroup& group) {
  return c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
}

TpGroup heldGroup(const c10::IValue& value) {
  auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(value.toCapsule());
  return holder->group;
}

void checkDevice(const at::Tensor& tensor, const TpGroup& group, const char* what) {
  if (tensor.device() != group.comm->device())
    throw ConfigError(
        fmt::format("{}: the tensor is on {} but tp group {} runs on {}; move it to the group's device", what,
                    tensor.device().str(), group.comm->name(), group.comm->device().str()),
        {.rank = group.comm->rank(), .group = group.comm->name(), .expected = group.comm->device().str()});
}

at::Tensor allReduce(at::Tensor tensor, const TpGroup& group, ReduceOp op) {
  at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  Deadline deadline = group.deadline();
  group.comm->allReduce(buffer, {.op = op, .deadline = deadline})->wait(deadline);
  return buffer;
}

at::Tensor allGatherLastDim(const at::Tensor& input, const TpGroup& group) {
  at::Tensor source = input.contiguous();
  std::vector<int64_t> shape{group.size()};
  shape.insert(shape.end(), source.sizes().begin(), source.sizes().end());
  at::Tensor gathered = at::empty(shape, source.options());
  Deadline deadline = group.deadline();
  group.comm->allGather(source, gathered, {.deadline = deadline})->wait(deadline);
  // [tp, ..., n] -> [..., tp, n] -> [..., tp * n]: rank r's block at r.
  std::vector<int64_t> outShape = source.sizes().vec();
  outShape.back() *= group.size();
  return gathered.movedim(0, -2).reshape(outShape);
}

at::Tensor ownBlockLastDim(const at::Tensor& input, const TpGroup& group) {
  int64_t width = input.size(-1);
  if (width % group.size() != 0)
    throw ConfigError(fmt::format("scatterToTensorParallel: the last dimension ({}) is not divisible by the tp size {}",
                                  width, group.size()),
                      {.rank = group.rank(), .group = group.comm->name(), .expected = "divisible last dimension"});
  int64_t block = width / group.size();
  return input.narrow(-1, block * group.rank(), block).contiguous();
}

}  // namespace detail

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TpGroup& group) {
    ctx->saved_data["group"] = detail::holdGroup(group);
    return input;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuseDoubleBackward("copyToTensorParallel");
    TpGroup group = detail::heldGroup(ctx->saved_data["group"]);
    return {detail::allReduce(grads[0].clone(at::MemoryFormat::Contiguous), group), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& input, const TpGroup& group) {
    return detail::allReduce(input.clone(at::MemoryFormat::Contiguous), group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct GatherFromTp : torch::autograd::Function<GatherFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TpGroup& group) {
    ctx->saved_data["group"] = detail::holdGroup(group);
    return detail::allGatherLastDim(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TpGroup group = detail::heldGroup(ctx->saved_data["group"]);
    return {detail::ownBlockLastDim(grads[0], group), at::Tensor()};
  }
};

struct ScatterToTp : torch::autograd::Function<ScatterToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TpGroup& group) {
    ctx->saved_data["group"] = detail::holdGroup(group);
    return detail::ownBlockLastDim(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuseDoubleBackward("scatterToTensorParallel");
    TpGroup group = detail::heldGroup(ctx->saved_data["group"]);
    return {detail::allGatherLastDim(grads[0], group), at::Tensor()};
  }
};

}  // namespace

at::Tensor copyToTensorParallel(const at::Tensor& input, const TpGroup& group) {
  if (group.size() == 1) return input;
  detail::checkDevice(input, group, "copyToTensorParallel");
  return CopyToTp::apply(input, group);
}

at::Tensor reduceFromTensorParallel(const at::Tensor& input, const TpGroup& group) {
  if (group.size() == 1) return input;
  detail::checkDevice(input, group, "reduceFromTensorParallel");
  return ReduceFromTp::apply(input, group);
}

at::Tensor gatherFromTensorParallel(const at::Tensor& input, const TpGroup& group) {
  if (group.size() == 1) return input;
  detail::checkDevice(input, group, "gatherFromTensorParallel");
  return GatherFromTp::apply(input, group);
}

at::Tensor scatterToTensorParallel(const at::Tensor& input, const TpGroup& group) {
  if (group.size() == 1) return input;
  detail::checkDevice(input, group, "scatterToTensorParallel");
  return ScatterToTp::apply(input, group);
}

}  // namespace bulkhead::parallel
