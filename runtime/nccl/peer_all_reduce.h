#pragma once
// The intra-node all-reduce through peer memory (docs/design.md#peer-all-reduce):
// every rank of a group on one node exports a region of device memory once,
// maps every peer's (CUDA IPC; the handles go over a communicator of the
// group), and a sum is then one kernel that reads the peers' copies directly:
//   one-shot  every rank reads every peer's input and sums it (small messages);
//   two-shot  rank p sums share p of every peer's input, then every rank
//             gathers the shares (medium ones).
// Each call uses regions of its own, chosen by its call number, which only
// grows and lives on the device: a call never shares flags or data with the
// calls before it whatever their shapes, and replays of a captured graph need
// no host work. A kernel waits for a peer at most `giveUpSeconds`, and gaveUp()
// then names the peer and the call; after abort() a waiting kernel stops at once
// (naming nobody: the caller knows why it aborted).
// Collective library headers are not needed: this is CUDA memory and one kernel.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "runtime/communicator.h"
#include "runtime/deadline.h"

namespace bulkhead::nccl {

struct PeerAllReduceOptions {
  // The largest message in bytes; larger ones are the caller's to send another way.
  int64_t capacityBytes = 8 << 20;
  // One-shot up to this many bytes, two-shot above.
  int64_t oneShotBytes = 256 << 10;
  // How long a kernel waits for a peer before it gives up (well past the
  // operation's deadline, so that the watchdog's abort comes first).
  double giveUpSeconds = 60;
};

// A kernel that stopped waiting for a peer: the call (1 for the first) and the peer.
struct PeerGaveUp {
  uint64_t call = 0;
  int peer = -1;
};

class PeerAllReduce {
 public:
  // Collective over `group`, whose ranks must be processes of this node, each
  // driving `device` (a CUDA device index; ranks may share one). Null, with
  // the reason in *why, where peer memory cannot serve the group: ranks on
  // other nodes, more than 8 ranks, or GPUs that cannot map each other's
  // memory. Raises TimeoutError when a rank does not join by the deadline.
  static std::unique_ptr<PeerAllReduce> create(Communicator& group, int device, PeerAllReduceOptions options,
                                               Deadline deadline, std::string* why = nullptr);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  // Whether a sum of `tensor` can go through peer memory: float32, bfloat16
  // or float16, contiguous, on this device, within the capacity.
  bool fits(const at::Tensor& tensor) const;
  // Enqueues the sum of `tensor` over the group, in place, on `stream` (a
  // cudaStream_t; null: the legacy default stream). Every rank must call it
  // with the same element count and dtype, in the same order. A call on
  // another stream than the last waits for the last, eagerly or within one
  // capture; a graph's replay and eager calls on other streams are the
  // caller's to order. Its kernel waits for a peer at most `giveUpSeconds`
  // (unset: the options'). Raises CommError once a kernel gave up, or after
  // abort() or close(): the regions' calls are out of step then.
  void enqueue(const at::Tensor& tensor, void* stream, std::optional<double> giveUpSeconds = std::nullopt);
  // Collective: ends every rank's use of every region, through `barrier` (a
  // barrier over the group that says whether every rank came by the
  // deadline), so that the memory is freed with this object. False where it
  // could not (a call did not end, a peer did not come): the memory is then
  // left to the process's end, as it is for an object destroyed unclosed once
  // it has launched, since a peer may still read it.
  bool close(const std::function<bool(Deadline)>& barrier, Deadline deadline);
  bool closed() const;
  // The first call a kernel of this rank gave up on, once it has; reads host memory, never waits.
  std::optional<PeerGaveUp> gaveUp() const;
  // Makes every waiting kernel of this rank give up now, and refuses later calls.
  void abort();
  int64_t calls() const { return calls_; }

 private:
  struct Resources;
  PeerAllReduce(std::unique_ptr<Resources> resources, PeerAllReduceOptions options, int rank, int size,
                std::string group);

  std::unique_ptr<Resources> resources_;
  PeerAllReduceOptions options_;
  int rank_, size_;
  std::string group_;
  int64_t calls_ = 0;
  std::atomic<bool> aborted_{false};
};

}  // namespace bulkhead::nccl
