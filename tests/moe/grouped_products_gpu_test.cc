// The experts' grouped products on Hopper (moe/grouped_products.h) against
// float64 math on the same bf16 inputs, on one GPU: the output and both
// gradients within a rounding of bf16, groups of every size (empty, under one
// tile, several tiles, ragged tails), rows past the last group end, widths
// that are not whole tiles; an input changed in place caught, a double
// backward refused, shapes the kernels do not take refused. Skipped with a
// message where the kernels do not apply (not a
// Hopper GPU, or a build without sm_90a code). Part of bulkhead_moe_gpu_tests.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <string>
#include <tuple>
#include <vector>

#include "moe/grouped_products.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

// Group ends for `rows` rows in `groups` groups drawn from `salt`, group 1
// empty, the last `tail` rows in none.
at::Tensor drawEnds(int64_t groups, int64_t rows, int64_t tail, int salt) {
  at::Tensor weights = at::rand({groups}, testing::sharedGenerator(salt), at::kDouble) + 0.05;
  weights[1] = 0;
  at::Tensor sizes = (weights / weights.sum() * static_cast<double>(rows - tail)).floor().to(at::kLong);
  sizes[groups - 1] += rows - tail - sizes.sum().item<int64_t>();
  return sizes.cumsum(0).to(at::kInt);
}

// Each group's rows times its weight transposed, in float64 on the host.
at::Tensor exactProducts(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends) {
  at::Tensor out = at::zeros({x.size(0), w.size(1)}, x.options());
  int64_t start = 0;
  for (int64_t g = 0; g < w.size(0); ++g) {
    const int64_t end = ends[g].item<int64_t>();
    if (end > start) out.narrow(0, start, end - start).copy_(at::mm(x.narrow(0, start, end - start), w[g].t()));
    start = end;
  }
  return out;
}

bool kernelsHere() {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, 0);
  return hopperProductsApply(at::empty({256, 128}, bf16), at::empty({2, 128, 128}, bf16),
                             at::full({2}, 128, bf16.dtype(at::kInt)));
}

void checkClose(const at::Tensor& got, const at::Tensor& exact, const char* what) {
  // One rounding to bf16 (half an ulp: 2^-9 of the value), twice over, and
  // float32 accumulation, judged against the largest value.
  const double scale = exact.abs().max().item<double>();
  INFO(what << ": largest error " << (got.cpu().to(at::kDouble) - exact).abs().max().item<double>() << " of " << scale);
  CHECK(at::allclose(got.cpu().to(at::kDouble), exact, 1.0 / 256, 1e-3 * scale));
}

// The output and both gradients of the products over `ends` (rows past the
// last end in none) against float64 math on the same rounded inputs.
void checkProducts(const at::Tensor& ends, int64_t rows, int64_t k, int64_t out, int salt) {
  const at::Device gpu(at::kCUDA, 0);
  const int64_t groups = ends.size(0);
  const at::Tensor x64 = at::randn({rows, k}, testing::sharedGenerator(salt + 1), at::kDouble);
  const at::Tensor w64 = at::randn({groups, out, k}, testing::sharedGenerator(salt + 2), at::kDouble) * 0.05;
  const at::Tensor dy64 = at::randn({rows, out}, testing::sharedGenerator(salt + 3), at::kDouble);
  at::Tensor x = x64.to(gpu, at::kBFloat16).requires_grad_(true), w = w64.to(gpu, at::kBFloat16).requires_grad_(true);
  const at::Tensor dy = dy64.to(gpu, at::kBFloat16);
  at::Tensor y = hopperGroupedLinear(x, w, ends.to(gpu));
  REQUIRE(y.grad_fn() != nullptr);
  CHECK(y.grad_fn()->name() == "bulkhead::GroupedProductBackward");
  y.backward(dy);

  // The exact answer on the rounded inputs.
  at::Tensor xe = x.detach().cpu().to(at::kDouble).requires_grad_(true);
  at::Tensor we = w.detach().cpu().to(at::kDouble).requires_grad_(true);
  at::Tensor ye = exactProducts(xe, we, ends);
  ye.backward(dy.cpu().to(at::kDouble));
  checkClose(y, ye.detach(), "output");
  checkClose(x.grad(), xe.grad(), "rows' gradient");
  checkClose(w.grad(), we.grad(), "weights' gradient");
  const int64_t covered = ends[groups - 1].item<int64_t>();
  CHECK(y.narrow(0, covered, rows - covered).eq(0).all().item<bool>());
  CHECK(x.grad().narrow(0, covered, rows - covered).eq(0).all().item<bool>());
  const at::Tensor sizes = at::diff(ends.to(at::kLong), 1, 0, at::zeros({1}, at::kLong));
  for (int64_t g = 0; g < groups; ++g) {
    if (sizes[g].item<int64_t>() == 0) CHECK(w.grad()[g].eq(0).all().item<bool>());  // an empty group
  }
}

