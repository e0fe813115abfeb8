#include "runtime/diagnosis/fault.h"

#include <fmt/format.h>

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <thread>
#include <utility>

#include "runtime/diagnosis/fault_spec.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::fault {
namespace {

constexpr const char* kForm =
    "rank=R,group=G[,op=OP],seq=N,action=skip|mismatch-op|mismatch-size|delay:S|exit|stop|kill";

constexpr OpType kOps[] = {OpType::AllReduce, OpType::AllGather, OpType::ReduceScatter, OpType::AllToAll,
                           OpType::Broadcast, OpType::Barrier,   OpType::Send,          OpType::Recv};

const std::optional<Fault>& configured() {
  static const std::optional<Fault> fault = [] {
    std::string text = env::kFault.text();
    return text.empty() ? std::nullopt : std::optional<Fault>(parse(text));
  }();
  return fault;
}

// "ep[1]" names that group; "ep" (no index) any group of that kind.
bool namesGroup(const std::string& spec, const std::string& name) {
  if (spec == name) return true;
  return spec.find('[') == std::string::npos && name.size() > spec.size() && name.compare(0, spec.size(), spec) == 0 &&
         name[spec.size()] == '[';
}

class SkippedWork : public Work {
 public:
  bool isCompleted() override { return true; }
  void wait(std::optional<Deadline>) override {}
  std::exception_ptr exception() const override { return nullptr; }
  uint64_t sequence() const override { return 0; }
};

}  // namespace

Fault parse(const std::string& text) {
  const FaultSpec spec({env::kFault.name(), kForm, {"rank", "group", "op", "seq", "action"}}, text);
  if (!spec.has("rank") || spec.text("group").empty() || !spec.has("seq") || !spec.has("action"))
    spec.reject("rank, group, seq (>= 1) and action are all needed");
  Fault fault;
  fault.rank = static_cast<int>(spec.integer("rank", 0, std::numeric_limits<int>::max()));
  fault.group = spec.text("group");
  fault.seq = static_cast<uint64_t>(spec.integer("seq", 1, std::numeric_limits<int64_t>::max()));
  if (spec.has("op")) {
    for (OpType op : kOps)
      if (spec.text("op") == toString(op)) fault.op = op;
    if (!fault.op) spec.reject(fmt::format("unknown op '{}'", spec.text("op")));
  }
  const FaultSpec::Action action = spec.action("action");
  if (action.name == "delay" && action.argument) {
    fault.action = Action::Delay;
    fault.delaySeconds = *action.argument;
    return fault;
  }
  const std::pair<const char*, Action> plain[] = {{"skip", Action::Skip},
                                                  {"mismatch-op", Action::MismatchOp},
                                                  {"mismatch-size", Action::MismatchSize},
                                                  {"exit", Action::Exit},
                                                  {"stop", Action::Stop},
                                                  {"kill", Action::Kill}};
  for (const auto& [name, value] : plain) {
    if (action.name == name && !action.argument) {
      fault.action = value;
      return fault;
    }
  }
  spec.reject(fmt::format("unknown action '{}'", spec.text("action")));
}

bool armed() {
  static const bool set = configured().has_value();
  return set;
}

std::optional<Action> inject(const Communicator& comm, uint64_t seq, OpType op) {
  const auto& fault = configured();
  if (!fault || !namesGroup(fault->group, comm.name())) return std::nullopt;
  if (fault->op ? (op != *fault->op || seq < fault->seq) : seq != fault->seq) return std::nullopt;
  if (comm.members().at(comm.rank()) != fault->rank) return std::nullopt;
  const bool mismatch = fault->action == Action::MismatchOp || fault->action == Action::MismatchSize;
  if (isPointToPoint(op) && mismatch) return std::nullopt;  // a send or receive has nothing to mismatch
  // One operation: a skipped one is not numbered, so the next would carry its seq again.
  static std::atomic<bool> fired{false};
  if (fired.exchange(true)) return std::nullopt;
  log::warn("fault", "injecting a fault at group {} {} seq {} ({})", comm.name(), toString(op), seq,
            env::kFault.text());
  switch (fault->action) {
    case Action::Delay:
      std::this_thread::sleep_for(std::chrono::duration<double>(fault->delaySeconds));
      return std::nullopt;
    case Action::Exit:
      std::fflush(nullptr);
      std::_Exit(17);
    case Action::Stop:
      std::fflush(nullptr);
      ::raise(SIGSTOP);  // returns once continued
      return std::nullopt;
    case Action::Kill:
      std::fflush(nullptr);
      ::raise(SIGKILL);
      return std::nullopt;
    default:
      return fault->action;
  }
}

Fingerprint mismatch(const Fingerprint& fingerprint, Action action) {
  Fingerprint other = fingerprint;
  if (action == Action::MismatchOp) {
    other.op = fingerprint.op == OpType::Broadcast ? OpType::AllReduce : OpType::Broadcast;
    other.root = other.op == OpType::Broadcast ? 0 : -1;
  } else {
    other.numel += 1;
    if (other.shape.empty()) other.shape.push_back(0);
    other.shape.back() += 1;
  }
  return other;
}

WorkPtr skippedWork() { return std::make_shared<SkippedWork>(); }

}  // namespace bulkhead::fault
