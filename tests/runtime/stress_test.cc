// 10,000 back-to-back all-reduces and all-to-alls whose shapes change on every
// call: small, odd and (every 250th call) large messages, uneven and zero
// splits. Inputs are slices of per-rank random pools that every rank holds, so
// references cost a few slices per call.
#include <fmt/format.h>

#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {
constexpr int kIterations = 10000;
constexpr int64_t kLarge = 1 << 20;
constexpr int64_t kPool = kLarge + 8192;
}  // namespace

TEST_CASE("10,000 back-to-back all-reduces and all-to-alls with changing shapes all give correct results", "[stress]") {
  int n = world().size(), me = world().rank();
  std::vector<at::Tensor> pools;
  for (int r = 0; r < n; ++r) pools.push_back(draw(r, 9000, {kPool}, at::kFloat));
  auto shared = sharedGenerator(2);
  // All shapes, offsets and splits are drawn up front from a generator every
  // rank seeds alike.
  at::Tensor sizes = at::randint(1, 4097, {kIterations}, shared, at::kLong);
  at::Tensor offsets = at::randint(0, 8192, {kIterations}, shared, at::kLong);
  at::Tensor widths = at::randint(1, 18, {kIterations}, shared, at::kLong);
  at::Tensor splits = at::randint(0, 40, {kIterations, n, n}, shared, at::kLong);
  int failures = 0;

  for (int i = 0; i < kIterations && failures < 5; ++i) {
    int64_t numel = i % 250 == 0 ? kLarge + i % 7 : sizes[i].item<int64_t>();
    int64_t offset = offsets[i].item<int64_t>();
    at::Tensor reduced = pools[me].slice(0, offset, offset + numel).clone();
    auto reduceWork = world().allReduce(reduced);

    int64_t width = widths[i].item<int64_t>();
    at::Tensor matrix = splits[i];
    auto rows = matrix.accessor<int64_t, 2>();
    if (i % 97 == 0)
      for (int s = 0; s < n; ++s) rows[s][(s + 1) % n] = 0;  // some pairs exchange nothing
    if (i % 500 == 1) rows[0][n - 1] = 3000;                 // very unequal
    std::vector<int64_t> sendSplits(n), recvSplits(n);
    int64_t sendRows = 0, recvRows = 0;
    for (int r = 0; r < n; ++r) {
      sendSplits[r] = rows[me][r];
      recvSplits[r] = rows[r][me];
      sendRows += sendSplits[r];
      recvRows += recvSplits[r];
    }
    at::Tensor send = pools[me].slice(0, offset, offset + sendRows * width).view({sendRows, width});
    at::Tensor recv = at::empty({recvRows, width});
    auto exchangeWork = world().allToAll(send, recv, sendSplits, recvSplits);
    reduceWork->wait();
    exchangeWork->wait();

    at::Tensor wantSum = at::zeros({numel});
    for (int r = 0; r < n; ++r) wantSum += pools[r].slice(0, offset, offset + numel);
    bool sumOk = at::equal(reduced, wantSum);
    bool exchangeOk = true;
    int64_t cursor = 0;
    for (int s = 0; s < n && exchangeOk; ++s) {
      int64_t before = 0;
      for (int d = 0; d < me; ++d) before += rows[s][d];
      int64_t begin = offset + before * width, count = rows[s][me] * width;
      exchangeOk = at::equal(recv.view({-1}).slice(0, cursor, cursor + count), pools[s].slice(0, begin, begin + count));
      cursor += count;
    }
    if (!sumOk || !exchangeOk) {
      ++failures;
      FAIL_CHECK(fmt::format("iteration {}: all-reduce of {} {} ; all-to-all width {} {}", i, numel,
                             sumOk ? "ok" : "WRONG", width, exchangeOk ? "ok" : "WRONG"));
    }
  }
  CHECK(failures == 0);
  CHECK(world().ledger().heads().lastCompleted >= 2 * kIterations);
}
