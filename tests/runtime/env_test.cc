#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

namespace {
// Sets a variable for one test and restores the environment after it.
struct ScopedEnv {
  std::string name;
  ScopedEnv(const std::string& n, const std::string& value) : name(n) {
    setenv(name.c_str(), value.c_str(), 1);
    env::forgetCachedValues();
  }
  ~ScopedEnv() {
    unsetenv(name.c_str());
    env::forgetCachedValues();
  }
};
}  // namespace

TEST_CASE("an unset knob reads as its documented default") {
  unsetenv("BULKHEAD_COLLECTIVE_TIMEOUT");
  env::forgetCachedValues();
  CHECK_FALSE(env::kCollectiveTimeout.isSet());
  CHECK(env::kCollectiveTimeout.seconds() == std::stod(env::kCollectiveTimeout.defaultValue()));
}

TEST_CASE("a knob reads its value from the environment") {
  ScopedEnv timeout("BULKHEAD_COLLECTIVE_TIMEOUT", "2.5");
  CHECK(env::kCollectiveTimeout.isSet());
  CHECK(env::kCollectiveTimeout.seconds() == 2.5);
  ScopedEnv capacity("BULKHEAD_LEDGER_CAPACITY", "77");
  CHECK(env::kLedgerCapacity.integer() == 77);
}

TEST_CASE("a knob value that does not parse is a ConfigError naming the knob") {
  SECTION("not a number") {
    ScopedEnv bad("BULKHEAD_INIT_TIMEOUT", "soon");
    CHECK_THROWS_AS(env::kInitTimeout.seconds(), ConfigError);
    try {
      env::kInitTimeout.seconds();
    } catch (const ConfigError& e) {
      CHECK(std::string(e.what()).find("BULKHEAD_INIT_TIMEOUT='soon'") != std::string::npos);
    }
  }
  SECTION("not positive") {
    ScopedEnv bad("BULKHEAD_INIT_TIMEOUT", "-1");
    CHECK_THROWS_AS(env::kInitTimeout.seconds(), ConfigError);
  }
  SECTION("trailing junk in an integer") {
    ScopedEnv bad("BULKHEAD_LEDGER_CAPACITY", "12x");
    CHECK_THROWS_AS(env::kLedgerCapacity.integer(), ConfigError);
  }
}

TEST_CASE("flags accept the usual spellings") {
  for (const char* yes : {"1", "true", "YES", "on"}) {
    ScopedEnv flag("BULKHEAD_LOG_LEVEL", yes);
    CHECK(env::kLogLevel.flag());
  }
  for (const char* no : {"0", "false", "No", "off"}) {
    ScopedEnv flag("BULKHEAD_LOG_LEVEL", no);
    CHECK_FALSE(env::kLogLevel.flag());
  }
  ScopedEnv bad("BULKHEAD_LOG_LEVEL", "maybe");
  CHECK_THROWS_AS(env::kLogLevel.flag(), ConfigError);
}

TEST_CASE("the registry holds each knob once, every one named BULKHEAD_*") {
  std::set<std::string> names;
  for (const env::Knob* knob : env::all()) {
    CHECK(std::string(knob->name()).rfind("BULKHEAD_", 0) == 0);
    CHECK(std::string(knob->help()).size() > 10);
    CHECK(names.insert(knob->name()).second);
  }
  CHECK(names.size() >= 8);
}

TEST_CASE("the README lists every knob with its default") {
  std::ifstream file(std::string(BULKHEAD_SOURCE_DIR) + "/README.md");
  REQUIRE(file.good());
  std::stringstream text;
  text << file.rdbuf();
  for (const env::Knob* knob : env::all()) {
    INFO(knob->name());
    std::string row = std::string("`") + knob->name() + "` | `" + knob->defaultValue() + "`";
    CHECK(text.str().find(row) != std::string::npos);
  }
}

TEST_CASE("log levels parse by name and reject anything else") {
  CHECK(log::parseLevel("error") == log::Level::Error);
  CHECK(log::parseLevel("warn") == log::Level::Warn);
  CHECK(log::parseLevel("debug") == log::Level::Debug);
  CHECK_THROWS_AS(log::parseLevel("loud"), ConfigError);
}
