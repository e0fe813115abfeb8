// The NCCL backend's operations and work handle (see nccl_backend.h).
#include "runtime/nccl/nccl_communicator.h"

#include <fmt/format.h>

#include <cstdlib>
#include <tuple>

#include "runtime/backoff.h"
#include "runtime/diagnosis/fault.h"
#include "runtime/diagnosis/monitor.h"
#include "runtime/diagnosis/op_checks.h"
#include "runtime/env.h"
#include "runtime/log.h"

#if BULKHEAD_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>
#endif

namespace bulkhead::nccl {
namespace {

using c10::ScalarType;

const checks::BackendRules kRules{c10::kCUDA,
                                  {ScalarType::Float, ScalarType::Double, ScalarType::BFloat16, ScalarType::Half,
                                   ScalarType::Int, ScalarType::Long, ScalarType::Char, ScalarType::Byte}};

// NCCL pairs a send to self only with its receive inside one group call,
// which separate send() and recv() calls never are: refused here, where the
// mistake is named, rather than as an invalid-usage error from NCCL.
void refuseSelf(const NcclCommunicator& comm, int peer, const char* role) {
  if (peer == comm.rank())
    throw ConfigError(fmt::format("{} to itself (rank {}) on {}: the nccl backend has no point-to-point pair with "
                                  "one rank; use allToAll, which moves a rank's own rows, or the mpi backend",
                                  role, peer, checks::describeGroup(comm)),
                      checks::context(comm, "a peer other than this rank"));
}

#if BULKHEAD_TORCH_CUDA && TORCH_VERSION_MAJOR >= 2
// Whether a block freed now may be reused only behind work on `stream`, once
// the allocator has been told of it: PyTorch's native caching allocator (a
// pluggable one may ignore the record), caching (not under
// PYTORCH_NO_CUDA_MEMORY_CACHING, where a free is a cudaFree that waits for
// the operation's peers), and a stream PyTorch owns: the default stream or
// one of its pools, which it names by ids of its own (an external stream by
// its handle). At the free the allocator records an event on the stream, and
// the caller may have destroyed an external one by then.
bool allocatorGuardsStream(c10::cuda::CUDACachingAllocator::CUDAAllocator& allocator,
                           const c10::cuda::CUDAStream& stream) {
  static const bool uncached = std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING") != nullptr;
  const bool pytorchOwns = stream.id() == 0 || stream.id() != reinterpret_cast<c10::StreamId>(stream.stream());
  return !uncached && allocator.name() == "native" && pytorchOwns;
}
#endif

// Hands an operation's buffers back to the caller at once where the caching
// allocator can guard them (see allocatorGuardsStream), after telling it of
// the operation's stream (recordStream): it then reuses a block the caller
// frees only behind the operation, in the stream's order or once an event it
// records there has fired. So the memory a step drops is free for its next
// allocation, not held until the watchdog settles the operation. Held until
// then: buffers of an operation on a stream the caller named (it may destroy
// the stream before freeing them), memory the allocator does not own
// (from_blob), and any buffer the allocator refuses to record.
void letGoOfOwnedBuffers(NcclOp& op, int device) noexcept {
#if BULKHEAD_TORCH_CUDA && TORCH_VERSION_MAJOR >= 2
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  if (allocator == nullptr || !allocatorGuardsStream(*allocator, stream)) return;
  std::erase_if(op.buffers, [&](const at::Tensor& buffer) {
    const c10::DataPtr& memory = buffer.storage().data_ptr();
    if (memory.get() == nullptr) return true;  // no elements: nothing to guard
    if (memory.get_deleter() != allocator->raw_deleter()) return false;
    try {
      c10::cuda::CUDACachingAllocator::recordStream(memory, stream);
      return true;
    } catch (const std::exception& e) {
      log::warn("comm",
                "the caching allocator refused to record an operation's stream ({}); the operation keeps "
                "its buffer until it completes",
                e.what());
      return false;
    }
  });
#else
  (void)op, (void)device;  // without a libtorch 2 with CUDA, operations keep their buffers
#endif
}

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclCommunicator> comm, std::shared_ptr<NcclOp> op)
      : comm_(std::move(comm)), op_(std::move(op)) {}

