#include "moe/gather_sum.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <string>

#include "runtime/errors.h"

#if BULKHEAD_MOE_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "moe/cuda/gather_sum_kernels.h"
#include "moe/cuda/group_kernels.h"
#include "moe/cuda/route_kernels.h"
#include "moe/kernel_support.h"
#endif

namespace bulkhead::moe {

at::Tensor gatherSumReference(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights) {
  const int64_t outputs = table.size(0), columns = table.size(1);
  // A zero row at the end stands in for the empty entries.
  at::Tensor padded = at::cat({source, at::zeros({1, source.size(1)}, source.options())});
  at::Tensor valid = table.ge(0);
  at::Tensor index = at::where(valid, table, at::full_like(table, source.size(0)));
  at::Tensor gathered = padded.index_select(0, index.reshape(-1)).view({outputs, columns, source.size(1)});
  if (!weights.defined()) return gathered.sum(1);
  return (gathered * weights.to(source.scalar_type()).unsqueeze(-1)).sum(1);
}

#if BULKHEAD_MOE_KERNELS
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

cuda::GatherSumArgs kernelArgs(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights) {
  cuda::GatherSumArgs args;
  args.rowType = *kernelDtype(source.scalar_type());  // checked by the caller
  args.weightType = weights.defined() && weights.scalar_type() == at::kDouble ? cuda::Dtype::Float64
                                                                               : cuda::Dtype::Float32;
  args.outputs = table.size(0);
  args.columns = table.size(1);
  args.width = source.size(1);
  args.table = table.data_ptr<int64_t>();
  args.weights = weights.defined() ? weights.data_ptr() : nullptr;
  args.stream = c10::cuda::getCurrentCUDAStream(source.device().index()).stream();
  return args;
}

// The gradients it returns have no graph of their own: a double backward raises.
struct GatherSumBackward : Node {
  at::Tensor source, table, weights;  // weights: float32 or float64, or undefined
  SourceRows named = SourceRows::Some;
  std::string name() const override { return "bulkhead::GatherSumBackward"; }
  variable_list apply(variable_list&& grads) override {
    refuseDoubleBackward("bulkhead::GatherSumBackward");
    const c10::cuda::CUDAGuard onDevice(source.device());
    at::Tensor gradOut = grads[0].defined() ? grads[0].contiguous()
                                            : at::zeros({table.size(0), source.size(1)}, source.options());
    at::Tensor gradSource = named == SourceRows::Every ? at::empty_like(source) : at::zeros_like(source);
    at::Tensor gradWeights = weights.defined() ? at::empty_like(weights) : at::Tensor();
    cuda::gatherSumBackward(kernelArgs(source, table, weights), source.data_ptr(), gradOut.data_ptr(),
                            gradSource.data_ptr(), weights.defined() ? gradWeights.data_ptr() : nullptr);
    return {gradSource, gradWeights};
  }
};

}  // namespace
#endif

at::Tensor gatherSum(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights, SourceRows named) {
#if BULKHEAD_MOE_KERNELS
  const bool floating = weights.defined() ? (weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kDouble)
                                          : true;
  if (source.is_cuda() && kernelDtype(source.scalar_type()) && floating && table.size(1) <= 64) {
    const c10::cuda::CUDAGuard onDevice(source.device());
    at::Tensor src = source.contiguous(), index = table.contiguous();
    at::Tensor w = weights.defined() ? weights.contiguous() : at::Tensor();
    at::Tensor out = at::empty({index.size(0), src.size(1)}, src.options());
    cuda::gatherSumForward(kernelArgs(src, index, w), src.detach().data_ptr(), out.data_ptr());
    const bool tracked = torch::autograd::GradMode::is_enabled() &&
                         (source.requires_grad() || (w.defined() && w.requires_grad()));
    if (!tracked) return out;
    auto node = std::shared_ptr<GatherSumBackward>(new GatherSumBackward(), torch::autograd::deleteNode);
    node->source = src.detach();
    node->table = index;
    node->weights = w.defined() ? w.detach() : at::Tensor();
    node->named = named;
    node->set_next_edges(torch::autograd::collect_next_edges(source, weights));
    torch::autograd::set_history(out, node);
    return out;
  }
#endif
  (void)named;  // index_select's backward zeroes the gradient itself
  return gatherSumReference(source, table, weights);
}

