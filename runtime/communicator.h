#pragma once
// The Communicator: one group of ranks and the operations they run together
// (docs/design.md#communicator). Backends: mpi (CPU tensors) and nccl (CUDA tensors).
//
// Contract, for every backend:
// - All ranks of a group issue the same collectives in the same order.
//   Zero-size messages are legal and still take part.
// - Every operation returns a Work at once. GPU backends enqueue it on a CUDA
//   stream (see StreamHandle): later work on that stream is ordered after it
//   without waiting; Work::wait blocks the host until it completed. A watchdog
//   enforces the deadline of work nobody waits on. Its deadline (the options', or the
//   communicator's default timeout counted from the call) covers the whole
//   operation. Work::wait returns when it completed, or raises:
//     TimeoutError  the deadline passed; the communicator is aborted and refuses
//                   further use (MPI cannot cancel a collective, so an MPI
//                   process must then exit: see mpi_backend.h);
//     CommError     the backend failed, or the communicator was aborted.
// - Bad arguments (split lengths, negative sizes, unsupported dtype, a tensor
//   on the wrong device or not contiguous) raise ConfigError before any
//   communication, on the calling rank.
// - Tensors passed in must stay untouched until the Work completes. Their
//   memory stays the operation's until then even if the caller drops them:
//   the Work keeps them alive, or (nccl, on the current stream) the caching
//   allocator, told of the stream, reuses it only behind the operation.
// Tensors are at::Tensor, the same type as torch::Tensor.

#include <ATen/core/Tensor.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/diagnosis/ledger.h"

namespace bulkhead {

// A CUDA stream (cudaStream_t) for GPU backends, kept opaque here so this
// header needs no CUDA. Null: the caller's current stream (PyTorch's current
// stream of the communicator's device). CPU backends ignore it.
using StreamHandle = void*;

struct CallOptions {
  // Unset: the communicator's default timeout, counted from the call.
  std::optional<Deadline> deadline;
  StreamHandle stream = nullptr;
  // Sends and receives: what the message is ("micro-batch 5 forward"), kept in
  // the ledger with the operation and shown in its reports and dumps.
  std::string label;
};

struct ReduceOptions {
  ReduceOp op = ReduceOp::Sum;
  std::optional<Deadline> deadline;
  StreamHandle stream = nullptr;
};

// One send or receive of a grouped exchange (Communicator::sendRecv).
struct PeerOp {
  enum class Kind { Send, Recv };
  Kind kind = Kind::Send;
  at::Tensor tensor;
  int peer = 0;
  std::string label;  // what the message is, kept in the ledger with it
};

struct SplitOptions {
  // Unset: BULKHEAD_INIT_TIMEOUT from the call. Splitting is bootstrap work.
  std::optional<Deadline> deadline;
};

// The handle of one operation in flight.
class Work {
 public:
  virtual ~Work() = default;
  // True once the operation has ended, successfully or not. Never blocks.
  virtual bool isCompleted() = 0;
  // Waits until the operation ends or the earlier of `deadline` and the
  // operation's own deadline passes (see the contract above); rethrows the
  // error the operation ended with.
  virtual void wait(std::optional<Deadline> deadline = std::nullopt) = 0;
  // The error the operation ended with, if it ended with one.
  virtual std::exception_ptr exception() const = 0;
  // Its sequence number in the communicator's ledger.
  virtual uint64_t sequence() const = 0;
};

using WorkPtr = std::shared_ptr<Work>;

class Monitor;  // runtime/diagnosis/monitor.h

class Communicator {
 public:
  virtual ~Communicator() = default;

  // The monitor that publishes this group's ledger and explains its timeouts
  // (null until the runtime attaches one; children of split inherit it).
  const std::shared_ptr<Monitor>& monitor() const { return monitor_; }
  void setMonitor(std::shared_ptr<Monitor> monitor) { monitor_ = std::move(monitor); }

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "world", "tp[0]", "ep[1]": the name every message about this group uses.
  virtual const std::string& name() const = 0;
  // The world ranks of the members, in this group's rank order.
  virtual const std::vector<int>& members() const = 0;
  virtual const char* backend() const = 0;
  // Where this communicator's tensors must live: cpu for mpi, cuda:<n> for nccl.
  virtual c10::Device device() const = 0;
  // The numbered record of this group's operations. The monitor keeps a
  // share of it, so dumps still show a group after its communicator is gone.
  const Ledger& ledger() const { return *ledger_; }
  std::shared_ptr<const Ledger> sharedLedger() const { return ledger_; }

