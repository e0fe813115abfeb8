#include "runtime/nccl/peer_all_reduce.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "runtime/backoff.h"
#include "runtime/cuda/cuda_device.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/dtype.h"
#include "runtime/log.h"
#include "runtime/nccl/nccl_check.h"
#include "runtime/nccl/peer_reduce_kernels.h"

namespace bulkhead::nccl {
namespace {

// What each rank tells the others at creation.
struct Card {
  uint64_t host = 0;  // a hash of the host's name: the group must share one
  int32_t device = -1;
  int32_t ready = 0;                  // its region was exported and the kernel runs on its GPU
  int64_t capacity = 0, oneShot = 0;  // the options, which must agree
  cudaIpcMemHandle_t handle{};
};

uint64_t hostHash() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return std::hash<std::string>{}(name);
}

std::optional<peer::Dtype> dtypeOf(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return peer::Dtype::Float32;
    case c10::ScalarType::BFloat16:
      return peer::Dtype::BFloat16;
    case c10::ScalarType::Half:
      return peer::Dtype::Float16;
    default:
      return std::nullopt;
  }
}

// Every rank's value of `mine`, gathered over the group on its device.
std::vector<Card> gatherCards(Communicator& group, const Card& mine, Deadline deadline) {
  at::Tensor own = at::empty({static_cast<int64_t>(sizeof(Card))}, at::kByte);
  std::memcpy(own.data_ptr(), &mine, sizeof(Card));
  at::Tensor all = at::empty({group.size() * static_cast<int64_t>(sizeof(Card))}, at::kByte);
  if (group.device().is_cpu()) {
    group.allGather(own, all, {.deadline = deadline})->wait();
  } else {
    at::Tensor onDevice = all.to(group.device());
    group.allGather(own.to(group.device()), onDevice, {.deadline = deadline})->wait();
    all = onDevice.cpu();
  }
  std::vector<Card> cards(group.size());
  std::memcpy(cards.data(), all.data_ptr(), all.numel());
  return cards;
}

// Whether every rank of the group says yes.
bool everyone(Communicator& group, bool yes, Deadline deadline) {
  at::Tensor vote = at::tensor({yes ? 1 : 0}, at::kInt);
  if (!group.device().is_cpu()) vote = vote.to(group.device());
  group.allReduce(vote, {.op = ReduceOp::Min, .deadline = deadline})->wait();
  return vote.cpu().item<int>() == 1;
}

}  // namespace

struct PeerAllReduce::Resources {
  int device = -1;
  int rank = 0;
  peer::Regions regions;
  std::vector<char*> opened;         // peers' regions, closed at the end
  char* own = nullptr;               // this rank's region
  char* counters = nullptr;          // device: the call number and the blocks done
  peer::Verdict* verdict = nullptr;  // mapped host memory
  peer::Verdict* deviceVerdict = nullptr;
  cudaEvent_t last = nullptr;  // after the last call
  void* lastStream = nullptr;
  unsigned long long lastCapture = 0;  // the capture of the last captured call
  bool exported = false;               // peers were given this region's handle
  bool launched = false;               // a kernel was enqueued or captured
  bool closed = false;                 // close() ended every peer's use of it

  // The counters, the verdict and the event; false if any could not be had.
  bool finish(Deadline deadline) {
    if (cudaMalloc(reinterpret_cast<void**>(&counters), 64) != cudaSuccess) return false;
    if (cudaHostAlloc(reinterpret_cast<void**>(&verdict), sizeof(peer::Verdict), cudaHostAllocMapped) != cudaSuccess)
      return false;
    *verdict = peer::Verdict{};
    if (cudaMemset(counters, 0, 64) != cudaSuccess ||
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&deviceVerdict), verdict, 0) != cudaSuccess ||
        cudaEventCreateWithFlags(&last, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(last, cudaStreamLegacy) != cudaSuccess)
      return false;
    // The zeroed flags and counters before any peer's call (the group's vote follows).
    Backoff backoff;
    for (cudaError_t state; (state = cudaEventQuery(last)) != cudaSuccess;) {
      if (state != cudaErrorNotReady || deadline.expired()) return false;
      backoff.pause(deadline);
    }
    return true;
  }

  // Frees what no kernel and no peer can still use. After close() that is all
  // of it; a rank that never launched frees its counters and closes the
  // regions it mapped, and its own region too if no peer was shown it. Anything
  // else is left to the process's end: a kernel (this rank's, or a peer's
  // reading this region) may still run, and freeing an exported region before
  // its importers close it is undefined.
  ~Resources() {
    const cuda::DeviceGuard guard(device);
    if (verdict) verdict->abort = 1;  // no kernel of this rank waits on past the end
    // cudaFree waits for the whole device, which a process ending after a fatal error may not get back.
    if ((!closed && launched) || fatal::ending()) return;
    for (char* region : opened) cudaIpcCloseMemHandle(region);
    if (last) cudaEventDestroy(last);
    if (counters) cudaFree(counters);
    if (verdict) cudaFreeHost(verdict);
    if (own && (closed || !exported)) cudaFree(own);
  }
};

