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

#include "parallel/tensor_parallel.h"
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
namespace {

// namedRows int32 [G] on the source's device, the `rows` rows G equal groups.
bool namedRowsFit(const at::Tensor& namedRows, const at::Tensor& source, int64_t rows) {
  return namedRows.defined() && namedRows.scalar_type() == at::kInt && namedRows.dim() == 1 && namedRows.numel() > 0 &&
         namedRows.device() == source.device() && namedRows.is_contiguous() && rows % namedRows.numel() == 0;
}

}  // namespace

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

// The rows of a contiguous buffer after each group's named ones (namedRows
// int32 [G]: G equal groups) set to zero on the device.
void zeroRowsAfter(const at::Tensor& buffer, const at::Tensor& namedRows) {
  cuda::zeroTail({.rows = buffer.data_ptr(),
                  .count = buffer.size(0),
                  .rowBytes = buffer.size(1) * buffer.element_size(),
                  .first = namedRows.data_ptr<int32_t>(),
                  .groups = namedRows.numel(),
                  .stream = c10::cuda::getCurrentCUDAStream(buffer.device().index()).stream()});
}

// Source rows [rows, width] of `options` (a kernel dtype, on a GPU).
struct SourceShape {
  int64_t rows = 0, width = 0;
  at::TensorOptions options;
};

cuda::GatherSumArgs kernelArgs(const SourceShape& source, const at::Tensor& table, const at::Tensor& weights) {
  cuda::GatherSumArgs args;
  args.rowType = *kernelDtype(c10::typeMetaToScalarType(source.options.dtype()));  // checked by the caller
  args.weightType =
      weights.defined() && weights.scalar_type() == at::kDouble ? cuda::Dtype::Float64 : cuda::Dtype::Float32;
  args.outputs = table.size(0);
  args.columns = table.size(1);
  args.width = source.width;
  args.table = table.data_ptr<int64_t>();
  args.weights = weights.defined() ? weights.data_ptr() : nullptr;
  args.stream = c10::cuda::getCurrentCUDAStream(source.options.device().index()).stream();
  return args;
}

// Source and weights are SavedVariables: either changed in place since the
// forward, or a second backward through a freed graph, raises as it would in
// ATen. The source rows are kept only for the weights' gradient, so a
// gather-sum without learned weights (the combine's last sum) keeps none.
// The gradients it returns have no graph of their own: a double backward raises.
struct GatherSumBackward : Node {
  torch::autograd::SavedVariable savedSource, savedWeights;  // weights: float32 or float64
  at::Tensor table;
  SourceShape shape;
  SourceRows named = SourceRows::Some;
  at::Tensor namedRows;  // with SourceRows::Prefix
  std::string name() const override { return "bulkhead::GatherSumBackward"; }
  void release_variables() override {
    savedSource.reset_data();
    savedWeights.reset_data();
  }
  variable_list apply(variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::GatherSumBackward");
    const at::Tensor source = savedSource.unpack(), weights = savedWeights.unpack();  // undefined where not saved
    const c10::cuda::CUDAGuard onDevice(shape.options.device());
    at::Tensor gradOut =
        grads[0].defined() ? grads[0].contiguous() : at::zeros({table.size(0), shape.width}, shape.options);
    at::Tensor gradSource = named == SourceRows::Some ? at::zeros({shape.rows, shape.width}, shape.options)
                                                      : at::empty({shape.rows, shape.width}, shape.options);
    at::Tensor gradWeights = source.defined() ? at::empty_like(weights) : at::Tensor();
    cuda::gatherSumBackward(kernelArgs(shape, table, weights), source.defined() ? source.data_ptr() : nullptr,
                            gradOut.data_ptr(), gradSource.data_ptr(),
                            gradWeights.defined() ? gradWeights.data_ptr() : nullptr);
    if (named == SourceRows::Prefix) zeroRowsAfter(gradSource, namedRows);
    return {gradSource, gradWeights};
  }
};

}  // namespace
#endif

at::Tensor gatherSum(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights, SourceRows named,
                     const at::Tensor& namedRows) {
  if (named == SourceRows::Prefix && !namedRowsFit(namedRows, source, source.size(0)))
    throw ConfigError(
        "gatherSum: SourceRows::Prefix needs namedRows, int32 [G] on the source's device, G dividing "
        "the source rows",
        {.expected = "namedRows: an int32 tensor of G elements, the source rows G equal groups"});
#if BULKHEAD_MOE_KERNELS
  const bool floating =
      weights.defined() ? (weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kDouble) : true;
  if (source.is_cuda() && kernelDtype(source.scalar_type()) && floating && table.size(1) <= 64) {
    const c10::cuda::CUDAGuard onDevice(source.device());
    at::Tensor src = source.contiguous(), index = table.contiguous();
    at::Tensor w = weights.defined() ? weights.contiguous() : at::Tensor();
    at::Tensor out = at::empty({index.size(0), src.size(1)}, src.options());
    const SourceShape shape{.rows = src.size(0), .width = src.size(1), .options = src.options()};
    cuda::gatherSumForward(kernelArgs(shape, index, w), src.detach().data_ptr(), out.data_ptr());
    const bool weightsLearn = w.defined() && w.requires_grad();
    const bool tracked = torch::autograd::GradMode::is_enabled() && (source.requires_grad() || weightsLearn);
    if (!tracked) return out;
    auto node = std::shared_ptr<GatherSumBackward>(new GatherSumBackward(), torch::autograd::deleteNode);
    if (weightsLearn) node->savedSource = torch::autograd::SavedVariable(src.detach(), /*is_output=*/false);
    if (w.defined()) node->savedWeights = torch::autograd::SavedVariable(w.detach(), /*is_output=*/false);
    node->table = index;
    node->shape = shape;
    node->named = named;
    node->namedRows = namedRows;
    node->set_next_edges(torch::autograd::collect_next_edges(source, weights));
    torch::autograd::set_history(out, node);
    return out;
  }
#endif
  (void)named, (void)namedRows;  // index_select's backward zeroes the gradient itself
  return gatherSumReference(source, table, weights);
}

