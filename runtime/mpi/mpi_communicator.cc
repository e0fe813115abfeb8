// The MPI backend's communicator and work handle (see mpi_backend.h).

#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <numeric>
#include <thread>
#include <tuple>

#include "runtime/backoff.h"
#include "runtime/diagnosis/diagnosis.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/diagnosis/fault.h"
#include "runtime/diagnosis/monitor.h"
#include "runtime/diagnosis/op_checks.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/mpi/mpi_backend.h"
#include "runtime/mpi/mpi_check.h"

namespace bulkhead::mpi {
namespace {

using c10::ScalarType;

std::atomic<bool> poisonedFlag{false};
std::atomic<bool> finalized{false};

constexpr int kPointToPointTag = 7000;  // MPI keeps send/recv order per (peer, tag)

const checks::BackendRules kRules{c10::kCPU,
                                  {ScalarType::Float, ScalarType::Double, ScalarType::BFloat16, ScalarType::Half,
                                   ScalarType::Int, ScalarType::Long, ScalarType::Char, ScalarType::Byte}};

// One operation in flight. MPI reads and writes its buffers (the tensors and
// the count arrays) until the requests complete, so they live here.
struct PendingOp {
  Fingerprint fingerprint;
  uint64_t seq = 0;
  Deadline deadline = Deadline::never();
  Deadline::Clock::time_point issuedAt;
  std::vector<MPI_Request> requests;
  std::vector<at::Tensor> buffers;
  std::vector<int> sendCounts, sendDispls, recvCounts, recvDispls;
  std::function<void()> finish;  // runs once on completion (e.g. avg's division)
  bool stalled = false;          // an injected mismatch: issued to no backend, never completes
  std::atomic<bool> done{false};
  std::exception_ptr error;
};

// Operations abandoned by a timeout or an abort: MPI may still touch their
// buffers, so they are never freed. The process exits soon after.
std::mutex abandonedLock;
std::vector<std::shared_ptr<PendingOp>> abandoned;

void ensureMpi() {
  std::lock_guard<std::mutex> lock(callLock());
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread", {});
  check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", {});
  if (provided < MPI_THREAD_SERIALIZED)
    throw ConfigError("this MPI library does not support MPI_THREAD_SERIALIZED; Bulkhead needs it (Open MPI 4+ does)");
  createReduceOps();
}

int countOf(int64_t elements, const Communicator& comm) {
  if (elements > INT_MAX)
    throw ConfigError(fmt::format("a message of {} elements exceeds MPI's int count; split it into parts", elements),
                      checks::context(comm, fmt::format("at most {} elements per message", INT_MAX)));
  return static_cast<int>(elements);
}

class MpiCommunicator;

class MpiWork : public Work {
 public:
  MpiWork(std::shared_ptr<MpiCommunicator> comm, std::shared_ptr<PendingOp> op)
      : comm_(std::move(comm)), op_(std::move(op)) {}
  bool isCompleted() override;
  void wait(std::optional<Deadline> deadline) override;
  std::exception_ptr exception() const override { return op_->done ? op_->error : nullptr; }
  uint64_t sequence() const override { return op_->seq; }

 private:
  std::shared_ptr<MpiCommunicator> comm_;
  std::shared_ptr<PendingOp> op_;
};

class MpiCommunicator : public Communicator, public std::enable_shared_from_this<MpiCommunicator> {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, std::vector<int> members)
      : comm_(comm),
        name_(std::move(name)),
        members_(std::move(members)),
        defaultTimeout_(env::kCollectiveTimeout.seconds()) {
    std::lock_guard<std::mutex> lock(callLock());
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank", {.group = name_});
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size", {.group = name_});
  }

