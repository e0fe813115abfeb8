// The experts' SwiGLU kernels (moe/swiglu.h) against float64 math on the same
// rounded inputs, on one GPU: forward and gradient within one rounding of the
// kernel's type, strided inputs, in-place changes caught, a double backward
// refused, no graph without grad mode. Part of bulkhead_moe_gpu_tests (its
// main skips without a GPU).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <string>
#include <tuple>

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

}  // namespace
}  // namespace bulkhead::moe
