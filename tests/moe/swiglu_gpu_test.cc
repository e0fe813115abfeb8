// The experts' SwiGLU kernels (moe/swiglu.h) against float64 math on the same
// rounded inputs, on one GPU: forward and gradient within one rounding of the
// kernel's type, strided inputs, in-place changes caught, a double backward
// refused, no graph without grad mode. Part of bulkhead_moe_gpu_tests (its
// main skips without a GPU).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "moe/swiglu.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

TEST_CASE("SwiGLU kernels are within one rounding of float64 math, forward and backward", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  // The layer's width in 16-byte vectors (768), rows of odd width (37) that
  // take the element-wise kernels, and more element groups than one pass of
  // the grid covers (460,000 rows of 37); and a strided input (the first 2F
  // columns of wider rows).
  for (auto [dtype, rows, width, strided] : {std::tuple{at::kDouble, 300L, 768L, false},
                                             {at::kFloat, 300L, 768L, false},
                                             {at::kBFloat16, 300L, 768L, false},
                                             {at::kHalf, 300L, 768L, false},
                                             {at::kDouble, 300L, 37L, false},
                                             {at::kFloat, 300L, 37L, false},
                                             {at::kBFloat16, 300L, 37L, false},
                                             {at::kBFloat16, 460000L, 37L, false},
                                             {at::kBFloat16, 300L, 768L, true}}) {
    // Gates well past silu's bend on both sides.
    const int64_t columns = strided ? 2 * width + 24 : 2 * width;
    at::Tensor leaf = (4 * at::randn({rows, columns}, testing::sharedGenerator(rows + width), at::kDouble))
                          .to(gpu, dtype)
                          .requires_grad_(true);
    at::Tensor gateUp = strided ? leaf.narrow(1, 0, 2 * width) : leaf;
    at::Tensor gradOut =
        at::randn({rows, width}, testing::sharedGenerator(rows + width + 1), at::kDouble).to(gpu, dtype);
    at::Tensor out = swiglu(gateUp);
    out.backward(gradOut);
    REQUIRE(out.grad_fn() != nullptr);
    CHECK(out.grad_fn()->name() == "bulkhead::SwigluBackward");

    at::Tensor exactIn = gateUp.detach().to(at::kDouble).requires_grad_(true);
    at::Tensor gradIn = leaf.grad().narrow(1, 0, 2 * width);
    at::Tensor exact = swigluReference(exactIn);
    exact.backward(gradOut.to(at::kDouble));
    // One rounding to the type (half an ulp), with room for float's own steps.
    const double tolerance = dtype == at::kDouble  ? 1e-12
                             : dtype == at::kFloat ? 1e-5
                             : dtype == at::kHalf  ? 1.0 / 1024
                                                   : 1.0 / 128;
    INFO("dtype " << c10::toString(dtype) << " rows " << rows << " width " << width << " strided " << strided);
    CHECK(at::allclose(out.to(at::kDouble), exact, tolerance, tolerance));
    CHECK(at::allclose(gradIn.to(at::kDouble), exactIn.grad(), tolerance, tolerance));
    if (strided) CHECK(leaf.grad().narrow(1, 2 * width, 24).eq(0).all().item<bool>());
  }
}

TEST_CASE(
    "SwiGLU kernels refuse an input changed since the forward and a double backward, and record nothing "
    "without grad mode",
    "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  at::Tensor leaf =
      at::randn({64, 96}, testing::sharedGenerator(7), at::kDouble).to(gpu, at::kBFloat16).requires_grad_(true);
  at::Tensor gateUp = leaf * 2;
  at::Tensor out = swiglu(gateUp);
  gateUp.add_(1);
  try {
    out.sum().backward();
    FAIL("the backward used an input changed in place since the forward");
  } catch (const c10::Error& error) {
    CHECK(std::string(error.what()).find("modified by an inplace operation") != std::string::npos);
  }

  at::Tensor twice = swiglu(leaf).sum();
  CHECK_THROWS_AS(torch::autograd::grad({twice}, {leaf}, {}, /*retain_graph=*/true, /*create_graph=*/true),
                  ConfigError);
  CHECK(torch::autograd::grad({twice}, {leaf})[0].defined());  // first order still works

  const c10::NoGradGuard noGrad;
  CHECK_FALSE(swiglu(leaf).requires_grad());
  CHECK_THROWS_AS(swiglu(leaf.narrow(1, 0, 95)), ConfigError);
}

