// The Gloo backend's communicator and work handle (see gloo_backend.h).

#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/types.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "runtime/diagnosis/diagnosis.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/diagnosis/fault.h"
#include "runtime/diagnosis/monitor.h"
#include "runtime/diagnosis/op_checks.h"
#include "runtime/env.h"
#include "runtime/gloo/gloo_backend.h"
#include "runtime/gloo/gloo_check.h"
#include "runtime/gloo/gloo_communicator.h"
#include "runtime/gloo/gloo_context.h"
#include "runtime/gloo/gloo_state.h"
#include "runtime/log.h"

namespace bulkhead::gloo {
namespace {

using c10::ScalarType;

const checks::BackendRules kRules{c10::kCPU,
                                  {ScalarType::Float, ScalarType::Double, ScalarType::BFloat16, ScalarType::Half,
                                   ScalarType::Int, ScalarType::Long, ScalarType::Char, ScalarType::Byte}};

// Sends and receives use their own slot prefix, apart from Gloo's collectives'.
constexpr uint8_t kPointToPointPrefix = 0x70;

template <typename T>
void reduceInto(void* c, const void* a, const void* b, size_t n, ReduceOp op) {
  auto* out = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        out[i] = static_cast<T>(x[i] + y[i]);
        break;
      case ReduceOp::Prod:
        out[i] = static_cast<T>(x[i] * y[i]);
        break;
      case ReduceOp::Min:
        out[i] = std::min<T>(x[i], y[i]);
        break;
      case ReduceOp::Max:
        out[i] = std::max<T>(x[i], y[i]);
        break;
    }
  }
}

template <typename T>
void allReduceTyped(const std::shared_ptr<::gloo::Context>& context, void* data, size_t count, ReduceOp op,
                    uint32_t tag, Millis timeout) {
  ::gloo::AllreduceOptions options(context);
  options.setOutput(static_cast<T*>(data), count);
  options.setReduceFunction([op](void* c, const void* a, const void* b, size_t n) { reduceInto<T>(c, a, b, n, op); });
  options.setTag(tag);
  options.setTimeout(timeout);
  ::gloo::allreduce(options);
}

// A sum (or min, max, product) over the group, in place, in the tensor's dtype.
void allReduceBytes(const std::shared_ptr<::gloo::Context>& context, at::Tensor& tensor, ReduceOp op, uint32_t tag,
                    Millis timeout) {
  void* data = tensor.data_ptr();
  auto count = static_cast<size_t>(tensor.numel());
  switch (tensor.scalar_type()) {
    case ScalarType::Float:
      return allReduceTyped<float>(context, data, count, op, tag, timeout);
    case ScalarType::Double:
      return allReduceTyped<double>(context, data, count, op, tag, timeout);
    case ScalarType::BFloat16:
      return allReduceTyped<c10::BFloat16>(context, data, count, op, tag, timeout);
    case ScalarType::Half:
      return allReduceTyped<c10::Half>(context, data, count, op, tag, timeout);
    case ScalarType::Int:
      return allReduceTyped<int32_t>(context, data, count, op, tag, timeout);
    case ScalarType::Long:
      return allReduceTyped<int64_t>(context, data, count, op, tag, timeout);
    case ScalarType::Char:
      return allReduceTyped<int8_t>(context, data, count, op, tag, timeout);
    case ScalarType::Byte:
      return allReduceTyped<uint8_t>(context, data, count, op, tag, timeout);
    default:
      break;  // refused by the argument checks before any communication
  }
}

void barrierCall(const std::shared_ptr<::gloo::Context>& context, uint32_t tag, Millis timeout) {
  ::gloo::BarrierOptions options(context);
  options.setTag(tag);
  options.setTimeout(timeout);
  ::gloo::barrier(options);
}

