#include <thread>

#include "runtime/deadline.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;
using namespace std::chrono_literals;

TEST_CASE("a deadline expires once its time has passed, not before") {
  Deadline deadline = Deadline::after(50ms);
  CHECK_FALSE(deadline.expired());
  CHECK(deadline.remaining() > 0ms);
  CHECK(deadline.remaining() <= 50ms);
  std::this_thread::sleep_for(60ms);
  CHECK(deadline.expired());
  CHECK(deadline.remaining() == Deadline::Clock::duration::zero());
}

TEST_CASE("a never-deadline never expires and reports a very long time left") {
  Deadline never = Deadline::never();
  CHECK(never.isNever());
  CHECK_FALSE(never.expired());
  CHECK(never.remaining() > std::chrono::hours(24 * 365));
  CHECK_FALSE(Deadline::after(1h).isNever());
}

TEST_CASE("nested calls share one deadline: earliest never extends it") {
  Deadline outer = Deadline::after(100ms);
  Deadline inner = outer.earliest(Deadline::after(10s));
  CHECK(inner == outer);
  Deadline shorter = outer.earliest(Deadline::after(5ms));
  CHECK(shorter.when() < outer.when());
  CHECK(Deadline::never().earliest(outer) == outer);
}

TEST_CASE("afterSeconds takes fractional seconds") {
  Deadline deadline = Deadline::afterSeconds(0.25);
  CHECK(deadline.remainingSeconds() > 0.2);
  CHECK(deadline.remainingSeconds() <= 0.25);
}
