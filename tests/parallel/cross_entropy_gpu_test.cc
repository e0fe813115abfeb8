// The vocabulary-parallel cross-entropy of half-precision logits on GPUs (its kernels,
// parallel/cuda/cross_entropy_kernels.h) against float64 math on the same rounded logits, with the
// vocabulary split over every GPU as tp: the per-token losses within one rounding of the logits' dtype,
// the gradient within one rounding of the float64 gradient, for a vocabulary in 16-byte vectors and one
// that is not (odd blocks take the element-wise kernels), and a double backward refused.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <string>
#include <tuple>

#include "parallel/process_groups.h"
#include "parallel/shard_init.h"
#include "parallel/tensor_parallel.h"
#include "parallel/vocab_parallel.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

namespace bulkhead::testing {
namespace {

TEST_CASE("the cross-entropy kernels give float64's losses and gradients with the vocabulary over tp", "[gpu]") {
  const int tp = gpuWorld().size();
  const parallel::ProcessGroups groups = parallel::ProcessGroups::create(
      gpuWorldPtr(), {.tp = tp}, {.deadline = Deadline::after(std::chrono::seconds(120))});
  const parallel::TpGroup group = parallel::TpGroup::dense(groups);
  for (auto [dtype, rows, vocab] :
       {std::tuple{at::kBFloat16, 300L, 32000L * tp}, {at::kBFloat16, 37L, 151L * tp}, {at::kHalf, 64L, 2048L * tp}}) {
    // Logits spread wide (a few dominate each row), the same on every rank; this rank holds its block.
    const at::Tensor full = (6 * gaussian(static_cast<int>(rows + vocab), {rows, vocab})).to(dtype).to(at::kDouble);
    const at::Tensor targets =
        at::randint(vocab, {rows}, sharedGenerator(static_cast<int>(vocab)), at::TensorOptions().dtype(at::kLong));
    const parallel::Range block = parallel::partition(vocab, tp, group.rank());
    at::Tensor logits = full.narrow(1, block.begin, block.length).to(gpu(), dtype).requires_grad_(true);
    const at::Tensor scale = gaussian(static_cast<int>(rows), {rows});

    const at::Tensor losses = parallel::vocabParallelCrossEntropy(logits, targets.to(gpu()), block.begin, group);
    REQUIRE(losses.grad_fn() != nullptr);
    CHECK(losses.grad_fn()->name().find("FusedVocabCrossEntropy") != std::string::npos);
    losses.backward(scale.to(gpu(), dtype));

    const at::Tensor logSoftmax = at::log_softmax(full, 1);
    const at::Tensor want = -logSoftmax.gather(1, targets.unsqueeze(1)).squeeze(1);
    const at::Tensor oneHot = at::zeros_like(full).scatter_(1, targets.unsqueeze(1), 1.0);
    // The gradient the kernel rounds: (softmax - one-hot) times the rounded incoming gradient.
    const at::Tensor wantGrad = ((logSoftmax.exp() - oneHot) * scale.to(dtype).to(at::kDouble).unsqueeze(1))
                                    .narrow(1, block.begin, block.length);
    const double ulp = dtype == at::kHalf ? 1.0 / 1024 : 1.0 / 128;
    const at::Tensor got = losses.detach().cpu().to(at::kDouble);
    const double lossError = ((got - want).abs() / want.abs().clamp_min(1)).max().item<double>();
    const at::Tensor gotGrad = logits.grad().cpu().to(at::kDouble);
    const double gradError = ((gotGrad - wantGrad).abs() - ulp * wantGrad.abs()).max().item<double>();
    INFO(fmt::format("{} rows {} vocab {} at tp {}: loss error {:.3g}, gradient error beyond one rounding {:.3g}",
                     c10::toString(dtype), rows, vocab, tp, lossError, gradError));
    CHECK(lossError <= ulp);
    CHECK(gradError <= 1e-6);
    CHECK(got.mean().item<double>() > 1);  // the losses are not degenerate
  }
}

TEST_CASE("the cross-entropy kernels refuse a double backward", "[gpu]") {
  const parallel::ProcessGroups groups = parallel::ProcessGroups::create(
      gpuWorldPtr(), {.tp = gpuWorld().size()}, {.deadline = Deadline::after(std::chrono::seconds(120))});
  const parallel::TpGroup group = parallel::TpGroup::dense(groups);
  at::Tensor logits = gaussian(1, {4, 64}).to(gpu(), at::kBFloat16).requires_grad_(true);
  const at::Tensor targets = at::zeros({4}, at::TensorOptions().dtype(at::kLong).device(gpu()));
  const at::Tensor loss = parallel::vocabParallelCrossEntropy(logits, targets, 64 * group.rank(), group).sum();
  CHECK_THROWS_AS(torch::autograd::grad({loss}, {logits}, {}, /*retain_graph=*/true, /*create_graph=*/true),
                  ConfigError);
  CHECK(torch::autograd::grad({loss}, {logits})[0].defined());  // first order still works
}

}  // namespace
}  // namespace bulkhead::testing
