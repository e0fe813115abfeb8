#include "launch/snapshot.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstring>

#include "runtime/errors.h"

namespace bulkhead::launch {
namespace {

constexpr uint64_t kMagic = 0x424b534e41503031ULL;  // "BKSNAP01"
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

// A tensor's slice of a packed buffer, as a CPU tensor of its dtype and shape.
at::Tensor sliceOf(const at::Tensor& packed, int64_t offset, const at::Tensor& like) {
  return at::from_blob(static_cast<uint8_t*>(packed.data_ptr()) + offset, like.sizes(),
                       at::TensorOptions().dtype(like.scalar_type()).device(at::kCPU));
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
  int64_t offset = kHeaderBytes;
  for (const auto& [name, tensor] : state) {
    hash = fnv(hash, name.data(), name.size() + 1);
    const int8_t dtype = static_cast<int8_t>(tensor.scalar_type());
    hash = fnv(hash, &dtype, sizeof(dtype));
    for (int64_t size : tensor.sizes()) hash = fnv(hash, &size, sizeof(size));
    layout.offsets.push_back(offset);
    offset += (tensor.numel() * static_cast<int64_t>(tensor.element_size()) + kAlign - 1) / kAlign * kAlign;
  }
  layout.bytes = offset;
  layout.signature = hash;
  return layout;
}

Snapshots::Copy& Snapshots::older(Copy (&copies)[2]) {
  if (copies[0].step < 0) return copies[0];
  if (copies[1].step < 0) return copies[1];
  return copies[0].step <= copies[1].step ? copies[0] : copies[1];
}

void Snapshots::take(Communicator& cpuWorld, int localSize, int64_t step, const NamedTensors& state,
                     Deadline deadline) {
  const PackedLayout layout = packedLayout(state);
  const bool onGpu = !state.empty() && state.front().second.is_cuda();
  Copy& own = older(own_);
  own.step = -1;
  if (!own.bytes.defined() || own.bytes.numel() != layout.bytes)
    own.bytes = at::empty({layout.bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(onGpu));
  const Header header{kMagic, step, layout.signature, layout.bytes};
  std::memcpy(own.bytes.data_ptr(), &header, sizeof(header));
  for (size_t i = 0; i < state.size(); ++i) {
    const at::Tensor& tensor = state[i].second;
    sliceOf(own.bytes, layout.offsets[i], tensor).copy_(tensor.detach());
  }
  own.step = step;

  const int size = cpuWorld.size(), rank = cpuWorld.rank();
  if (size == 1) return;
  if (wardBytes_ < 0) {  // once per world: how much the ward sends
    at::Tensor mine = at::full({1}, layout.bytes, at::kLong);
    at::Tensor all = at::empty({size}, at::kLong);
    cpuWorld.allGather(mine, all, {.deadline = deadline})->wait();
    wardBytes_ = all[wardOf(rank, size, localSize)].item<int64_t>();
  }
  Copy& ward = older(ward_);
  ward.step = -1;
  if (!ward.bytes.defined() || ward.bytes.numel() != wardBytes_) ward.bytes = at::empty({wardBytes_}, at::kByte);
  const std::string label = fmt::format("snapshot of step {}", step);
  cpuWorld
      .sendRecv(
          {{.kind = PeerOp::Kind::Send, .tensor = own.bytes, .peer = holderOf(rank, size, localSize), .label = label},
           {.kind = PeerOp::Kind::Recv, .tensor = ward.bytes, .peer = wardOf(rank, size, localSize), .label = label}},
          {.deadline = deadline})
      ->wait();
  ward.step = headerOf(ward.bytes).step;
}

std::vector<int64_t> Snapshots::ownSteps() const { return {own_[0].step, own_[1].step}; }
std::vector<int64_t> Snapshots::wardSteps() const { return {ward_[0].step, ward_[1].step}; }

at::Tensor Snapshots::own(int64_t step) const {
  for (const Copy& copy : own_)
    if (copy.step == step && step >= 0) return copy.bytes;
  return {};
}

at::Tensor Snapshots::ward(int64_t step) const {
  for (const Copy& copy : ward_)
    if (copy.step == step && step >= 0) return copy.bytes;
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
