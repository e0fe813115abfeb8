#pragma once
// Backend-internal: the NCCL communicator and its work handle (see nccl_backend.h).

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/cuda/cuda_device.h"
#include "runtime/nccl/nccl_backend.h"
#include "runtime/nccl/nccl_check.h"

namespace bulkhead::nccl {

enum class OpStatus { Pending, Completed, Failed };

// Recycled CUDA events. An operation gives its event back when it is
// destroyed, so a waiter that holds the operation never sees the event reused.
class EventPool {
 public:
  ~EventPool();
  cudaEvent_t take(const ErrorContext& context);
  void give(cudaEvent_t event);

 private:
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// One operation in flight: NCCL reads and writes its buffers until `done`
// (an event recorded after it on its stream) has fired. On PyTorch's current
// stream, buffers from its caching allocator are guarded there (recordStream)
// and not held; any other memory lives here until the operation settles (the
// watchdog hands it to a thread of its own then: see letGoOf).
struct NcclOp {
  ~NcclOp();
  Fingerprint fingerprint;
  uint64_t seq = 0;
  Deadline deadline = Deadline::never();
  Deadline::Clock::time_point issuedAt;
  cudaEvent_t done = nullptr;
  std::shared_ptr<EventPool> events;
  std::vector<at::Tensor> buffers;
  std::atomic<OpStatus> status{OpStatus::Pending};
  std::exception_ptr error;            // set before status becomes Failed
  bool stalled = false;                // an injected mismatch: issued to no backend, never completes
  bool faultsInjected = false;         // a grouped exchange's faults were applied member by member
  std::vector<Fingerprint> grouped;    // a grouped exchange's later members, numbered seq + 1, seq + 2, ...
  std::atomic<bool> timingOut{false};  // claimed by the one thread that explains its timeout
  bool peer = false;                   // an all-reduce through peer memory (peer_all_reduce.h), not NCCL
};

// Ends an operation's ledger entries: one, or a grouped exchange's one a member.
void endInLedger(Ledger& ledger, const NcclOp& op, bool completed);

using cuda::DeviceGuard;  // runtime/cuda/cuda_device.h

// Polls a non-blocking communicator until its init, split or enqueue has
// finished. False on expiry; CommError if NCCL reports an error.
bool waitReady(ncclComm_t comm, Deadline deadline, const ErrorContext& context);

// ncclCommAbort on a helper thread, abandoned after graceSeconds (negative:
// BULKHEAD_ABORT_GRACE; 0: not waited for at all).
// True if it returned in time (the communicator's resources are then freed).
bool abortBounded(ncclComm_t comm, double graceSeconds = -1);

// Runs a blocking NCCL call on a helper thread and waits for it until the
// deadline. Nullopt if it has not returned by then: it is abandoned to the
// abort that the caller issues next, which makes NCCL give it up.
std::optional<ncclResult_t> runBounded(std::function<ncclResult_t()> call, Deadline deadline);

// A blocking child of `parent` (color < 0: none) created under the deadline:
// data-path communicators are blocking, because NCCL launches every operation
// of a non-blocking one on a thread of its own (tens of microseconds each).
// On expiry the parent is aborted and TimeoutError names `what`.
ncclComm_t splitBounded(ncclComm_t parent, int color, int key, Deadline deadline, const ErrorContext& context,
                        const std::string& what);

// NCCL's bootstrap from a unique id on the current CUDA device (non-blocking,
// polled against the deadline), handing back a blocking communicator;
// TimeoutError names `what` where a rank does not join.
ncclComm_t initBounded(const ncclUniqueId& id, int rank, int size, Deadline deadline, const ErrorContext& context,
                       const std::string& what);
// initBounded over the ranks of `bootstrap` (a CPU communicator, which
// carries NCCL's unique id).
ncclComm_t bootstrapBounded(Communicator& bootstrap, Deadline deadline, const ErrorContext& context,
                            const std::string& what);

class PeerAllReduce;  // peer_all_reduce.h

class NcclCommunicator : public Communicator, public std::enable_shared_from_this<NcclCommunicator> {
 public:
  NcclCommunicator(ncclComm_t comm, int device, std::string name, std::vector<int> members);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& members() const override { return members_; }
  const char* backend() const override { return "nccl"; }
  bool isAborted() const override { return aborted_; }
  c10::Device device() const override { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_)); }

