// The one fault-spec parser (runtime/diagnosis/fault_spec.h) and the two specs built on
// it: BULKHEAD_FAULT (runtime/diagnosis/fault.h) and BULKHEAD_CHECKPOINT_FAULT
// (checkpoint/fault.h). Every malformed spec is a ConfigError that names the
// variable, quotes the text and shows the expected form.

#include <fmt/format.h>

#include <random>
#include <string>

#include "runtime/diagnosis/fault.h"
#include "runtime/diagnosis/fault_spec.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

namespace {

const fault::SpecSyntax kSyntax{"BULKHEAD_TEST_FAULT", "a=N,b=TEXT,act=NAME[:SECONDS]", {"a", "b", "act"}};

// The message of the ConfigError that `parse` raises, or "" when it raises none.
template <typename Parse>
std::string errorOf(Parse parse) {
  try {
    parse();
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a fault spec reads integers, text and actions with an argument") {
  std::mt19937_64 random(7);
  const int64_t a = static_cast<int64_t>(random() % 100000) + 1;
  const double seconds = static_cast<double>(random() % 1000) / 8;
  fault::FaultSpec spec(kSyntax, fmt::format("a={},b=ep[3],act=stall:{}", a, seconds));
  CHECK(spec.integer("a", 0, 1 << 30) == a);
  CHECK(spec.text("b") == "ep[3]");
  CHECK(spec.action("act").name == "stall");
  CHECK(spec.action("act").argument == seconds);
  CHECK(fault::FaultSpec(kSyntax, "act=skip").action("act").argument == std::nullopt);
  CHECK_FALSE(fault::FaultSpec(kSyntax, "act=skip").has("a"));
}

TEST_CASE("a malformed fault spec names the variable, the text and the form") {
  for (const char* text : {"a", "a=1,zz=2", "a=1,a=2", "a=x", "a=12abc", "a=-1", "a=99999999999999999999",
                           "act=stall:", "act=stall:x", "act=stall:-1", "act=stall:nan"}) {
    INFO(text);
    const std::string message = errorOf([&] {
      fault::FaultSpec spec(kSyntax, text);
      if (spec.has("a")) spec.integer("a", 0, 1 << 30);
      if (spec.has("act")) spec.action("act");
    });
    CHECK(message.find("BULKHEAD_TEST_FAULT='") != std::string::npos);
    CHECK(message.find(text) != std::string::npos);
    CHECK(message.find(kSyntax.form) != std::string::npos);
  }
}

TEST_CASE("BULKHEAD_FAULT specs parse through the one parser") {
  const fault::Fault parsed = fault::parse("rank=2,group=ep[1],seq=6,action=delay:1.5");
  CHECK(parsed.rank == 2);
  CHECK(parsed.group == "ep[1]");
  CHECK(parsed.seq == 6);
  CHECK(parsed.action == fault::Action::Delay);
  CHECK(parsed.delaySeconds == 1.5);
  CHECK(fault::parse("rank=0,group=world,seq=1,action=mismatch-size").action == fault::Action::MismatchSize);
  CHECK(!parsed.op);
  const fault::Fault stop = fault::parse("rank=3,group=dp-cp[0],op=reduce_scatter,seq=40,action=stop");
  CHECK(stop.op == OpType::ReduceScatter);
  CHECK(stop.seq == 40);
  CHECK(stop.action == fault::Action::Stop);
  CHECK(fault::parse("rank=1,group=ep[0],op=all_to_all,seq=9,action=kill").action == fault::Action::Kill);
  CHECK(errorOf([&] { fault::parse("rank=0,group=world,op=allreduce,seq=1,action=stop"); }).find("unknown op") !=
        std::string::npos);
  for (const char* bad : {"rank=0,group=world,seq=0,action=skip", "rank=0,seq=1,action=skip",
                          "rank=0,group=world,seq=1,action=stop:2", "rank=0,group=world,op=,seq=1,action=kill",
                          "rank=0,group=world,seq=1,action=explode", "rank=0,group=world,seq=1,action=skip:2",
                          "rank=0,group=world,seq=1,action=delay", "rank=0,group=world,seq=1,action=skip,extra=1"}) {
    INFO(bad);
    CHECK(errorOf([&] { fault::parse(bad); }).find("BULKHEAD_FAULT='") != std::string::npos);
  }
}
