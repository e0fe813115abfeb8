#include "tests/support/parallel_helpers.h"

#include <fmt/format.h>

#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

namespace bulkhead::testing {

parallel::ProcessGroups makeGroups(const parallel::LayoutOptions& options) {
  // No warm-up: these tests build many small layouts on oversubscribed cores.
  return parallel::ProcessGroups::create(worldPtr(), options,
                                         {.deadline = Deadline::after(std::chrono::seconds(60)), .warmup = false});
}

at::Tensor seeded(at::IntArrayRef shape, int a, int b, int c, const std::string& name) {
  uint64_t seed = 0x9e3779b97f4a7c15ULL;
  for (uint64_t part : {uint64_t(a), uint64_t(b), uint64_t(c)}) seed = (seed ^ part) * 1099511628211ULL;
  for (unsigned char ch : name) seed = (seed ^ ch) * 1099511628211ULL;
  auto generator = at::detail::createCPUGenerator(seed);
  return at::randn(shape, generator, at::TensorOptions().dtype(at::kDouble));
}

double relativeError(const at::Tensor& got, const at::Tensor& want) {
  at::Tensor g = got.detach().to(at::kDouble), w = want.detach().to(at::kDouble);
  REQUIRE(g.sizes() == w.sizes());
  double scale = w.numel() == 0 ? 1.0 : w.abs().max().item<double>();
  double diff = w.numel() == 0 ? 0.0 : (g - w).abs().max().item<double>();
  return diff / std::max(scale, 1e-300);
}

at::Tensor sliceOf(const at::Tensor& global, const std::vector<int64_t>& offsets, at::IntArrayRef shape) {
  at::Tensor slice = global;
  for (size_t d = 0; d < offsets.size(); ++d) slice = slice.narrow(static_cast<int64_t>(d), offsets[d], shape[d]);
  return slice;
}

std::map<std::string, at::Tensor> assemble(const std::vector<parallel::ShardedTensor>& state,
                                           const std::vector<GlobalKey>& keys) {
  std::map<std::string, at::Tensor> globals;
  for (const GlobalKey& key : keys) {
    // Values and a coverage count, summed over the world in one all-reduce.
    std::vector<int64_t> shape{2};
    shape.insert(shape.end(), key.shape.begin(), key.shape.end());
    at::Tensor both = at::zeros(shape, at::kDouble);
    for (const parallel::ShardedTensor& piece : state) {
      if (piece.key != key.key || piece.shard.replicaId != 0) continue;
      REQUIRE(piece.shard.globalShape == key.shape);
      sliceOf(both[0], piece.shard.offsets, piece.local.sizes()).add_(piece.local.to(at::kDouble));
      sliceOf(both[1], piece.shard.offsets, piece.local.sizes()).add_(1.0);
    }
    world().allReduce(both, {.deadline = Deadline::after(std::chrono::seconds(60))})->wait();
    INFO("key " << key.key);
    CHECK(at::equal(both[1], at::ones_like(both[1])));
    globals[key.key] = both[0].clone();
  }
  return globals;
}

void fillFrom(const std::vector<parallel::ShardedTensor>& targets, const std::map<std::string, at::Tensor>& globals) {
  for (const parallel::ShardedTensor& target : targets) {
    INFO("key " << target.key);
    auto it = globals.find(target.key);
    REQUIRE(it != globals.end());
    REQUIRE(it->second.sizes().vec() == target.shard.globalShape);
    target.local.copy_(sliceOf(it->second, target.shard.offsets, target.local.sizes()));
  }
}

}  // namespace bulkhead::testing
