#include "checkpoint/state_dict.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <sstream>

#include "checkpoint/dtype.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

constexpr const char* kReserved = "_bulkhead/";

}  // namespace

LayoutRecord LayoutRecord::of(const parallel::Layout& layout) {
  return {.worldSize = layout.worldSize(), .options = layout.options()};
}

std::string LayoutRecord::text() const {
  return fmt::format("world={} tp={} cp={} pp={} ep={} etp={} order={} optimizer_instances={}", worldSize, options.tp,
                     options.cp, options.pp, options.ep, options.etp, options.order, options.optimizerInstances);
}

std::optional<LayoutRecord> LayoutRecord::parse(const std::string& text) {
  LayoutRecord record;
  std::istringstream in(text);
  std::string field;
  int seen = 0;
  while (in >> field) {
    size_t equals = field.find('=');
    if (equals == std::string::npos) return std::nullopt;
    std::string name = field.substr(0, equals), value = field.substr(equals + 1);
    try {
      if (name == "order")
        record.options.order = value;
      else if (name == "world")
        record.worldSize = std::stoi(value);
      else if (name == "tp")
        record.options.tp = std::stoi(value);
      else if (name == "cp")
        record.options.cp = std::stoi(value);
      else if (name == "pp")
        record.options.pp = std::stoi(value);
      else if (name == "ep")
        record.options.ep = std::stoi(value);
      else if (name == "etp")
        record.options.etp = std::stoi(value);
      else if (name == "optimizer_instances")
        record.options.optimizerInstances = std::stoi(value);
      else
        return std::nullopt;
    } catch (const std::exception&) {
      return std::nullopt;
    }
    ++seen;
  }
  if (seen != 8) return std::nullopt;
  return record;
}

void StateDict::add(std::string key, at::Tensor local, parallel::ShardInfo shard) {
  tensors.push_back({std::move(key), std::move(local), std::move(shard)});
}

void StateDict::addWhole(std::string key, at::Tensor tensor, int replicaId) {
  auto shard = parallel::ShardInfo::whole(tensor.sizes(), replicaId);
  tensors.push_back({std::move(key), std::move(tensor), std::move(shard)});
}

const parallel::ShardedTensor* StateDict::find(const std::string& key) const {
  for (const auto& tensor : tensors)
    if (tensor.key == key) return &tensor;
  return nullptr;
}

void validate(const StateDict& state, int rank) {
  auto fail = [&](const std::string& key, const std::string& what) {
    throw ConfigError(fmt::format("state dict entry '{}': {}", key, what),
                      {.rank = rank, .expected = "a slice inside its global shape, one offset per dimension"});
  };
  for (const auto& entry : state.tensors) {
    if (entry.key.empty()) fail(entry.key, "the key is empty; name every tensor by its global key");
    if (isReservedKey(entry.key)) fail(entry.key, fmt::format("keys starting with '{}' are reserved", kReserved));
    if (!entry.local.defined()) fail(entry.key, "the tensor is undefined");
    requireStored(entry.local.scalar_type());
    const auto& shard = entry.shard;
    auto sizes = entry.local.sizes();
    if (shard.globalShape.size() != sizes.size() || shard.offsets.size() != sizes.size())
      fail(entry.key, fmt::format("the tensor has {} dimensions but the shard gives a global shape [{}] and offsets "
                                  "[{}]",
                                  sizes.size(), fmt::join(shard.globalShape, ", "), fmt::join(shard.offsets, ", ")));
    for (size_t d = 0; d < sizes.size(); ++d)
      if (shard.offsets[d] < 0 || shard.offsets[d] + sizes[d] > shard.globalShape[d])
        fail(entry.key, fmt::format("the slice [{}] + [{}] lies outside the global shape [{}] in dimension {}",
                                    fmt::join(shard.offsets, ", "), fmt::join(sizes, ", "),
                                    fmt::join(shard.globalShape, ", "), d));
    if (shard.replicaId < 0) fail(entry.key, fmt::format("replica id {} is negative", shard.replicaId));
  }
}

std::string rngKey(int rank, const std::string& name) { return fmt::format("{}rank{}/rng/{}", kReserved, rank, name); }
std::string dataPositionKey(int rank) { return fmt::format("{}rank{}/data_position", kReserved, rank); }
std::string userKey(const std::string& name) { return fmt::format("{}user/{}", kReserved, name); }
bool isReservedKey(const std::string& key) { return key.rfind(kReserved, 0) == 0; }

void captureTorchRng(StateDict& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  at::Tensor bytes;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    bytes = generator.get_state().contiguous();
  }
  state.rng["torch.cpu"] = std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
}

bool restoreTorchRng(const std::map<std::string, std::string>& rng) {
  auto it = rng.find("torch.cpu");
  if (it == rng.end()) return false;
  at::Tensor bytes = at::empty({static_cast<int64_t>(it->second.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), it->second.data(), it->second.size());
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(bytes);
  return true;
}

}  // namespace bulkhead::checkpoint
