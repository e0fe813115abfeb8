// Checked regions on every rank of the job, where every rank issues the same
// collectives: the check passes, counts what it compared, cleans up behind
// itself, and refuses misuse. Regions whose ranks differ fail in separate jobs
// (checked_region_fault.cc): a desync leaves collectives that never complete.
#include <fmt/format.h>

#include "runtime/diagnosis/checked_region.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

// Collectives of shapes drawn from a generator every rank seeds alike, some
// waited on inside the region and some only after its end.
std::vector<WorkPtr> issueDrawn(Communicator& comm, at::Generator& shared, int count) {
  std::vector<WorkPtr> pending;
  for (int i = 0; i < count; ++i) {
    const int64_t rows = at::randint(1, 50, {1}, shared).item<int64_t>();
    const int64_t kind = at::randint(0, 3, {1}, shared).item<int64_t>();
    at::Tensor t = draw(comm.rank(), i, {rows * comm.size()}, at::kFloat);
    WorkPtr work;
    if (kind == 0) {
      work = comm.allReduce(t);
    } else if (kind == 1) {
      work = comm.allGather(t, at::empty({t.numel() * comm.size()}, t.options()));
    } else {
      work = comm.allToAll(t, at::empty_like(t), {}, {});
    }
    if (i % 2 == 0)
      work->wait();
    else
      pending.push_back(work);
  }
  return pending;
}

}  // namespace

TEST_CASE("a region in which every rank issues the same collectives passes and reports what it compared") {
  int me = world().rank(), n = world().size();
  auto halves = world().split(me % 2, me, "region-half");
  at::Generator shared = sharedGenerator(811);
  at::Generator half = sharedGenerator(900 + me % 2);  // each half draws its own sequence

  CheckedRegion region(store(), {worldPtr(), halves}, {.name = "same"});
  auto pending = issueDrawn(world(), shared, 7);
  auto more = issueDrawn(*halves, half, 3 + me % 2);  // the halves differ, each one agrees within itself
  CHECK(region.recorded(world()) == 7);
  CHECK(region.recorded(*halves) == static_cast<size_t>(3 + me % 2));
  RegionReport report = region.end();
  CHECK(report.ranks == static_cast<size_t>(n));
  CHECK(report.groups == static_cast<size_t>(std::min(n, 2) + 1));
  CHECK(report.collectives == static_cast<size_t>(10 + me % 2));
  CHECK(report.checkSeconds > 0);
  for (auto& work : pending) work->wait();
  for (auto& work : more) work->wait();
  // Collectives after the end are not recorded.
  at::Tensor t = draw(me, 1, {8}, at::kFloat);
  world().allReduce(t)->wait();
  CHECK(region.recorded(world()) == 7);
  CHECK_THROWS_AS(region.end(), ConfigError);
}

TEST_CASE("regions in a row pass and erase their records behind them") {
  int me = world().rank();
  at::Generator shared = sharedGenerator(812);
  uint64_t first = 0, last = 0;
  for (int i = 0; i < 12; ++i) {
    CheckedRegion region(store(), {worldPtr()}, {.name = "row"});
    for (auto& work : issueDrawn(world(), shared, i % 3)) work->wait();  // some regions are empty
    RegionReport report = region.end();
    if (i == 0) first = report.index;
    last = report.index;
  }
  CHECK(last == first + 11);
  // Region n erases this rank's record of n - 2: only the newest two remain.
  Deadline deadline = Deadline::afterSeconds(10);
  CHECK_FALSE(store()->tryGet(fmt::format("region/row/{}/{}", last - 2, me), deadline));
  CHECK(store()->tryGet(fmt::format("region/row/{}/{}", last - 1, me), deadline));
  CHECK(store()->tryGet(fmt::format("region/row/{}/{}", last, me), deadline));
}

TEST_CASE("a region refuses a bad name, no communicator and no store") {
  CHECK_THROWS_AS(CheckedRegion(store(), {worldPtr()}, {.name = "a/b"}), ConfigError);
  CHECK_THROWS_AS(CheckedRegion(store(), {nullptr}, {.name = "none"}), ConfigError);
  CHECK_THROWS_AS(CheckedRegion(nullptr, {worldPtr()}, {.name = "nostore"}), ConfigError);
}

TEST_CASE("a region left by an exception checks nothing and stops recording") {
  {
    CheckedRegion region(store(), {worldPtr()}, {.name = "unwound"});
    at::Tensor t = draw(world().rank(), 2, {4}, at::kFloat);
    world().allReduce(t)->wait();
    CHECK(region.recorded(world()) == 1);
  }  // no end(): nothing published, nothing waited for
  CHECK_FALSE(store()->tryGet(fmt::format("region/unwound/1/{}", world().rank()), Deadline::afterSeconds(10)));
}
