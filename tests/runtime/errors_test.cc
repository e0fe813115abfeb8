#include <string>

#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/text.h"

using namespace bulkhead;

namespace {
using bulkhead::testing::contains;
}  // namespace

TEST_CASE("an error names its kind, rank, group and what was expected") {
  CommError error("all_reduce failed", {.rank = 3, .group = "ep[1]", .expected = "4 ranks"});
  std::string text = error.what();
  CHECK(contains(text, "CommError"));
  CHECK(contains(text, "rank 3"));
  CHECK(contains(text, "group ep[1]"));
  CHECK(contains(text, "all_reduce failed"));
  CHECK(contains(text, "expected: 4 ranks"));
  CHECK(error.rank() == 3);
  CHECK(error.group() == "ep[1]");
  CHECK(error.expected() == "4 ranks");
  CHECK(error.message() == "all_reduce failed");
}

TEST_CASE("an error without a rank or group says only what it knows") {
  ConfigError error("tp 3 does not divide 8");
  CHECK(std::string(error.what()) == "ConfigError: tp 3 does not divide 8");
  CHECK(error.rank() == -1);
  CHECK(error.group().empty());
}

TEST_CASE("every error type is a bulkhead::Error with its own kind and exit code") {
  auto check = [](const Error& e, const char* kind, int code) {
    CHECK(std::string(e.kind()) == kind);
    CHECK(e.exitCode() == code);
    CHECK(std::string(e.what()).rfind(kind, 0) == 0);
  };
  check(ConfigError("x"), "ConfigError", 2);
  check(TimeoutError("x", {}, 18), "TimeoutError", 3);
  check(DesyncError("x"), "DesyncError", 4);
  check(CommError("x"), "CommError", 5);
  check(IoError("x"), "IoError", 6);
  check(CheckpointError("x"), "CheckpointError", 7);
}

TEST_CASE("a timeout error carries its sequence number and diagnosis") {
  try {
    throw TimeoutError("all_to_all seq 18 did not complete", {.rank = 4, .group = "ep[1]"}, 18, "rank 6 lags");
  } catch (const Error& e) {
    auto* timeout = dynamic_cast<const TimeoutError*>(&e);
    REQUIRE(timeout != nullptr);
    CHECK(timeout->sequence() == 18);
    CHECK(timeout->diagnosis() == "rank 6 lags");
  }
}