  // In place: every rank ends with the reduction of all ranks' tensors.
  virtual WorkPtr allReduce(at::Tensor tensor, ReduceOptions options = {}) = 0;
  // output.numel() == size() * input.numel(); rank r's input lands in chunk r.
  virtual WorkPtr allGather(at::Tensor input, at::Tensor output, CallOptions options = {}) = 0;
  // input.numel() == size() * output.numel(); rank r gets chunk r of the reduction.
  virtual WorkPtr reduceScatter(at::Tensor input, at::Tensor output, ReduceOptions options = {}) = 0;
  // Rows (dim 0) of `send` go to ranks in order: sendSplits[r] rows to rank r;
  // recvSplits[r] rows arrive from rank r. Empty split lists mean equal splits.
  // Uneven and zero splits are legal; both tensors share dtype and row shape.
  virtual WorkPtr allToAll(at::Tensor send, at::Tensor recv, std::vector<int64_t> sendSplits,
                           std::vector<int64_t> recvSplits, CallOptions options = {}) = 0;
  virtual WorkPtr broadcast(at::Tensor tensor, int root, CallOptions options = {}) = 0;
  virtual WorkPtr barrier(CallOptions options = {}) = 0;
  // A pair with peer == rank(): the mpi backend completes it; the nccl backend
  // refuses it (ConfigError), as NCCL pairs a send to self only with its
  // receive in one group call. allToAll moves a rank's own rows on both.
  virtual WorkPtr send(at::Tensor tensor, int peer, CallOptions options = {}) = 0;
  virtual WorkPtr recv(at::Tensor tensor, int peer, CallOptions options = {}) = 0;
  // Sends and receives issued together as one operation: none waits for
  // another to start, so two ranks may each send to and receive from the
  // other in one call (nccl: one ncclGroupStart/End; mpi and gloo: their
  // non-blocking sends and receives). Messages between two ranks match in the
  // order they are issued, over calls and within one. Each is numbered in the
  // ledger as a send or receive with its peer and label, and BULKHEAD_FAULT
  // names each by that number (a skipped one is left out of the call). The
  // Work completes when all have, under one deadline (the options'; their
  // label is unused). Arguments are checked as send's and recv's, before
  // anything is issued; no operation at all is a completed Work.
  virtual WorkPtr sendRecv(std::vector<PeerOp> ops, CallOptions options = {});

  // Collective over this group: ranks with the same color form a new group,
  // ordered by (key, rank). A negative color joins no group and gets nullptr.
  // The new group is named "<name>[<color>]".
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name,
                                              SplitOptions options = {}) = 0;

  // Marks the communicator unusable and fails its pending work; bounded.
  virtual void abort(const std::string& reason) = 0;
  virtual bool isAborted() const = 0;

 protected:
  // Capacity: BULKHEAD_LEDGER_CAPACITY.
  Communicator();

  // Steps every backend takes before it issues an operation (communicator.cc).
  // A fault injected for the next collective (BULKHEAD_FAULT): Skip means
  // return fault::skippedWork() without issuing or numbering anything;
  // Altered means `fingerprint` now describes another operation (a mismatch):
  // it is recorded as issued but sent to no backend, so it never completes.
  enum class Injected { None, Skip, Altered };
  // `ahead`: operations of the same kind numbered before this one but not
  // issued yet (the earlier members of a grouped call).
  Injected injectFault(Fingerprint& fingerprint, uint64_t ahead = 0);
  // Strict mode: compares the fingerprint of collective `seq` across the
  // group; on a mismatch the ledger entry fails and DesyncError propagates.
  void checkStrict(uint64_t seq, const Fingerprint& fingerprint, Deadline deadline);

  std::shared_ptr<Ledger> ledger_;

 private:
  std::shared_ptr<Monitor> monitor_;
};

using CommunicatorPtr = std::shared_ptr<Communicator>;

// The checks every backend's sendRecv makes before it issues anything: a
// tensor on the communicator's device and a peer in the group (ConfigError).
void checkPeerOps(const Communicator& comm, const std::vector<PeerOp>& ops);

}  // namespace bulkhead
