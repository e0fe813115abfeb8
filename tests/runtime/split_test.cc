#include <fmt/format.h>

#include <algorithm>

#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

TEST_CASE("split into several colors: each group holds its ranks, ordered by key, and works on its own") {
  int n = world().size(), me = world().rank();
  int colors = std::min(3, n);
  int color = me % colors;
  // Reverse order inside each group: the highest world rank becomes rank 0.
  auto group = world().split(color, -me, "mod3");
  REQUIRE(group != nullptr);
  std::vector<int> expected;
  for (int r = n - 1; r >= 0; --r)
    if (r % colors == color) expected.push_back(r);
  CHECK(group->members() == expected);
  CHECK(group->size() == static_cast<int>(expected.size()));
  CHECK(group->members()[group->rank()] == me);
  CHECK(group->name() == fmt::format("mod3[{}]", color));

  at::Tensor t = draw(me, 700, {31}, at::kDouble);
  group->allReduce(t)->wait();
  at::Tensor want = at::zeros({31}, at::kDouble);
  for (int r : expected) want += draw(r, 700, {31}, at::kDouble);
  CHECK(at::equal(t, want));
  // The parent's sequence numbers are untouched by the child's collectives.
  CHECK(group->ledger().heads().lastCompleted == 1);
}

TEST_CASE("a negative color joins no group") {
  int me = world().rank();
  bool inside = me % 2 == 0;
  auto evens = world().split(inside ? 0 : -1, me, "evens");
  CHECK((evens != nullptr) == inside);
  if (evens) {
    at::Tensor count = at::ones({1}, at::kInt);
    evens->allReduce(count)->wait();
    CHECK(count.item<int>() == (world().size() + 1) / 2);
  }
}

TEST_CASE("a group splits again, and its children name world ranks") {
  int me = world().rank(), n = world().size();
  auto halves = world().split(me < n / 2 ? 0 : 1, me, "half");
  auto pairs = halves->split(halves->rank() / 2, halves->rank(), "pair");
  REQUIRE(pairs != nullptr);
  for (int member : pairs->members()) CHECK((member < n / 2) == (me < n / 2));
  at::Tensor ranks = at::tensor({me}, at::kInt), gathered = at::empty({pairs->size()}, at::kInt);
  pairs->allGather(ranks, gathered)->wait();
  std::vector<int> seen(gathered.data_ptr<int>(), gathered.data_ptr<int>() + pairs->size());
  CHECK(seen == pairs->members());
}