  ~MpiCommunicator() override {
    drainOnDestroy();
    std::lock_guard<std::mutex> lock(callLock());
    if (!aborted_ && pending_.empty() && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& members() const override { return members_; }
  const char* backend() const override { return "mpi"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  bool isAborted() const override { return aborted_; }

  WorkPtr allReduce(at::Tensor tensor, ReduceOptions options) override {
    checks::allReduceArgs(*this, kRules, tensor, options.op);
    auto op = prepare(OpType::AllReduce, tensor);
    op->fingerprint.reduce = options.op;
    int count = countOf(tensor.numel(), *this);
    if (options.op == ReduceOp::Avg) op->finish = [tensor, n = size_]() mutable { tensor.div_(n); };
    return launch(op, options.deadline, "MPI_Iallreduce", [&](MPI_Request* request) {
      return MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), count, datatype(tensor.scalar_type()),
                            reduceOp(options.op, tensor.scalar_type()), comm_, request);
    });
  }

  WorkPtr allGather(at::Tensor input, at::Tensor output, CallOptions options) override {
    checks::allGatherArgs(*this, kRules, input, output);
    auto op = prepare(OpType::AllGather, input, output);
    int count = countOf(input.numel(), *this);
    countOf(output.numel(), *this);
    return launch(op, options.deadline, "MPI_Iallgather", [&](MPI_Request* request) {
      MPI_Datatype type = datatype(input.scalar_type());
      return MPI_Iallgather(input.data_ptr(), count, type, output.data_ptr(), count, type, comm_, request);
    });
  }

  WorkPtr reduceScatter(at::Tensor input, at::Tensor output, ReduceOptions options) override {
    checks::reduceScatterArgs(*this, kRules, input, output, options.op);
    auto op = prepare(OpType::ReduceScatter, input, output);
    op->fingerprint.reduce = options.op;
    int count = countOf(output.numel(), *this);
    countOf(input.numel(), *this);
    if (options.op == ReduceOp::Avg) op->finish = [output, n = size_]() mutable { output.div_(n); };
    return launch(op, options.deadline, "MPI_Ireduce_scatter_block", [&](MPI_Request* request) {
      return MPI_Ireduce_scatter_block(input.data_ptr(), output.data_ptr(), count, datatype(input.scalar_type()),
                                       reduceOp(options.op, input.scalar_type()), comm_, request);
    });
  }

  WorkPtr allToAll(at::Tensor send, at::Tensor recv, std::vector<int64_t> sendSplits, std::vector<int64_t> recvSplits,
                   CallOptions options) override {
    std::tie(sendSplits, recvSplits) =
        checks::allToAllArgs(*this, kRules, send, recv, std::move(sendSplits), std::move(recvSplits));
    auto op = prepare(OpType::AllToAll, send, recv);
    op->fingerprint.sendSplits = sendSplits;
    op->fingerprint.recvSplits = recvSplits;
    int64_t row = checks::rowElements(send);
    auto layout = [&](const std::vector<int64_t>& splits, std::vector<int>& counts, std::vector<int>& displs) {
      int64_t offset = 0;
      for (int64_t rows : splits) {
        counts.push_back(countOf(rows * row, *this));
        displs.push_back(countOf(offset, *this));
        offset += rows * row;
      }
      countOf(offset, *this);
    };
    layout(sendSplits, op->sendCounts, op->sendDispls);
    layout(recvSplits, op->recvCounts, op->recvDispls);
    return launch(op, options.deadline, "MPI_Ialltoallv", [&](MPI_Request* request) {
      MPI_Datatype type = datatype(send.scalar_type());
      return MPI_Ialltoallv(send.data_ptr(), op->sendCounts.data(), op->sendDispls.data(), type, recv.data_ptr(),
                            op->recvCounts.data(), op->recvDispls.data(), type, comm_, request);
    });
  }

  WorkPtr broadcast(at::Tensor tensor, int root, CallOptions options) override {
    checks::tensor(*this, kRules, tensor, "broadcast");
    checks::peer(*this, root, "root");
    auto op = prepare(OpType::Broadcast, tensor);
    op->fingerprint.root = root;
    int count = countOf(tensor.numel(), *this);
    return launch(op, options.deadline, "MPI_Ibcast", [&](MPI_Request* request) {
      return MPI_Ibcast(tensor.data_ptr(), count, datatype(tensor.scalar_type()), root, comm_, request);
    });
  }

  WorkPtr barrier(CallOptions options) override {
    auto op = prepare(OpType::Barrier, at::Tensor());
    return launch(op, options.deadline, "MPI_Ibarrier",
                  [&](MPI_Request* request) { return MPI_Ibarrier(comm_, request); });
  }

  WorkPtr send(at::Tensor tensor, int peer, CallOptions options) override {
    checks::tensor(*this, kRules, tensor, "send");
    checks::peer(*this, peer, "peer");
    auto op = prepare(OpType::Send, tensor);
    op->fingerprint.root = peer;
    op->fingerprint.label = options.label;
    int count = countOf(tensor.numel(), *this);
    return launch(op, options.deadline, "MPI_Isend", [&](MPI_Request* request) {
      return MPI_Isend(tensor.data_ptr(), count, datatype(tensor.scalar_type()), peer, kPointToPointTag, comm_,
                       request);
    });
  }

  WorkPtr recv(at::Tensor tensor, int peer, CallOptions options) override {
    checks::tensor(*this, kRules, tensor, "recv");
    checks::peer(*this, peer, "peer");
    auto op = prepare(OpType::Recv, tensor);
    op->fingerprint.root = peer;
    op->fingerprint.label = options.label;
    int count = countOf(tensor.numel(), *this);
    return launch(op, options.deadline, "MPI_Irecv", [&](MPI_Request* request) {
      return MPI_Irecv(tensor.data_ptr(), count, datatype(tensor.scalar_type()), peer, kPointToPointTag, comm_,
                       request);
    });
  }

  CommunicatorPtr split(int color, int key, const std::string& name, SplitOptions options) override {
    Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
    // MPI_Comm_split blocks until every rank calls it, so first agree on all
    // (color, key) pairs with a bounded all-gather; the split then finds every
    // rank already there.
    at::Tensor mine = at::empty({2}, at::kInt), all = at::empty({2 * size_}, at::kInt);
    mine.data_ptr<int>()[0] = color;
    mine.data_ptr<int>()[1] = key;
    auto op = prepare(OpType::Split, mine, all);
    launch(op, deadline, "MPI_Iallgather", [&](MPI_Request* request) {
      return MPI_Iallgather(mine.data_ptr(), 2, MPI_INT, all.data_ptr(), 2, MPI_INT, comm_, request);
    })->wait();

    // MPI_Comm_split blocks; a rank that passed the gather and then died
    // would hold the others in it, so it runs on a helper thread under the
    // deadline (on expiry the process is poisoned and exits at shutdown).
    struct Split {
      std::mutex mutex;
      std::condition_variable done;
      bool finished = false;
      int rc = MPI_SUCCESS;
      MPI_Comm child = MPI_COMM_NULL;
    };
    auto job = std::make_shared<Split>();
    std::thread([job, comm = comm_, color, key] {
      MPI_Comm child = MPI_COMM_NULL;
      int rc;
      {
        std::lock_guard<std::mutex> lock(callLock());
        rc = MPI_Comm_split(comm, color < 0 ? MPI_UNDEFINED : color, key, &child);
      }
      std::lock_guard<std::mutex> lock(job->mutex);
      job->rc = rc;
      job->child = child;
      job->finished = true;
      job->done.notify_all();
    }).detach();
    {
      std::unique_lock<std::mutex> lock(job->mutex);
      if (!job->done.wait_until(lock, deadline.when(), [&] { return job->finished; })) {
        poisonedFlag = true;
        markAborted("MPI_Comm_split did not finish", 3);
        throw TimeoutError(fmt::format("MPI_Comm_split of {} into '{}' did not finish within the init deadline: a "
                                       "rank left after agreeing to split; this process exits with code 3 at shutdown",
                                       checks::describeGroup(*this), name),
                           checks::context(*this));
      }
    }
    check(job->rc, "MPI_Comm_split", checks::context(*this));
    MPI_Comm child = job->child;
    if (color < 0) return nullptr;
    const int* pairs = all.data_ptr<int>();
    std::vector<int> ranks;
    for (int r = 0; r < size_; ++r)
      if (pairs[2 * r] == color) ranks.push_back(r);
    std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return pairs[2 * a + 1] < pairs[2 * b + 1]; });
    std::vector<int> worldRanks;
    for (int r : ranks) worldRanks.push_back(members_[r]);
    auto group = std::make_shared<MpiCommunicator>(child, fmt::format("{}[{}]", name, color), std::move(worldRanks));
    if (monitor()) monitor()->watch(group);
    return group;
  }

