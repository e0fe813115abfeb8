#include "moe/grouped_products.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "runtime/env.h"
#include "runtime/errors.h"

#if BULKHEAD_HOPPER_PRODUCTS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <cstdint>
#include <memory>

#include "moe/cuda/grouped_gemm_kernels.h"
#include "parallel/tensor_parallel.h"
#endif

namespace bulkhead::moe {
namespace {

#if BULKHEAD_HOPPER_PRODUCTS
bool productsOn() {
  static const bool on = [] {
    const std::string value = env::kGroupedProducts.text();
    if (value != "hopper" && value != "aten") {
      throw ConfigError("BULKHEAD_GROUPED_PRODUCTS=" + value,
                        {.expected = "hopper (Bulkhead's kernels where they apply) or aten (at::_grouped_mm)"});
    }
    return value == "hopper";
  }();
  return on;
}

void* streamOf(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// out = the product `kind` of a and b (see moe/cuda/grouped_gemm_kernels.h).
at::Tensor product(cuda::GroupedProduct kind, const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends) {
  const cuda::GroupedGemmCall call =
      cuda::groupedGemmCall(kind, a.size(0), a.size(1), b.size(1), b.dim() > 2 ? b.size(2) : 0,
                            static_cast<int>(ends.numel()), ends.data_ptr<int32_t>(), streamOf(a));
  at::Tensor out = at::empty(at::IntArrayRef(call.outShape, call.outDims), a.options());
  cuda::groupedGemm(call.args, a.data_ptr(), b.data_ptr(), out.data_ptr());
  return out;
}

// Contiguous, on a 16-byte boundary (what the tensor copy engine reads): `t`
// itself where it already is, else a copy.
at::Tensor aligned(const at::Tensor& t) {
  const at::Tensor dense = t.contiguous();
  return reinterpret_cast<uintptr_t>(dense.data_ptr()) % 16 == 0 ? dense : dense.clone();
}

// Saved as SavedVariables: rows (for the weights' gradient) and weights (for
// the rows'), each only where the other needs a gradient, and the ends. One
// changed in place since the forward, or a second backward through a freed
// graph, raises as it would in ATen (a strided or unaligned input was copied,
// so later changes to it do not matter). The gradients have no graph of their
// own, so a double backward raises.
struct GroupedProductBackward : torch::autograd::Node {
  torch::autograd::SavedVariable savedRows, savedWeights, savedEnds;
  std::string name() const override { return "bulkhead::GroupedProductBackward"; }
  void release_variables() override {
    savedRows.reset_data();
    savedWeights.reset_data();
    savedEnds.reset_data();
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::GroupedProductBackward");
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor ends = savedEnds.unpack();
    const c10::cuda::CUDAGuard onDevice(ends.device());
    const at::Tensor gradOut = aligned(grads[0].to(at::kBFloat16));
    at::Tensor gradRows, gradWeights;
    if (task_should_compute_output(0)) {
      gradRows = product(cuda::GroupedProduct::Dgrad, gradOut, savedWeights.unpack(), ends);
    }
    if (task_should_compute_output(1)) {
      gradWeights = product(cuda::GroupedProduct::Wgrad, gradOut, savedRows.unpack(), ends);
    }
    return {gradRows, gradWeights};
  }
};
#endif

// Whether the kernels serve `rows` rows of k into `out` columns over `groups`
// groups, for operands like `like` (bf16 on a Hopper GPU) and these ends.
bool servedShapes(const at::Tensor& like, int64_t rows, int64_t k, int64_t out, int64_t groups,
                  const at::Tensor& ends) {
#if BULKHEAD_HOPPER_PRODUCTS
  if (!like.is_cuda() || like.scalar_type() != at::kBFloat16 || !ends.defined() || ends.scalar_type() != at::kInt ||
      ends.dim() != 1 || ends.numel() != groups || ends.device() != like.device() || !productsOn()) {
    return false;
  }
  const c10::cuda::CUDAGuard onDevice(like.device());
  using cuda::GroupedProduct;
  const auto g = static_cast<int>(std::min<int64_t>(groups, cuda::kMaxProductGroups + 1));
  const cuda::GroupedGemmArgs forward{.product = GroupedProduct::Forward, .rows = rows, .groups = g, .n = out, .k = k};
  const cuda::GroupedGemmArgs wgrad{.product = GroupedProduct::Wgrad, .rows = rows, .groups = g, .m = out, .n = k};
  return cuda::groupedGemmApplies(forward) && cuda::groupedGemmApplies(wgrad);
#else
  (void)like, (void)rows, (void)k, (void)out, (void)groups, (void)ends;
  return false;
#endif
}

}  // namespace

bool hopperProductsApply(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& ends) {
  return rows.defined() && weights.defined() && rows.dim() == 2 && weights.dim() == 3 &&
         weights.scalar_type() == at::kBFloat16 && weights.device() == rows.device() &&
         weights.size(2) == rows.size(1) &&
         servedShapes(rows, rows.size(0), rows.size(1), weights.size(1), weights.size(0), ends);
}

at::Tensor hopperGroupedLinear(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& ends) {
  if (!hopperProductsApply(rows, weights, ends)) {
    throw ConfigError("grouped products: these tensors are not served by the Hopper kernels",
                      {.expected = "bf16 rows [N, K] and weights [G, Out, K] on a Hopper GPU with int32 ends [G] "
                                   "(check hopperProductsApply first)"});
  }
#if BULKHEAD_HOPPER_PRODUCTS
  const c10::cuda::CUDAGuard onDevice(rows.device());
  const at::Tensor input = aligned(rows.detach()), w = aligned(weights.detach());
  const at::Tensor groupEnds = ends.contiguous();
  at::Tensor out = product(cuda::GroupedProduct::Forward, input, w, groupEnds);
  if (torch::autograd::GradMode::is_enabled() && (rows.requires_grad() || weights.requires_grad())) {
    auto node = std::shared_ptr<GroupedProductBackward>(new GroupedProductBackward(), torch::autograd::deleteNode);
    if (weights.requires_grad()) node->savedRows = torch::autograd::SavedVariable(input, /*is_output=*/false);
    if (rows.requires_grad()) node->savedWeights = torch::autograd::SavedVariable(w, /*is_output=*/false);
    node->savedEnds = torch::autograd::SavedVariable(groupEnds, /*is_output=*/false);
    node->set_next_edges(torch::autograd::collect_next_edges(rows, weights));
    torch::autograd::set_history(out, node);
  }
  return out;
#else
  return {};
#endif
}

at::Tensor hopperProduct(HopperProduct kind, const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends) {
  bool fits = a.defined() && b.defined() && a.is_contiguous() && b.is_contiguous() && a.dim() == 2 &&
              b.scalar_type() == at::kBFloat16 && b.device() == a.device();
  if (fits && kind == HopperProduct::Forward) fits = hopperProductsApply(a, b, ends);
  if (fits && kind == HopperProduct::Dgrad) {  // a = dy [N, Out], b = w [G, Out, K]
    fits = b.dim() == 3 && b.size(1) == a.size(1) && servedShapes(a, a.size(0), b.size(2), b.size(1), b.size(0), ends);
  }
  if (fits && kind == HopperProduct::Wgrad) {  // a = dy [N, Out], b = x [N, K]
    fits = b.dim() == 2 && b.size(0) == a.size(0) && ends.defined() &&
           servedShapes(a, a.size(0), b.size(1), a.size(1), ends.numel(), ends);
  }
  if (!fits) {
    throw ConfigError("grouped products: operands not served by the Hopper kernels",
                      {.expected = "contiguous bf16 operands on a Hopper GPU as hopperProduct's contract has them"});
  }
#if BULKHEAD_HOPPER_PRODUCTS
  const c10::cuda::CUDAGuard onDevice(a.device());
  const auto kernelKind = kind == HopperProduct::Forward ? cuda::GroupedProduct::Forward
                          : kind == HopperProduct::Dgrad ? cuda::GroupedProduct::Dgrad
                                                         : cuda::GroupedProduct::Wgrad;
  return product(kernelKind, aligned(a), aligned(b), ends.contiguous());
#else
  return {};
#endif
}

}  // namespace bulkhead::moe