size_t bytesOf(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

// Where Gloo may point for an empty tensor (it needs a pointer even for 0 bytes).
uint8_t* dataOrDummy(const at::Tensor& t) {
  static uint8_t dummy[8];
  return t.numel() > 0 ? static_cast<uint8_t*>(t.data_ptr()) : dummy;
}

class GlooCommunicator;

class GlooWork : public Work {
 public:
  GlooWork(std::shared_ptr<GlooCommunicator> comm, OpPtr op) : comm_(std::move(comm)), op_(std::move(op)) {}
  bool isCompleted() override;
  void wait(std::optional<Deadline> deadline) override;
  std::exception_ptr exception() const override;
  uint64_t sequence() const override { return op_->seq; }

 private:
  std::shared_ptr<GlooCommunicator> comm_;
  OpPtr op_;
};

class GlooCommunicator : public Communicator, public std::enable_shared_from_this<GlooCommunicator> {
 public:
  GlooCommunicator(std::shared_ptr<::gloo::Context> context, ContextFactory factory, std::string name,
                   std::vector<int> members)
      : factory_(std::move(factory)),
        name_(std::move(name)),
        members_(std::move(members)),
        defaultTimeout_(env::kCollectiveTimeout.seconds()),
        state_(std::make_shared<State>()) {
    state_->context = std::move(context);
    state_->ledger = ledger_;
    state_->errorContext = {.rank = members_.at(state_->context->rank), .group = name_};
    worker_ = std::thread(collectiveWorker, state_);
  }

  ~GlooCommunicator() override {
    drainOnDestroy();
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stopping = true;
      state_->changed.notify_all();
    }
    // Threads in a Gloo call end by its timeout; they own what they use.
    worker_.detach();
    for (auto& [key, thread] : pointToPointThreads_) thread.detach();
  }

  int rank() const override { return state_->context->rank; }
  int size() const override { return state_->context->size; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& members() const override { return members_; }
  const char* backend() const override { return "gloo"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  bool isAborted() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->aborted;
  }

  WorkPtr allReduce(at::Tensor tensor, ReduceOptions options) override {
    checks::allReduceArgs(*this, kRules, tensor, options.op);
    auto op = prepare(OpType::AllReduce, tensor);
    op->fingerprint.reduce = options.op;
    const int n = size();
    return launch(op, options.deadline,
                  [ctx = context(), tensor, reduce = options.op, n, op = op.get()](Millis timeout) mutable {
                    if (tensor.numel() == 0) return barrierCall(ctx, tag(*op), timeout);
                    allReduceBytes(ctx, tensor, reduce, tag(*op), timeout);
                    if (reduce == ReduceOp::Avg) tensor.div_(n);
                  });
  }

  WorkPtr allGather(at::Tensor input, at::Tensor output, CallOptions options) override {
    checks::allGatherArgs(*this, kRules, input, output);
    auto op = prepare(OpType::AllGather, input, output);
    return launch(op, options.deadline, [ctx = context(), input, output, op = op.get()](Millis timeout) {
      if (input.numel() == 0) return barrierCall(ctx, tag(*op), timeout);
      ::gloo::AllgatherOptions gather(ctx);
      gather.setInput(static_cast<uint8_t*>(input.data_ptr()), bytesOf(input));
      gather.setOutput(static_cast<uint8_t*>(output.data_ptr()), bytesOf(output));
      gather.setTag(tag(*op));
      gather.setTimeout(timeout);
      ::gloo::allgather(gather);
    });
  }

  WorkPtr reduceScatter(at::Tensor input, at::Tensor output, ReduceOptions options) override {
    checks::reduceScatterArgs(*this, kRules, input, output, options.op);
    auto op = prepare(OpType::ReduceScatter, input, output);
    op->fingerprint.reduce = options.op;
    const int n = size(), me = rank();
    // Gloo has no reduce-scatter for arbitrary types: a full all-reduce of a
    // copy, then this rank's chunk.
    return launch(op, options.deadline,
                  [ctx = context(), input, output, reduce = options.op, n, me, op = op.get()](Millis timeout) mutable {
                    if (output.numel() == 0) return barrierCall(ctx, tag(*op), timeout);
                    at::Tensor all = input.reshape({-1}).clone();
                    allReduceBytes(ctx, all, reduce, tag(*op), timeout);
                    output.reshape({-1}).copy_(all.narrow(0, me * output.numel(), output.numel()));
                    if (reduce == ReduceOp::Avg) output.div_(n);
                  });
  }

  WorkPtr allToAll(at::Tensor send, at::Tensor recv, std::vector<int64_t> sendSplits, std::vector<int64_t> recvSplits,
                   CallOptions options) override {
    std::tie(sendSplits, recvSplits) =
        checks::allToAllArgs(*this, kRules, send, recv, std::move(sendSplits), std::move(recvSplits));
    auto op = prepare(OpType::AllToAll, send, recv);
    op->fingerprint.sendSplits = sendSplits;
    op->fingerprint.recvSplits = recvSplits;
    const int64_t rowBytes = checks::rowElements(send) * send.element_size();
    auto bytes = [rowBytes](std::vector<int64_t> splits) {
      for (int64_t& rows : splits) rows *= rowBytes;
      return splits;
    };
    return launch(op, options.deadline,
                  [ctx = context(), send, recv, sendBytes = bytes(sendSplits), recvBytes = bytes(recvSplits),
                   op = op.get()](Millis timeout) {
                    ::gloo::AlltoallvOptions exchange(ctx);
                    exchange.setInput(dataOrDummy(send), sendBytes);
                    exchange.setOutput(dataOrDummy(recv), recvBytes);
                    exchange.setTag(tag(*op));
                    exchange.setTimeout(timeout);
                    ::gloo::alltoallv(exchange);
                  });
  }

  WorkPtr broadcast(at::Tensor tensor, int root, CallOptions options) override {
    checks::tensor(*this, kRules, tensor, "broadcast");
    checks::peer(*this, root, "root");
    auto op = prepare(OpType::Broadcast, tensor);
    op->fingerprint.root = root;
    return launch(op, options.deadline, [ctx = context(), tensor, root, op = op.get()](Millis timeout) {
      if (tensor.numel() == 0) return barrierCall(ctx, tag(*op), timeout);
      ::gloo::BroadcastOptions cast(ctx);
      cast.setRoot(root);
      cast.setOutput(static_cast<uint8_t*>(tensor.data_ptr()), bytesOf(tensor));
      cast.setTag(tag(*op));
      cast.setTimeout(timeout);
      ::gloo::broadcast(cast);
    });
  }

  WorkPtr barrier(CallOptions options) override {
    auto op = prepare(OpType::Barrier, at::Tensor());
    return launch(op, options.deadline,
                  [ctx = context(), op = op.get()](Millis timeout) { barrierCall(ctx, tag(*op), timeout); });
  }

  WorkPtr send(at::Tensor tensor, int peer, CallOptions options) override {
    return pointToPoint(OpType::Send, std::move(tensor), peer, std::move(options));
  }

  WorkPtr recv(at::Tensor tensor, int peer, CallOptions options) override {
    return pointToPoint(OpType::Recv, std::move(tensor), peer, std::move(options));
  }

  CommunicatorPtr split(int color, int key, const std::string& name, SplitOptions options) override;

  void abort(const std::string& reason) override {
    log::warn("comm", "aborting {}: {}", checks::describeGroup(*this), reason);
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->abortLocked(reason);
  }

  // For GlooWork.
  std::mutex& mutex() { return state_->mutex; }
  std::condition_variable& changed() { return state_->changed; }
  std::string abortReason() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->abortReason;
  }

  [[noreturn]] void throwAborted(const Op& op) const {
    throw CommError(fmt::format("{} seq {} cannot finish: {} was aborted ({})", toString(op.fingerprint.op), op.seq,
                                checks::describeGroup(*this), abortReason()),
                    checks::context(*this));
  }

  [[noreturn]] void timeout(const Op& op) {
    double waited = secondsSince(op.issuedAt);
    Diagnosis diagnosis = monitor() ? monitor()->diagnose(*this, op.seq, op.fingerprint, waited)
                                    : Diagnosis{describeTimeout(*this, op.fingerprint, op.seq, waited), false};
    std::string message = diagnosis.message + " The communicator is aborted; restart from the last checkpoint.";
    log::error("comm", "{}", message);
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->abortLocked(fmt::format("{} seq {} timed out", toString(op.fingerprint.op), op.seq),
                          diagnosis.desync ? 4 : 3);
    }
    if (diagnosis.desync) throw DesyncError(message, checks::context(*this));
    throw TimeoutError(message, checks::context(*this), op.seq, diagnosis.message);
  }

 private:
  static uint32_t tag(const Op& op) { return static_cast<uint32_t>(op.seq); }
  const std::shared_ptr<::gloo::Context>& context() const { return state_->context; }

  OpPtr prepare(OpType type, const at::Tensor& input, const at::Tensor& output = {}) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (state_->aborted)
        throw CommError(fmt::format("{} was aborted ({}) and refuses further operations; restart the job from its "
                                    "last checkpoint once the cause is fixed",
                                    checks::describeGroup(*this), state_->abortReason),
                        checks::context(*this));
    }
    auto op = std::make_shared<Op>();
    op->fingerprint = checks::fingerprint(type, input);
    if (input.defined()) op->buffers.push_back(input);
    if (output.defined()) op->buffers.push_back(output);
    return op;
  }

  // Starts the operation's clock: its deadline (the caller's, or the default
  // timeout counted from the call) also covers waiting for issueMutex_.
  void start(const OpPtr& op, std::optional<Deadline> deadline) {
    op->issuedAt = Deadline::Clock::now();
    op->deadline = deadline.value_or(Deadline::afterSeconds(defaultTimeout_));
  }

  // Numbers the operation, applies an injected fault and the strict check.
  // Returns false when the operation was skipped (not issued, not numbered).
  bool number(const OpPtr& op) {
    Injected injected = injectFault(op->fingerprint);
    if (injected == Injected::Skip) return false;
    op->stalled = injected == Injected::Altered;
    op->seq = ledger_->issue(op->fingerprint);
    checkStrict(op->seq, op->fingerprint, op->deadline);
    return true;
  }

  // What issue() did with an operation.
  enum class Issued {
    Skipped,  // an injected skip: not numbered, not recorded
    Settled,  // the communicator was aborted: failed at once with the abort's error
    Pending,  // numbered and pending: waiters and abort see it from now on
  };

  // Numbers the operation and records it as pending. The caller holds
  // issueMutex_, not state_->mutex.
  Issued issue(const OpPtr& op) {
    if (!number(op)) return Issued::Skipped;
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->pending.push_back(op);
    if (!state_->aborted) return Issued::Pending;
    state_->abortLocked(state_->abortReason);
    return Issued::Settled;
  }

  WorkPtr launch(const OpPtr& op, std::optional<Deadline> deadline, std::function<void(Millis)> run) {
    start(op, deadline);
    // The worker runs the collectives in queue order: numbered and queued as one step.
    std::lock_guard<std::mutex> ordered(issueMutex_);
    Issued issued = issue(op);
    if (issued == Issued::Skipped) return fault::skippedWork();
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!op->stalled && !op->done) {
      op->run = std::move(run);
      state_->collectives.push_back(op);
      state_->changed.notify_all();
    }
    return std::make_shared<GlooWork>(shared_from_this(), op);
  }

  WorkPtr pointToPoint(OpType type, at::Tensor tensor, int peer, CallOptions options) {
    const bool isSend = type == OpType::Send;
    checks::tensor(*this, kRules, tensor, isSend ? "send" : "recv");
    checks::peer(*this, peer, "peer");
    auto op = prepare(type, tensor);
    op->fingerprint.root = peer;
    op->fingerprint.label = options.label;
    op->isSend = isSend;
    start(op, options.deadline);
    // Gloo matches the messages of a pair and slot in the order posted: numbered and posted as one step.
    std::lock_guard<std::mutex> ordered(issueMutex_);
    Issued issued = issue(op);
    if (issued == Issued::Skipped) return fault::skippedWork();
    if (issued == Issued::Pending && !op->stalled) post(op, tensor, peer);
    return std::make_shared<GlooWork>(shared_from_this(), op);
  }

  // Hands a pending send or receive to Gloo, then to its peer's thread. The
  // caller holds issueMutex_ and not state_->mutex: posting may block on the
  // pair's connection (up to the context's timeout), and Work::wait, abort and
  // the timeouts take state_->mutex only, so they keep their deadlines
  // meanwhile. A failed post fails the operation and aborts the communicator.
  void post(const OpPtr& op, const at::Tensor& tensor, int peer) {
    std::unique_ptr<::gloo::transport::UnboundBuffer> unbound;
    std::exception_ptr error;
    try {
      guarded(op->isSend ? "send" : "recv", state_->errorContext, [&] {
        unbound = context()->createUnboundBuffer(dataOrDummy(tensor), bytesOf(tensor));
        const uint64_t slot = ::gloo::Slot::build(kPointToPointPrefix, 0);
        if (op->isSend)
          unbound->send(peer, slot);
        else
          unbound->recv(peer, slot);
      });
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    // Kept even when the operation was abandoned meanwhile: Gloo may still use it.
    op->unbound = std::move(unbound);
    if (error) {
      state_->abandoned.push_back(op);
      state_->settle(op, error);
      if (!state_->aborted) state_->abortLocked(fmt::format("{} seq {} failed", toString(op->fingerprint.op), op->seq));
      return;
    }
    if (op->done) return;  // aborted while posting
    auto key = std::make_pair(peer, op->isSend);
    state_->pointToPoint[key].push_back(op);
    if (!pointToPointThreads_.count(key)) pointToPointThreads_[key] = std::thread(pointToPointWorker, state_, key);
    state_->changed.notify_all();
  }

  // Operations nobody waited for get the shutdown timeout to finish; what is
  // still in flight then is abandoned.
  void drainOnDestroy() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    if (state_->aborted) return;
    // A process that is ending after a fatal error waits on no peer.
    auto until = fatal::ending() ? Deadline::Clock::now() : fatal::shutdownDeadline().when();
    bool drained = state_->changed.wait_until(lock, until, [&] {
      return std::all_of(state_->pending.begin(), state_->pending.end(), [](const OpPtr& op) { return op->stalled; });
    });
    if (!drained && !fatal::ending())
      log::error("comm", "{} destroyed with operations in flight that did not finish in {} s", name_,
                 env::kShutdownTimeout.seconds());
    state_->abortLocked(drained ? "destroyed" : "destroyed with operations in flight", drained ? 0 : 5);
  }

  ContextFactory factory_;
  std::string name_;
  std::vector<int> members_;
  double defaultTimeout_;
  std::shared_ptr<State> state_;
  // Held while an operation is numbered and handed to Gloo or to the worker, so
  // that they see the operations in ledger order. Never taken by a waiter, and
  // never under state_->mutex.
  std::mutex issueMutex_;
  std::thread worker_;
  std::map<std::pair<int, bool>, std::thread> pointToPointThreads_;  // guarded by state_->mutex
  int splits_ = 0;
};