  void abort(const std::string& reason) override {
    log::warn("comm", "aborting {}: {}", checks::describeGroup(*this), reason);
    markAborted(reason);
  }

  // Tests every operation in flight, in issue order, and settles those done.
  void progress() {
    std::lock_guard<std::mutex> pendingLock(mutex_);
    std::lock_guard<std::mutex> mpiLock(callLock());
    for (auto it = pending_.begin(); it != pending_.end();) {
      PendingOp& op = **it;
      if (op.stalled) {
        ++it;
        continue;
      }
      int flag = 0;
      int rc = MPI_Testall(static_cast<int>(op.requests.size()), op.requests.data(), &flag, MPI_STATUSES_IGNORE);
      if (rc == MPI_SUCCESS && !flag) {
        ++it;
        continue;
      }
      try {
        check(rc, "MPI_Testall", checks::context(*this));
        if (op.finish) op.finish();
        ledger_->complete(op.fingerprint.op, op.seq);
      } catch (...) {
        op.error = std::current_exception();
        ledger_->fail(op.fingerprint.op, op.seq);
      }
      op.done = true;
      it = pending_.erase(it);
    }
  }

  [[noreturn]] void throwAborted(const PendingOp& op) const {
    throw CommError(fmt::format("{} seq {} cannot finish: {} was aborted ({})", toString(op.fingerprint.op), op.seq,
                                checks::describeGroup(*this), abortReason()),
                    checks::context(*this));
  }

