#pragma once
// A decoder-only MoE language model's shape, read from a Hugging Face config.json: the Qwen3-MoE
// (`qwen3_moe`) and Mixtral (`mixtral`) families (docs/models.md).
//
// Contract:
// - Fields keep transformers' meaning and defaults (v4 and v5 spellings alike: `rope_theta` or
//   `rope_parameters.rope_theta`, `num_experts` or `num_local_experts`).
// - Anything the model does not implement is refused before anything is allocated: another
//   `model_type`, a `rope_scaling` or rope type other than the default, a sliding window switched on,
//   an activation other than SiLU, dropout, router jitter. The ConfigError names the field, its value and
//   what would be accepted.
// - `text` is kept as read, so that an export writes the same config.json back.

#include <cstdint>
#include <string>
#include <vector>

namespace bulkhead::models {

enum class Family { Qwen3Moe, Mixtral };

struct DecoderConfig {
  Family family = Family::Qwen3Moe;
  std::string modelType = "qwen3_moe";
  int64_t vocab = 0;
  int64_t hidden = 0;
  int layers = 0;
  int heads = 0;
  int kvHeads = 0;
  int64_t headDim = 0;                             // the config's head_dim, else hidden / heads
  int64_t intermediate = 0;                        // the dense MLP layers' hidden size
  int64_t moeIntermediate = 0;                     // each expert's hidden size
  int experts = 0;                                 // 0: every layer dense
  std::string expertsField = "num_local_experts";  // the field that gave it (Qwen3 in v4: num_experts)
  int topK = 0;
  bool normTopK = true;         // renormalise the top-k weights (Mixtral always)
  std::vector<bool> moeLayers;  // per layer: a MoE block, else a dense MLP
  bool tieEmbeddings = false;
  bool attentionBias = false;  // q, k, v and o projections
  bool qkNorm = true;          // RMSNorm of q and k over head_dim (Qwen3)
  double rmsEps = 1e-6;
  double ropeTheta = 10000.0;
  int64_t maxPositions = 0;
  double routerAuxLossCoef = 0.001;
  std::string text;  // config.json as read
};

// ConfigError (exit code 2) naming `source` and the field for a document that is not JSON, a family
// Bulkhead does not implement, a missing or out-of-range field, or an unsupported value.
DecoderConfig parseDecoderConfig(const std::string& text, const std::string& source);
// parseDecoderConfig of a file; IoError when it cannot be read.
DecoderConfig loadDecoderConfig(const std::string& path);

// Parameters in all, and those one token activates (top-k experts), from the shape alone.
int64_t parameterCount(const DecoderConfig& config);
int64_t activeParameterCount(const DecoderConfig& config);

}  // namespace bulkhead::models