namespace {

// gatherRows as one kernel that reads each source row once (by the table);
// undefined where the kernels are not built or do not take this layout.
// The caller has checked that the table fits the source.
// zeroed: the rows the table does not name are zeros (the kernel writes only
// the rows it names).
// namedRows (int32 [G] on the device), where given: the rows are G equal
// groups, the table names the first namedRows[g] rows of group g, and only
// the rows after those are zeroed.
at::Tensor expandRowsKernel(const at::Tensor& source, int64_t rows, const at::Tensor& table, bool zeroed = false,
                            const at::Tensor& namedRows = {}) {
#if BULKHEAD_MOE_KERNELS
  if (source.is_cuda() && source.stride(1) == 1 && table.size(1) <= cuda::kMaxRouteColumns) {
    const c10::cuda::CUDAGuard device(source.device());
    at::Tensor index = table.contiguous();
    at::Tensor out = zeroed && !namedRows.defined() ? at::zeros({rows, source.size(1)}, source.options())
                                                    : at::empty({rows, source.size(1)}, source.options());
    if (zeroed && namedRows.defined()) zeroRowsAfter(out, namedRows);
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
  (void)source, (void)rows, (void)table, (void)zeroed, (void)namedRows;
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

namespace {

void checkGatherArgs(const char* call, const at::Tensor& source, const at::Tensor& table, int64_t rows) {
  if (source.dim() != 2 || table.dim() != 2 || table.size(0) != source.size(0) || table.scalar_type() != at::kLong ||
      table.device() != source.device() || rows < 0) {
    throw ConfigError(
        fmt::format("{}: {} rows from source [{}] on {} by table [{}] ({}) on {}", call, rows,
                    fmt::join(source.sizes(), ", "), source.device().str(), fmt::join(table.sizes(), ", "),
                    c10::toString(table.scalar_type()), table.device().str()),
        {.expected = "source [S, W] and an int64 table [S, m] on the source's device; rows >= 0"});
  }
}

// The index the table inverts to, index[table[s, c]] = s, with no device
// sync: empty entries land in a spare slot past the end, and a row the table
// misses keeps -1.
at::Tensor invertTable(const at::Tensor& table, int64_t rows) {
  at::Tensor reader = at::arange(table.size(0), table.options()).unsqueeze(1).expand_as(table);
  at::Tensor slot = at::where(table.ge(0), table, rows);
  return at::full({rows + 1}, -1, table.options()).scatter_(0, slot.reshape(-1), reader.reshape(-1)).narrow(0, 0, rows);
}

// `output`, gathered from `source` by `table` outside autograd, with the
// gradient that gathers back: gatherSum over the same table.
at::Tensor withGatherBackward(at::Tensor output, const at::Tensor& source, const at::Tensor& table) {
  if (!torch::autograd::GradMode::is_enabled() || !source.requires_grad()) return output;
  auto node = std::shared_ptr<GatherRowsBackward>(new GatherRowsBackward(), torch::autograd::deleteNode);
  node->table = table;
  node->set_next_edges(torch::autograd::collect_next_edges(source));
  torch::autograd::set_history(output, node);
  return output;
}

}  // namespace

at::Tensor gatherRowsOrZero(const at::Tensor& source, const at::Tensor& table, int64_t rows,
                            const at::Tensor& namedRows) {
  checkGatherArgs("gatherRowsOrZero", source, table, rows);
  if (namedRows.defined() && !namedRowsFit(namedRows, source, rows))
    throw ConfigError(fmt::format("gatherRowsOrZero: namedRows does not divide {} rows into int32 groups", rows),
                      {.expected = "namedRows: an int32 tensor of G elements on the source's device, G dividing rows"});
  at::Tensor output;
  {
    const c10::NoGradGuard untracked;
    // On a GPU: a zeroed buffer and one kernel that writes the named rows.
    output = expandRowsKernel(source, rows, table, /*zeroed=*/true, namedRows);
    if (!output.defined()) {
      at::Tensor index = invertTable(table, rows);
      output = source.index_select(0, index.clamp_min(0));
      output.masked_fill_(index.lt(0).unsqueeze(1), 0);
    }
  }
  return withGatherBackward(std::move(output), source, table);
}

at::Tensor gatherRows(const at::Tensor& source, const at::Tensor& table, int64_t rows) {
  checkGatherArgs("gatherRows", source, table, rows);
  at::Tensor output;
  {
    const c10::NoGradGuard untracked;
    output = expandRowsKernel(source, rows, table);
    // Without the kernel: an index_select by the inverted table (a row the
    // table misses keeps -1, which index_select refuses).
    if (!output.defined()) output = source.index_select(0, invertTable(table, rows));
  }
  return withGatherBackward(std::move(output), source, table);
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

int64_t groupByKeyKernelsMaxGroups() {
#if BULKHEAD_MOE_KERNELS
  return cuda::kMaxGroups;
#else
  return 0;
#endif
}

}  // namespace bulkhead::moe
