// The dispatcher's planning, packing and expansion kernels (moe/dispatch_routes.h,
// gatherRows) against the ATen forms the CPU runs, on one GPU: equal values,
// bit for bit. Part of bulkhead_moe_gpu_tests (its main skips without a GPU).
#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "moe/dispatch_routes.h"
#include "moe/dispatcher.h"
#include "moe/gather_sum.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

struct Case {
  int64_t tokens, hidden;
  int ranks, localExperts, topK;
  at::ScalarType tokenType, sideType;
};

// Distinct experts per token (as top-k gives), about one slot in seven dropped.
Routing randomRouting(const Case& c, uint64_t seed) {
  const int64_t experts = static_cast<int64_t>(c.ranks) * c.localExperts;
  Routing routing;
  routing.indices = std::get<1>(at::rand({c.tokens, experts}, testing::sharedGenerator(seed)).topk(c.topK, 1));
  routing.keep = at::rand({c.tokens, c.topK}, testing::sharedGenerator(seed + 1)).lt(0.85);
  routing.weights = at::rand({c.tokens, c.topK}, testing::sharedGenerator(seed + 2), c.sideType);
  return routing;
}

Routing onDevice(const Routing& routing, const at::Device& device) {
  Routing moved;
  moved.indices = routing.indices.to(device);
  moved.keep = routing.keep.to(device);
  moved.weights = routing.weights.to(device);
  return moved;
}

// The same tables, and the same first `rows` rows part by part (the padding
// bytes between the parts are never written).
void checkSameRows(const RoutedLayout& layout, const SendRows& cpuRows, const SendRows& gpuRows, int64_t rows) {
  CHECK(at::equal(gpuRows.table.cpu(), cpuRows.table));
  const RoutedRows want = layout.parts(cpuRows.bytes.narrow(0, 0, rows));
  const RoutedRows have = layout.parts(gpuRows.bytes.narrow(0, 0, rows).cpu());
  CHECK(at::equal(have.rows, want.rows));
  CHECK(at::equal(have.weights, want.weights));
  CHECK(at::equal(have.ids, want.ids));
}

// The kernels take every layout but once-per-rank planning past 64 ranks and
// rows of more than 64 columns; there the GPU runs the ATen forms.
bool kernelsTake(const Case& c, bool perSlot) {
  return (perSlot || c.ranks <= 64) && (perSlot ? c.topK : c.ranks) <= 64;
}

TEST_CASE("route planning and packing kernels equal their ATen forms", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  // Rows of 16-byte vectors (bf16 x 96), of 4-byte words (float x 37) and of
  // odd bytes (bf16 x 37, whose side part then sits at a 4-byte offset); 64
  // ranks (the last a token's rank mask holds) with more counters than a
  // block keeps in shared memory (64 x 132), and 65 ranks (the ATen forms
  // once per rank, the kernels per slot).
  for (const Case& c :
       {Case{37, 96, 1, 8, 2, at::kBFloat16, at::kFloat}, Case{4096, 96, 2, 32, 8, at::kBFloat16, at::kFloat},
        Case{1000, 37, 4, 4, 6, at::kFloat, at::kDouble}, Case{777, 37, 8, 8, 8, at::kBFloat16, at::kFloat},
        Case{300, 64, 3, 5, 4, at::kDouble, at::kDouble}, Case{0, 96, 2, 4, 2, at::kBFloat16, at::kFloat},
        Case{50, 64, 64, 130, 8, at::kBFloat16, at::kFloat}, Case{40, 32, 65, 2, 4, at::kFloat, at::kFloat}}) {
    for (bool perSlot : {false, true}) {
      INFO("tokens " << c.tokens << " hidden " << c.hidden << " ranks " << c.ranks << " local experts "
                     << c.localExperts << " top-k " << c.topK << " per slot " << perSlot);
      const RouteShape shape{.localExperts = c.localExperts, .ranks = c.ranks, .perSlot = perSlot};
      const Routing routing = randomRouting(c, 40 + c.tokens);
      const Routing gpuRouting = onDevice(routing, gpu);
      const RoutePlan expected = planRoutes(routing, shape);
      const RoutePlan got = planRoutes(gpuRouting, shape);
      REQUIRE(got.counts.is_cuda());
      CHECK(at::equal(got.counts.cpu(), expected.counts));
      CHECK(at::equal(got.key.cpu(), expected.key));

      const at::Tensor tokens = at::randn({c.tokens, c.hidden}, testing::sharedGenerator(7), c.tokenType);
      const RoutedLayout layout(tokens, c.sideType, perSlot ? 1 : c.topK);
      const SendRows cpuRows = packSendRows(layout, tokens, routing.weights, routing, shape, expected);
      const SendRows gpuRows = packSendRows(layout, tokens.to(gpu), gpuRouting.weights, gpuRouting, shape, got);
      const int64_t rows = expected.counts[0].select(1, c.localExperts).sum().item<int64_t>();
      const int64_t columns = perSlot ? c.topK : c.ranks;
      REQUIRE(cpuRows.bytes.size(0) == rows);
      // The kernels size the rows for the most a dispatch can send; the ATen form, exactly.
      REQUIRE(gpuRows.bytes.size(0) ==
              (kernelsTake(c, perSlot) ? c.tokens * std::min<int64_t>(columns, c.topK) : rows));
      checkSameRows(layout, cpuRows, gpuRows, rows);
    }
  }
}

