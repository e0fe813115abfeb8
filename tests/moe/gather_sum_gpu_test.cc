// The combine's gather-sum kernels (moe/cuda) against the ATen reference, on
// one GPU: forward and both gradients, for every row dtype; the grouping
// kernels against the sort the CPU runs (route_gpu_test.cc adds the routing
// kernels). Skipped (exit 77)
// where libtorch has no CUDA or no GPU is present.
#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <cstdio>
#include <limits>
#include <tuple>
#include <utility>

#include "moe/dispatcher.h"
#include "moe/gather_sum.h"
#include "tests/support/catch_compat.h"
#include "tests/support/catch_session.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

TEST_CASE("gather-sum kernels equal the reference, forward and backward", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  // Widths: whole 16-byte vectors (96), more vectors than threads (2056), and
  // rows that are not whole vectors (37), which take the element-wise kernels.
  for (auto [dtype, width] : {std::pair{at::kDouble, 96},
                              {at::kFloat, 96},
                              {at::kBFloat16, 96},
                              {at::kDouble, 37},
                              {at::kFloat, 37},
                              {at::kBFloat16, 37},
                              {at::kBFloat16, 2056},
                              {at::kFloat, 2056}}) {
    const double tolerance = dtype == at::kDouble ? 1e-12 : dtype == at::kFloat ? 1e-5 : 2e-2;
    // 300 source rows, each named once by a [120, 5] table with gaps.
    at::Tensor table = at::randperm(600, testing::sharedGenerator(1), at::kLong).view({120, 5});
    table = at::where(table.lt(300), table, at::full_like(table, -1));
    at::Tensor source = at::randn({300, width}, testing::sharedGenerator(2), at::kDouble);
    at::Tensor weights = at::rand({120, 5}, testing::sharedGenerator(3), at::kDouble);
    at::Tensor grad = at::randn({120, width}, testing::sharedGenerator(4), at::kDouble);
    for (bool weighted : {true, false}) {
      auto run = [&](bool kernels) {
        at::Tensor s = source.to(gpu, dtype).requires_grad_(true);
        at::Tensor w = weighted ? weights.to(gpu, dtype == at::kDouble ? at::kDouble : at::kFloat).requires_grad_(true)
                                : at::Tensor();
        at::Tensor t = table.to(gpu);
        at::Tensor out = kernels ? gatherSum(s, t, w) : gatherSumReference(s, t, w);
        out.backward(grad.to(gpu, dtype));
        return std::make_tuple(out.to(at::kDouble).cpu(), s.grad().to(at::kDouble).cpu(),
                               weighted ? w.grad().to(at::kDouble).cpu() : at::Tensor());
      };
      auto [out, gradSource, gradWeights] = run(true);
      auto [refOut, refSource, refWeights] = run(false);
      INFO("dtype " << c10::toString(dtype) << " width " << width << " weighted " << weighted);
      CHECK(at::allclose(out, refOut, tolerance, tolerance));
      CHECK(at::allclose(gradSource, refSource, tolerance, tolerance));
      if (weighted) CHECK(at::allclose(gradWeights, refWeights, tolerance, tolerance * 10));
    }
  }
}

TEST_CASE("gather-sum over a table naming every source row writes every gradient row", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  // 300 source rows named once each by a [100, 4] table with gaps.
  at::Tensor table = at::full({400}, -1, at::kLong);
  table.index_put_({at::randperm(400, testing::sharedGenerator(5), at::kLong).narrow(0, 0, 300)},
                   at::randperm(300, testing::sharedGenerator(6), at::kLong));
  table = table.view({100, 4});
  at::Tensor source = at::randn({300, 2056}, testing::sharedGenerator(7), at::kDouble);
  at::Tensor weights = at::rand({100, 4}, testing::sharedGenerator(8), at::kDouble);
  at::Tensor grad = at::randn({100, 2056}, testing::sharedGenerator(9), at::kDouble);
  for (auto dtype : {at::kDouble, at::kBFloat16}) {
    const double tolerance = dtype == at::kDouble ? 1e-12 : 2e-2;
    auto run = [&](bool kernels) {
      at::Tensor s = source.to(gpu, dtype).requires_grad_(true);
      at::Tensor w = weights.to(gpu, dtype == at::kDouble ? at::kDouble : at::kFloat).requires_grad_(true);
      at::Tensor t = table.to(gpu), g = grad.to(gpu, dtype);
      at::Tensor out = kernels ? gatherSum(s, t, w, SourceRows::Every) : gatherSumReference(s, t, w);
      // Freed at once: the caching allocator is likely to hand this block to
      // the source's gradient, so a row the backward did not write stays NaN.
      const void* nanBlock = at::full_like(s, std::numeric_limits<double>::quiet_NaN()).data_ptr();
      out.backward(g);
      if (kernels && s.grad().data_ptr() != nanBlock) WARN("the gradient did not reuse the NaN-filled block");
      return std::make_tuple(out.to(at::kDouble).cpu(), s.grad().to(at::kDouble).cpu(), w.grad().to(at::kDouble).cpu());
    };
    auto [out, gradSource, gradWeights] = run(true);
    auto [refOut, refSource, refWeights] = run(false);
    INFO("dtype " << c10::toString(dtype));
    CHECK(at::allclose(out, refOut, tolerance, tolerance));
    CHECK(at::isfinite(gradSource).all().item<bool>());
    CHECK(at::allclose(gradSource, refSource, tolerance, tolerance));
    CHECK(at::allclose(gradWeights, refWeights, tolerance, tolerance * 10));
  }
}

