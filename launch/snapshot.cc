#include "launch/snapshot.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>

#include <chrono>
#include <cstring>

#include "runtime/backoff.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::launch {
namespace {

constexpr uint64_t kMagic = 0x424b534e41503032ULL;  // "BKSNAP02"
constexpr int64_t kHeaderBytes = 64;
constexpr int64_t kAlign = 64;

struct Header {
  uint64_t magic;
  int64_t step;
  uint64_t signature;
  int64_t bytes;
};

uint64_t fnv(uint64_t hash, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * 1099511628211ULL;
  return hash;
}

Header headerOf(const at::Tensor& packed) {
  Header header{};
  if (packed.defined() && packed.numel() >= kHeaderBytes) std::memcpy(&header, packed.data_ptr(), sizeof(header));
  return header;
}

int64_t bytesOf(const at::Tensor& tensor) { return tensor.numel() * static_cast<int64_t>(tensor.element_size()); }

// A tensor's slice of a packed buffer, as a CPU tensor of its dtype and shape.
at::Tensor sliceOf(const at::Tensor& packed, int64_t offset, const at::Tensor& like) {
  return at::from_blob(static_cast<uint8_t*>(packed.data_ptr()) + offset, like.sizes(),
                       at::TensorOptions().dtype(like.scalar_type()).device(at::kCPU));
}

// A tensor's slice of a device staging buffer, as a tensor of its dtype and shape.
at::Tensor stagedSlice(const at::Tensor& staging, int64_t offset, const at::Tensor& like) {
  return staging.narrow(0, offset, bytesOf(like)).view(like.scalar_type()).view(like.sizes());
}

c10::Device deviceOf(const NamedTensors& state) {
  for (const auto& named : state)
    if (!named.second.is_cpu()) return named.second.device();
  return at::kCPU;
}

}  // namespace

int holderOf(int rank, int size, int localSize) {
  const int shift = localSize > 0 && localSize < size ? localSize : 1;
  return (rank + shift) % size;
}

int wardOf(int rank, int size, int localSize) {
  const int shift = localSize > 0 && localSize < size ? localSize : 1;
  return ((rank - shift) % size + size) % size;
}

PackedLayout packedLayout(const NamedTensors& state) {
  PackedLayout layout;
  uint64_t hash = 1469598103934665603ULL;
  for (const auto& [name, tensor] : state) {
    hash = fnv(hash, name.data(), name.size() + 1);
    const int8_t kind[2] = {static_cast<int8_t>(tensor.scalar_type()), static_cast<int8_t>(tensor.is_cpu())};
    hash = fnv(hash, kind, sizeof(kind));
    for (int64_t size : tensor.sizes()) hash = fnv(hash, &size, sizeof(size));
  }
  layout.offsets.assign(state.size(), 0);
  int64_t offset = kHeaderBytes;
  for (const bool host : {true, false}) {  // the host tensors first, then the device ones
    for (size_t i = 0; i < state.size(); ++i) {
      if (state[i].second.is_cpu() != host) continue;
      layout.offsets[i] = offset;
      offset += (bytesOf(state[i].second) + kAlign - 1) / kAlign * kAlign;
    }
    if (host) layout.hostBytes = offset;
  }
  layout.bytes = offset;
  layout.signature = hash;
  return layout;
}

Snapshots::Snapshots(SnapshotOptions options) : options_(options) {}

Snapshots::~Snapshots() {
  try {
    settle(Deadline::afterSeconds(kSnapshotLandingSeconds));  // no download left writing into freed memory
  } catch (const std::exception& e) {
    log::warn("snapshot", "a snapshot's download did not end: {}", e.what());
  }
}

bool Snapshots::Copy::landed() const { return !landing || landing->query(); }

Snapshots::Copy& Snapshots::older(Copy (&copies)[2]) {
  if (copies[0].step < 0) return copies[0];
  if (copies[1].step < 0) return copies[1];
  return copies[0].step <= copies[1].step ? copies[0] : copies[1];
}

bool Snapshots::settleCopy(Copy& copy, Deadline deadline) {
  Backoff backoff;
  while (!copy.landed()) {
    if (deadline.expired()) {
      copy.step = -1;
      return false;
    }
    backoff.pause(deadline);
  }
  copy.landing.reset();
  return true;
}