  [[noreturn]] void timeout(const PendingOp& op) {
    double waited = secondsSince(op.issuedAt);
    Diagnosis diagnosis = monitor() ? monitor()->diagnose(*this, op.seq, op.fingerprint, waited)
                                    : Diagnosis{describeTimeout(*this, op.fingerprint, op.seq, waited), false};
    std::string message = diagnosis.message +
                          " MPI cannot cancel it: the communicator is aborted and this process exits with code 3 at "
                          "shutdown.";
    log::error("comm", "{}", message);
    markAborted(fmt::format("{} seq {} timed out", toString(op.fingerprint.op), op.seq), diagnosis.desync ? 4 : 3);
    if (diagnosis.desync) throw DesyncError(message, checks::context(*this));
    throw TimeoutError(message, checks::context(*this), op.seq, diagnosis.message);
  }

 private:
  std::string abortReason() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return abortReason_;
  }

  void ensureUsable() const {
    if (aborted_)
      throw CommError(fmt::format("{} was aborted ({}) and refuses further operations; restart the job from its "
                                  "last checkpoint once the cause is fixed",
                                  checks::describeGroup(*this), abortReason()),
                      checks::context(*this));
  }

  std::shared_ptr<PendingOp> prepare(OpType type, const at::Tensor& input, const at::Tensor& output = {}) {
    ensureUsable();
    auto op = std::make_shared<PendingOp>();
    op->fingerprint = checks::fingerprint(type, input);
    if (input.defined()) op->buffers.push_back(input);
    if (output.defined()) op->buffers.push_back(output);
    return op;
  }

  WorkPtr launch(const std::shared_ptr<PendingOp>& op, std::optional<Deadline> deadline, const char* call,
                 const std::function<int(MPI_Request*)>& issue) {
    op->issuedAt = Deadline::Clock::now();
    op->deadline = deadline.value_or(Deadline::afterSeconds(defaultTimeout_));
    Injected injected = injectFault(op->fingerprint);
    if (injected == Injected::Skip) return fault::skippedWork();
    op->stalled = injected == Injected::Altered;
    op->seq = ledger_->issue(op->fingerprint);
    checkStrict(op->seq, op->fingerprint, op->deadline);
    std::lock_guard<std::mutex> pendingLock(mutex_);
    if (!op->stalled) {
      std::lock_guard<std::mutex> mpiLock(callLock());
      MPI_Request request = MPI_REQUEST_NULL;
      int rc = issue(&request);
      if (rc != MPI_SUCCESS) {
        ledger_->fail(op->fingerprint.op, op->seq);
        check(rc, call, checks::context(*this));
      }
      op->requests.push_back(request);
    }
    pending_.push_back(op);
    return std::make_shared<MpiWork>(shared_from_this(), op);
  }

  // Marks the communicator aborted (raising the process's fatal error with
  // `exitCode`, runtime/diagnosis/fatal_exit.h) and abandons what is in flight.
  void markAborted(const std::string& reason, int exitCode = 5) {
    fatal::raise(exitCode, fmt::format("{} was aborted: {}", name_, reason));
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aborted_) abortReason_ = reason;
    aborted_ = true;
    if (pending_.empty()) return;
    poisonedFlag = true;
    std::lock_guard<std::mutex> keep(abandonedLock);
    for (auto& op : pending_) {
      ledger_->fail(op->fingerprint.op, op->seq);
      abandoned.push_back(op);
    }
    pending_.clear();
  }

  // Operations nobody waited for get the shutdown timeout to finish (none in a
  // poisoned process); what is still in flight then is abandoned (and the
  // process poisoned).
  void drainOnDestroy() {
    if (aborted_ || finalized) return;
    // A process whose MPI operation timed out exits at shutdown: what is in
    // flight elsewhere (perhaps with the same stalled peer) is abandoned now.
    if (poisonedFlag || fatal::ending()) return markAborted("this process is ending after an earlier fatal error");
    Deadline deadline = fatal::shutdownDeadline();
    Backoff backoff;
    for (;;) {
      progress();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (pending_.empty()) return;
      }
      if (deadline.expired()) break;
      backoff.pause(deadline);
    }
    log::error("comm", "{} destroyed with operations in flight that did not finish in {} s",
               checks::describeGroup(*this), env::kShutdownTimeout.seconds());
    markAborted("destroyed with operations in flight");
  }

  MPI_Comm comm_;
  std::string name_;
  std::vector<int> members_;
  int rank_ = 0, size_ = 1;
  double defaultTimeout_;
  mutable std::mutex mutex_;  // guards pending_ and abortReason_; taken before callLock()
  std::deque<std::shared_ptr<PendingOp>> pending_;
  std::atomic<bool> aborted_{false};
  std::string abortReason_;
};

