// The nccl backend's path through peer memory (peer_all_reduce.h): small sums
// of the groups BULKHEAD_PEER_ALL_REDUCE names, within one node. They are
// operations of the communicator as its NCCL calls are: numbered in its
// ledger, bounded by their deadlines, watched, and ended by its abort.
#include <fmt/format.h>

#include <sstream>

#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/nccl/nccl_communicator.h"
#include "runtime/op_checks.h"

#if BULKHEAD_PEER_ALL_REDUCE
#include "runtime/nccl/peer_all_reduce.h"
#endif

namespace bulkhead::nccl {
namespace {

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
  // A kernel outwaits every deadline the watchdog enforces, so the abort comes first.
  const double giveUp = std::max(env::kCollectiveTimeout.seconds(), env::kInitTimeout.seconds()) + 30;
  std::string why;
  peer_ = PeerAllReduce::create(*this, device_,
                                {.capacityBytes = bytes, .oneShotBytes = std::min<int64_t>(bytes, 256 << 10),
                                 .giveUpSeconds = giveUp},
                                deadline, &why);
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

void NcclCommunicator::issuePeerAllReduce(const at::Tensor& tensor, cudaStream_t stream) {
  peer_->enqueue(tensor, stream);
}

void NcclCommunicator::abortPeerMemory() noexcept {
  if (peer_) peer_->abort();
}

std::exception_ptr NcclCommunicator::peerFailure(const NcclOp& op) const {
  const std::optional<PeerGaveUp> gaveUp = peer_ ? peer_->gaveUp() : std::nullopt;
  if (!gaveUp) return nullptr;
  const int culprit = gaveUp->peer >= 0 && gaveUp->peer < size_ ? members_[gaveUp->peer] : -1;
  return std::make_exception_ptr(TimeoutError(
      fmt::format("all-reduce seq {} through peer memory on {}: rank {} ({} rank {}) did not reach its call {} of "
                  "the peer all-reduce within {:.0f} s; the communicator is aborted",
                  op.seq, checks::describeGroup(*this), culprit, name_, gaveUp->peer, gaveUp->call,
                  std::max(env::kCollectiveTimeout.seconds(), env::kInitTimeout.seconds()) + 30),
      checks::context(*this, fmt::format("rank {} in the all-reduce", culprit)), op.seq));
}

#else  // a build whose libtorch has no CUDA: the nccl backend cannot run, and no group takes the path

void NcclCommunicator::attachPeerMemory(const std::string& kind, Deadline) {
  if (size_ >= 2 && named(env::kPeerAllReduce.text(), kind) && rank_ == 0)
    log::warn("comm", "{}: BULKHEAD_PEER_ALL_REDUCE names it, but this build has no peer all-reduce kernel", name_);
}

bool NcclCommunicator::throughPeers(const at::Tensor&, ReduceOp) const { return false; }
void NcclCommunicator::issuePeerAllReduce(const at::Tensor&, cudaStream_t) {}
void NcclCommunicator::abortPeerMemory() noexcept {}
std::exception_ptr NcclCommunicator::peerFailure(const NcclOp&) const { return nullptr; }

#endif

}  // namespace bulkhead::nccl
