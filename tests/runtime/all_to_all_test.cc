#include <fmt/format.h>
#include <fmt/ranges.h>

#include <functional>

#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

using SplitMatrix = std::vector<std::vector<int64_t>>;  // [sender][receiver] rows

// Runs one all-to-all where rank s sends rows[s][d] rows to rank d, and checks
// what arrived against each sender's regenerated input.
void exchangeAndCheck(const SplitMatrix& rows, std::vector<int64_t> rowShape, at::ScalarType dtype, int salt) {
  int n = world().size(), me = world().rank();
  auto sent = [&](int s) {
    int64_t total = 0;
    for (int64_t r : rows[s]) total += r;
    std::vector<int64_t> shape = {total};
    shape.insert(shape.end(), rowShape.begin(), rowShape.end());
    return draw(s, salt, shape, dtype);
  };
  std::vector<int64_t> sendSplits = rows[me], recvSplits;
  std::vector<at::Tensor> expected;
  for (int s = 0; s < n; ++s) {
    recvSplits.push_back(rows[s][me]);
    int64_t offset = 0;
    for (int d = 0; d < me; ++d) offset += rows[s][d];
    expected.push_back(sent(s).slice(0, offset, offset + rows[s][me]));
  }
  at::Tensor want = at::cat(expected);
  at::Tensor recv = at::full(want.sizes(), 77, at::TensorOptions().dtype(dtype));
  world().allToAll(sent(me), recv, sendSplits, recvSplits)->wait();
  INFO(fmt::format("rank {} send {} recv {}", me, fmt::join(sendSplits, ","), fmt::join(recvSplits, ",")));
  CHECK(at::equal(recv, want));
}

SplitMatrix matrix(const std::function<int64_t(int, int)>& rows) {
  int n = world().size();
  SplitMatrix m(n, std::vector<int64_t>(n));
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < n; ++d) m[s][d] = rows(s, d);
  return m;
}

}  // namespace

TEST_CASE("all-to-all with random uneven splits, zeros included, for several dtypes and row shapes") {
  auto generator = sharedGenerator(1);
  int salt = 100;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kLong, at::kByte, at::kDouble}) {
    for (std::vector<int64_t> rowShape : {std::vector<int64_t>{}, {5}, {2, 3}}) {
      at::Tensor draws = at::randint(0, 6, {world().size(), world().size()}, generator, at::kLong);
      exchangeAndCheck(matrix([&](int s, int d) { return draws[s][d].item<int64_t>(); }), rowShape, dtype, ++salt);
    }
  }
}

TEST_CASE("all-to-all where nobody sends anything still takes part and completes") {
  uint64_t before = world().ledger().heads().lastCompleted;
  exchangeAndCheck(matrix([](int, int) { return 0; }), {4}, at::kFloat, 200);
  CHECK(world().ledger().heads().lastCompleted == before + 1);
}

TEST_CASE("all-to-all with very unequal splits: one pair carries almost everything") {
  int n = world().size();
  exchangeAndCheck(matrix([n](int s, int d) -> int64_t { return s == 0 && d == n - 1 ? 50000 : (s + d) % 3; }), {3},
                   at::kFloat, 300);
  // One rank receives nothing at all, while sending to everyone.
  exchangeAndCheck(matrix([n](int s, int d) -> int64_t { return d == n - 1 && n > 1 ? 0 : 1 + s; }), {}, at::kHalf,
                   301);
}

TEST_CASE("all-to-all with empty split lists splits rows evenly") {
  int n = world().size(), me = world().rank();
  at::Tensor send = draw(me, 400, {3 * n, 2}, at::kInt), recv = at::empty({3 * n, 2}, at::kInt);
  world().allToAll(send, recv, {}, {})->wait();
  std::vector<at::Tensor> parts;
  for (int s = 0; s < n; ++s) parts.push_back(draw(s, 400, {3 * n, 2}, at::kInt).slice(0, 3 * me, 3 * me + 3));
  CHECK(at::equal(recv, at::cat(parts)));
}
