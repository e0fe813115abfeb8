#pragma once
// The safetensors files of a Hugging Face model folder, opened and checked together: its
// model.safetensors.index.json (and optimizer.safetensors.index.json) where there is one, else its
// model.safetensors, else every *.safetensors file in it; or one file. What `bulkhead-ckpt import` and the model loader read.
//
// Every header is checked (safetensors.h). A tensor held by two files, an index naming a file outside the
// folder or a tensor its file does not hold, and a folder without safetensors files are CheckpointErrors.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/safetensors.h"

namespace bulkhead::checkpoint {

struct SafetensorsSource {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  // Every tensor, with its file; the index decides which file holds a tensor where there is one.
  std::vector<std::pair<const SafetensorsFile*, const SafetensorsTensor*>> tensors;
  int64_t bytes = 0;
};

// `source`: a folder or one .safetensors file.
SafetensorsSource openSafetensorsSource(const std::string& source);

}  // namespace bulkhead::checkpoint