bool MpiWork::isCompleted() {
  if (!op_->done) comm_->progress();
  return op_->done;
}

void MpiWork::wait(std::optional<Deadline> deadline) {
  Deadline until = deadline ? op_->deadline.earliest(*deadline) : op_->deadline;
  Backoff backoff;
  for (;;) {
    comm_->progress();
    if (op_->done) {
      if (op_->error) std::rethrow_exception(op_->error);
      return;
    }
    if (comm_->isAborted()) comm_->throwAborted(*op_);
    if (until.expired()) comm_->timeout(*op_);
    backoff.pause(until);
  }
}

// Polls one request against a deadline outside any communicator (world setup
// and the final barrier). Returns false on expiry, leaving the request live.
bool pollRequest(MPI_Request& request, Deadline deadline, const char* call) {
  Backoff backoff;
  for (;;) {
    int flag = 0;
    {
      std::lock_guard<std::mutex> lock(callLock());
      check(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), call, {});
    }
    if (flag) return true;
    if (deadline.expired()) return false;
    backoff.pause(deadline);
  }
}

}  // namespace

CommunicatorPtr initWorld(WorldOptions options) {
  ensureMpi();
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  int size = worldSize();
  // MPI writes the new communicator when the duplication completes, perhaps
  // after a timeout: it lives on the heap and is leaked in that case.
  auto* dup = new MPI_Comm(MPI_COMM_NULL);
  MPI_Request request = MPI_REQUEST_NULL;
  {
    std::lock_guard<std::mutex> lock(callLock());
    check(MPI_Comm_idup(MPI_COMM_WORLD, dup, &request), "MPI_Comm_idup", {.group = "world"});
  }
  if (!pollRequest(request, deadline, "MPI_Comm_idup")) {
    poisonedFlag = true;
    throw TimeoutError(fmt::format("the world communicator ({} ranks) was not set up within the init deadline: "
                                   "some rank did not reach init; check that every rank started, or raise {}",
                                   size, env::kInitTimeout.name()),
                       {.rank = worldRank(), .group = "world"});
  }
  std::vector<int> members(size);
  std::iota(members.begin(), members.end(), 0);
  MPI_Comm world = *dup;
  delete dup;
  return std::make_shared<MpiCommunicator>(world, "world", std::move(members));
}

int worldRank() {
  ensureMpi();
  int rank = 0;
  std::lock_guard<std::mutex> lock(callLock());
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank", {});
  return rank;
}

int worldSize() {
  ensureMpi();
  int size = 0;
  std::lock_guard<std::mutex> lock(callLock());
  check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size", {});
  return size;
}

bool poisoned() { return poisonedFlag; }

void finalize(Deadline deadline) {
  if (fatal::ending()) return;  // no barrier with a stopped peer; guardedMain ends the process
  if (!poisonedFlag) {          // a poisoned process may have a thread stuck in MPI holding the lock
    int initialized = 0, done = 0;
    std::lock_guard<std::mutex> lock(callLock());
    MPI_Initialized(&initialized);
    MPI_Finalized(&done);
    if (!initialized || done) return;
  }
  if (!poisonedFlag) {
    MPI_Request request = MPI_REQUEST_NULL;
    {
      std::lock_guard<std::mutex> lock(callLock());
      check(MPI_Ibarrier(MPI_COMM_WORLD, &request), "MPI_Ibarrier", {.group = "world"});
    }
    if (!pollRequest(request, deadline, "MPI_Ibarrier")) {
      log::error("launch",
                 "the final world barrier did not complete within {} s: some rank stopped early or "
                 "is stuck",
                 env::kShutdownTimeout.seconds());
      poisonedFlag = true;
    }
  }
  if (poisonedFlag) {
    double grace = env::kAbortGrace.seconds();
    log::error("launch",
               "an MPI operation of this process timed out or was abandoned; MPI cannot cancel it, so "
               "the process exits with code 3 in {} s without MPI_Finalize",
               grace);
    std::this_thread::sleep_for(std::chrono::duration<double>(grace));
    std::fflush(nullptr);
    std::_Exit(3);
  }
  std::lock_guard<std::mutex> lock(callLock());
  finalized = true;
  freeReduceOps();
  MPI_Finalize();
}

}  // namespace bulkhead::mpi