  WorkPtr allReduce(at::Tensor tensor, ReduceOptions options) override;
  WorkPtr allGather(at::Tensor input, at::Tensor output, CallOptions options) override;
  WorkPtr reduceScatter(at::Tensor input, at::Tensor output, ReduceOptions options) override;
  WorkPtr allToAll(at::Tensor send, at::Tensor recv, std::vector<int64_t> sendSplits, std::vector<int64_t> recvSplits,
                   CallOptions options) override;
  WorkPtr broadcast(at::Tensor tensor, int root, CallOptions options) override;
  WorkPtr barrier(CallOptions options) override;
  WorkPtr send(at::Tensor tensor, int peer, CallOptions options) override;
  WorkPtr recv(at::Tensor tensor, int peer, CallOptions options) override;
  WorkPtr sendRecv(std::vector<PeerOp> ops, CallOptions options) override;
  CommunicatorPtr split(int color, int key, const std::string& name, SplitOptions options) override;
  void abort(const std::string& reason) override;

  // Settles, in issue order, the operations whose events fired; stops at the
  // first still running, so a call costs one event query in the steady state.
  void progress();
  // Settles one operation whose event reported `state` (idempotent).
  void settle(NcclOp& op, cudaError_t state);
  // Aborts the communicator because `op` ran out of time; every pending
  // operation (this one included) then fails with the TimeoutError.
  [[noreturn]] void timeout(NcclOp& op);
  // Collective over this group, once, before its first operation: where
  // BULKHEAD_PEER_ALL_REDUCE names `kind` and the group shares a node, its
  // small sums go through peer memory from then on (nccl_peer.cc).
  void attachPeerMemory(const std::string& kind, Deadline deadline);

 private:
  using Issue = std::function<ncclResult_t(cudaStream_t)>;
  std::shared_ptr<NcclOp> prepare(OpType type, const at::Tensor& input, const at::Tensor& output = {});
  WorkPtr enqueue(const std::shared_ptr<NcclOp>& op, std::optional<Deadline> deadline, StreamHandle stream,
                  const char* call, const Issue& issue);
  // From the NCCL call until the operation is tracked, enqueuing_ names it, so
  // an abort in between always finds it. Enter raises (ensureUsable) when the
  // communicator was aborted meanwhile.
  void enterEnqueuing(const std::shared_ptr<NcclOp>& op);
  void leaveEnqueuingOf(const std::shared_ptr<NcclOp>& op);
  // Under CUDA-graph capture: the call is recorded into the graph, not run.
  WorkPtr enqueueCaptured(const std::shared_ptr<NcclOp>& op, cudaStream_t stream, const char* call, const Issue& issue);
  cudaStream_t streamFor(StreamHandle handle) const;
  // The peer path (nccl_peer.cc): whether a sum of `tensor` takes it, its
  // launch, its abort, and the error of an operation whose kernel gave up.
  bool throughPeers(const at::Tensor& tensor, ReduceOp op) const;
  void issuePeerAllReduce(const at::Tensor& tensor, cudaStream_t stream, Deadline deadline);
  // Aborts the group where a kernel gave up (a graph replay's, which no operation settles).
  void checkPeerMemory();
  // Ends every rank's use of the peer memory before the communicator is finalized (collective).
  void closePeerMemory(Deadline deadline);
  void abortPeerMemory() noexcept;
  // The TimeoutError naming the peer a kernel gave up on, for operation `seq` (0: a replay's); null if none did.
  std::exception_ptr peerFailure(uint64_t seq) const;
  void ensureUsable() const;
  // Marks the communicator aborted and fails every pending operation (and the
  // one being enqueued) with `error`, which is raised as the process's fatal
  // error (runtime/diagnosis/fatal_exit.h); runs ncclCommAbort unless `ncclAborted`
  // says the NCCL communicator is already aborted (a timed-out split). Without
  // `wait` (a process that is ending) ncclCommAbort is started, not waited
  // for, and the operations' buffers are kept for it.
  void abortWith(std::exception_ptr error, const std::string& reason, bool ncclAborted = false, bool wait = true);
  // A drained communicator's end under `deadline`: ncclCommFinalize, then
  // ncclCommDestroy, each on a helper thread; an abort when finalize does not
  // finish, a fatal error when destroy does not return.
  void finalizeAndDestroy(Deadline deadline);
  void watch();
  void shutdown();

  ncclComm_t comm_;
  int device_;
  std::string name_;
  std::vector<int> members_;
  int rank_ = 0, size_ = 1;
  double defaultTimeout_;
  int* scratch_ = nullptr;               // one device int for barriers
  std::shared_ptr<PeerAllReduce> peer_;  // small sums through peer memory, where attached
  int64_t peerBytes_ = 0;

  std::mutex enqueueMutex_;  // NCCL calls on comm_ come one at a time
  mutable std::mutex pendingMutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<NcclOp>> pending_;
  // The operation whose NCCL call is running now: a first send to a peer
  // connects inside that call, so the watchdog bounds it too.
  std::shared_ptr<NcclOp> enqueuing_;
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();
  std::atomic<bool> aborted_{false};
  std::string abortReason_;
  std::atomic<bool> stopping_{false};
  std::thread watchdog_;
};

}  // namespace bulkhead::nccl
