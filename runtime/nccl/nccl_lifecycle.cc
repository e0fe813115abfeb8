// The NCCL communicator's life: its watchdog, splits, abort and teardown
// (bootstrap and the bounded NCCL calls: nccl_bootstrap.cc).
#include <fmt/format.h>
#include <pthread.h>

#include "runtime/backoff.h"
#include "runtime/diagnosis/diagnosis.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/diagnosis/monitor.h"
#include "runtime/diagnosis/op_checks.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/nccl/nccl_communicator.h"

namespace bulkhead::nccl {

void endInLedger(Ledger& ledger, const NcclOp& op, bool completed) {
  for (uint64_t i = 0; i <= op.grouped.size(); ++i) {
    const OpType type = i == 0 ? op.fingerprint.op : op.grouped[i - 1].op;
    if (completed)
      ledger.complete(type, op.seq + i);
    else
      ledger.fail(type, op.seq + i);
  }
}
namespace {

constexpr auto kWatchdogPoll = std::chrono::milliseconds(2);
constexpr auto kWatchdogIdle = std::chrono::milliseconds(100);

// Operations and communicators abandoned by an abort that did not return:
// NCCL may still touch their memory, so they are never freed. (An operation
// on the current stream has handed the caching allocator's buffers back at
// issue; the allocator's stream record guards them.)
std::mutex abandonedLock;
std::vector<std::shared_ptr<NcclOp>> abandoned;

// Lets go of tensors on a thread of its own ("bulkhead-free"): a deleter may
// be a cudaFree, which waits for the whole device and so stalls behind a hung
// operation; a watchdog must not (it enforces that operation's deadline).
// Never destroyed: its thread may be stalled there when the process exits.
class Releaser {
 public:
  static Releaser& instance() {
    static Releaser* releaser = new Releaser;
    return *releaser;
  }
  void hand(int device, std::vector<at::Tensor> buffers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back({device, std::move(buffers)});
    }
    wake_.notify_one();
  }

 private:
  struct Batch {
    int device = 0;
    std::vector<at::Tensor> buffers;
  };
  Releaser() {
    std::thread([this] {
      pthread_setname_np(pthread_self(), "bulkhead-free");
      for (;;) {
        Batch batch;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [this] { return !queue_.empty(); });  // idle: nothing to bound
          batch = std::move(queue_.front());
          queue_.pop_front();
        }
        cudaSetDevice(batch.device);
        batch.buffers.clear();
      }
    }).detach();
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Batch> queue_;
};

void letGoOf(int device, std::vector<at::Tensor> buffers) {
  if (!buffers.empty()) Releaser::instance().hand(device, std::move(buffers));
}

}  // namespace

EventPool::~EventPool() {
  for (cudaEvent_t event : free_) cudaEventDestroy(event);
}

cudaEvent_t EventPool::take(const ErrorContext& context) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      cudaEvent_t event = free_.back();
      free_.pop_back();
      return event;
    }
  }
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags", context);
  return event;
}

void EventPool::give(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(event);
}

// A failed operation's event may still be recorded on a stream NCCL never
// finished (an abandoned abort): it is not reused.
NcclOp::~NcclOp() {
  if (done && events && status == OpStatus::Completed) events->give(done);
}

int deviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

std::string deviceName(int index) {
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, index) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return properties.name;
}

bool peerAccess(int a, int b) {
  if (a == b) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return can != 0;
}

bool available() {
#if BULKHEAD_TORCH_CUDA
  return deviceCount() > 0;
#else
  return false;
#endif
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int device, std::string name, std::vector<int> members)
    : comm_(comm),
      device_(device),
      name_(std::move(name)),
      members_(std::move(members)),
      defaultTimeout_(env::kCollectiveTimeout.seconds()) {
  DeviceGuard guard(device_);
  check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", {.group = name_});
  check(ncclCommCount(comm_, &size_), "ncclCommCount", {.group = name_});
  check(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(int)), "cudaMalloc", {.group = name_});
  watchdog_ = std::thread([this] { watch(); });
}

NcclCommunicator::~NcclCommunicator() {
  try {
    shutdown();
  } catch (const std::exception& e) {
    log::error("comm", "shutting down {} failed: {}", name_, e.what());
  }
}

