#include "parallel/shard_init.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "runtime/errors.h"

namespace bulkhead::parallel {

Range partition(int64_t total, int parts, int index) {
  if (parts < 1 || index < 0 || index >= parts || total < 0)
    throw ConfigError(fmt::format("partition: part {} of {} items in {} parts is out of range", index, total, parts),
                      {.expected = "0 <= index < parts, total >= 0"});
  int64_t base = total / parts, extra = total % parts;
  return {.begin = index * base + std::min<int64_t>(index, extra), .length = base + (index < extra ? 1 : 0)};
}

namespace {
// FNV-1a: a stable hash of the key, the same on every rank and build.
uint64_t hashKey(const std::string& key, uint64_t seed) {
  uint64_t hash = 1469598103934665603ULL ^ (seed * 0x9e3779b97f4a7c15ULL);
  for (unsigned char c : key) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return hash;
}
}  // namespace

at::Tensor seededSlice(const std::string& key, uint64_t seed, const ShardInfo& shard, at::IntArrayRef localShape,
                       double std, at::TensorOptions options) {
  if (shard.globalShape.size() != localShape.size() || shard.offsets.size() != localShape.size())
    throw ConfigError(fmt::format("seededSlice({}): global shape, offsets and local shape differ in rank", key),
                      {.expected = "one offset and one extent per dimension"});
  auto generator = at::detail::createCPUGenerator(hashKey(key, seed));
  at::Tensor global = at::randn(shard.globalShape, generator, at::TensorOptions().dtype(at::kDouble)) * std;
  at::Tensor slice = global;
  for (size_t d = 0; d < localShape.size(); ++d) {
    if (shard.offsets[d] < 0 || shard.offsets[d] + localShape[d] > shard.globalShape[d])
      throw ConfigError(fmt::format("seededSlice({}): dimension {} slice [{}, {}) is outside the global extent {}", key,
                                    d, shard.offsets[d], shard.offsets[d] + localShape[d], shard.globalShape[d]),
                        {.expected = "a slice inside the global shape"});
    slice = slice.narrow(static_cast<int64_t>(d), shard.offsets[d], localShape[d]);
  }
  return slice.to(options).contiguous();
}

at::Tensor newParameterTensor(const std::string& key, uint64_t seed, const ShardInfo& shard, at::IntArrayRef localShape,
                              double std, at::TensorOptions options) {
  at::Tensor tensor =
      std == 0.0 ? at::zeros(localShape, options) : seededSlice(key, seed, shard, localShape, std, options);
  return tensor.detach().set_requires_grad(true);
}

}  // namespace bulkhead::parallel
