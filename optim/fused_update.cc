#include "optim/fused_update.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include "runtime/errors.h"

#define BULKHEAD_FUSED_OPTIM (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2))

namespace bulkhead::optim::fused {

bool available(const c10::Device& device) {
#if BULKHEAD_FUSED_OPTIM
  return device.is_cuda();
#else
  (void)device;
  return false;
#endif
}

#if BULKHEAD_FUSED_OPTIM
at::Tensor sumOfSquares(const std::vector<at::Tensor>& pieces, const at::TensorOptions& resultOptions) {
  if (pieces.empty()) return at::zeros({1}, resultOptions);
  std::vector<at::Tensor> norms = at::_foreach_norm(pieces, 2);
  return at::stack(norms).to(resultOptions.dtype()).square().sum().reshape({1});
}

void adamw(const std::map<double, AdamWPieces>& groups, double lr, const DeviceScalars& scalars,
           const AdamWOptions& options) {
  for (const auto& [decay, pieces] : groups) {
    if (pieces.masters.empty()) continue;
    // The kernels read the step count (one per piece; all the same here).
    std::vector<at::Tensor> steps(pieces.masters.size(), scalars.step);
    at::_fused_adamw_(pieces.masters, pieces.grads, pieces.expAvg, pieces.expAvgSq, {}, steps, lr, options.beta1,
                      options.beta2, decay, options.eps, /*amsgrad=*/false, /*maximize=*/false, scalars.unscale,
                      scalars.skip);
  }
}

void copy(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  if (!dst.empty()) at::_foreach_copy_(dst, src);
}
#else
[[noreturn]] void unavailable() {
  throw ConfigError("the fused optimizer kernels need libtorch 2.2 or later with CUDA");
}
at::Tensor sumOfSquares(const std::vector<at::Tensor>&, const at::TensorOptions&) { unavailable(); }
void adamw(const std::map<double, AdamWPieces>&, double, const DeviceScalars&, const AdamWOptions&) { unavailable(); }
void copy(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&) { unavailable(); }
#endif

}  // namespace bulkhead::optim::fused
