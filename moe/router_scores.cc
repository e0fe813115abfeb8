#include "moe/router_scores.h"

#if BULKHEAD_MOE_KERNELS
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/version.h>

#include <algorithm>
#include <memory>
#include <string>

#include "moe/cuda/capacity_kernels.h"
#include "moe/cuda/score_kernels.h"
#include "moe/kernel_support.h"
#include "parallel/tensor_parallel.h"

// at::mm with out_dtype (bf16 or fp16 in, float32 out) came with libtorch 2.8.
#define BULKHEAD_MM_OUT_DTYPE (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8))
#endif

namespace bulkhead::moe {

#if BULKHEAD_MOE_KERNELS
namespace {

cuda::ScoreArgs scoreArgs(const at::Tensor& logits, const RouterOptions& options) {
  return {.tokens = logits.size(0),
          .experts = logits.size(1),
          .topK = options.topK,
          .sigmoid = options.scoreFunction == ScoreFunction::Sigmoid,
          .normalize = options.normalizeWeights,
          .doubles = logits.scalar_type() == at::kDouble,
          .logits = logits.data_ptr(),
          .stream = c10::cuda::getCurrentCUDAStream(logits.device().index()).stream()};
}

const void* dataOrNull(const at::Tensor& tensor) { return tensor.defined() ? tensor.data_ptr() : nullptr; }

// Gradients of (weights, probSum, lseSquaredSum) to the logits. Saved as
// SavedVariables: a logits tensor changed in place since the forward, or a
// second backward through a freed graph, raises as it would in ATen. The
// gradient it returns has no graph of its own: a double backward raises.
struct ScoresBackward : torch::autograd::Node {
  torch::autograd::SavedVariable savedLogits, savedIndices;
  RouterOptions options;
  std::string name() const override { return "bulkhead::RouterScoresBackward"; }
  void release_variables() override {
    savedLogits.reset_data();
    savedIndices.reset_data();
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::RouterScoresBackward");
    if (!grads[0].defined() && !grads[1].defined() && !grads[2].defined()) return {at::Tensor()};
    const at::Tensor logits = savedLogits.unpack(), indices = savedIndices.unpack();
    const c10::cuda::CUDAGuard onDevice(logits.device());
    auto flat = [&](const at::Tensor& grad) {
      return grad.defined() ? grad.to(logits.scalar_type()).contiguous() : grad;
    };
    const at::Tensor weights = flat(grads[0]), probSum = flat(grads[1]), lseSquaredSum = flat(grads[2]);
    at::Tensor gradLogits = at::empty_like(logits);
    cuda::scoreBackward(scoreArgs(logits, options),
                        {.indices = indices.data_ptr<int64_t>(),
                         .weights = dataOrNull(weights),
                         .probSum = dataOrNull(probSum),
                         .lseSquaredSum = dataOrNull(lseSquaredSum)},
                        gradLogits.data_ptr());
    return {gradLogits};
  }
};

#if BULKHEAD_MM_OUT_DTYPE
// Gradients of float32 logits = tokens @ gate^T to the bf16 or fp16 tokens and
// gate, summed in float32 as the converting form's are and each rounded once:
// fp16 multiplies float32 copies, bf16 the gradient's two bf16 halves (below).
// Like ATen's mm, it keeps the tokens only for the gate's gradient and the
// gate only for the tokens'.
struct LogitsBackward : torch::autograd::Node {
  torch::autograd::SavedVariable savedTokens, savedGate;
  at::ScalarType type = at::kBFloat16;
  std::string name() const override { return "bulkhead::RouterLogitsBackward"; }
  void release_variables() override {
    savedTokens.reset_data();
    savedGate.reset_data();
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::RouterLogitsBackward");
    at::Tensor gradTokens, gradGate;
    if (!grads[0].defined()) return {gradTokens, gradGate};
    const c10::cuda::CUDAGuard onDevice(grads[0].device());
    const at::Tensor grad = grads[0].to(at::kFloat);
    const bool needTokens = task_should_compute_output(0), needGate = task_should_compute_output(1);
    if (type == at::kBFloat16) return splitProducts(grad, needTokens, needGate);
    if (needTokens) gradTokens = at::mm(grad, savedGate.unpack().to(at::kFloat)).to(type);
    if (needGate) gradGate = at::mm(grad.t(), savedTokens.unpack().to(at::kFloat)).to(type);
    return {gradTokens, gradGate};
  }

