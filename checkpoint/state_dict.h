#pragma once
// What a checkpoint holds (docs/design.md#checkpoints-layout-and-commit): sharded tensors under global,
// layout-independent keys, plus the state that is not a tensor.
//
// - tensors: each a rank's slice of a global tensor (parallel/parameter.h).
//   Replica 0 of a slice writes it; every rank that holds a slice loads it.
//   Keys are free-form, except that "_bulkhead/" is reserved.
// - rng, dataPosition: this rank's own (every rank saves its own; on load a
//   rank gets what the rank of the same number saved).
// - layout: the parallel layout that produced the slices (for the record and
//   `bulkhead-ckpt inspect`; loading works across layouts).
// - user: a free map of bytes; rank 0's copy is saved, every rank loads it.
// The helpers that build state dicts for layers and the optimizer add to
// `tensors`; nothing here depends on what the tensors are.

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "parallel/layout.h"
#include "parallel/parameter.h"

namespace bulkhead::checkpoint {

// The layout a checkpoint was saved under.
struct LayoutRecord {
  int worldSize = 0;
  parallel::LayoutOptions options;

  static LayoutRecord of(const parallel::Layout& layout);
  // "world=8 tp=2 cp=1 pp=1 ep=4 etp=1 order=tp-cp-ep-dp-pp optimizer_instances=1"
  std::string text() const;
  static std::optional<LayoutRecord> parse(const std::string& text);
};

struct StateDict {
  std::vector<parallel::ShardedTensor> tensors;
  std::map<std::string, std::string> rng;  // name -> generator state bytes ("torch.cpu", "cuda:0", ...)
  std::string dataPosition;                // the data loader's position, as bytes
  std::optional<LayoutRecord> layout;
  std::map<std::string, std::string> user;  // rank 0's copy is saved

  // A slice of a global tensor: `local` is this rank's part, at `shard.offsets`.
  void add(std::string key, at::Tensor local, parallel::ShardInfo shard);
  // A tensor every rank holds whole; replica `replicaId` (0 writes).
  void addWhole(std::string key, at::Tensor tensor, int replicaId = 0);
  // The first slice with this key, or nullptr.
  const parallel::ShardedTensor* find(const std::string& key) const;
};

// ConfigError, naming the key and the rank, for: an empty or reserved key, an
// undefined tensor, offsets or a global shape whose length differs from the
// tensor's dimensions, a slice outside its global shape, a negative replica
// id, an unsupported dtype.
void validate(const StateDict& state, int rank);

// The reserved keys that carry a rank's non-tensor state through the same
// writer, reader and checksums as tensors (uint8 tensors, written by `rank`).
std::string rngKey(int rank, const std::string& name);
std::string dataPositionKey(int rank);
std::string userKey(const std::string& name);
bool isReservedKey(const std::string& key);

// libtorch's default CPU generator, under rng["torch.cpu"].
void captureTorchRng(StateDict& state);
// Restores it from a map that has "torch.cpu"; returns false when absent.
bool restoreTorchRng(const std::map<std::string, std::string>& rng);

}  // namespace bulkhead::checkpoint