TEST_CASE("Hopper grouped products are within a bf16 rounding of float64 math, forward and both gradients",
          "[moe][gpu]") {
  if (!kernelsHere()) {
    WARN("skipped: Bulkhead's grouped products do not apply here (they need a Hopper GPU and sm_90a code)");
    return;
  }
  // groups, rows, K, Out, rows past the last end
  for (auto [groups, rows, k, out, tail] : {std::tuple{5L, 1000L, 192L, 320L, 0L},
                                            {8L, 3001L, 256L, 520L, 77L},
                                            {3L, 700L, 2048L, 1536L, 0L},
                                            {64L, 9000L, 768L, 2048L, 5L},
                                            {130L, 2000L, 136L, 64L, 0L}}) {
    INFO(groups << " groups, " << rows << " rows, K " << k << ", Out " << out << ", tail " << tail);
    const int salt = static_cast<int>(rows + k);
    checkProducts(drawEnds(groups, rows, tail, salt), rows, k, out, salt);
  }
}

TEST_CASE("Hopper grouped products at every kind of group end a tile meets", "[moe][gpu]") {
  if (!kernelsHere()) {
    WARN("skipped: Bulkhead's grouped products do not apply here (they need a Hopper GPU and sm_90a code)");
    return;
  }
  // Sizes whose ends fall in each 16-row slice of a 64-deep step and on its
  // edges (wgrad's last step), and in each half of a 128-row tile (a tile
  // whose rows end in its first half leaves the second warpgroup nothing).
  const std::vector<int64_t> sizes = {16, 0, 17, 33, 48, 49, 63, 64, 65, 127, 128, 129, 200, 1, 31, 96};
  const at::Tensor ends = at::tensor(sizes, at::kLong).cumsum(0).to(at::kInt);
  const int64_t covered = ends[-1].item<int64_t>();
  checkProducts(ends, covered + 3, 256, 320, 5);
}

TEST_CASE("Hopper grouped products refuse an input changed in place and a double backward", "[moe][gpu]") {
  if (!kernelsHere()) {
    WARN("skipped: Bulkhead's grouped products do not apply here (they need a Hopper GPU and sm_90a code)");
    return;
  }
  const at::Device gpu(at::kCUDA, 0);
  const at::Tensor ends = drawEnds(4, 512, 0, 9).to(gpu);
  at::Tensor x = at::randn({512, 128}, testing::sharedGenerator(10), at::kDouble).to(gpu, at::kBFloat16);
  at::Tensor w = (at::randn({4, 256, 128}, testing::sharedGenerator(11), at::kDouble) * 0.1)
                     .to(gpu, at::kBFloat16)
                     .requires_grad_(true);
  at::Tensor rows = (x * 1).requires_grad_(true);
  at::Tensor y = hopperGroupedLinear(rows, w, ends);
  rows.detach().add_(1);
  try {
    y.sum().backward();
    FAIL("the backward used rows changed in place since the forward");
  } catch (const c10::Error& error) {
    CHECK(std::string(error.what()).find("modified by an inplace operation") != std::string::npos);
  }
  at::Tensor twice = hopperGroupedLinear(x, w, ends).sum();
  CHECK_THROWS_AS(torch::autograd::grad({twice}, {w}, {}, /*retain_graph=*/true, /*create_graph=*/true), ConfigError);
  CHECK(torch::autograd::grad({twice}, {w})[0].defined());
  // Shapes the kernels do not take are refused, not computed wrongly.
  CHECK_FALSE(hopperProductsApply(x.narrow(1, 0, 40), w.narrow(2, 0, 40), ends));
  CHECK_THROWS_AS(hopperGroupedLinear(x.to(at::kFloat), w, ends), ConfigError);
}

}  // namespace
}  // namespace bulkhead::moe
