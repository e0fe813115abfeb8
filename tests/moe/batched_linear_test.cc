// The batched expert product (moe/batched_linear.h) against per-group
// at::matmul with autograd's own gradients, float64, random inputs (one
// process): the weight gradient goes into .grad in place, is added to a held
// one, and is left alone where autograd would leave it alone.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <vector>

#include "moe/batched_linear.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

constexpr int64_t kGroups = 3, kRows = 5, kIn = 4;  // weight [3, 2, 3, 4]: 6 outputs per group

using testing::gaussian;

at::Tensor leafWeight(int salt) { return gaussian(salt, {kGroups, 2, 3, kIn}).requires_grad_(true); }

// Each group's rows times its matrix transposed, through at::matmul and autograd.
at::Tensor reference(const at::Tensor& rows, const at::Tensor& weight) {
  std::vector<at::Tensor> parts;
  for (int64_t g = 0; g < kGroups; ++g)
    parts.push_back(at::matmul(rows.narrow(0, g * kRows, kRows), weight[g].flatten(0, 1).t()));
  return at::cat(parts);
}

struct Pair {
  at::Tensor rows, weight;
};

Pair freshPair(int salt) { return {gaussian(salt, {kGroups * kRows, kIn}).requires_grad_(true), leafWeight(salt + 1)}; }

TEST_CASE("the batched product and its gradients equal per-group products, and weight gradients add up in place",
          "[moe][experts]") {
  Pair ours = freshPair(1);
  Pair theirs{ours.rows.detach().clone().requires_grad_(true), ours.weight.detach().clone().requires_grad_(true)};
  for (int step = 0; step < 3; ++step) {  // the second and third add to the held gradient
    at::Tensor upstream = gaussian(10 + step, {kGroups * kRows, 6});
    at::Tensor out = batchedLinear(ours.rows, ours.weight);
    at::Tensor expected = reference(theirs.rows, theirs.weight);
    CHECK(at::allclose(out, expected, 1e-13, 1e-13));
    torch::autograd::backward({out}, {upstream});
    torch::autograd::backward({expected}, {upstream});
    INFO("step " << step);
    CHECK(at::allclose(ours.rows.grad(), theirs.rows.grad(), 1e-13, 1e-13));
    CHECK(at::allclose(ours.weight.grad(), theirs.weight.grad(), 1e-13, 1e-13));
    CHECK(ours.weight.grad().sizes() == ours.weight.sizes());
  }
  // The held gradient was added to where it lies: the same storage since the first step.
  const void* held = ours.weight.grad().data_ptr();
  torch::autograd::backward({batchedLinear(ours.rows, ours.weight)}, {gaussian(20, {kGroups * kRows, 6})});
  CHECK(ours.weight.grad().data_ptr() == held);
}

TEST_CASE("the batched product's backward writes the weight gradient itself and hands autograd none",
          "[moe][experts]") {
  Pair ours = freshPair(9);
  at::Tensor upstream = gaussian(90, {kGroups * kRows, 6});
  at::Tensor expected = torch::autograd::grad({reference(ours.rows, ours.weight)}, {ours.weight}, {upstream})[0];
  // Called directly (no graph task): the weight's AccumulateGrad would run, so the node writes .grad itself.
  at::Tensor out = batchedLinear(ours.rows, ours.weight);
  torch::autograd::variable_list grads;
  {
    c10::NoGradGuard asInBackward;  // the engine runs a first-order backward without grad mode
    grads = (*out.grad_fn())(torch::autograd::variable_list{upstream});
  }
  REQUIRE(grads.size() == 2);
  CHECK(grads[0].defined());
  CHECK_FALSE(grads[1].defined());
  REQUIRE(ours.weight.grad().defined());
  CHECK(at::allclose(ours.weight.grad(), expected, 1e-13, 1e-13));
  const void* held = ours.weight.grad().data_ptr();
  at::Tensor again = batchedLinear(ours.rows, ours.weight);
  {
    c10::NoGradGuard asInBackward;
    (*again.grad_fn())(torch::autograd::variable_list{upstream});  // added in place
  }
  CHECK(ours.weight.grad().data_ptr() == held);
  CHECK(at::allclose(ours.weight.grad(), 2 * expected, 1e-13, 1e-13));
  // backward(inputs = weight) and a retained graph's second backward add as autograd does.
  ours.weight.mutable_grad().reset();
  at::Tensor kept = batchedLinear(ours.rows, ours.weight);
  torch::autograd::backward({kept}, {upstream}, /*retain_graph=*/true, false, {ours.weight});
  CHECK(at::allclose(ours.weight.grad(), expected, 1e-13, 1e-13));
  CHECK_FALSE(ours.rows.grad().defined());
  torch::autograd::backward({kept}, {upstream});
  CHECK(at::allclose(ours.weight.grad(), 2 * expected, 1e-13, 1e-13));
  // The result is a tensor of its own: changing it in place is allowed.
  at::Tensor changed = batchedLinear(ours.rows, ours.weight);
  changed.mul_(2);
  torch::autograd::backward({changed}, {upstream});
  CHECK(at::allclose(ours.weight.grad(), 4 * expected, 1e-13, 1e-13));
}