TEST_CASE("route planning and packing on the GPU count kept slots naming no expert and send none", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  const Case c{64, 96, 2, 4, 3, at::kBFloat16, at::kFloat};
  for (bool perSlot : {false, true}) {
    INFO("per slot " << perSlot);
    const RouteShape shape{.localExperts = c.localExperts, .ranks = c.ranks, .perSlot = perSlot};
    Routing routing = randomRouting(c, 90);
    routing.keep.fill_(true);
    Routing broken = routing;
    broken.indices = routing.indices.clone();
    broken.keep = routing.keep.clone();
    broken.indices[5][1] = 8;   // past the last expert, kept
    broken.indices[9][0] = -3;  // before the first (-3 / 4 truncates to rank 0), kept
    broken.indices[11][2] = 9;  // past the last, but dropped
    broken.keep[11][2] = false;
    const Routing gpuBroken = onDevice(broken, gpu);
    const RoutePlan got = planRoutes(gpuBroken, shape);
    const RoutePlan cpu = planRoutes(broken, shape);
    CHECK(at::equal(got.counts.cpu(), cpu.counts));
    CHECK(at::equal(got.key.cpu(), cpu.key));
    CHECK(at::equal(cpu.counts[0].select(1, c.localExperts + 1), at::full({c.ranks}, 2, at::kLong)));
    // The rest is what the slots' being dropped gives.
    Routing dropped = routing;
    dropped.keep = broken.keep.clone();
    dropped.keep[5][1] = false;
    dropped.keep[9][0] = false;
    const RoutePlan expected = planRoutes(dropped, shape);
    CHECK(at::equal(cpu.counts.narrow(2, 0, c.localExperts + 1), expected.counts.narrow(2, 0, c.localExperts + 1)));
    CHECK(at::equal(cpu.key, expected.key));

    const at::Tensor tokens = at::randn({c.tokens, c.hidden}, testing::sharedGenerator(8), c.tokenType);
    const RoutedLayout layout(tokens, c.sideType, perSlot ? 1 : c.topK);
    const SendRows cpuRows = packSendRows(layout, tokens, broken.weights, broken, shape, cpu);
    const SendRows gpuRows = packSendRows(layout, tokens.to(gpu), gpuBroken.weights, gpuBroken, shape, got);
    checkSameRows(layout, cpuRows, gpuRows, cpuRows.bytes.size(0));
    const RoutedRows have = layout.parts(gpuRows.bytes.narrow(0, 0, cpuRows.bytes.size(0)).cpu());
    // The invalid slots (token 5 slot 1, token 9 slot 0) travel nowhere: per
    // slot in no row, once per rank as id -1 in every row of their token.
    for (auto [token, slot] : {std::pair<int64_t, int64_t>{5, 1}, {9, 0}}) {
      INFO("token " << token << " slot " << slot);
      if (perSlot) {
        CHECK(cpuRows.table[token][slot].item<int64_t>() == -1);
        continue;
      }
      for (int64_t rank = 0; rank < c.ranks; ++rank) {
        const int64_t row = cpuRows.table[token][rank].item<int64_t>();
        if (row >= 0) CHECK(have.ids[row][slot].item<double>() == -1);
      }
    }
  }
}