void NcclCommunicator::shutdown() {
  stopping_ = true;
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  DeviceGuard guard(device_);
  // A process that is ending after a fatal error waits on no peer: a peer it
  // shares this communicator with may be the one that stopped.
  if (fatal::ending() && !aborted_) {
    const std::string reason = "the process is ending after a fatal error";
    abortWith(
        std::make_exception_ptr(CommError(fmt::format("{} was aborted: {}", name_, reason), checks::context(*this))),
        reason, /*ncclAborted=*/false, /*wait=*/false);
  }
  Deadline deadline = fatal::shutdownDeadline();
  Backoff backoff;
  for (;;) {  // operations nobody waited for get the shutdown timeout to finish
    progress();
    std::lock_guard<std::mutex> lock(pendingMutex_);
    if (pending_.empty() || aborted_ || deadline.expired()) break;
    backoff.pause(deadline);
  }
  if (!aborted_) {
    bool drained;
    {
      std::lock_guard<std::mutex> lock(pendingMutex_);
      drained = pending_.empty();
    }
    if (drained) {
      closePeerMemory(deadline);  // a timed-out barrier there aborts the communicator
      if (!aborted_) finalizeAndDestroy(deadline);
    } else {
      log::error("comm", "{} is being destroyed with operations that did not finish in {} s; aborting it",
                 checks::describeGroup(*this), env::kShutdownTimeout.seconds());
      abortWith(std::make_exception_ptr(CommError("destroyed with operations in flight", checks::context(*this))),
                "destroyed with operations in flight");
    }
  }
  // After an abort a kernel may still hold it; and cudaFree waits for the
  // whole device, which a process that is ending may not get back.
  if (!aborted_ && !fatal::ending()) cudaFree(scratch_);
}

void NcclCommunicator::finalizeAndDestroy(Deadline deadline) {
  ncclComm_t comm = comm_;
  auto rc = runBounded([comm] { return ncclCommFinalize(comm); }, deadline);
  if (!rc || (*rc != ncclSuccess && *rc != ncclInProgress) || !waitReady(comm_, deadline, checks::context(*this))) {
    abortWith(std::make_exception_ptr(CommError("finalize timed out", checks::context(*this))),
              "ncclCommFinalize did not finish within the shutdown timeout");
    return;
  }
  // Finalized, but a destroy joins NCCL's proxy thread, which waits until
  // every local peer has closed its connection into it: a stopped peer never
  // does. Past the deadline it is left running, and that is fatal.
  fatal::Waiting waiting(fmt::format("ncclCommDestroy of {}", name_));
  if (!runBounded([comm] { return ncclCommDestroy(comm); }, deadline)) {
    std::string message = fmt::format(
        "ncclCommDestroy of {} did not return within the shutdown timeout ({} s): a peer that shares it stopped "
        "without closing its connections; leaving it",
        checks::describeGroup(*this), env::kShutdownTimeout.seconds());
    log::error("comm", "{}", message);
    fatal::raise(std::make_exception_ptr(CommError(message, checks::context(*this))), message);
  }
}

void NcclCommunicator::progress() {
  for (;;) {
    std::shared_ptr<NcclOp> front;
    {
      std::lock_guard<std::mutex> lock(pendingMutex_);
      if (pending_.empty() || pending_.front()->stalled) return;
      front = pending_.front();
    }
    cudaError_t state = cudaEventQuery(front->done);
    if (state == cudaErrorNotReady) return;
    settle(*front, state);
  }
}

void NcclCommunicator::settle(NcclOp& op, cudaError_t state) {
  if (state == cudaSuccess && op.peer)
    if (const std::exception_ptr gaveUp = peerFailure(op.seq)) {  // its regions are out of step: the group ends
      abortWith(gaveUp, "an all-reduce through peer memory gave up waiting for a peer");
      return;
    }
  // Let go of after the lock, and on the watchdog through letGoOf: a deleter
  // may be a cudaFree, which waits for the device.
  std::vector<at::Tensor> buffers;
  std::lock_guard<std::mutex> lock(pendingMutex_);
  auto it = std::find_if(pending_.begin(), pending_.end(), [&](const auto& p) { return p.get() == &op; });
  if (it == pending_.end()) return;  // settled already, or failed by an abort
  if (state == cudaSuccess) {
    endInLedger(*ledger_, op, true);
    op.status = OpStatus::Completed;
  } else {
    cudaGetLastError();
    op.error = std::make_exception_ptr(CommError(
        fmt::format("{} seq {} failed on the GPU: {}", toString(op.fingerprint.op), op.seq, cudaGetErrorString(state)),
        checks::context(*this)));
    endInLedger(*ledger_, op, false);
    op.status = OpStatus::Failed;
  }
  buffers.swap(op.buffers);
  pending_.erase(it);
  if (std::this_thread::get_id() == watchdog_.get_id()) letGoOf(device_, std::move(buffers));
}

