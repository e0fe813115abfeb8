#include "tests/checkpoint/model.h"

#include <fmt/format.h>

#include <cstring>

#include "checkpoint/checksum.h"
#include "tests/support/inputs.h"

namespace bulkhead::testing::ckpt {

std::vector<Spec> specs(const ModelShape& m) {
  int64_t E = m.experts, H = m.hidden, F = m.ffn;
  std::vector<Spec> all;
  for (int l = 0; l < m.layers; ++l) {
    std::string p = fmt::format("layers.{}.", l);
    all.push_back({p + "experts.w1", {E, H, F}, at::kFloat, Split::Expert});
    all.push_back({p + "experts.w2", {E, F, H}, at::kBFloat16, Split::Expert});
    all.push_back({"optimizer.exp_avg." + p + "experts.w1", {E, H, F}, at::kFloat, Split::Expert});
    all.push_back({p + "attention.qkv", {3 * H, H}, at::kFloat, Split::Column});
    all.push_back({p + "attention.out", {H, 3 * H}, at::kBFloat16, Split::Row});
    all.push_back({p + "norm.weight", {H}, at::kFloat, Split::Whole});
    all.push_back({p + "router.weight", {E, H}, at::kHalf, Split::Whole});
  }
  all.push_back({"embedding", {4 * H, H}, at::kFloat, Split::Column});
  all.push_back({"optimizer.step", {3}, at::kLong, Split::Whole});
  all.push_back({"optimizer.counts", {E}, at::kInt, Split::Whole});
  all.push_back({"tokens_seen", {}, at::kLong, Split::Whole});
  all.push_back({"loss_scale", {}, at::kFloat, Split::Whole});
  all.push_back({"bytes/with spaces%and/slashes", {5}, at::kByte, Split::Whole});
  all.push_back({"empty", {0, 3}, at::kFloat, Split::Whole});
  return all;
}

at::Tensor globalValue(const Spec& spec, int seed) {
  int salt = static_cast<int>(checkpoint::Hash64().add(spec.key).value() % 100000);
  return draw(seed, salt, spec.shape, spec.dtype);
}

namespace {

// (offsets, sizes, replica id) of this rank's slice of `spec` under `layout`.
parallel::ShardInfo shardOf(const Spec& spec, const parallel::Layout& layout, int rank, std::vector<int64_t>& sizes) {
  auto c = layout.coordinates(rank);
  sizes = spec.shape;
  std::vector<int64_t> offsets(spec.shape.size(), 0);
  int replica = rank;
  switch (spec.split) {
    case Split::Expert:
      sizes[0] /= layout.ep();
      offsets[0] = c.ep * sizes[0];
      sizes[2] /= layout.etp();
      offsets[2] = c.etp * sizes[2];
      replica = c.edp;
      break;
    case Split::Column:
      sizes[0] /= layout.tp();
      offsets[0] = c.tp * sizes[0];
      replica = c.dp + layout.dp() * (c.cp + layout.cp() * c.pp);
      break;
    case Split::Row:
      sizes[1] /= layout.tp();
      offsets[1] = c.tp * sizes[1];
      replica = c.dp + layout.dp() * (c.cp + layout.cp() * c.pp);
      break;
    case Split::Whole:
      break;
  }
  return {spec.shape, offsets, replica};
}

at::Tensor sliceOf(const at::Tensor& global, const parallel::ShardInfo& shard, const std::vector<int64_t>& sizes) {
  at::Tensor view = global;
  for (size_t d = 0; d < sizes.size(); ++d) view = view.narrow(static_cast<int64_t>(d), shard.offsets[d], sizes[d]);
  return view.contiguous();
}

}  // namespace

checkpoint::StateDict build(const ModelShape& shape, const parallel::Layout& layout, int rank, int seed) {
  checkpoint::StateDict state;
  for (const Spec& spec : specs(shape)) {
    std::vector<int64_t> sizes;
    parallel::ShardInfo shard = shardOf(spec, layout, rank, sizes);
    state.add(spec.key, sliceOf(globalValue(spec, seed), shard, sizes).clone(), shard);
  }
  state.rng["torch.cpu"] = rngOf(rank, seed);
  state.rng["cuda:0"] = rngOf(rank, seed + 1);
  state.dataPosition = dataPositionOf(rank, seed);
  state.layout = checkpoint::LayoutRecord::of(layout);
  state.user["config"] = fmt::format("seed={} layers={}", seed, shape.layers);
  state.user["blob"] = userBlobOf(seed);
  return state;
}

std::vector<std::string> mismatches(const checkpoint::StateDict& state, const ModelShape& shape, int seed) {
  std::vector<std::string> wrong;
  for (const Spec& spec : specs(shape)) {
    const auto* entry = state.find(spec.key);
    if (!entry) {
      wrong.push_back(spec.key + " (absent)");
      continue;
    }
    std::vector<int64_t> sizes = entry->local.sizes().vec();
    if (!bitwiseEqual(entry->local, sliceOf(globalValue(spec, seed), entry->shard, sizes))) wrong.push_back(spec.key);
  }
  return wrong;
}

bool bitwiseEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;  // an empty slice: no data pointer to compare
  at::Tensor x = a.cpu().contiguous(), y = b.cpu().contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

std::string dataPositionOf(int rank, int seed) { return fmt::format("epoch 3 sample {}", 1000 * seed + rank); }

std::string rngOf(int rank, int seed) {
  std::string bytes(64 + rank, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 31 + rank * 7 + seed) & 0xff);
  return bytes;
}

std::string userBlobOf(int seed) { return std::string("bin\0ary\n", 8) + std::to_string(seed); }

}  // namespace bulkhead::testing::ckpt