  bool isCompleted() override {
    if (op_->status == OpStatus::Pending && !op_->stalled) {
      cudaError_t state = cudaEventQuery(op_->done);
      if (state != cudaErrorNotReady) comm_->settle(*op_, state);
    }
    return op_->status != OpStatus::Pending;
  }

  // Polls this operation's own event: no lock, one query per poll.
  void wait(std::optional<Deadline> deadline) override {
    Deadline until = deadline ? op_->deadline.earliest(*deadline) : op_->deadline;
    Backoff backoff(std::chrono::microseconds(50));
    for (;;) {
      OpStatus status = op_->status;
      if (status == OpStatus::Completed) return;
      if (status == OpStatus::Failed) std::rethrow_exception(op_->error);
      cudaError_t state = op_->stalled ? cudaErrorNotReady : cudaEventQuery(op_->done);
      if (state != cudaErrorNotReady) {
        comm_->settle(*op_, state);
        continue;
      }
      if (until.expired()) comm_->timeout(*op_);
      backoff.pause(until);
    }
  }

  std::exception_ptr exception() const override { return op_->status == OpStatus::Failed ? op_->error : nullptr; }
  uint64_t sequence() const override { return op_->seq; }

 private:
  std::shared_ptr<NcclCommunicator> comm_;
  std::shared_ptr<NcclOp> op_;
};

}  // namespace

void NcclCommunicator::ensureUsable() const {
  if (!aborted_) return;
  std::lock_guard<std::mutex> lock(pendingMutex_);
  throw CommError(fmt::format("{} was aborted ({}) and refuses further operations; restart the job from its last "
                              "checkpoint once the cause is fixed",
                              checks::describeGroup(*this), abortReason_),
                  checks::context(*this));
}

std::shared_ptr<NcclOp> NcclCommunicator::prepare(OpType type, const at::Tensor& input, const at::Tensor& output) {
  checkPeerMemory();
  ensureUsable();
  auto check = [&](const at::Tensor& t) {
    if (t.defined() && t.is_cuda() && t.get_device() != device_)
      throw ConfigError(
          fmt::format("the tensor is on cuda:{}, but this rank's communicator uses cuda:{}", t.get_device(), device_),
          checks::context(*this, fmt::format("tensors on cuda:{}", device_)));
  };
  check(input);
  check(output);
  auto op = std::make_shared<NcclOp>();
  op->fingerprint = checks::fingerprint(type, input);
  if (input.defined()) op->buffers.push_back(input);
  if (output.defined()) op->buffers.push_back(output);
  return op;
}

cudaStream_t NcclCommunicator::streamFor(StreamHandle handle) const {
  if (handle) return static_cast<cudaStream_t>(handle);
#if BULKHEAD_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(device_).stream();
#else
  return nullptr;          // CUDA tensors need a libtorch with CUDA; this build has none
#endif
}

