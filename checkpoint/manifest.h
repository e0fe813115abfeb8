#pragma once
// The manifest of one committed checkpoint: what was saved, where every slice
// lives, and the checks that it is whole. A checksummed text file
// (`step_000100/manifest.txt`), one record a line, strings percent-escaped:
//
//   bulkhead-checkpoint 1
//   step 100
//   job 3f9c2a...                      (the saving job's nonce; each rank file carries it too)
//   world_size 8
//   created 1732267200.5
//   layout world=8 tp=2 ... | -
//   file <rank> <name> <bytes>         (one per rank file)
//   tensor <key> <dtype> <global shape: 64,1536,1024 or - for a scalar>
//   slice <tensor index> <rank> <dataset> <offsets> <shape> <digest>
//   checksum <FNV-1a 64 of every byte above this line>
//
// A manifest that does not parse or whose checksum differs raises
// CheckpointError: a hand-edited or damaged manifest never loads.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "checkpoint/state_dict.h"

namespace bulkhead::checkpoint {

struct FileRecord {
  int rank = 0;
  std::string name;  // rank_00003.h5
  int64_t bytes = 0;
};

struct TensorRecord {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> globalShape;
};

struct SliceRecord {
  int tensor = 0;  // index into Manifest::tensors
  int rank = 0;    // the rank whose file holds it
  std::string dataset;
  std::vector<int64_t> offsets;
  std::vector<int64_t> shape;
  uint64_t digest = 0;  // Hash64 of its chunks' Fletcher-32 values, in chunk order
};

struct Manifest {
  int64_t step = 0;
  std::string job;
  int worldSize = 0;
  double created = 0;  // seconds since the epoch
  std::optional<LayoutRecord> layout;
  std::vector<FileRecord> files;
  std::vector<TensorRecord> tensors;
  std::vector<SliceRecord> slices;

  std::string serialize() const;
  // `path` and `rank` name the file and the reader in errors.
  static Manifest parse(const std::string& text, const std::string& path, int rank);

  // Index of the tensor with `key`, or -1. Built on first use, rebuilt when
  // the number of tensors changes.
  int findTensor(const std::string& key) const;
  // Slices of each tensor, by tensor index. Built on first use, rebuilt when
  // the number of tensors or slices changes.
  const std::vector<std::vector<int>>& slicesByTensor() const;
  int64_t totalBytes() const;

 private:
  mutable std::unordered_map<std::string, int> byKey_;
  mutable std::vector<std::vector<int>> byTensor_;
  mutable size_t indexedSlices_ = 0;
};

// Percent-escaping of strings in the manifest and reports: every byte outside
// printable ASCII, space and '%' become %XX.
std::string escape(const std::string& text);
std::optional<std::string> unescape(const std::string& text);
// "64,1536,1024"; "-" for an empty list.
std::string formatDims(const std::vector<int64_t>& dims);
std::optional<std::vector<int64_t>> parseDims(const std::string& text);

int64_t volume(const std::vector<int64_t>& dims);

// Every tensor of the manifest covered exactly once by its slices: each slice
// inside the global shape, no two overlapping, no element missing. Time
// linear in the number of slices for slices that form a grid (what layouts
// produce). CheckpointError naming the key, the ranks and the region.
void checkCoverage(const Manifest& manifest, int rank);

}  // namespace bulkhead::checkpoint
