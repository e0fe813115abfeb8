#pragma once
// Whole tensors of one committed checkpoint, each assembled from its saved
// slices whatever layout saved them, one tensor at a time (memory: the
// tensor asked for). Every chunk read is verified against its checksum, as a
// load does. One process, no store: what `bulkhead-ckpt export` and `diff`
// read checkpoints with.
//
// Errors: CheckpointError for a missing, damaged or incomplete checkpoint or
// an unknown key, naming the file and the key.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "checkpoint/manifest.h"

namespace bulkhead::checkpoint {

class CheckpointReader;

class WholeTensorReader {
 public:
  // `stepFolder`: a committed step folder (see resolveStepFolder in inspect.h).
  // Reads and checks its manifest and the coverage of every tensor.
  WholeTensorReader(std::string stepFolder, int threads);
  WholeTensorReader(const WholeTensorReader&) = delete;
  WholeTensorReader& operator=(const WholeTensorReader&) = delete;
  ~WholeTensorReader();

  const Manifest& manifest() const { return manifest_; }
  const std::string& folder() const { return folder_; }

  // Tensor `index` of the manifest: a contiguous CPU tensor of its saved
  // dtype and global shape (a 0-dim tensor for a scalar).
  at::Tensor read(int index);
  at::Tensor read(const std::string& key);
  // The same into `storage` (a byte tensor of at least the tensor's bytes,
  // reused from one read to the next: no fresh pages to fault in each time);
  // the result is a view of it.
  at::Tensor read(int index, const at::Tensor& storage);
  int64_t bytesRead() const;

 private:
  std::string folder_;
  Manifest manifest_;
  std::unique_ptr<CheckpointReader> reader_;
};

}  // namespace bulkhead::checkpoint