TEST_CASE("SwiGLU with live rows computes each group's first rows and zeroes the rest without reading it",
          "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  // 5 groups of 40 rows: none live, a few, most, all (45 of 40), one; vector and element-wise widths.
  for (auto [dtype, width] : {std::tuple{at::kBFloat16, 768L}, {at::kBFloat16, 37L}, {at::kFloat, 768L}}) {
    INFO(c10::toString(dtype) << ", width " << width);
    const int64_t groupRows = 40;
    at::Tensor live = at::tensor(std::vector<int32_t>{0, 7, 33, 45, 1}, at::kInt);
    at::Tensor liveMask =
        at::arange(groupRows, at::kLong).repeat({5}).lt(live.to(at::kLong).repeat_interleave(groupRows)).unsqueeze(1);
    at::Tensor values = 4 * at::randn({5 * groupRows, 2 * width}, testing::sharedGenerator(31), at::kDouble);
    // The tails hold NaN: a kernel that read them would spread it.
    at::Tensor leaf = at::where(liveMask, values, at::full({}, NAN, at::kDouble)).to(gpu, dtype).requires_grad_(true);
    at::Tensor gradOut = at::randn({5 * groupRows, width}, testing::sharedGenerator(32), at::kDouble);
    gradOut = at::where(liveMask, gradOut, at::full({}, NAN, at::kDouble)).to(gpu, dtype);
    at::Tensor out = swiglu(leaf, live.to(gpu));
    out.backward(gradOut);
    const at::Tensor onDevice = liveMask.to(gpu);
    CHECK_FALSE(out.isnan().any().item<bool>());
    CHECK_FALSE(leaf.grad().isnan().any().item<bool>());
    CHECK(out.masked_select(onDevice.logical_not()).eq(0).all().item<bool>());
    CHECK(leaf.grad().masked_select(onDevice.logical_not()).eq(0).all().item<bool>());
    // The live rows are the plain activation's, forward and backward.
    at::Tensor plainIn = leaf.detach().clone().requires_grad_(true);
    at::Tensor plain = swiglu(plainIn);
    plain.backward(gradOut);
    CHECK(at::equal(out.masked_select(onDevice), plain.masked_select(onDevice)));
    CHECK(at::equal(leaf.grad().masked_select(onDevice), plainIn.grad().masked_select(onDevice)));
    // The ATen form on the CPU (where the kernels do not run) agrees.
    at::Tensor cpuIn = leaf.detach().cpu().to(at::kDouble).requires_grad_(true);
    at::Tensor cpuOut = swiglu(cpuIn, live);
    cpuOut.backward(gradOut.cpu().to(at::kDouble));
    CHECK(at::allclose(cpuOut, out.cpu().to(at::kDouble), 1.0 / 64, 1.0 / 64));
    CHECK(at::allclose(cpuIn.grad(), leaf.grad().cpu().to(at::kDouble), 1.0 / 64, 1.0 / 64));
  }
  at::Tensor rows = at::randn({12, 16}, testing::sharedGenerator(33), at::kFloat).to(gpu);
  CHECK_THROWS_AS(swiglu(rows, at::tensor(std::vector<int32_t>{1, 2, 3, 4, 5}, at::kInt).to(gpu)), ConfigError);
  CHECK_THROWS_AS(swiglu(rows, at::tensor(std::vector<int32_t>{1, 2}, at::kInt)), ConfigError);  // another device
  CHECK_THROWS_AS(swiglu(rows, at::tensor(std::vector<int64_t>{1, 2}, at::kLong).to(gpu)), ConfigError);
}

}  // namespace
}  // namespace bulkhead::moe
