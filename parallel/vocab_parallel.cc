#include "parallel/vocab_parallel.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/custom_function.h>

#include "parallel/tensor_parallel_detail.h"
#include "runtime/errors.h"

#if BULKHEAD_PARALLEL_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "parallel/cuda/cross_entropy_kernels.h"
#endif

namespace bulkhead::parallel {

VocabParallelEmbedding::VocabParallelEmbedding(std::string name, int64_t vocabSize, int64_t dim, TpGroup group,
                                               VocabEmbeddingOptions options)
    : name_(std::move(name)), group_(std::move(group)), vocab_(vocabSize), dim_(dim) {
  if (vocab_ < group_.size() || dim_ <= 0)
    throw ConfigError(fmt::format("{}: a vocabulary of {} over tp {} with dimension {}: every tp rank needs at least "
                                  "one row and the dimension must be positive",
                                  name_, vocab_, group_.size(), dim_),
                      {.rank = group_.rank(), .group = group_.comm->name(), .expected = "vocab >= tp, dim > 0"});
  rows_ = partition(vocab_, group_.size(), group_.rank());
  weight_ =
      newParameterTensor(name_ + ".weight", options.seed, {{vocab_, dim_}, {rows_.begin, 0}}, {rows_.length, dim_},
                         options.initStd, at::TensorOptions().dtype(options.dtype).device(group_.comm->device()));
}

at::Tensor VocabParallelEmbedding::forward(const at::Tensor& ids) const {
  if (group_.size() == 1) return at::embedding(weight_, ids);
  at::Tensor outside = (ids < rows_.begin).logical_or(ids >= rows_.begin + rows_.length);
  at::Tensor local = (ids - rows_.begin).masked_fill(outside, 0);
  at::Tensor partial = at::embedding(weight_, local).masked_fill(outside.unsqueeze(-1), 0);
  return reduceFromTensorParallel(partial, group_);
}

at::Tensor VocabParallelEmbedding::logits(const at::Tensor& hidden) const {
  return at::linear(copyToTensorParallel(hidden, group_), weight_);
}

std::vector<Parameter> VocabParallelEmbedding::parameters() const {
  return {{.name = name_ + ".weight",
           .tensor = weight_,
           .shard = {{vocab_, dim_}, {rows_.begin, 0}, group_.replicaId(false)},
           .group = group_.paramGroup}};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Half-precision logits are reduced in float32.
at::ScalarType computeType(at::ScalarType dtype) {
  return (dtype == at::kHalf || dtype == at::kBFloat16) ? at::kFloat : dtype;
}

struct VocabCrossEntropy : torch::autograd::Function<VocabCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocabBegin, const TpGroup& group) {
    int64_t width = logits.size(-1);
    at::Tensor x = logits.to(computeType(logits.scalar_type())).reshape({-1, width});
    at::Tensor t = targets.reshape({-1}).to(at::kLong);
    bool split = group.size() > 1;

    // Shift by the global maximum so exp() cannot overflow.
    at::Tensor max = std::get<0>(x.max(1));
    if (split) max = detail::allReduce(max, group, ReduceOp::Max);
    at::Tensor shifted = x - max.unsqueeze(1);

    // The target's logit lives on one rank; the others contribute zero.
    at::Tensor inside = (t >= vocabBegin).logical_and(t < vocabBegin + width);
    at::Tensor column = (t - vocabBegin).masked_fill(inside.logical_not(), 0);
    at::Tensor targetLogit = shifted.gather(1, column.unsqueeze(1)).squeeze(1).masked_fill(inside.logical_not(), 0);
    at::Tensor exps = shifted.exp();
    at::Tensor sums = at::stack({targetLogit, exps.sum(1)});  // one all-reduce for both
    if (split) sums = detail::allReduce(sums, group);
    at::Tensor sumExp = sums[1];