std::unique_ptr<PeerAllReduce> PeerAllReduce::create(Communicator& group, int device, PeerAllReduceOptions options,
                                                     Deadline deadline, std::string* why) {
  const int size = group.size(), rank = group.rank();
  auto refuse = [&](std::string reason) -> std::unique_ptr<PeerAllReduce> {
    if (why) *why = std::move(reason);
    return nullptr;
  };
  if (size > peer::kMaxRanks) return refuse(fmt::format("{} ranks, more than {}", size, peer::kMaxRanks));
  options.capacityBytes = (options.capacityBytes + 255) / 256 * 256;
  const cuda::DeviceGuard guard(device);
  auto resources = std::make_unique<Resources>();
  resources->device = device;
  resources->rank = rank;
  Card mine{.host = hostHash(), .device = device, .capacity = options.capacityBytes, .oneShot = options.oneShotBytes};
  const cudaError_t allocated =
      cudaMalloc(reinterpret_cast<void**>(&resources->own), peer::regionBytes(options.capacityBytes));
  if (allocated == cudaSuccess && peer::kernelRunsHere() &&
      cudaMemset(resources->own, 0, peer::kFlagBytes) == cudaSuccess &&
      cudaIpcGetMemHandle(&mine.handle, resources->own) == cudaSuccess)
    mine.ready = 1;
  cudaGetLastError();  // what failed is told below, on every rank
  const std::vector<Card> cards = gatherCards(group, mine, deadline);
  for (int p = 0; p < size; ++p) {
    if (cards[p].host != mine.host) return refuse(fmt::format("rank {} runs on another node", p));
    if (!cards[p].ready)
      return refuse(fmt::format("rank {} could not export peer memory, or its GPU cannot run the kernel", p));
    if (cards[p].capacity != mine.capacity || cards[p].oneShot != mine.oneShot)
      return refuse(
          fmt::format("rank {} sums up to {} bytes, one-shot up to {}, where this rank does {} and {}: set "
                      "BULKHEAD_PEER_ALL_REDUCE_BYTES alike on every rank",
                      p, cards[p].capacity, cards[p].oneShot, mine.capacity, mine.oneShot));
  }
  resources->exported = true;
  bool ready = true;
  for (int p = 0; p < size && ready; ++p) {
    if (p == rank) {
      resources->regions.base[p] = resources->own;
      continue;
    }
    void* region = nullptr;
    ready = cudaIpcOpenMemHandle(&region, cards[p].handle, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess;
    if (ready) resources->opened.push_back(static_cast<char*>(region));
    resources->regions.base[p] = static_cast<char*>(region);
  }
  ready = ready && resources->finish(deadline);
  cudaGetLastError();  // what failed is told below, on every rank
  if (!everyone(group, ready, deadline))
    return refuse("a rank could not map a peer's memory (no peer access) or set up its counters");
  return std::unique_ptr<PeerAllReduce>(new PeerAllReduce(std::move(resources), options, rank, size, group.name()));
}

PeerAllReduce::PeerAllReduce(std::unique_ptr<Resources> resources, PeerAllReduceOptions options, int rank, int size,
                             std::string group)
    : resources_(std::move(resources)), options_(options), rank_(rank), size_(size), group_(std::move(group)) {}

PeerAllReduce::~PeerAllReduce() = default;

bool PeerAllReduce::fits(const at::Tensor& tensor) const {
  return tensor.is_cuda() && tensor.device().index() == resources_->device && tensor.is_contiguous() &&
         dtypeOf(tensor.scalar_type()).has_value() && tensor.nbytes() <= static_cast<size_t>(options_.capacityBytes);
}

void PeerAllReduce::enqueue(const at::Tensor& tensor, void* stream, std::optional<double> giveUpSeconds) {
  const ErrorContext context{.rank = rank_, .group = group_, .expected = "a sum through peer memory"};
  if (aborted_ || closed() || gaveUp())
    throw CommError(fmt::format("the peer all-reduce of {} was aborted, closed or gave up waiting for a peer; its "
                                "calls are out of step: restart the job from its last checkpoint",
                                group_),
                    context);
  if (!fits(tensor))
    throw ConfigError(fmt::format("a {} tensor of {} bytes on {} does not fit the peer all-reduce of {} (float32, "
                                  "bfloat16 or float16, contiguous, on cuda:{}, at most {} bytes)",
                                  dtypeName(tensor.scalar_type()), tensor.nbytes(), tensor.device().str(), group_,
                                  resources_->device, options_.capacityBytes),
                      context);
  const cuda::DeviceGuard guard(resources_->device);
  Resources& r = *resources_;
  auto* cudaStream = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  check(cudaStreamGetCaptureInfo(cudaStream, &capturing, &capture), "cudaStreamGetCaptureInfo", context);
  if (capturing == cudaStreamCaptureStatusNone) capture = 0;
  // Calls share the call counter: each runs after the last. Across streams the
  // event orders them, eager after eager or within one capture; a replay and
  // eager calls on other streams are the caller's to order.
  if (r.launched && stream != r.lastStream && capture == r.lastCapture)
    check(cudaStreamWaitEvent(cudaStream, r.last, 0), "cudaStreamWaitEvent", context);
  auto* counters = reinterpret_cast<uint64_t*>(r.counters);
  const double seconds = giveUpSeconds.value_or(options_.giveUpSeconds);
  r.launched = true;
  peer::launchPeerAllReduce(r.regions, {.dtype = *dtypeOf(tensor.scalar_type()),
                                        .rank = rank_,
                                        .size = size_,
                                        .tensor = tensor.data_ptr(),
                                        .numel = tensor.numel(),
                                        .capacity = options_.capacityBytes,
                                        .twoShot = static_cast<int64_t>(tensor.nbytes()) > options_.oneShotBytes,
                                        .sequence = counters,
                                        .blocksDone = reinterpret_cast<unsigned int*>(counters + 1),
                                        .verdict = r.deviceVerdict,
                                        .giveUpNanoseconds = static_cast<uint64_t>(std::max(seconds, 0.0) * 1e9),
                                        .stream = stream});
  check(cudaEventRecord(r.last, cudaStream), "cudaEventRecord", context);
  r.lastStream = stream;
  r.lastCapture = capture;
  ++calls_;
}

bool PeerAllReduce::close(const std::function<bool(Deadline)>& barrier, Deadline deadline) {
  Resources& r = *resources_;
  if (r.closed) return true;
  const cuda::DeviceGuard guard(r.device);
  // This rank's last call on the device, then every rank's: no kernel reads any region after the barrier.
  Backoff backoff;
  for (cudaError_t state; r.launched && r.lastCapture == 0 && (state = cudaEventQuery(r.last)) != cudaSuccess;) {
    if (state != cudaErrorNotReady || deadline.expired()) return false;
    backoff.pause(deadline);
  }
  if (aborted_ || gaveUp() || !barrier(deadline)) return false;
  for (char* region : r.opened) cudaIpcCloseMemHandle(region);
  r.opened.clear();
  if (!barrier(deadline)) return false;  // every peer's mapping of this region is closed
  r.closed = true;
  return true;
}

bool PeerAllReduce::closed() const { return resources_->closed; }

std::optional<PeerGaveUp> PeerAllReduce::gaveUp() const {
  const unsigned long long verdict = reinterpret_cast<volatile peer::Verdict*>(resources_->verdict)->gaveUp;
  if (verdict == 0) return std::nullopt;
  return PeerGaveUp{.call = verdict >> 8, .peer = static_cast<int>(verdict & 0xff)};
}

void PeerAllReduce::abort() {
  aborted_ = true;
  reinterpret_cast<volatile peer::Verdict*>(resources_->verdict)->abort = 1;
}

}  // namespace bulkhead::nccl
