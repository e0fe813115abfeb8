#include "moe/batched_linear.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <string>

#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::moe {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

struct Shape {
  int64_t groups = 0, rows = 0, out = 0, in = 0;  // rows per group
};

Shape checkedShape(const at::Tensor& rows, const at::Tensor& weight) {
  const bool fits = weight.dim() >= 3 && weight.is_contiguous() && rows.dim() == 2 && rows.size(1) == weight.size(-1) &&
                    weight.size(0) > 0 && rows.size(0) % weight.size(0) == 0 &&
                    rows.scalar_type() == weight.scalar_type() && rows.device() == weight.device();
  if (!fits) {
    throw ConfigError(fmt::format("batched linear: rows [{}] {} on {}, weight [{}] {} on {}{}",
                                  fmt::join(rows.sizes(), ", "), c10::toString(rows.scalar_type()), rows.device().str(),
                                  fmt::join(weight.sizes(), ", "), c10::toString(weight.scalar_type()),
                                  weight.device().str(), weight.is_contiguous() ? "" : " (not contiguous)"),
                      {.expected = "rows [G * C, K] and a contiguous weight [G, ..., K] of one dtype and device"});
  }
  Shape shape{.groups = weight.size(0), .in = weight.size(-1)};
  shape.rows = rows.size(0) / shape.groups;
  shape.out = 1;
  for (int64_t d = 1; d + 1 < weight.dim(); ++d) shape.out *= weight.size(d);
  return shape;
}

// Whether this backward would hand the weight's gradient to its
// AccumulateGrad (backward(), or backward(inputs) naming it): not where
// grad() only captures it, nor where the weight is no leaf.
torch::autograd::AccumulateGrad* accumulatorToRun(const torch::autograd::Edge& edge) {
  auto* accumulator = dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get());
  if (accumulator == nullptr || !accumulator->variable.requires_grad()) return nullptr;
  const auto* execInfo = torch::autograd::get_current_graph_task_exec_info();
  if (execInfo == nullptr || execInfo->empty()) return accumulator;
  auto it = execInfo->find(accumulator);
  return it != execInfo->end() && it->second.needed_ && !it->second.captures_ ? accumulator : nullptr;
}

// Adds the weight gradient `lhs x rhs` (batched) to the leaf's gradient in
// place, or makes it the leaf's gradient. False where the held gradient's
// layout does not take a batched GEMM's output (the caller returns the
// product for AccumulateGrad instead).
bool accumulateInPlace(const at::Tensor& leaf, const Shape& shape, const at::Tensor& lhs, const at::Tensor& rhs) {
  at::Tensor& grad = leaf.mutable_grad();
  if (!grad.defined()) {
    grad = at::bmm(lhs, rhs).view(leaf.sizes());
    return true;
  }
  if (grad.layout() != at::kStrided || !grad.is_contiguous() || grad.scalar_type() != leaf.scalar_type() ||
      grad.sizes() != leaf.sizes() || grad.device() != leaf.device())
    return false;
  grad.view({shape.groups, shape.out, shape.in}).baddbmm_(lhs, rhs);
  return true;
}

// Saved as SavedVariables: rows or weights changed in place since the
// forward (an optimizer step before the backward) raise as in ATen.
struct BatchedLinearBackward : Node {
  SavedVariable savedRows, savedWeight;  // [G, C, K] and [G, N, K], detached aliases
  Shape shape;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> weightSizes;  // as the forward took it: [G, ..., K]
  std::string name() const override { return "bulkhead::BatchedLinearBackward"; }
  void release_variables() override {
    savedRows.reset_data();
    savedWeight.reset_data();
  }
  variable_list apply(variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::BatchedLinearBackward");
    variable_list out(2);
    if (!grads[0].defined()) return out;
    const at::Tensor grad = grads[0].to(dtype).reshape({shape.groups, shape.rows, shape.out});
    if (task_should_compute_output(0))
      out[0] = at::bmm(grad, savedWeight.unpack()).view({shape.groups * shape.rows, shape.in});
    if (task_should_compute_output(1)) {
      const at::Tensor rows = savedRows.unpack();
      const at::Tensor gradT = grad.transpose(1, 2);
      torch::autograd::AccumulateGrad* accumulator = accumulatorToRun(next_edge(1));
      if (accumulator == nullptr || !accumulateInPlace(accumulator->variable, shape, gradT, rows))
        out[1] = at::bmm(gradT, rows).view(weightSizes);
    }
    return out;
  }
};

}  // namespace

at::Tensor batchedLinear(const at::Tensor& rows, const at::Tensor& weight) {
  const Shape shape = checkedShape(rows, weight);
  const at::Tensor rows3 = rows.detach().contiguous().view({shape.groups, shape.rows, shape.in});
  const at::Tensor weight3 = weight.detach().view({shape.groups, shape.out, shape.in});
  // A tensor of its own, not a view: the caller may change it in place.
  at::Tensor out = at::_unsafe_view(at::bmm(rows3, weight3.transpose(1, 2)), {shape.groups * shape.rows, shape.out});
  if (torch::autograd::GradMode::is_enabled() && (rows.requires_grad() || weight.requires_grad())) {
    auto node = std::shared_ptr<BatchedLinearBackward>(new BatchedLinearBackward(), torch::autograd::deleteNode);
    // Each side's gradient needs the other side's values.
    if (weight.requires_grad()) node->savedRows = SavedVariable(rows3, /*is_output=*/false);
    if (rows.requires_grad()) node->savedWeight = SavedVariable(weight3, /*is_output=*/false);
    node->shape = shape;
    node->dtype = rows.scalar_type();
    node->weightSizes = weight.sizes().vec();
    node->set_next_edges(torch::autograd::collect_next_edges(rows, weight));
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace bulkhead::moe