namespace {

// gatherRows as one kernel that reads each source row once (by the table);
// undefined where the kernels are not built or do not take this layout.
// The caller has checked that the table fits the source.
at::Tensor expandRowsKernel(const at::Tensor& source, int64_t rows, const at::Tensor& table) {
#if BULKHEAD_MOE_KERNELS
  if (source.is_cuda() && source.stride(1) == 1 && table.size(1) <= cuda::kMaxRouteColumns) {
    const c10::cuda::CUDAGuard device(source.device());
    at::Tensor index = table.contiguous();
    at::Tensor out = at::empty({rows, source.size(1)}, source.options());
    cuda::expandRows({.source = source.data_ptr(),
                      .sourceRows = source.size(0),
                      .sourceStride = source.stride(0) * source.element_size(),
                      .rowBytes = source.size(1) * source.element_size(),
                      .table = index.data_ptr<int64_t>(),
                      .columns = index.size(1),
                      .out = out.data_ptr(),
                      .stream = c10::cuda::getCurrentCUDAStream(source.device().index()).stream()});
    return out;
  }
#endif
  (void)source, (void)rows, (void)table;
  return at::Tensor();
}

struct GatherRowsBackward : torch::autograd::Node {
  at::Tensor table;
  std::string name() const override { return "bulkhead::GatherRowsBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};  // no gradient reached the rows: none to the source
    return {gatherSum(grads[0], table, at::Tensor())};
  }
};

}  // namespace

at::Tensor gatherRows(const at::Tensor& source, const at::Tensor& table, int64_t rows) {
  if (source.dim() != 2 || table.dim() != 2 || table.size(0) != source.size(0) || table.scalar_type() != at::kLong ||
      table.device() != source.device() || rows < 0) {
    throw ConfigError(fmt::format("gatherRows: {} rows from source [{}] on {} by table [{}] ({}) on {}", rows,
                                  fmt::join(source.sizes(), ", "), source.device().str(),
                                  fmt::join(table.sizes(), ", "), c10::toString(table.scalar_type()),
                                  table.device().str()),
                      {.expected = "source [S, W] and an int64 table [S, m] on the source's device; rows >= 0"});
  }
  const bool tracked = torch::autograd::GradMode::is_enabled() && source.requires_grad();
  at::Tensor output;
  {
    const c10::NoGradGuard untracked;
    output = expandRowsKernel(source, rows, table);
    if (!output.defined()) {
      // The index the table inverts to, index[table[s, c]] = s, with no
      // device sync: empty entries land in a spare slot past the end, and a
      // row the table misses keeps -1, which index_select refuses.
      at::Tensor reader = at::arange(table.size(0), table.options()).unsqueeze(1).expand_as(table);
      at::Tensor slot = at::where(table.ge(0), table, rows);
      at::Tensor index = at::full({rows + 1}, -1, table.options()).scatter_(0, slot.reshape(-1), reader.reshape(-1));
      output = source.index_select(0, index.narrow(0, 0, rows));
    }
  }
  if (!tracked) return output;
  auto node = std::shared_ptr<GatherRowsBackward>(new GatherRowsBackward(), torch::autograd::deleteNode);
  node->table = table;
  node->set_next_edges(torch::autograd::collect_next_edges(source));
  torch::autograd::set_history(output, node);
  return output;
}

bool groupByKeyKernels(const at::Tensor& key, int64_t groups, int64_t count, at::Tensor& order, at::Tensor& table,
                       at::Tensor* ends) {
#if BULKHEAD_MOE_KERNELS
  if (!key.is_cuda() || groups > cuda::kMaxGroups || key.scalar_type() != at::kLong) return false;
  const c10::cuda::CUDAGuard device(key.device());
  at::Tensor keys = key.contiguous();
  order = at::empty({count}, keys.options());
  table = at::empty(keys.sizes(), keys.options());
  if (ends != nullptr) *ends = at::empty({groups}, keys.options().dtype(at::kInt));
  at::Tensor scratch = at::empty({cuda::groupScratchInts(keys.numel(), groups)}, keys.options().dtype(at::kInt));
  cuda::groupEntries({.entries = keys.numel(),
                      .groups = groups,
                      .keys = keys.data_ptr<int64_t>(),
                      .order = order.data_ptr<int64_t>(),
                      .table = table.data_ptr<int64_t>(),
                      .ends = ends != nullptr ? ends->data_ptr<int32_t>() : nullptr,
                      .scratch = scratch.data_ptr<int32_t>(),
                      .stream = c10::cuda::getCurrentCUDAStream(key.device().index()).stream()});
  return true;
#else
  (void)key, (void)groups, (void)count, (void)order, (void)table, (void)ends;
  return false;
#endif
}

}  // namespace bulkhead::moe
