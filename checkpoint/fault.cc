#include "checkpoint/fault.h"

#include <fmt/format.h>

#include <limits>
#include <utility>

#include "runtime/diagnosis/fault_spec.h"
#include "runtime/env.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint::fault {
namespace {

using bulkhead::fault::FaultSpec;

constexpr const char* kForm = "rank=R[,step=S],action=exit|stop|kill|stall:SECONDS|write-error|commit-exit";

}  // namespace

Fault parse(const std::string& text) {
  const FaultSpec spec({env::kCheckpointFault.name(), kForm, {"rank", "step", "action"}}, text);
  if (!spec.has("rank") || !spec.has("action")) spec.reject("rank and action are required");
  Fault fault;
  fault.rank = static_cast<int>(spec.integer("rank", 0, std::numeric_limits<int>::max()));
  if (spec.has("step")) fault.step = spec.integer("step", 0, std::numeric_limits<int64_t>::max());
  const FaultSpec::Action action = spec.action("action");
  if (action.name == "stall" && action.argument) {
    fault.action = Action::Stall;
    fault.stallSeconds = *action.argument;
    return fault;
  }
  const std::pair<const char*, Action> plain[] = {{"exit", Action::Exit},
                                                  {"stop", Action::Stop},
                                                  {"kill", Action::Kill},
                                                  {"write-error", Action::WriteError},
                                                  {"commit-exit", Action::CommitExit}};
  for (const auto& [name, value] : plain) {
    if (action.name == name && !action.argument) {
      fault.action = value;
      return fault;
    }
  }
  spec.reject(fmt::format("unknown action '{}'", spec.text("action")));
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