WorkPtr NcclCommunicator::enqueue(const std::shared_ptr<NcclOp>& op, std::optional<Deadline> deadline,
                                  StreamHandle stream, const char* call, const Issue& issue) {
  op->issuedAt = Deadline::Clock::now();
  op->deadline = deadline.value_or(Deadline::afterSeconds(defaultTimeout_));
  cudaStream_t cudaStream = streamFor(stream);
  if (!op->faultsInjected) {
    Injected injected = injectFault(op->fingerprint);
    if (injected == Injected::Skip) return fault::skippedWork();
    op->stalled = injected == Injected::Altered;
  }
  DeviceGuard guard(device_);
  std::unique_lock<std::mutex> lock(enqueueMutex_);
  ensureUsable();
  op->seq = ledger_->issue(op->fingerprint);
  for (const Fingerprint& member : op->grouped) ledger_->issue(member);
  checkStrict(op->seq, op->fingerprint, op->deadline);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(cudaStream, &capture), "cudaStreamIsCapturing", checks::context(*this));
  if (capture != cudaStreamCaptureStatusNone && !op->stalled) return enqueueCaptured(op, cudaStream, call, issue);
  // From the NCCL call until it joins pending_, the operation is the one
  // enqueuing_ names, so an abort in between always finds it: it fails, and
  // if ncclCommAbort does not return it is kept, buffers and all.
  auto leaveEnqueuing = [&] { leaveEnqueuingOf(op); };
  if (!op->stalled) {
    enterEnqueuing(op);
    ncclResult_t rc = ncclInternalError;
    try {
      rc = issue(cudaStream);
    } catch (...) {
      leaveEnqueuing();
      if (op->status == OpStatus::Pending) endInLedger(*ledger_, *op, false);
      throw;
    }
    if (op->status == OpStatus::Failed) {  // the watchdog gave up on the call
      leaveEnqueuing();
      std::rethrow_exception(op->error);
    }
    if (rc != ncclSuccess && rc != ncclInProgress) {
      leaveEnqueuing();
      endInLedger(*ledger_, *op, false);
      check(rc, call, checks::context(*this));
    }
    try {
      if (rc == ncclInProgress && !waitReady(comm_, op->deadline, checks::context(*this))) timeout(*op);
    } catch (...) {
      leaveEnqueuing();
      throw;
    }
    try {
      op->events = events_;
      op->done = events_->take(checks::context(*this));
      check(cudaEventRecord(op->done, cudaStream), "cudaEventRecord", checks::context(*this));
    } catch (...) {
      // The operation is on the stream but cannot be tracked: nothing may free its buffers.
      abortWith(std::current_exception(), "an issued operation could not be tracked");
      leaveEnqueuing();
      throw;
    }
    if (stream == nullptr) letGoOfOwnedBuffers(*op, device_);
  }
  bool wasIdle;
  {
    std::lock_guard<std::mutex> pendingLock(pendingMutex_);
    if (enqueuing_ == op) enqueuing_.reset();
    if (aborted_) {  // aborted while this call was in NCCL: it fails with the abort
      if (op->status == OpStatus::Pending) {
        op->error = std::make_exception_ptr(
            CommError(fmt::format("{} seq {} cannot finish: {} was aborted ({})", toString(op->fingerprint.op), op->seq,
                                  checks::describeGroup(*this), abortReason_),
                      checks::context(*this)));
        endInLedger(*ledger_, *op, false);
        op->status = OpStatus::Failed;
      }
      std::rethrow_exception(op->error);
    }
    wasIdle = pending_.empty();
    pending_.push_back(op);  // under enqueueMutex_ still: pending_ keeps issue order
  }
  lock.unlock();
  if (wasIdle) wake_.notify_one();  // the watchdog sleeps long only while nothing is pending
  return std::make_shared<NcclWork>(shared_from_this(), op);
}

void NcclCommunicator::enterEnqueuing(const std::shared_ptr<NcclOp>& op) {
  bool usable;
  {
    std::lock_guard<std::mutex> watched(pendingMutex_);
    usable = !aborted_;
    if (usable) enqueuing_ = op;
  }
  if (!usable) {  // aborted since ensureUsable(): comm_ may be freed already
    endInLedger(*ledger_, *op, false);
    ensureUsable();
  }
}

void NcclCommunicator::leaveEnqueuingOf(const std::shared_ptr<NcclOp>& op) {
  std::lock_guard<std::mutex> watched(pendingMutex_);
  if (enqueuing_ == op) enqueuing_.reset();
}

// The watchdog cannot follow a captured call (an event recorded during capture
// cannot be queried), and there is nothing to wait for until the graph
// replays: the ledger counts it issued and completed at capture, its Work is
// complete at once, and each replay is bounded by CapturedGraph::replay's
// deadline. A checked region around the capture compares it across ranks.
WorkPtr NcclCommunicator::enqueueCaptured(const std::shared_ptr<NcclOp>& op, cudaStream_t stream, const char* call,
                                          const Issue& issue) {
  enterEnqueuing(op);  // an abort from here on finds it, as in enqueue
  ncclResult_t rc = ncclInternalError;
  try {
    rc = issue(stream);
    if (rc == ncclInProgress && !waitReady(comm_, op->deadline, checks::context(*this))) timeout(*op);
  } catch (...) {
    leaveEnqueuingOf(op);
    endInLedger(*ledger_, *op, false);
    throw;
  }
  leaveEnqueuingOf(op);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    endInLedger(*ledger_, *op, false);
    check(rc, call, checks::context(*this));
  }
  endInLedger(*ledger_, *op, true);
  return fault::skippedWork();
}

