#include "moe/swiglu.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

#if BULKHEAD_MOE_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <string>

#include "moe/cuda/swiglu_kernels.h"
#include "moe/kernel_support.h"
#endif

namespace bulkhead::moe {
namespace {

void checkShape(const at::Tensor& gateUp, const at::Tensor& liveRows) {
  if (gateUp.dim() != 2 || gateUp.size(1) % 2 != 0) {
    throw ConfigError(fmt::format("swiglu: input [{}]", fmt::join(gateUp.sizes(), ", ")),
                      {.expected = "[N, 2F]: the gate projection's F columns, then the up projection's"});
  }
  if (liveRows.defined() && (liveRows.dim() != 1 || liveRows.numel() == 0 || gateUp.size(0) % liveRows.numel() != 0 ||
                             liveRows.scalar_type() != at::kInt || liveRows.device() != gateUp.device())) {
    throw ConfigError(fmt::format("swiglu: live rows [{}] {} on {} for input [{}] on {}",
                                  fmt::join(liveRows.sizes(), ", "), c10::toString(liveRows.scalar_type()),
                                  liveRows.device().str(), fmt::join(gateUp.sizes(), ", "), gateUp.device().str()),
                      {.expected = "int32 [G] on the input's device, G dividing the input's rows"});
  }
}

// Row i of group g (G equal groups) is live where i < liveRows[g].
at::Tensor liveMask(const at::Tensor& liveRows, int64_t rows) {
  const int64_t groupRows = rows / liveRows.numel();
  at::Tensor inGroup = at::arange(groupRows, liveRows.options().dtype(at::kLong)).repeat({liveRows.numel()});
  return inGroup.lt(liveRows.to(at::kLong).repeat_interleave(groupRows));
}

#if BULKHEAD_MOE_KERNELS
cuda::SwigluArgs kernelArgs(const at::Tensor& gateUp, const at::Tensor& liveRows) {
  return {.type = *kernelDtype(gateUp.scalar_type()),
          .rows = gateUp.size(0),
          .width = gateUp.size(1) / 2,
          .live = liveRows.defined() ? liveRows.data_ptr<int32_t>() : nullptr,
          .groups = liveRows.defined() ? liveRows.numel() : 1,
          .stream = c10::cuda::getCurrentCUDAStream(gateUp.device().index()).stream()};
}

// Saved as a SavedVariable: a contiguous input changed in place since the
// forward, or a second backward through a freed graph, raises as it would in
// ATen (a strided input was copied, so later changes to it do not matter).
// The gradient it returns has no graph of its own, so a double backward raises.
struct SwigluBackward : torch::autograd::Node {
  torch::autograd::SavedVariable savedGateUp;
  at::Tensor liveRows;  // contiguous int32, or undefined
  std::string name() const override { return "bulkhead::SwigluBackward"; }
  void release_variables() override {
    savedGateUp.reset_data();
    liveRows.reset();
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::SwigluBackward");
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor gateUp = savedGateUp.unpack();
    const c10::cuda::CUDAGuard onDevice(gateUp.device());
    const at::Tensor gradOut = grads[0].to(gateUp.scalar_type()).contiguous();
    at::Tensor gradGateUp = at::empty_like(gateUp);
    cuda::swigluBackward(kernelArgs(gateUp, liveRows), gateUp.data_ptr(), gradOut.data_ptr(), gradGateUp.data_ptr());
    return {gradGateUp};
  }
};
#endif

}  // namespace

at::Tensor swigluReference(const at::Tensor& gateUp) {
  checkShape(gateUp, {});
  const int64_t width = gateUp.size(1) / 2;
  return at::silu(gateUp.narrow(1, 0, width)) * gateUp.narrow(1, width, width);
}

at::Tensor swiglu(const at::Tensor& gateUp, const at::Tensor& liveRows) {
  checkShape(gateUp, liveRows);
#if BULKHEAD_MOE_KERNELS
  if (gateUp.is_cuda() && kernelDtype(gateUp.scalar_type())) {
    const c10::cuda::CUDAGuard onDevice(gateUp.device());
    const at::Tensor input = gateUp.detach().contiguous();
    const at::Tensor live = liveRows.defined() ? liveRows.contiguous() : at::Tensor();
    at::Tensor out = at::empty({input.size(0), input.size(1) / 2}, input.options());
    cuda::swigluForward(kernelArgs(input, live), input.data_ptr(), out.data_ptr());
    if (torch::autograd::GradMode::is_enabled() && gateUp.requires_grad()) {
      auto node = std::shared_ptr<SwigluBackward>(new SwigluBackward(), torch::autograd::deleteNode);
      node->savedGateUp = torch::autograd::SavedVariable(input, /*is_output=*/false);
      node->liveRows = live;
      node->set_next_edges(torch::autograd::collect_next_edges(gateUp));
      torch::autograd::set_history(out, node);
    }
    return out;
  }
#endif
  if (!liveRows.defined()) return swigluReference(gateUp);
  // The tails zero and without gradient, whatever they hold (0 * inf would not be).
  const at::Tensor live = liveMask(liveRows, gateUp.size(0)).unsqueeze(1);
  return at::where(live, swigluReference(at::where(live, gateUp, at::zeros({}, gateUp.options()))),
                   at::zeros({}, gateUp.options()));
}

}  // namespace bulkhead::moe