TEST_CASE("grad() of the batched product leaves .grad alone and returns what autograd returns", "[moe][experts]") {
  Pair ours = freshPair(3);
  at::Tensor upstream = gaussian(30, {kGroups * kRows, 6});
  at::Tensor rowsGrad = torch::autograd::grad({batchedLinear(ours.rows, ours.weight)}, {ours.rows}, {upstream})[0];
  CHECK_FALSE(ours.weight.grad().defined());
  at::Tensor weightGrad = torch::autograd::grad({batchedLinear(ours.rows, ours.weight)}, {ours.weight}, {upstream})[0];
  CHECK_FALSE(ours.weight.grad().defined());
  CHECK_FALSE(ours.rows.grad().defined());
  auto expected = torch::autograd::grad({reference(ours.rows, ours.weight)}, {ours.rows, ours.weight}, {upstream});
  CHECK(at::allclose(rowsGrad, expected[0], 1e-13, 1e-13));
  CHECK(at::allclose(weightGrad, expected[1], 1e-13, 1e-13));
  // backward(inputs = rows only) does not accumulate into the weight either.
  torch::autograd::backward({batchedLinear(ours.rows, ours.weight)}, {upstream}, {}, false, {ours.rows});
  CHECK_FALSE(ours.weight.grad().defined());
  CHECK(at::allclose(ours.rows.grad(), expected[0], 1e-13, 1e-13));
}

TEST_CASE("a held gradient of another layout, or frozen rows, still get the right sums", "[moe][experts]") {
  Pair ours = freshPair(5);
  at::Tensor frozenRows = ours.rows.detach();
  at::Tensor upstream = gaussian(50, {kGroups * kRows, 6});
  // A held gradient that is a transposed view: added to the usual way (AccumulateGrad).
  at::Tensor start = gaussian(51, {kIn, 3, 2, kGroups}).permute({3, 2, 1, 0});
  REQUIRE_FALSE(start.is_contiguous());
  ours.weight.mutable_grad() = start.clone(at::MemoryFormat::Preserve);
  torch::autograd::backward({batchedLinear(frozenRows, ours.weight)}, {upstream});
  at::Tensor check = ours.weight.detach().clone().requires_grad_(true);
  torch::autograd::backward({reference(frozenRows, check)}, {upstream});
  CHECK(at::allclose(ours.weight.grad(), start + check.grad(), 1e-13, 1e-13));
}

TEST_CASE("the batched product refuses what it cannot multiply, and what changed since its forward", "[moe][experts]") {
  Pair ours = freshPair(7);
  CHECK_THROWS_AS(batchedLinear(ours.rows.narrow(0, 0, 7), ours.weight), ConfigError);  // 7 rows in 3 groups
  CHECK_THROWS_AS(batchedLinear(ours.rows.narrow(1, 0, 3), ours.weight), ConfigError);  // K 3, not 4
  CHECK_THROWS_AS(batchedLinear(ours.rows, ours.weight.detach().transpose(1, 2)), ConfigError);
  CHECK_THROWS_AS(batchedLinear(ours.rows.to(at::kFloat), ours.weight), ConfigError);
  // The weight updated in place between forward and backward: autograd's version check.
  at::Tensor out = batchedLinear(ours.rows, ours.weight);
  {
    c10::NoGradGuard noGrad;
    ours.weight.add_(1.0);
  }
  CHECK_THROWS(torch::autograd::backward({out.sum()}));
  // A double backward would lose second-order terms: refused.
  at::Tensor again = batchedLinear(ours.rows, ours.weight);
  CHECK_THROWS_AS(torch::autograd::grad({again.pow(2).sum()}, {ours.rows}, {}, true, true), ConfigError);
}

}  // namespace
}  // namespace bulkhead::moe