bool GlooWork::isCompleted() {
  std::lock_guard<std::mutex> lock(comm_->mutex());
  return op_->done;
}

std::exception_ptr GlooWork::exception() const {
  std::lock_guard<std::mutex> lock(comm_->mutex());
  return op_->done ? op_->error : nullptr;
}

void GlooWork::wait(std::optional<Deadline> deadline) {
  Deadline until = deadline ? op_->deadline.earliest(*deadline) : op_->deadline;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(comm_->mutex());
    auto settled = [&] { return op_->done; };
    if (until.isNever())
      comm_->changed().wait(lock, settled);
    else
      comm_->changed().wait_until(lock, until.when(), settled);
    if (!op_->done) {
      lock.unlock();
      if (comm_->isAborted()) comm_->throwAborted(*op_);
      comm_->timeout(*op_);
    }
    error = op_->error;
  }
  if (isGlooTimeout(error)) comm_->timeout(*op_);
  if (isGlooPeerLost(error)) {
    // A peer closed its connection: once its heartbeat has stopped long
    // enough for the diagnosis to name it, report as a timeout does.
    const MonitorOptions monitorOptions = MonitorOptions::fromEnvironment();
    Deadline named = Deadline::afterSeconds(monitorOptions.deadAfterSeconds + 2 * monitorOptions.heartbeatSeconds);
    std::this_thread::sleep_for(until.earliest(named).remaining());
    comm_->timeout(*op_);
  }
  if (error) std::rethrow_exception(error);
}

