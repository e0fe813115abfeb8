#include "checkpoint/fault.h"

#include <fmt/format.h>

#include <sstream>

#include "runtime/env.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint::fault {
namespace {

constexpr const char* kForm = "rank=R[,step=S],action=exit|stall:SECONDS|write-error|commit-exit";

}  // namespace

Fault parse(const std::string& text) {
  auto fail = [&](const std::string& why) {
    return ConfigError(fmt::format("{}='{}': {}", env::kCheckpointFault.name(), text, why), {.expected = kForm});
  };
  Fault fault;
  bool haveRank = false, haveAction = false;
  std::stringstream in(text);
  std::string field;
  while (std::getline(in, field, ',')) {
    size_t equals = field.find('=');
    if (equals == std::string::npos) throw fail(fmt::format("'{}' is not name=value", field));
    std::string name = field.substr(0, equals), value = field.substr(equals + 1);
    try {
      if (name == "rank") {
        fault.rank = std::stoi(value);
        haveRank = true;
      } else if (name == "step") {
        fault.step = std::stoll(value);
      } else if (name == "action") {
        haveAction = true;
        if (value == "exit") fault.action = Action::Exit;
        else if (value == "write-error") fault.action = Action::WriteError;
        else if (value == "commit-exit") fault.action = Action::CommitExit;
        else if (value.rfind("stall:", 0) == 0) {
          fault.action = Action::Stall;
          fault.stallSeconds = std::stod(value.substr(6));
        } else {
          throw fail(fmt::format("unknown action '{}'", value));
        }
      } else {
        throw fail(fmt::format("unknown field '{}'", name));
      }
    } catch (const std::logic_error&) {
      throw fail(fmt::format("'{}' is not a number", value));
    }
  }
  if (!haveRank || !haveAction) throw fail("rank and action are required");
  return fault;
}

std::optional<Fault> at(int rank, int64_t step) {
  static const std::optional<Fault> configured = [] {
    std::string text = env::kCheckpointFault.text();
    return text.empty() ? std::nullopt : std::optional<Fault>(parse(text));
  }();
  if (!configured || configured->rank != rank) return std::nullopt;
  if (configured->step && *configured->step != step) return std::nullopt;
  return configured;
}

}  // namespace bulkhead::checkpoint::fault
