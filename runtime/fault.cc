#include "runtime/fault.h"

#include <fmt/format.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::fault {
namespace {

constexpr const char* kForm = "rank=R,group=G,seq=N,action=skip|mismatch-op|mismatch-size|delay:S|exit";

const std::optional<Fault>& configured() {
  static const std::optional<Fault> fault = [] {
    std::string text = env::kFault.text();
    return text.empty() ? std::nullopt : std::optional<Fault>(parse(text));
  }();
  return fault;
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
  Fault fault;
  bool haveRank = false, haveGroup = false, haveSeq = false, haveAction = false;
  std::istringstream fields(text);
  std::string field;
  auto reject = [&](const std::string& why) {
    throw ConfigError(fmt::format("{}='{}': {}", env::kFault.name(), text, why), {.expected = kForm});
  };
  while (std::getline(fields, field, ',')) {
    auto equals = field.find('=');
    if (equals == std::string::npos) reject(fmt::format("'{}' is not key=value", field));
    std::string key = field.substr(0, equals), value = field.substr(equals + 1);
    try {
      if (key == "rank") {
        fault.rank = std::stoi(value);
        haveRank = true;
      } else if (key == "group") {
        fault.group = value;
        haveGroup = !value.empty();
      } else if (key == "seq") {
        fault.seq = std::stoull(value);
        haveSeq = fault.seq > 0;
      } else if (key == "action") {
        haveAction = true;
        if (value == "skip") fault.action = Action::Skip;
        else if (value == "mismatch-op") fault.action = Action::MismatchOp;
        else if (value == "mismatch-size") fault.action = Action::MismatchSize;
        else if (value == "exit") fault.action = Action::Exit;
        else if (value.rfind("delay:", 0) == 0) {
          fault.action = Action::Delay;
          fault.delaySeconds = std::stod(value.substr(6));
        } else {
          reject(fmt::format("unknown action '{}'", value));
        }
      } else {
        reject(fmt::format("unknown key '{}'", key));
      }
    } catch (const std::logic_error&) {  // stoi and friends
      reject(fmt::format("'{}' has a value that is not a number", field));
    }
  }
  if (!haveRank || !haveGroup || !haveSeq || !haveAction) reject("rank, group, seq (>= 1) and action are all needed");
  return fault;
}

bool armed() {
  static const bool set = configured().has_value();
  return set;
}

std::optional<Action> inject(const Communicator& comm, uint64_t seq, bool pointToPoint) {
  const auto& fault = configured();
  if (!fault || fault->seq != seq || fault->group != comm.name()) return std::nullopt;
  if (comm.members().at(comm.rank()) != fault->rank) return std::nullopt;
  const bool mismatch = fault->action == Action::MismatchOp || fault->action == Action::MismatchSize;
  if (pointToPoint && mismatch) return std::nullopt;  // a send or receive has nothing to mismatch
  // One operation: a skipped one is not numbered, so the next would carry its seq again.
  static std::atomic<bool> fired{false};
  if (fired.exchange(true)) return std::nullopt;
  log::warn("fault", "injecting a fault at group {} seq {} ({})", comm.name(), seq, env::kFault.text());
  if (fault->action == Action::Delay) {
    std::this_thread::sleep_for(std::chrono::duration<double>(fault->delaySeconds));
    return std::nullopt;
  }
  if (fault->action == Action::Exit) {
    std::fflush(nullptr);
    std::_Exit(17);
  }
  return fault->action;
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