TEST_CASE("gatherRows' kernel reads strided rows once and matches index_select, with its gradient", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  // Row strides of 208 and 400 bytes (16-byte vectors), 200 (4-byte words) and 100 (bytes).
  for (auto [dtype, width, pad] :
       {std::tuple{at::kBFloat16, 96, 8}, {at::kFloat, 96, 4}, {at::kFloat, 37, 13}, {at::kBFloat16, 37, 13}}) {
    INFO("dtype " << c10::toString(dtype) << " width " << width << " pad " << pad);
    // 200 source rows, some read by up to 4 output rows, some by none; the
    // source is a column slice of a wider buffer (as received rows are).
    at::Tensor group = at::randint(-1, 4, {200, 4}, testing::sharedGenerator(11), at::kLong);
    const int64_t count = group.ge(0).sum().item<int64_t>();
    const Grouping grouping = groupEntries(group, 4, count);
    at::Tensor index = grouping.order.div(4, "floor");
    at::Tensor wide = at::randn({200, width + pad}, testing::sharedGenerator(12), at::kDouble).to(dtype);
    at::Tensor grad = at::randn({count, width}, testing::sharedGenerator(13), at::kDouble).to(dtype);
    auto run = [&](const at::Device& device) {
      at::Tensor buffer = wide.clone().to(device).requires_grad_(true);
      at::Tensor out = gatherRows(buffer.narrow(1, 0, width), grouping.table.to(device), count);
      out.backward(grad.to(device));
      return std::make_pair(out.cpu(), buffer.grad().cpu());
    };
    auto [out, gradSource] = run(gpu);
    auto [refOut, refSource] = run(at::kCPU);
    CHECK(at::equal(out, refOut));
    CHECK(at::equal(out, wide.narrow(1, 0, width).index_select(0, index)));
    const double tolerance = dtype == at::kBFloat16 ? 2e-2 : 1e-5;  // sums of up to 4 rows, in another order
    CHECK(at::allclose(gradSource.to(at::kDouble), refSource.to(at::kDouble), tolerance, tolerance));
  }
}

TEST_CASE("gatherRowsOrZero's kernel fills the rows its table misses with zeros and matches the CPU", "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    INFO("dtype " << c10::toString(dtype));
    // 300 output rows, 120 sources reading into distinct rows (up to 2 each), a third of the rows named by none.
    at::Tensor rows = at::randperm(300, testing::sharedGenerator(21), at::kLong).narrow(0, 0, 240).view({120, 2});
    at::Tensor table = at::where(at::rand({120, 2}, testing::sharedGenerator(22)).lt(0.8), rows, -1);
    at::Tensor source = at::randn({120, 64}, testing::sharedGenerator(23), at::kDouble).to(dtype) + 1;
    at::Tensor grad = at::randn({300, 64}, testing::sharedGenerator(24), at::kDouble).to(dtype);
    auto run = [&](const at::Device& device) {
      at::Tensor leaf = source.clone().to(device).requires_grad_(true);
      // Garbage in the allocator's recycled memory first, so zeros are written, not found.
      at::full({300, 64}, 7, leaf.options()).sum();
      at::Tensor out = gatherRowsOrZero(leaf, table.to(device), 300);
      out.backward(grad.to(device));
      return std::make_pair(out.cpu(), leaf.grad().cpu());
    };
    auto [out, gradSource] = run(gpu);
    auto [refOut, refSource] = run(at::kCPU);
    CHECK(at::equal(out, refOut));
    const int64_t named = table.ge(0).sum().item<int64_t>();
    CHECK(out.ne(0).any(1).sum().item<int64_t>() == named);
    CHECK(at::allclose(gradSource.to(at::kDouble), refSource.to(at::kDouble), 2e-2, 2e-2));
  }
}