void Snapshots::reserve(Copy (&copies)[2], int64_t bytes, bool pinned) {
  for (Copy& copy : copies)
    if (!copy.bytes.defined())
      copy.bytes = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
}

void Snapshots::settle(Deadline deadline) {
  for (Copy* copies : {own_, ward_})
    for (int i = 0; i < 2; ++i)
      if (!settleCopy(copies[i], deadline))
        log::warn("snapshot", "a snapshot's copy to the host did not land by its deadline; it no longer counts");
}

bool Snapshots::stage(Staging& staging, int64_t bytes, c10::Device device) {
  if (!options_.stageOnDevice || stagingFailed_ || device.is_cpu()) return false;
  if (staging.bytes.defined() && staging.bytes.numel() == bytes && staging.bytes.device() == device) return true;
  settle(Deadline::afterSeconds(kSnapshotLandingSeconds));  // no download still reads the old buffer
  staging = Staging{};
  try {
    staging.bytes = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    return true;
  } catch (const c10::Error& e) {
    stagingFailed_ = true;
    log::warn("snapshot",
              "no {:.1f} MB of GPU memory for the snapshots' device copy ({}): snapshots are copied to the host in "
              "place from now on, which holds each snapshot's step up for the copy",
              static_cast<double>(bytes) / 1e6, e.what_without_backtrace());
    return false;
  }
}

void Snapshots::download(Staging& from, Copy& to, int64_t offset) {
  const c10::Device device = from.bytes.device();
  const c10::impl::VirtualGuardImpl impl(device.type());
  if (!stream_) stream_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  c10::Event written(device.type());
  written.record(impl.getStream(device));
  written.block(*stream_);
  {
    const c10::StreamGuard onStream(*stream_);
    to.bytes.narrow(0, offset, from.bytes.numel()).copy_(from.bytes, /*non_blocking=*/true);
  }
  auto landing = std::make_shared<c10::Event>(device.type());
  landing->record(*stream_);
  to.landing = landing;
  from.read = std::move(landing);
}

void Snapshots::pack(Copy& own, const PackedLayout& layout, int64_t step, const NamedTensors& state, bool staged) {
  if (!settleCopy(own, Deadline::afterSeconds(kSnapshotLandingSeconds))) own = Copy{};  // still written: a new buffer
  own.step = -1;
  if (!own.bytes.defined() || own.bytes.numel() != layout.bytes)
    own.bytes =
        at::empty({layout.bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(layout.hostBytes < layout.bytes));
  const Header header{kMagic, step, layout.signature, layout.bytes};
  std::memcpy(own.bytes.data_ptr(), &header, sizeof(header));
  if (staged && ownStaging_.read)  // the last download from the buffer first
    ownStaging_.read->block(
        c10::impl::VirtualGuardImpl(ownStaging_.bytes.device().type()).getStream(ownStaging_.bytes.device()));
  for (size_t i = 0; i < state.size(); ++i) {
    const at::Tensor tensor = state[i].second.detach();
    if (tensor.is_cpu() || !staged)
      sliceOf(own.bytes, layout.offsets[i], tensor).copy_(tensor);
    else
      stagedSlice(ownStaging_.bytes, layout.offsets[i] - layout.hostBytes, tensor).copy_(tensor, /*non_blocking=*/true);
  }
  if (staged) download(ownStaging_, own, layout.hostBytes);
  own.step = step;
}

void Snapshots::take(Communicator& cpuWorld, int localSize, int64_t step, const NamedTensors& state, Deadline deadline,
                     Communicator* deviceWorld) {
  const auto began = std::chrono::steady_clock::now();
  const PackedLayout layout = packedLayout(state);
  const c10::Device device = deviceOf(state);
  const int size = cpuWorld.size();
  if (size > 1 && wardBytes_ < 0) learnWard(cpuWorld, deviceWorld, localSize, layout, device, deadline);
  const bool staged = stage(ownStaging_, layout.bytes - layout.hostBytes, device);
  if (!announced_ && cpuWorld.rank() == 0)
    log::info("snapshot", "snapshots of {:.1f} MB a rank ({:.1f} MB of it from {}{})", layout.bytes / 1e6,
              (layout.bytes - layout.hostBytes) / 1e6, device.str(),
              device.is_cpu() ? ""
              : staged        ? ", through a device copy"
                              : ", in place");
  announced_ = true;
  const auto reserving = std::chrono::steady_clock::now();
  reserve(own_, layout.bytes, layout.hostBytes < layout.bytes);
  if (size > 1) reserve(ward_, wardBytes_, receiveStaged_);
  cost_.setupSeconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - reserving).count();
  if (staged) {
    foldTimers();
    timers_.emplace_back(device);
    timers_.back().start();
  }
  try {
    Copy& own = older(own_);
    pack(own, layout, step, state, staged);
    if (size > 1) exchange(cpuWorld, deviceWorld, localSize, own, layout, step, deadline);
  } catch (...) {
    if (staged) timers_.pop_back();  // a span that never ends
    throw;
  }
  if (staged) timers_.back().stop();
  ++cost_.taken;
  cost_.hostSeconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}

