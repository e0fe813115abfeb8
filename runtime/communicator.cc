#include "runtime/communicator.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/diagnosis/fault.h"
#include "runtime/diagnosis/monitor.h"
#include "runtime/env.h"
#include "runtime/errors.h"

namespace bulkhead {

Communicator::Communicator()
    : ledger_(std::make_shared<Ledger>(static_cast<size_t>(std::max<int64_t>(1, env::kLedgerCapacity.integer())))) {}

namespace {

// The members of a grouped exchange, each issued on its own: done when all are.
class GroupedWork : public Work {
 public:
  explicit GroupedWork(std::vector<WorkPtr> works) : works_(std::move(works)) {}
  bool isCompleted() override {
    return std::all_of(works_.begin(), works_.end(), [](const WorkPtr& w) { return w->isCompleted(); });
  }
  void wait(std::optional<Deadline> deadline) override {
    for (auto& work : works_) work->wait(deadline);
  }
  std::exception_ptr exception() const override {
    for (const auto& work : works_)
      if (auto error = work->exception()) return error;
    return nullptr;
  }
  uint64_t sequence() const override { return works_.empty() ? 0 : works_.front()->sequence(); }

 private:
  std::vector<WorkPtr> works_;
};

}  // namespace

void checkPeerOps(const Communicator& comm, const std::vector<PeerOp>& ops) {
  for (const PeerOp& op : ops) {
    const char* role = op.kind == PeerOp::Kind::Send ? "send" : "receive";
    if (!op.tensor.defined())
      throw ConfigError(fmt::format("a grouped {} to/from rank {} of {} has no tensor", role, op.peer, comm.name()),
                        {.rank = comm.rank(), .group = comm.name(), .expected = "a defined tensor"});
    if (op.peer < 0 || op.peer >= comm.size())
      throw ConfigError(
          fmt::format("a grouped {} names rank {}, outside {} of {} ranks", role, op.peer, comm.name(), comm.size()),
          {.rank = comm.rank(), .group = comm.name(), .expected = fmt::format("a peer in [0, {})", comm.size())});
    if (op.tensor.device() != comm.device())
      throw ConfigError(fmt::format("a grouped {} of {} has its tensor on {}, not on {}", role, comm.name(),
                                    op.tensor.device().str(), comm.device().str()),
                        {.rank = comm.rank(), .group = comm.name(), .expected = comm.device().str()});
  }
}

WorkPtr Communicator::sendRecv(std::vector<PeerOp> ops, CallOptions options) {
  checkPeerOps(*this, ops);
  std::vector<WorkPtr> works;
  works.reserve(ops.size());
  const Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kCollectiveTimeout.seconds()));
  for (PeerOp& op : ops) {
    CallOptions each{.deadline = deadline, .stream = options.stream, .label = std::move(op.label)};
    works.push_back(op.kind == PeerOp::Kind::Send ? send(std::move(op.tensor), op.peer, std::move(each))
                                                  : recv(std::move(op.tensor), op.peer, std::move(each)));
  }
  return std::make_shared<GroupedWork>(std::move(works));
}

Communicator::Injected Communicator::injectFault(Fingerprint& fingerprint, uint64_t ahead) {
  if (!fault::armed()) return Injected::None;
  // Point-to-point operations are numbered on their own (Ledger::issue).
  const LedgerHeads heads = ledger_->heads();
  const bool pointToPoint = isPointToPoint(fingerprint.op);
  auto action =
      fault::inject(*this, (pointToPoint ? heads.lastIssuedP2P : heads.lastIssued) + 1 + ahead, fingerprint.op);
  if (!action) return Injected::None;
  if (*action == fault::Action::Skip) return Injected::Skip;
  fingerprint = fault::mismatch(fingerprint, *action);
  return Injected::Altered;
}

void Communicator::checkStrict(uint64_t seq, const Fingerprint& fingerprint, Deadline deadline) {
  if (!monitor_ || !monitor_->strict() || isPointToPoint(fingerprint.op)) return;
  try {
    monitor_->checkBeforeCollective(*this, seq, fingerprint, deadline);
  } catch (...) {
    ledger_->fail(fingerprint.op, seq);
    throw;
  }
}

}  // namespace bulkhead