TEST_CASE("gather-sum keeps its source only for learned weights, and refuses one changed since the forward",
          "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  at::Tensor table = at::randperm(64, testing::sharedGenerator(11), at::kLong).view({32, 2}).to(gpu);
  at::Tensor leaf = at::randn({64, 40}, testing::sharedGenerator(12), at::kDouble).to(gpu).requires_grad_(true);
  at::Tensor weights = at::rand({32, 2}, testing::sharedGenerator(13), at::kDouble).to(gpu);
  at::Tensor grad = at::randn({32, 40}, testing::sharedGenerator(14), at::kDouble).to(gpu);

  // Learned weights: their gradient reads the source, so a change to it in place is caught.
  {
    at::Tensor source = leaf * 2, w = weights.clone().requires_grad_(true);
    at::Tensor out = gatherSum(source, table, w, SourceRows::Every);
    source.add_(1);
    try {
      out.backward(grad);
      FAIL("the backward used a source changed in place since the forward");
    } catch (const c10::Error& error) {
      CHECK(std::string(error.what()).find("modified by an inplace operation") != std::string::npos);
    }
  }
  // Fixed weights, or none: the source is not kept, so changing it does not matter.
  for (bool weighted : {true, false}) {
    INFO("weighted " << weighted);
    at::Tensor source = leaf * 2;
    at::Tensor w = weighted ? weights : at::Tensor();
    at::Tensor out = gatherSum(source, table, w, SourceRows::Every);
    source.add_(1);
    leaf.mutable_grad() = at::Tensor();
    out.backward(grad);
    at::Tensor expected = leaf.detach().clone().requires_grad_(true);
    (gatherSumReference(expected * 2, table, w) * grad).sum().backward();
    CHECK(at::allclose(leaf.grad(), expected.grad(), 1e-12, 1e-12));
  }
  // A second backward through a freed graph raises, as in ATen.
  at::Tensor w = weights.clone().requires_grad_(true);
  at::Tensor out = gatherSum(leaf * 2, table, w, SourceRows::Every);
  out.backward(grad);
  CHECK_THROWS_AS(out.backward(grad), c10::Error);
}

TEST_CASE("grouping kernels list entries as the stable sort does", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  // Sizes around the kernels' segment boundaries (512 entries per warp, at most 256 segments).
  for (auto [rows, columns, groups] : {std::tuple<int64_t, int64_t, int>{1, 1, 1},
                                       {7, 3, 2},
                                       {4096, 2, 2},
                                       {8171, 8, 32},
                                       {32681, 8, 32},
                                       {70001, 4, 512},
                                       {600, 8, 5}}) {
    // Keys in [-1, groups), about a third of them -1, some groups left empty.
    at::Tensor keys = at::randint(-1, groups, {rows, columns}, testing::sharedGenerator(rows + groups), at::kLong);
    keys = at::where(keys.remainder(3).eq(0), at::full_like(keys, -1), keys);
    if (groups > 2) keys = at::where(keys.eq(1), at::full_like(keys, -1), keys);
    const int64_t count = keys.ge(0).sum().item<int64_t>();
    Grouping expected = groupEntries(keys, groups, count);
    const at::Tensor expectedEnds = at::bincount(keys.masked_select(keys.ge(0)), {}, groups).cumsum(0, at::kInt);
    INFO("rows " << rows << " columns " << columns << " groups " << groups);
    at::Tensor ends;
    Grouping got = groupEntries(keys.to(gpu), groups, count, &ends);
    REQUIRE(got.order.is_cuda());
    CHECK(at::equal(got.order.cpu(), expected.order));
    CHECK(at::equal(got.table.cpu(), expected.table));
    REQUIRE(ends.defined());
    CHECK(at::equal(ends.cpu(), expectedEnds));
    Grouping withoutEnds = groupEntries(keys.to(gpu), groups, count);
    CHECK(at::equal(withoutEnds.table.cpu(), expected.table));
  }
  // No entries at all: every group ends at 0.
  at::Tensor ends;
  Grouping none = groupEntries(at::empty({0, 4}, at::TensorOptions(at::kLong).device(gpu)), 3, 0, &ends);
  CHECK(none.order.numel() == 0);
  REQUIRE(ends.defined());
  CHECK(at::equal(ends.cpu(), at::zeros({3}, at::kInt)));
}

}  // namespace
}  // namespace bulkhead::moe

int main(int argc, char** argv) {
  if (!at::hasCUDA()) {
    std::printf("SKIPPED: no CUDA GPU here (libtorch without CUDA, or no device); runs on the device machine\n");
    return 77;
  }
  return bulkhead::testing::runCatch(argc, argv);
}