CommunicatorPtr GlooCommunicator::split(int color, int key, const std::string& name, SplitOptions options) {
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  // Every rank's (color, key), then each new group connects through the store
  // under a prefix of its own.
  at::Tensor mine = at::empty({2}, at::kInt), all = at::empty({2 * size()}, at::kInt);
  mine.data_ptr<int>()[0] = color;
  mine.data_ptr<int>()[1] = key;
  auto op = prepare(OpType::Split, mine, all);
  const int index = splits_++;
  launch(op, deadline, [ctx = context(), mine, all, op = op.get()](Millis timeout) {
    ::gloo::AllgatherOptions gather(ctx);
    gather.setInput(mine.data_ptr<int>(), 2);
    gather.setOutput(all.data_ptr<int>(), all.numel());
    gather.setTag(tag(*op));
    gather.setTimeout(timeout);
    ::gloo::allgather(gather);
  })->wait();
  if (color < 0) return nullptr;
  const int* pairs = all.data_ptr<int>();
  std::vector<int> ranks;
  for (int r = 0; r < size(); ++r)
    if (pairs[2 * r] == color) ranks.push_back(r);
  std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return pairs[2 * a + 1] < pairs[2 * b + 1]; });
  const int childRank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
  std::vector<int> worldRanks;
  for (int r : ranks) worldRanks.push_back(members_[r]);
  std::string groupName = fmt::format("{}[{}]", name, color);
  ContextFactory child = factory_.child(fmt::format("{}/split{}/{}/", name_, index, color));
  auto context = child.connect(childRank, static_cast<int>(ranks.size()), deadline,
                               {.rank = members_[rank()], .group = groupName});
  auto group = std::make_shared<GlooCommunicator>(std::move(context), std::move(child), std::move(groupName),
                                                  std::move(worldRanks));
  if (monitor()) monitor()->watch(group);
  return group;
}

}  // namespace

bool available() { return true; }

CommunicatorPtr makeCommunicator(std::shared_ptr<::gloo::Context> context, ContextFactory factory, std::string name,
                                 std::vector<int> members) {
  return std::make_shared<GlooCommunicator>(std::move(context), std::move(factory), std::move(name),
                                            std::move(members));
}

CommunicatorPtr initWorld(std::shared_ptr<Store> store, int rank, int size, WorldOptions options) {
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  if (rank < 0 || rank >= size)
    throw ConfigError(fmt::format("gloo world: rank {} is not in a world of {} ranks", rank, size),
                      {.rank = rank, .group = "world", .expected = "0 <= rank < size"});
  ContextFactory factory(std::move(store), options.host, options.prefix);
  auto context = factory.connect(rank, size, deadline, {.rank = rank, .group = "world"});
  std::vector<int> members(size);
  for (int r = 0; r < size; ++r) members[r] = r;
  return makeCommunicator(std::move(context), std::move(factory), "world", std::move(members));
}

}  // namespace bulkhead::gloo