WorkPtr NcclCommunicator::allReduce(at::Tensor tensor, ReduceOptions options) {
  checks::allReduceArgs(*this, kRules, tensor, options.op);
  auto op = prepare(OpType::AllReduce, tensor);
  op->fingerprint.reduce = options.op;
  if (throughPeers(tensor, options.op)) {
    op->peer = true;
    return enqueue(op, options.deadline, options.stream, "the peer all-reduce", [&](cudaStream_t stream) {
      issuePeerAllReduce(tensor, stream, op->deadline);
      return ncclSuccess;
    });
  }
  return enqueue(op, options.deadline, options.stream, "ncclAllReduce", [&](cudaStream_t stream) {
    return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), datatype(tensor.scalar_type()),
                         reduceOp(options.op), comm_, stream);
  });
}

WorkPtr NcclCommunicator::allGather(at::Tensor input, at::Tensor output, CallOptions options) {
  checks::allGatherArgs(*this, kRules, input, output);
  auto op = prepare(OpType::AllGather, input, output);
  return enqueue(op, options.deadline, options.stream, "ncclAllGather", [&](cudaStream_t stream) {
    return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(), datatype(input.scalar_type()), comm_,
                         stream);
  });
}

WorkPtr NcclCommunicator::reduceScatter(at::Tensor input, at::Tensor output, ReduceOptions options) {
  checks::reduceScatterArgs(*this, kRules, input, output, options.op);
  auto op = prepare(OpType::ReduceScatter, input, output);
  op->fingerprint.reduce = options.op;
  return enqueue(op, options.deadline, options.stream, "ncclReduceScatter", [&](cudaStream_t stream) {
    return ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), datatype(input.scalar_type()),
                             reduceOp(options.op), comm_, stream);
  });
}

WorkPtr NcclCommunicator::allToAll(at::Tensor send, at::Tensor recv, std::vector<int64_t> sendSplits,
                                   std::vector<int64_t> recvSplits, CallOptions options) {
  std::tie(sendSplits, recvSplits) =
      checks::allToAllArgs(*this, kRules, send, recv, std::move(sendSplits), std::move(recvSplits));
  auto op = prepare(OpType::AllToAll, send, recv);
  op->fingerprint.sendSplits = sendSplits;
  op->fingerprint.recvSplits = recvSplits;
  size_t rowBytes = static_cast<size_t>(checks::rowElements(send)) * send.element_size();
  int64_t rowElements = checks::rowElements(send);
  return enqueue(op, options.deadline, options.stream, "ncclGroupEnd (all-to-all)", [&](cudaStream_t stream) {
    ncclDataType_t type = datatype(send.scalar_type());
    auto* sendBytes = static_cast<char*>(send.data_ptr());
    auto* recvBytes = static_cast<char*>(recv.data_ptr());
    check(ncclGroupStart(), "ncclGroupStart", checks::context(*this));
    try {
      size_t sendOffset = 0, recvOffset = 0;
      for (int peer = 0; peer < size_; ++peer) {
        if (sendSplits[peer] > 0)
          check(ncclSend(sendBytes + sendOffset, sendSplits[peer] * rowElements, type, peer, comm_, stream), "ncclSend",
                checks::context(*this));
        if (recvSplits[peer] > 0)
          check(ncclRecv(recvBytes + recvOffset, recvSplits[peer] * rowElements, type, peer, comm_, stream), "ncclRecv",
                checks::context(*this));
        sendOffset += sendSplits[peer] * rowBytes;
        recvOffset += recvSplits[peer] * rowBytes;
      }
    } catch (...) {
      ncclGroupEnd();  // an open group would defer every later NCCL call of this thread
      throw;
    }
    return ncclGroupEnd();
  });
}

