// The autograd row gather (moe/gather_sum.h): its forward equals index_select
// and its gradient (a gather-sum over the table) equals index_select's
// (an index_add), float64, on random inputs (one process).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <vector>

#include "moe/dispatcher.h"
#include "moe/gather_sum.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

namespace bulkhead::moe {
namespace {

using testing::gaussian;

// The table of an index: row s lists the output rows that read source row s,
// in ascending order, padded with -1 to `columns`.
at::Tensor tableOf(const at::Tensor& index, int64_t sourceRows, int64_t columns) {
  std::vector<std::vector<int64_t>> readers(sourceRows);
  for (int64_t row = 0; row < index.size(0); ++row) readers[index[row].item<int64_t>()].push_back(row);
  at::Tensor table = at::full({sourceRows, columns}, -1, at::kLong);
  for (int64_t source = 0; source < sourceRows; ++source)
    for (size_t c = 0; c < readers[source].size(); ++c) table[source][static_cast<int64_t>(c)] = readers[source][c];
  return table;
}

TEST_CASE("the row gather's output and gradient equal index_select's", "[moe][dispatcher]") {
  // 7 source rows read 0 to 3 times each, in random order: rows 1 and 5 never.
  const std::vector<int64_t> reads{2, 0, 3, 1, 2, 0, 3};
  std::vector<int64_t> picks;
  for (size_t source = 0; source < reads.size(); ++source)
    for (int64_t n = 0; n < reads[source]; ++n) picks.push_back(static_cast<int64_t>(source));
  at::Tensor shuffle = at::randperm(static_cast<int64_t>(picks.size()), testing::sharedGenerator(21), at::kLong);
  at::Tensor index = at::tensor(picks, at::kLong).index_select(0, shuffle);
  at::Tensor table = tableOf(index, 7, 4);  // a column more than any row needs

  at::Tensor source = gaussian(22, {7, 5}).requires_grad_(true);
  at::Tensor reference = source.detach().clone().requires_grad_(true);
  at::Tensor out = gatherRows(source * 1.0, table, index.size(0));  // a non-leaf source too
  at::Tensor expected = reference.index_select(0, index);
  REQUIRE(out.requires_grad());
  CHECK(at::equal(out, expected));

  at::Tensor grad = gaussian(23, {index.size(0), 5});
  out.backward(grad);
  expected.backward(grad);
  CHECK(at::allclose(source.grad(), reference.grad(), 1e-15, 1e-15));
  CHECK(source.grad()[1].abs().sum().item<double>() == 0);
  CHECK(source.grad()[2].abs().sum().item<double>() > 0);

  // A table that does not list the source's rows is refused up front, not
  // found out in the backward.
  CHECK_THROWS_AS(gatherRows(source, table.narrow(0, 0, 6), index.size(0)), ConfigError);
  CHECK_THROWS_AS(gatherRows(source, table.to(at::kInt), index.size(0)), ConfigError);
  CHECK_THROWS_AS(gatherRows(source, table, -1), ConfigError);
}

TEST_CASE("the row gather of a permutation carries gradients both ways", "[moe][dispatcher]") {
  // Tokens to grouped rows (one per (token, column) entry), then the rows
  // expanded again through a second grouping: the dispatcher's two gathers.
  at::Tensor tokens = gaussian(24, {11, 6}).requires_grad_(true);
  at::Tensor group = at::randint(-1, 3, {11, 4}, testing::sharedGenerator(25), at::kLong);
  const int64_t count = group.ge(0).sum().item<int64_t>();
  Grouping grouping = groupEntries(group, 3, count);
  at::Tensor rows = permuteTokens(tokens, grouping);
  at::Tensor expected = tokens.index_select(0, grouping.order.div(4, "floor"));
  CHECK(at::equal(rows, expected));
  at::Tensor grad = gaussian(26, {count, 6});
  at::Tensor viaGather = torch::autograd::grad({rows}, {tokens}, {grad})[0];
  at::Tensor viaIndexSelect = torch::autograd::grad({expected}, {tokens}, {grad})[0];
  CHECK(at::allclose(viaGather, viaIndexSelect, 1e-15, 1e-15));
  // Without autograd the gather records nothing.
  at::Tensor plain = gatherRows(tokens.detach(), grouping.table, count);
  CHECK(!plain.requires_grad());
  CHECK(at::equal(plain, expected));
}

}  // namespace
}  // namespace bulkhead::moe