void Snapshots::foldTimers() {
  constexpr size_t kPending = 8;  // spans older than this many snapshots are dropped unmeasured
  while (!timers_.empty()) {
    const std::optional<double> seconds = timers_.front().elapsed();
    if (!seconds && timers_.size() < kPending) break;
    if (seconds) {
      ++cost_.timed;
      cost_.streamSeconds += *seconds;
    }
    timers_.pop_front();
  }
}

SnapshotCost Snapshots::cost() {
  foldTimers();
  return cost_;
}

}  // namespace bulkhead::launch

namespace bulkhead::launch {

void Snapshots::learnWard(Communicator& cpuWorld, Communicator* deviceWorld, int localSize, const PackedLayout& layout,
                          c10::Device device, Deadline deadline) {
  const int size = cpuWorld.size(), rank = cpuWorld.rank();
  const int holder = holderOf(rank, size, localSize), ward = wardOf(rank, size, localSize);
  auto gather = [&](std::vector<int64_t> mine) {
    const auto fields = static_cast<int64_t>(mine.size());
    at::Tensor all = at::empty({size * fields}, at::kLong);
    cpuWorld.allGather(at::tensor(mine, at::kLong), all, {.deadline = deadline})->wait();
    return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + size * fields);
  };
  const std::vector<int64_t> sizes = gather({layout.bytes, layout.hostBytes});
  wardBytes_ = sizes[2 * ward];
  wardHostBytes_ = sizes[2 * ward + 1];
  // GPU to GPU where this rank can stage both its own GPU part and its ward's, and its partner can too.
  const bool canStage = deviceWorld != nullptr && !deviceWorld->device().is_cpu() && layout.hostBytes < layout.bytes &&
                        wardHostBytes_ < wardBytes_ && stage(ownStaging_, layout.bytes - layout.hostBytes, device) &&
                        stage(wardStaging_, wardBytes_ - wardHostBytes_, device);
  const std::vector<int64_t> staged = gather({canStage ? 1 : 0});
  sendStaged_ = canStage && staged[holder] != 0;
  receiveStaged_ = canStage && staged[ward] != 0;
}

