#pragma once
// A Decoder's weights from a Hugging Face model folder (config.json beside model.safetensors, a sharded
// index, or *.safetensors files), at any layout: each rank reads only the bytes of its own slices, so no
// process holds the whole model and nothing is converted first (docs/models.md#loading).
//
// Contract:
// - Both on-disk forms of the experts are read, per layer: one tensor per expert and projection
//   (`mlp.experts.{j}.gate_proj.weight`, what save_pretrained writes; Mixtral's
//   `block_sparse_moe.experts.{j}.w1/w3/w2.weight`) or fused 3D tensors (`mlp.experts.gate_up_proj`
//   [E, 2F, H], gate rows first, and `mlp.experts.down_proj` [E, H, F]).
// - Before any byte is read, the folder is checked against the whole model (not this rank's part alone):
//   a missing tensor, one of another shape than the config gives, or one the model has no place for is a
//   CheckpointError naming the tensor and the config fields behind its shape. Every rank sees the same
//   folder and raises the same error, so nothing is half-loaded.
// - Tensors are converted to the model's dtype as they are read.

#include <cstdint>
#include <string>

#include "models/decoder.h"

namespace bulkhead::models {

struct HfLoadReport {
  int64_t tensors = 0;      // read by this rank (pieces of tensors count once each)
  int64_t bytesRead = 0;    // by this rank
  int64_t folderBytes = 0;  // tensor bytes in the folder
  double seconds = 0;
};

HfLoadReport loadHfWeights(Decoder& model, const std::string& folder);

}  // namespace bulkhead::models
