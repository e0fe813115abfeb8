#include "optim/fused_update.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include <tuple>

#include "runtime/errors.h"

#if BULKHEAD_OPTIM_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "optim/cuda/adamw_kernels.h"
#endif

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

bool kernels(const c10::Device& device) {
#if BULKHEAD_OPTIM_KERNELS
  return device.is_cuda();
#else
  (void)device;
  return false;
#endif
}

#if BULKHEAD_FUSED_OPTIM
at::Tensor sumOfSquares(const std::vector<at::Tensor>& pieces, const at::TensorOptions& resultOptions) {
  if (pieces.empty()) return at::zeros({1}, resultOptions);
  std::vector<at::Tensor> wide, half;  // half-precision norms are taken in float32
  for (const at::Tensor& piece : pieces)
    (at::isReducedFloatingType(piece.scalar_type()) ? half : wide).push_back(piece);
  std::vector<at::Tensor> norms = wide.empty() ? std::vector<at::Tensor>{} : at::_foreach_norm(wide, 2);
  if (!half.empty()) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    std::vector<at::Tensor> more = at::_foreach_norm(half, 2, at::kFloat);
#else
    std::vector<at::Tensor> more;
    for (const at::Tensor& piece : half) more.push_back(piece.to(at::kFloat).norm());
#endif
    norms.insert(norms.end(), more.begin(), more.end());
  }
  for (at::Tensor& norm : norms) norm = norm.to(resultOptions.dtype());
  return at::stack(norms).square().sum().reshape({1});
}

#if BULKHEAD_OPTIM_KERNELS
namespace {

cuda::HalfType halfType(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return cuda::HalfType::BFloat16;
  if (t.scalar_type() == at::kHalf) return cuda::HalfType::Float16;
  return cuda::HalfType::None;
}

// Whether the kernel takes these pieces: float32 masters, float32 or bf16 moments (both of one dtype),
// float32 or half gradients, and contiguous half parameters of one dtype where written.
bool kernelTakes(const AdamWPieces& pieces) {
  for (size_t i = 0; i < pieces.masters.size(); ++i) {
    const at::ScalarType moments = pieces.expAvg[i].scalar_type();
    if (pieces.masters[i].scalar_type() != at::kFloat || (moments != at::kFloat && moments != at::kBFloat16) ||
        pieces.expAvgSq[i].scalar_type() != moments)
      return false;
    for (const at::Tensor* t : {&pieces.masters[i], &pieces.expAvg[i], &pieces.expAvgSq[i]})
      if (!t->is_contiguous()) return false;
    const at::Tensor& grad = pieces.grads[i];
    if ((grad.scalar_type() != at::kFloat && halfType(grad) == cuda::HalfType::None) || !grad.is_contiguous())
      return false;
    if (pieces.params.empty() || !pieces.params[i].defined()) continue;
    const at::Tensor& param = pieces.params[i];
    if (halfType(param) == cuda::HalfType::None || !param.is_contiguous() ||
        param.scalar_type() != pieces.params[0].scalar_type())
      return false;
  }
  return true;
}

// The gradient, parameter and moment dtypes of one launch.
using LaunchTypes = std::tuple<cuda::HalfType, cuda::HalfType, cuda::HalfType>;

// The pieces in launches of at most kMaxPieces, each of one gradient, parameter and moment dtype.
void kernelAdamw(const AdamWPieces& pieces, double lr, double decay, const DeviceScalars& scalars,
                 const AdamWOptions& options) {
  std::map<LaunchTypes, cuda::AdamWPiecePointers> launches;
  const auto run = [&](const LaunchTypes& types, cuda::AdamWPiecePointers& batch) {
    const cuda::AdamWArgs args{.gradType = std::get<0>(types),
                               .paramType = std::get<1>(types),
                               .momentType = std::get<2>(types),
                               .lr = lr,
                               .beta1 = options.beta1,
                               .beta2 = options.beta2,
                               .eps = options.eps,
                               .decay = decay,
                               .step = scalars.step.data_ptr<float>(),
                               .unscale = scalars.unscale ? scalars.unscale->data_ptr<float>() : nullptr,
                               .skip = scalars.skip ? scalars.skip->data_ptr<float>() : nullptr,
                               .stream = c10::cuda::getCurrentCUDAStream(scalars.step.device().index()).stream()};
    cuda::adamw(args, batch);
    batch = {};
  };
  for (size_t i = 0; i < pieces.masters.size(); ++i) {
    const bool writes = !pieces.params.empty() && pieces.params[i].defined();
    const LaunchTypes types{halfType(pieces.grads[i]), writes ? halfType(pieces.params[i]) : cuda::HalfType::None,
                            halfType(pieces.expAvg[i])};
    cuda::AdamWPiecePointers& batch = launches[types];
    const int k = batch.pieces++;
    batch.master[k] = pieces.masters[i].data_ptr<float>();
    batch.grad[k] = pieces.grads[i].data_ptr();
    batch.expAvg[k] = pieces.expAvg[i].data_ptr();
    batch.expAvgSq[k] = pieces.expAvgSq[i].data_ptr();
    batch.param[k] = writes ? pieces.params[i].data_ptr() : nullptr;
    batch.numel[k] = pieces.masters[i].numel();
    if (batch.pieces == cuda::kMaxPieces) run(types, batch);
  }
  for (auto& [types, batch] : launches)
    if (batch.pieces > 0) run(types, batch);
}

}  // namespace
#endif

void adamw(const std::map<double, AdamWPieces>& groups, double lr, const DeviceScalars& scalars,
           const AdamWOptions& options) {
  for (const auto& [decay, pieces] : groups) {
    if (pieces.masters.empty()) continue;
#if BULKHEAD_OPTIM_KERNELS
    if (kernelTakes(pieces)) {
      kernelAdamw(pieces, lr, decay, scalars, options);
      continue;
    }
#endif
    // ATen's kernel takes gradients and moments in the masters' dtype, and writes no parameters: all
    // done apart (moments of another dtype updated in the masters' and rounded back).
    std::vector<at::Tensor> grads = pieces.grads, m = pieces.expAvg, v = pieces.expAvgSq, into, from;
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto type = pieces.masters[i].dtype();
      if (grads[i].dtype() != type) grads[i] = grads[i].to(type);
      if (m[i].dtype() != type) m[i] = m[i].to(type), v[i] = v[i].to(type);
      if (!pieces.params.empty() && pieces.params[i].defined()) {
        into.push_back(pieces.params[i]);
        from.push_back(pieces.masters[i]);
      }
    }
    // The kernels read the step count (one per piece; all the same here).
    std::vector<at::Tensor> steps(pieces.masters.size(), scalars.step);
    at::_fused_adamw_(pieces.masters, grads, m, v, {}, steps, lr, options.beta1, options.beta2, decay, options.eps,
                      /*amsgrad=*/false, /*maximize=*/false, scalars.unscale, scalars.skip);
    for (size_t i = 0; i < m.size(); ++i) {
      if (m[i].is_same(pieces.expAvg[i])) continue;
      into.push_back(pieces.expAvg[i]), from.push_back(m[i]);
      into.push_back(pieces.expAvgSq[i]), from.push_back(v[i]);
    }
    copy(into, from);
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