    at::Tensor softmax = exps.div_(sumExp.unsqueeze(1));
    ctx->save_for_backward({softmax, column, inside});
    ctx->saved_data["shape"] = logits.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return (sumExp.log() - sums[0]).reshape(targets.sizes()).to(logits.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuseDoubleBackward("vocabParallelCrossEntropy");  // the closed form below has no graph in the logits
    auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& column = saved[1];
    const at::Tensor& inside = saved[2];
    at::Tensor g = grads[0].reshape({-1}).to(softmax.scalar_type());
    // d loss / d logits = softmax - onehot(target), on the rank holding the target.
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, column.unsqueeze(1), inside.to(grad.scalar_type()).neg().unsqueeze(1));
    grad.mul_(g.unsqueeze(1));
    auto shape = ctx->saved_data["shape"].toIntVector();
    auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.reshape(shape).to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

#if BULKHEAD_PARALLEL_KERNELS
cuda::CrossEntropyArgs kernelArgs(const at::Tensor& rows, const at::Tensor& column) {
  return {.type = rows.scalar_type() == at::kBFloat16 ? cuda::LogitsType::BFloat16 : cuda::LogitsType::Float16,
          .rows = rows.size(0),
          .width = rows.size(1),
          .column = column.data_ptr<int64_t>(),
          .stream = c10::cuda::getCurrentCUDAStream(rows.device().index()).stream()};
}

// Half-precision logits on a GPU take the kernels, which read them in place: one pass for the forward's
// row statistics, one for the gradient, no float32 copy of the logits and nothing of their size saved
// but the logits themselves.
struct FusedVocabCrossEntropy : torch::autograd::Function<FusedVocabCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocabBegin, const TpGroup& group) {
    const int64_t width = logits.size(-1);
    const at::Tensor x = logits.reshape({-1, width}).contiguous();
    const at::Tensor t = targets.reshape({-1}).to(at::kLong);
    const at::Tensor inside = (t >= vocabBegin).logical_and(t < vocabBegin + width);
    const at::Tensor column = (t - vocabBegin).masked_fill(inside.logical_not(), -1).contiguous();
    // Rows: this block's maximum, its sum of exp(x - maximum), the target's logit (0 off this block).
    const at::Tensor stats = at::empty({3, x.size(0)}, x.options().dtype(at::kFloat));
    cuda::crossEntropyRowStats(kernelArgs(x, column), x.data_ptr(), stats[0].data_ptr<float>(),
                               stats[1].data_ptr<float>(), stats[2].data_ptr<float>());
    at::Tensor max = stats[0], sumExp = stats[1], target = stats[2];
    if (group.size() > 1) {  // the blocks' sums rescaled to the global maximum, summed with the target logits
      const at::Tensor globalMax = detail::allReduce(max, group, ReduceOp::Max);
      const at::Tensor sums = detail::allReduce(at::stack({sumExp * (max - globalMax).exp(), target}), group);
      max = globalMax;
      sumExp = sums[0];
      target = sums[1];
    }
    const at::Tensor logSumExp = max + sumExp.log();
    ctx->save_for_backward({x, column, logSumExp});
    ctx->saved_data["shape"] = logits.sizes().vec();
    return (logSumExp - target).reshape(targets.sizes()).to(logits.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuseDoubleBackward("vocabParallelCrossEntropy");
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& column = saved[1];
    const at::Tensor& logSumExp = saved[2];
    const at::Tensor scale = grads[0].reshape({-1}).to(at::kFloat).contiguous();
    at::Tensor grad = at::empty_like(x);
    cuda::crossEntropyGradient(kernelArgs(x, column), x.data_ptr(), logSumExp.data_ptr<float>(),
                               scale.data_ptr<float>(), grad.data_ptr());
    return {grad.reshape(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor vocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocabBegin,
                                     const TpGroup& group) {
  if (logits.dim() < 1 || logits.size(-1) < 1 || logits.numel() / logits.size(-1) != targets.numel())
    throw ConfigError(fmt::format("vocabParallelCrossEntropy: logits [{}] and targets [{}] do not match: want logits "
                                  "[..., vocab block] with one target per row",
                                  fmt::join(logits.sizes(), ","), fmt::join(targets.sizes(), ",")),
                      {.rank = group.rank(), .group = group.comm->name(), .expected = "one target per logits row"});
  if (group.size() > 1) detail::checkDevice(logits, group, "vocabParallelCrossEntropy");
#if BULKHEAD_PARALLEL_KERNELS
  if (logits.is_cuda() && (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kHalf))
    return FusedVocabCrossEntropy::apply(logits, targets, vocabBegin, group);
#endif
  return VocabCrossEntropy::apply(logits, targets, vocabBegin, group);
}

}  // namespace bulkhead::parallel