  // bf16: the float32 gradient as two bf16 halves, grad = high + low to 16 of
  // its 24 significant bits (bf16 has float32's exponent range, so nothing
  // underflows that float32 keeps; an infinite gradient, or one past bf16's
  // largest finite value, becomes NaN), side by side as [T, 2E]; then bf16
  // tensor core products that accumulate in float32, with the tokens and gate
  // as they are (exact in bf16) instead of float32 copies of them. The gate's
  // gradient is written in float32 and rounded once; the tokens' is rounded
  // once from cuBLAS's float32 sums (over K = 2E, too short for cuBLAS to
  // split and round partial sums where torch allows bf16 reductions).
  torch::autograd::variable_list splitProducts(const at::Tensor& grad, bool needTokens, bool needGate) {
    if (!needTokens && !needGate) return {at::Tensor(), at::Tensor()};
    const int64_t experts = grad.size(1);
    at::Tensor halves = at::empty({grad.size(0), 2 * experts}, grad.options().dtype(at::kBFloat16));
    at::Tensor high = halves.narrow(1, 0, experts), low = halves.narrow(1, experts, experts);
    high.copy_(grad);
    at::sub_out(low, grad, high);  // in float32, rounded once to bf16
    at::Tensor gradTokens, gradGate;
    if (needTokens) {
      const at::Tensor gate = savedGate.unpack();
      gradTokens = at::mm(halves, at::cat({gate, gate}));  // [T, 2E] x [2E, H]: high @ gate + low @ gate
    }
    if (needGate) {
      at::Tensor both = at::mm(halves.t(), savedTokens.unpack(), at::kFloat);  // [2E, H], float32
      gradGate = at::empty({experts, both.size(1)}, both.options().dtype(at::kBFloat16));
      at::add_out(gradGate, both.narrow(0, 0, experts), both.narrow(0, experts, experts));
    }
    return {gradTokens, gradGate};
  }
};
#endif

}  // namespace
#endif

std::optional<at::Tensor> mixedPrecisionLogits(const at::Tensor& tokens, const at::Tensor& gate) {
#if BULKHEAD_MOE_KERNELS && BULKHEAD_MM_OUT_DTYPE
  const at::ScalarType type = tokens.scalar_type();
  const bool applies = tokens.is_cuda() && gate.device() == tokens.device() && tokens.dim() == 2 && gate.dim() == 2 &&
                       tokens.size(0) > 0 && tokens.size(1) == gate.size(1) &&
                       (type == at::kBFloat16 || type == at::kHalf) && gate.scalar_type() == type;
  if (!applies) return std::nullopt;
  const c10::cuda::CUDAGuard onDevice(tokens.device());
  at::Tensor logits = at::mm(tokens.detach(), gate.detach().t(), at::kFloat);  // the node below is its graph
  if (torch::autograd::GradMode::is_enabled() && (tokens.requires_grad() || gate.requires_grad())) {
    auto node = std::shared_ptr<LogitsBackward>(new LogitsBackward(), torch::autograd::deleteNode);
    if (gate.requires_grad()) node->savedTokens = torch::autograd::SavedVariable(tokens, /*is_output=*/false);
    if (tokens.requires_grad()) node->savedGate = torch::autograd::SavedVariable(gate, /*is_output=*/false);
    node->type = type;
    node->set_next_edges(torch::autograd::collect_next_edges(tokens, gate));
    torch::autograd::set_history(logits, node);
  }
  return logits;
#else
  (void)tokens, (void)gate;
  return std::nullopt;
#endif
}

std::optional<at::Tensor> capacityPositionKernels(const at::Tensor& indices, const at::Tensor& weights,
                                                  int numExperts) {
#if BULKHEAD_MOE_KERNELS
  const bool applies = indices.is_cuda() && weights.device() == indices.device() &&
                       indices.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat &&
                       indices.numel() == weights.numel() && indices.numel() <= cuda::kMaxCapacitySlots &&
                       numExperts > 0;
  if (!applies) return std::nullopt;
  const c10::cuda::CUDAGuard onDevice(indices.device());
  const at::Tensor flatIndices = indices.reshape(-1).contiguous(), flatWeights = weights.reshape(-1).contiguous();
  const int64_t slots = flatIndices.numel();
  at::Tensor position = at::empty({slots}, flatIndices.options());
  at::Tensor scratch = at::empty({static_cast<int64_t>(cuda::capacityScratchBytes(slots, numExperts))},
                                 flatIndices.options().dtype(at::kByte));
  cuda::capacityPositions({.slots = slots,
                           .experts = numExperts,
                           .indices = flatIndices.data_ptr<int64_t>(),
                           .weights = flatWeights.data_ptr<float>(),
                           .position = position.data_ptr<int64_t>(),
                           .scratch = scratch.data_ptr(),
                           .stream = c10::cuda::getCurrentCUDAStream(indices.device().index()).stream()});
  return position.view(indices.sizes());
#else
  (void)indices, (void)weights, (void)numExperts;
  return std::nullopt;
#endif
}

std::optional<FusedScores> fusedScores(const at::Tensor& logits, const RouterOptions& options, const at::Tensor& bias,
                                       const at::Tensor& noiseKeys) {
#if BULKHEAD_MOE_KERNELS
  const bool applies = logits.is_cuda() && logits.dim() == 2 && logits.size(0) > 0 &&
                       logits.size(1) <= cuda::kMaxScoreExperts && options.topK >= 1 &&
                       options.topK <= std::min<int64_t>(logits.size(1), cuda::kMaxScoreTopK) &&
                       (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble);
  if (!applies) return std::nullopt;
  const c10::cuda::CUDAGuard onDevice(logits.device());
  const at::Tensor input = logits.detach().contiguous();
  const int64_t tokens = input.size(0), experts = input.size(1), rows = cuda::scorePartialRows(tokens);
  const at::Tensor biasOnDevice = bias.defined() ? bias.to(input.device(), at::kFloat).contiguous() : at::Tensor();
  const at::Tensor keysOnDevice =
      noiseKeys.defined() ? noiseKeys.to(input.device(), at::kLong).reshape({-1}).contiguous() : at::Tensor();
  FusedScores scores;
  scores.indices = at::empty({tokens, options.topK}, input.options().dtype(at::kLong));
  scores.weights = at::empty({tokens, options.topK}, input.options());
  if (options.capacityFactor == 0) scores.keep = at::empty({tokens, options.topK}, input.options().dtype(at::kBool));
  scores.tokensPerExpert = at::zeros({experts}, input.options().dtype(at::kLong));
  scores.probSum = at::empty({experts}, input.options());
  scores.lseSquaredSum = at::empty({}, input.options());
  at::Tensor probPartial = at::empty({rows, experts}, input.options());
  at::Tensor lsePartial = at::empty({rows}, input.options());
  cuda::ScoreArgs args = scoreArgs(input, options);
  if (keysOnDevice.defined()) {
    args.noiseKeys = keysOnDevice.data_ptr<int64_t>();
    args.noiseStd = options.selectionNoise;
    args.noiseSeed = options.noiseSeed;
  }
  cuda::scoreForward(args, biasOnDevice.defined() ? biasOnDevice.data_ptr<float>() : nullptr,
                     {.indices = scores.indices.data_ptr<int64_t>(),
                      .weights = scores.weights.data_ptr(),
                      .keep = scores.keep.defined() ? scores.keep.data_ptr<bool>() : nullptr,
                      .counts = scores.tokensPerExpert.data_ptr<int64_t>(),
                      .probSum = scores.probSum.data_ptr(),
                      .lseSquaredSum = scores.lseSquaredSum.data_ptr(),
                      .probPartial = probPartial.data_ptr(),
                      .lsePartial = lsePartial.data_ptr()});
  if (torch::autograd::GradMode::is_enabled() && logits.requires_grad()) {
    auto node = std::shared_ptr<ScoresBackward>(new ScoresBackward(), torch::autograd::deleteNode);
    node->savedLogits = torch::autograd::SavedVariable(input, /*is_output=*/false);
    node->savedIndices = torch::autograd::SavedVariable(scores.indices, /*is_output=*/false);
    node->options = options;
    node->set_next_edges(torch::autograd::collect_next_edges(logits));
    for (at::Tensor* output : {&scores.weights, &scores.probSum, &scores.lseSquaredSum})
      torch::autograd::set_history(*output, node);
  }
  return scores;
#else
  (void)logits, (void)options, (void)bias, (void)noiseKeys;
  return std::nullopt;
#endif
}

}  // namespace bulkhead::moe