void NcclCommunicator::timeout(NcclOp& op) {
  if (op.timingOut.exchange(true)) {
    // Another thread (the watchdog, or a waiter) explains this timeout: wait
    // for its verdict, bounded by what the diagnosis and the abort may take.
    Deadline verdict = Deadline::afterSeconds(env::kAbortGrace.seconds() + 3.0);
    Backoff backoff;
    while (op.status == OpStatus::Pending && !verdict.expired()) backoff.pause(verdict);
    if (op.status == OpStatus::Failed) std::rethrow_exception(op.error);
    throw TimeoutError(fmt::format("{} seq {} timed out on {}", toString(op.fingerprint.op), op.seq, name_),
                       checks::context(*this), op.seq);
  }
  double waited = secondsSince(op.issuedAt);
  Diagnosis diagnosis = monitor() && !aborted_
                            ? monitor()->diagnose(*this, op.seq, op.fingerprint, waited)
                            : Diagnosis{describeTimeout(*this, op.fingerprint, op.seq, waited), false};
  std::string message =
      diagnosis.message + " The communicator is aborted (ncclCommAbort) and refuses further operations.";
  auto error = diagnosis.desync
                   ? std::make_exception_ptr(DesyncError(message, checks::context(*this)))
                   : std::make_exception_ptr(TimeoutError(message, checks::context(*this), op.seq, diagnosis.message));
  if (!aborted_) log::error("comm", "{}", message);
  // The operation fails before the abort starts: a caller blocked inside its
  // NCCL call returns when the abort lands and must find this error, not NCCL's.
  if (op.status == OpStatus::Pending) {
    endInLedger(*ledger_, op, false);
    op.error = error;
    op.status = OpStatus::Failed;
  }
  abortWith(error, fmt::format("{} seq {} timed out", toString(op.fingerprint.op), op.seq));
  std::rethrow_exception(op.error);
}

void NcclCommunicator::abort(const std::string& reason) {
  log::warn("comm", "aborting {}: {}", checks::describeGroup(*this), reason);
  abortWith(
      std::make_exception_ptr(CommError(fmt::format("{} was aborted: {}", name_, reason), checks::context(*this))),
      reason);
}

void NcclCommunicator::abortWith(std::exception_ptr error, const std::string& reason, bool ncclAborted, bool wait) {
  std::vector<std::shared_ptr<NcclOp>> failed;  // the enqueuing one first
  bool wasEnqueuing = false;
  {
    std::lock_guard<std::mutex> lock(pendingMutex_);
    if (aborted_.exchange(true)) return;
    abortReason_ = reason;
    wasEnqueuing = enqueuing_ != nullptr;
    if (enqueuing_) {  // issued to NCCL, or being issued
      if (enqueuing_->status == OpStatus::Pending) {
        enqueuing_->error = error;
        endInLedger(*ledger_, *enqueuing_, false);
        enqueuing_->status = OpStatus::Failed;
      }
      failed.push_back(enqueuing_);
    }
    for (auto& op : pending_) {
      op->error = error;
      endInLedger(*ledger_, *op, false);
      op->status = OpStatus::Failed;
      failed.push_back(op);
    }
    pending_.clear();
  }
  abortPeerMemory();  // its kernels stop waiting for peers
  fatal::raise(error, reason);
  if (!ncclAborted && !abortBounded(comm_, wait ? -1 : 0)) {
    if (wait)
      log::error("comm", "ncclCommAbort of {} did not return within {} s; abandoning it", name_,
                 env::kAbortGrace.seconds());
    std::lock_guard<std::mutex> lock(abandonedLock);
    abandoned.insert(abandoned.end(), failed.begin(), failed.end());
  } else if (std::this_thread::get_id() == watchdog_.get_id()) {
    // NCCL is off the device: the buffers may go, though not on the watchdog;
    // those of the operation being enqueued stay with its caller's thread.
    for (size_t i = wasEnqueuing ? 1 : 0; i < failed.size(); ++i) letGoOf(device_, std::move(failed[i]->buffers));
  }
}

