#pragma once
// What `bulkhead-ckpt export` writes for a checkpoint of a Hugging Face model (one whose user state holds
// the model's config.json under kHfConfigKey, as train_moe --hf-model and --model-config save it): the key
// map from Bulkhead's parameter names to the per-expert names save_pretrained writes, and the config.json
// and generation_config.json that let AutoModelForCausalLM.from_pretrained load the export.

#include <map>
#include <string>

#include "models/config.h"

namespace bulkhead::models {

// The checkpoint user-state entry that holds a model's config.json.
inline constexpr const char* kHfConfigKey = "hf_config";

struct HfExport {
  std::string keyMap;                        // a bulkhead-keymap 1 document (checkpoint/key_map.h)
  std::map<std::string, std::string> files;  // config.json, generation_config.json
};

// ConfigError (naming the field) when `configText` is not a config this library implements.
HfExport hfExport(const std::string& configText, const std::string& source);

}  // namespace bulkhead::models