TEST_CASE("per-group named rows (a padded buffer's kept rows per expert) are kept, and only the tails zeroed",
          "[moe][gpu]") {
  const at::Device gpu(at::kCUDA, 0);
  constexpr int64_t kGroups = 5, kGroupRows = 40, kWidth = 64;
  // Group g names its first kept[g] rows (0 and all 40 included), each once, from 2 columns of random sources.
  const std::vector<int32_t> kept{17, 0, 40, 3, 29};
  std::vector<int64_t> named;
  for (int64_t g = 0; g < kGroups; ++g)
    for (int64_t p = 0; p < kept[g]; ++p) named.push_back(g * kGroupRows + p);
  const auto count = static_cast<int64_t>(named.size());  // 89: 45 sources, one column of the last empty
  at::Tensor shuffled =
      at::tensor(named, at::kLong).index_select(0, at::randperm(count, testing::sharedGenerator(31), at::kLong));
  at::Tensor table = at::cat({shuffled, at::full({1}, -1, at::kLong)}).view({-1, 2});
  const int64_t sources = table.size(0);
  at::Tensor namedRows = at::tensor(std::vector<int32_t>(kept.begin(), kept.end()), at::kInt);
  at::Tensor weights = at::rand({sources, 2}, testing::sharedGenerator(32), at::kFloat) + 0.5;
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    INFO("dtype " << c10::toString(dtype));
    at::Tensor source = at::randn({sources, kWidth}, testing::sharedGenerator(33), at::kDouble).to(dtype) + 1;
    at::Tensor grad = at::randn({kGroups * kGroupRows, kWidth}, testing::sharedGenerator(34), at::kDouble).to(dtype);
    at::Tensor rowsIn = at::randn({kGroups * kGroupRows, kWidth}, testing::sharedGenerator(35), at::kDouble).to(dtype);
    at::Tensor sumGrad = at::randn({sources, kWidth}, testing::sharedGenerator(36), at::kDouble).to(dtype);
    auto run = [&](const at::Device& device) {
      at::Tensor leaf = source.clone().to(device).requires_grad_(true);
      at::full({kGroups * kGroupRows, kWidth}, 7, leaf.options()).sum();  // garbage in recycled memory first
      at::Tensor expanded = device.is_cuda()
                                ? gatherRowsOrZero(leaf, table.to(device), kGroups * kGroupRows, namedRows.to(device))
                                : gatherRowsOrZero(leaf, table, kGroups * kGroupRows);
      expanded.backward(grad.to(device));
      at::Tensor rows = rowsIn.clone().to(device).requires_grad_(true);
      at::full({kGroups * kGroupRows, kWidth}, 7, leaf.options()).sum();
      at::Tensor summed = device.is_cuda() ? gatherSum(rows, table.to(device), weights.to(device), SourceRows::Prefix,
                                                       namedRows.to(device))
                                           : gatherSum(rows, table, weights);
      summed.backward(sumGrad.to(device));
      return std::vector<at::Tensor>{expanded.cpu(), leaf.grad().cpu(), summed.cpu(), rows.grad().cpu()};
    };
    auto ours = run(gpu), theirs = run(at::kCPU);
    CHECK(at::equal(ours[0], theirs[0]));
    CHECK(ours[0].ne(0).any(1).sum().item<int64_t>() == count);  // the tails are zeros
    CHECK(at::allclose(ours[1].to(at::kDouble), theirs[1].to(at::kDouble), 2e-2, 2e-2));
    CHECK(at::allclose(ours[2].to(at::kDouble), theirs[2].to(at::kDouble), 2e-2, 2e-2));
    CHECK(at::allclose(ours[3].to(at::kDouble), theirs[3].to(at::kDouble), 1e-2, 1e-2));  // weighted, once each
    CHECK(ours[3].ne(0).any(1).sum().item<int64_t>() == count);
  }
  // A namedRows that does not divide the rows is refused.
  at::Tensor leaf = at::randn({sources, kWidth}, at::TensorOptions().device(gpu));
  CHECK_THROWS_AS(gatherRowsOrZero(leaf, table.to(gpu), kGroups * kGroupRows - 1, namedRows.to(gpu)), ConfigError);
}

}  // namespace
}  // namespace bulkhead::moe
