// The CPU share a thread reads: its affinity mask against the CPUs online.

#include <sched.h>
#include <unistd.h>

#include <thread>

#include "runtime/cpu_share.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

TEST_CASE("a thread bound to one CPU reads a share of one CPU and one core; the process's own binding is unchanged") {
  const CpuShare before = cpuShare();
  CHECK(before.online == static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
  REQUIRE(before.allowed >= 1);
  CHECK(before.allowed <= before.online);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  REQUIRE(::sched_getaffinity(0, sizeof(mine), &mine) == 0);
  int first = 0;
  while (!CPU_ISSET(first, &mine)) ++first;
  CHECK(before.allowedCores >= 1);
  CHECK(before.allowedCores <= before.allowed);
  CpuShare bound;
  bool pinnedOk = false;
  std::thread pinned([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    pinnedOk = ::sched_setaffinity(0, sizeof(one), &one) == 0;
    if (pinnedOk) bound = cpuShare();
  });
  pinned.join();
  if (!pinnedOk) {
    WARN("sched_setaffinity was refused here: nothing to check");
    return;
  }
  CHECK(bound.allowed == 1);
  CHECK(bound.allowedCores == 1);
  CHECK(bound.online == before.online);
  CHECK(bound.crampedToOne() == (before.online > 1));
  CHECK(cpuShare().allowed == before.allowed);
}