WorkPtr NcclCommunicator::broadcast(at::Tensor tensor, int root, CallOptions options) {
  checks::tensor(*this, kRules, tensor, "broadcast");
  checks::peer(*this, root, "root");
  auto op = prepare(OpType::Broadcast, tensor);
  op->fingerprint.root = root;
  return enqueue(op, options.deadline, options.stream, "ncclBroadcast", [&](cudaStream_t stream) {
    return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), datatype(tensor.scalar_type()), root,
                         comm_, stream);
  });
}

WorkPtr NcclCommunicator::barrier(CallOptions options) {
  auto op = prepare(OpType::Barrier, at::Tensor());
  return enqueue(op, options.deadline, options.stream, "ncclAllReduce (barrier)", [&](cudaStream_t stream) {
    return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream);
  });
}

WorkPtr NcclCommunicator::send(at::Tensor tensor, int peer, CallOptions options) {
  checks::tensor(*this, kRules, tensor, "send");
  checks::peer(*this, peer, "peer");
  refuseSelf(*this, peer, "send");
  auto op = prepare(OpType::Send, tensor);
  op->fingerprint.root = peer;
  op->fingerprint.label = options.label;
  return enqueue(op, options.deadline, options.stream, "ncclSend", [&](cudaStream_t stream) {
    return ncclSend(tensor.data_ptr(), tensor.numel(), datatype(tensor.scalar_type()), peer, comm_, stream);
  });
}

WorkPtr NcclCommunicator::recv(at::Tensor tensor, int peer, CallOptions options) {
  checks::tensor(*this, kRules, tensor, "recv");
  checks::peer(*this, peer, "peer");
  refuseSelf(*this, peer, "recv");
  auto op = prepare(OpType::Recv, tensor);
  op->fingerprint.root = peer;
  op->fingerprint.label = options.label;
  return enqueue(op, options.deadline, options.stream, "ncclRecv", [&](cudaStream_t stream) {
    return ncclRecv(tensor.data_ptr(), tensor.numel(), datatype(tensor.scalar_type()), peer, comm_, stream);
  });
}

WorkPtr NcclCommunicator::sendRecv(std::vector<PeerOp> ops, CallOptions options) {
  checkPeerOps(*this, ops);
  for (const PeerOp& peerOp : ops) {
    const bool isSend = peerOp.kind == PeerOp::Kind::Send;
    checks::tensor(*this, kRules, peerOp.tensor, isSend ? "send" : "recv");
  }
  // Faults member by member, as the ledger numbers them: a skipped one is left out.
  std::vector<PeerOp> kept;
  std::vector<Fingerprint> prints;
  for (PeerOp& peerOp : ops) {
    Fingerprint print =
        checks::fingerprint(peerOp.kind == PeerOp::Kind::Send ? OpType::Send : OpType::Recv, peerOp.tensor);
    print.root = peerOp.peer;
    print.label = peerOp.label;
    if (fault::armed() && injectFault(print, prints.size()) == Injected::Skip) continue;
    prints.push_back(std::move(print));
    kept.push_back(std::move(peerOp));
  }
  if (kept.empty()) return fault::skippedWork();
  auto op = prepare(prints.front().op, kept.front().tensor);
  op->fingerprint = prints.front();
  op->grouped.assign(prints.begin() + 1, prints.end());
  op->faultsInjected = true;
  for (size_t i = 1; i < kept.size(); ++i) op->buffers.push_back(kept[i].tensor);
  return enqueue(op, options.deadline, options.stream, "ncclGroupEnd (send/recv)", [&](cudaStream_t stream) {
    check(ncclGroupStart(), "ncclGroupStart", checks::context(*this));
    try {
      for (const PeerOp& peerOp : kept) {
        const at::Tensor& t = peerOp.tensor;
        if (peerOp.kind == PeerOp::Kind::Send)
          check(ncclSend(t.data_ptr(), t.numel(), datatype(t.scalar_type()), peerOp.peer, comm_, stream), "ncclSend",
                checks::context(*this));
        else
          check(ncclRecv(t.data_ptr(), t.numel(), datatype(t.scalar_type()), peerOp.peer, comm_, stream), "ncclRecv",
                checks::context(*this));
      }
    } catch (...) {
      ncclGroupEnd();  // an open group would defer every later NCCL call of this thread
      throw;
    }
    return ncclGroupEnd();
  });
}

}  // namespace bulkhead::nccl
