// The nccl backend's path through peer memory (peer_all_reduce.h): small sums
// of the groups BULKHEAD_PEER_ALL_REDUCE names, within one node. They are
// operations of the communicator as its NCCL calls are: numbered in its
// ledger, bounded by their deadlines, watched, and ended by its abort.
#include <fmt/format.h>

#include <sstream>

#include "runtime/diagnosis/op_checks.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/nccl/nccl_communicator.h"

#if BULKHEAD_PEER_ALL_REDUCE
#include "runtime/nccl/peer_all_reduce.h"
#endif

namespace bulkhead::nccl {
namespace {

// How long a kernel waits for a peer past its operation's deadline.
[[maybe_unused]] constexpr double kPeerGraceSeconds = 30;

// Whether the knob's comma list names `kind` ("tp"), or says "all".
bool named(const std::string& list, const std::string& kind) {
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ','))
    if (item == kind || item == "all") return true;
  return false;
}

}  // namespace

#if BULKHEAD_PEER_ALL_REDUCE

void NcclCommunicator::attachPeerMemory(const std::string& kind, Deadline deadline) {
  if (size_ < 2 || !named(env::kPeerAllReduce.text(), kind)) return;
  const int64_t bytes = env::kPeerAllReduceBytes.integer();
  if (bytes <= 0)
    throw ConfigError(fmt::format("BULKHEAD_PEER_ALL_REDUCE_BYTES is {}; it must be a positive number of bytes", bytes),
                      checks::context(*this, "a positive BULKHEAD_PEER_ALL_REDUCE_BYTES"));
  // A captured call's kernel outwaits every deadline the watchdog enforces; an eager one its operation's.
  const double giveUp = std::max(env::kCollectiveTimeout.seconds(), env::kInitTimeout.seconds()) + kPeerGraceSeconds;
  std::string why;
  peer_ = PeerAllReduce::create(
      *this, device_,
      {.capacityBytes = bytes, .oneShotBytes = std::min<int64_t>(bytes, 256 << 10), .giveUpSeconds = giveUp}, deadline,
      &why);
  peerBytes_ = peer_ ? bytes : 0;
  if (rank_ != 0) return;
  if (peer_)
    log::info("comm", "{}: sums of at most {} bytes go through peer memory ({} ranks)", name_, bytes, size_);
  else
    log::warn("comm", "{}: sums stay on NCCL, peer memory cannot serve the group: {}", name_, why);
}

bool NcclCommunicator::throughPeers(const at::Tensor& tensor, ReduceOp op) const {
  return peer_ && op == ReduceOp::Sum && static_cast<int64_t>(tensor.nbytes()) <= peerBytes_ && peer_->fits(tensor);
}

void NcclCommunicator::issuePeerAllReduce(const at::Tensor& tensor, cudaStream_t stream, Deadline deadline) {
  // The kernel outwaits the operation's deadline, so the watchdog's abort and diagnosis come first.
  peer_->enqueue(tensor, stream, std::max(deadline.remainingSeconds(), 0.0) + kPeerGraceSeconds);
}

void NcclCommunicator::checkPeerMemory() {
  if (!peer_ || aborted_) return;
  if (const std::exception_ptr gaveUp = peerFailure(0))  // a replay's call, which no operation settles
    abortWith(gaveUp, "an all-reduce through peer memory gave up waiting for a peer");
}

void NcclCommunicator::closePeerMemory(Deadline deadline) {
  if (!peer_ || aborted_) return;
  bool closed = false;
  try {
    closed = peer_->close(
        [this](Deadline until) {
          barrier({.deadline = until})->wait();
          return true;
        },
        deadline);
  } catch (const Error& e) {
    log::warn("comm", "{}: closing its peer memory failed: {}", name_, e.what());
  }
  if (!closed) log::warn("comm", "{}: its peer memory is left to the process's end", name_);
}

void NcclCommunicator::abortPeerMemory() noexcept {
  if (peer_) peer_->abort();
}

std::exception_ptr NcclCommunicator::peerFailure(uint64_t seq) const {
  const std::optional<PeerGaveUp> gaveUp = peer_ ? peer_->gaveUp() : std::nullopt;
  if (!gaveUp) return nullptr;
  const int culprit = gaveUp->peer >= 0 && gaveUp->peer < size_ ? members_[gaveUp->peer] : -1;
  return std::make_exception_ptr(TimeoutError(
      fmt::format("an all-reduce through peer memory on {} ({}): rank {} ({} rank {}) did not reach its call {} of "
                  "the peer all-reduce within the operation's deadline + {:.0f} s; the communicator is aborted",
                  checks::describeGroup(*this), seq > 0 ? fmt::format("seq {}", seq) : "replayed in a CUDA graph",
                  culprit, name_, gaveUp->peer, gaveUp->call, kPeerGraceSeconds),
      checks::context(*this, fmt::format("rank {} in the all-reduce", culprit)), seq));
}

#else  // a build whose libtorch has no CUDA: the nccl backend cannot run, and no group takes the path

void NcclCommunicator::attachPeerMemory(const std::string& kind, Deadline) {
  if (size_ >= 2 && named(env::kPeerAllReduce.text(), kind) && rank_ == 0)
    log::warn("comm", "{}: BULKHEAD_PEER_ALL_REDUCE names it, but this build has no peer all-reduce kernel", name_);
}

bool NcclCommunicator::throughPeers(const at::Tensor&, ReduceOp) const { return false; }
void NcclCommunicator::issuePeerAllReduce(const at::Tensor&, cudaStream_t, Deadline) {}
void NcclCommunicator::checkPeerMemory() {}
void NcclCommunicator::closePeerMemory(Deadline) {}
void NcclCommunicator::abortPeerMemory() noexcept {}
std::exception_ptr NcclCommunicator::peerFailure(uint64_t) const { return nullptr; }

#endif

}  // namespace bulkhead::nccl