void Snapshots::exchange(Communicator& cpuWorld, Communicator* deviceWorld, int localSize, Copy& own,
                         const PackedLayout& layout, int64_t step, Deadline deadline) {
  const int size = cpuWorld.size(), rank = cpuWorld.rank();
  const int holder = holderOf(rank, size, localSize), wardRank = wardOf(rank, size, localSize);
  const std::string label = fmt::format("snapshot of step {}", step);
  std::vector<PeerOp> hostOps, deviceOps;
  if (sendStaged_ && !own.landing)
    throw ConfigError(fmt::format("the {} was copied to the host in place where its holder expects it from the GPU: "
                                  "the state changed its size or device within the world",
                                  label),
                      {.rank = rank, .expected = "the same tensors at every snapshot"});
  if (sendStaged_) {
    hostOps.push_back({.kind = PeerOp::Kind::Send,
                       .tensor = own.bytes.narrow(0, 0, layout.hostBytes),
                       .peer = holder,
                       .label = label});
    deviceOps.push_back({.kind = PeerOp::Kind::Send, .tensor = ownStaging_.bytes, .peer = holder, .label = label});
  } else {
    if (!settleCopy(own, deadline))
      throw TimeoutError(fmt::format("the {} did not reach the host by its deadline", label),
                         {.rank = rank, .expected = "the snapshot's copy to the host done within the deadline"});
    hostOps.push_back({.kind = PeerOp::Kind::Send, .tensor = own.bytes, .peer = holder, .label = label});
  }
  Copy& ward = older(ward_);
  if (!settleCopy(ward, Deadline::afterSeconds(kSnapshotLandingSeconds))) ward = Copy{};  // still written: a new buffer
  ward.step = -1;
  if (!ward.bytes.defined() || ward.bytes.numel() != wardBytes_)
    ward.bytes = at::empty({wardBytes_}, at::TensorOptions().dtype(at::kByte).pinned_memory(receiveStaged_));
  if (receiveStaged_) {
    hostOps.push_back({.kind = PeerOp::Kind::Recv,
                       .tensor = ward.bytes.narrow(0, 0, wardHostBytes_),
                       .peer = wardRank,
                       .label = label});
    if (wardStaging_.read)  // the last download from the buffer first
      wardStaging_.read->block(
          c10::impl::VirtualGuardImpl(wardStaging_.bytes.device().type()).getStream(wardStaging_.bytes.device()));
    deviceOps.push_back({.kind = PeerOp::Kind::Recv, .tensor = wardStaging_.bytes, .peer = wardRank, .label = label});
  } else {
    hostOps.push_back({.kind = PeerOp::Kind::Recv, .tensor = ward.bytes, .peer = wardRank, .label = label});
  }
  cpuWorld.sendRecv(std::move(hostOps), {.deadline = deadline})->wait();
  if (!deviceOps.empty()) deviceWorld->sendRecv(std::move(deviceOps), {.deadline = deadline})->wait();
  if (receiveStaged_) download(wardStaging_, ward, wardHostBytes_);
  if (const Header header = headerOf(ward.bytes); header.magic != kMagic || header.step != step)
    throw CommError(fmt::format("rank {} sent a snapshot of step {} (magic {:#x}) where this rank takes step {}",
                                wardRank, header.step, header.magic, step),
                    {.rank = rank, .group = cpuWorld.name(), .expected = fmt::format("the ward's {}", label)});
  ward.step = step;
}

std::vector<int64_t> Snapshots::ownSteps() const {
  std::vector<int64_t> steps;
  for (const Copy& copy : own_) steps.push_back(copy.landed() ? copy.step : -1);
  return steps;
}

std::vector<int64_t> Snapshots::wardSteps() const {
  std::vector<int64_t> steps;
  for (const Copy& copy : ward_) steps.push_back(copy.landed() ? copy.step : -1);
  return steps;
}

at::Tensor Snapshots::own(int64_t step) const {
  for (const Copy& copy : own_)
    if (copy.step == step && step >= 0 && copy.landed()) return copy.bytes;
  return {};
}

at::Tensor Snapshots::ward(int64_t step) const {
  for (const Copy& copy : ward_)
    if (copy.step == step && step >= 0 && copy.landed()) return copy.bytes;
  return {};
}

void Snapshots::forgetAfter(int64_t step) {
  for (Copy* copies : {own_, ward_})
    for (int i = 0; i < 2; ++i)
      if (copies[i].step > step) copies[i].step = -1;
}

int64_t Snapshots::stepOf(const at::Tensor& packed) { return headerOf(packed).step; }

void Snapshots::unpack(const at::Tensor& packed, const NamedTensors& state, int rank) {
  const PackedLayout layout = packedLayout(state);
  const Header header = headerOf(packed);
  if (header.magic != kMagic || header.bytes != packed.numel())
    throw CommError(fmt::format("a snapshot of {} bytes does not hold a whole snapshot (magic {:#x}, {} bytes said)",
                                packed.numel(), header.magic, header.bytes),
                    {.rank = rank, .expected = "a snapshot packed by Snapshots::take"});
  if (header.signature != layout.signature || header.bytes != layout.bytes)
    throw ConfigError(fmt::format("the snapshot of step {} was taken of other tensors ({} bytes, signature {:#x}) "
                                  "than this rank's ({} bytes, {:#x}): the process that takes a rank's place must "
                                  "run the same model, flags and layout",
                                  header.step, header.bytes, header.signature, layout.bytes, layout.signature),
                      {.rank = rank, .expected = "the same tensors as the rank's snapshot"});
  for (size_t i = 0; i < state.size(); ++i) {
    const at::Tensor& tensor = state[i].second;
    tensor.detach().copy_(sliceOf(packed, layout.offsets[i], tensor));
  }
}

}  // namespace bulkhead::launch