void NcclCommunicator::watch() {
  pthread_setname_np(pthread_self(), "bulkhead-wd");
  cudaSetDevice(device_);
  while (!stopping_ && !aborted_) {
    {
      std::unique_lock<std::mutex> lock(pendingMutex_);
      if (pending_.empty() && !enqueuing_) {
        // Idle: a long sleep, cut short by the next operation (enqueue
        // notifies), which from then on is polled: its buffers are let go of
        // within a poll of its completion, not held for the rest of the sleep.
        wake_.wait_for(lock, kWatchdogIdle, [this] { return stopping_.load() || !pending_.empty(); });
      } else {
        wake_.wait_for(lock, kWatchdogPoll, [this] { return stopping_.load(); });
      }
    }
    if (stopping_ || aborted_) break;
    try {
      progress();
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        std::string message = fmt::format("NCCL reported an asynchronous error on {}: {}", checks::describeGroup(*this),
                                          ncclGetErrorString(state));
        log::error("comm", "{}", message);
        abortWith(std::make_exception_ptr(CommError(message, checks::context(*this))), message);
        break;
      }
      std::shared_ptr<NcclOp> late;
      bool insideCall = false;
      {
        std::lock_guard<std::mutex> lock(pendingMutex_);
        if (enqueuing_ && enqueuing_->deadline.expired()) late = enqueuing_;
        insideCall = late != nullptr;
        for (auto it = pending_.begin(); !late && it != pending_.end(); ++it)
          if ((*it)->deadline.expired()) late = *it;
      }
      if (insideCall || (late && late->stalled)) timeout(*late);  // stuck inside its NCCL call, or an injected stall
      if (late) {
        // It may have finished behind an earlier operation on another stream.
        cudaError_t state = cudaEventQuery(late->done);
        if (state == cudaErrorNotReady) timeout(*late);
        settle(*late, state);
      }
    } catch (const Error&) {
      // Already logged and delivered to the operation's waiters.
    } catch (const std::exception& e) {
      log::error("comm", "watchdog of {}: {}", name_, e.what());
    }
  }
}

CommunicatorPtr NcclCommunicator::split(int color, int key, const std::string& name, SplitOptions options) {
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  // Every rank's (color, key), gathered over this communicator under the
  // deadline: it names the members of each new group and proves every rank
  // reached the split before NCCL bootstraps the children.
  DeviceGuard guard(device_);
  int mine[2] = {color, key};
  std::vector<int> all(2 * size_);
  int* deviceBuffer = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&deviceBuffer), sizeof(int) * 2 * (size_ + 1)), "cudaMalloc",
        checks::context(*this));
  std::unique_ptr<int, void (*)(int*)> release(deviceBuffer, [](int* p) { cudaFree(p); });
  // Copied in on the stream the gather runs on, so the gather sees it.
  check(cudaMemcpyAsync(deviceBuffer, mine, sizeof(mine), cudaMemcpyHostToDevice, streamFor(nullptr)),
        "cudaMemcpyAsync", checks::context(*this));
  auto op = prepare(OpType::Split, at::Tensor());
  op->fingerprint.numel = 2;
  try {
    enqueue(op, deadline, nullptr, "ncclAllGather (split)", [&](cudaStream_t stream) {
      return ncclAllGather(deviceBuffer, deviceBuffer + 2, 2, ncclInt32, comm_, stream);
    })->wait();  // the gather has finished: the copy out below reads final data
  } catch (...) {
    release.release();  // the communicator is aborted: NCCL may still write into it
    throw;
  }
  check(cudaMemcpy(all.data(), deviceBuffer + 2, sizeof(int) * 2 * size_, cudaMemcpyDeviceToHost), "cudaMemcpy",
        checks::context(*this));

  ncclComm_t child = nullptr;
  {
    std::lock_guard<std::mutex> lock(enqueueMutex_);
    try {
      child = splitBounded(comm_, color, key, deadline, checks::context(*this),
                           fmt::format("group '{}' from {}", name, checks::describeGroup(*this)));
    } catch (const TimeoutError& e) {
      abortWith(std::current_exception(), "a split timed out", /*ncclAborted=*/true);  // splitBounded aborted it
      throw;
    }
  }
  if (color < 0) return nullptr;
  std::vector<int> ranks;
  for (int r = 0; r < size_; ++r)
    if (all[2 * r] == color) ranks.push_back(r);
  std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  std::vector<int> worldRanks;
  for (int r : ranks) worldRanks.push_back(members_[r]);
  auto group =
      std::make_shared<NcclCommunicator>(child, device_, fmt::format("{}[{}]", name, color), std::move(worldRanks));
  if (monitor()) monitor()->watch(group);
  group->attachPeerMemory(name, deadline);
  return group;
}

}  // namespace bulkhead::nccl
