#include "models/hf_export.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace bulkhead::models {
namespace {

using OrderedJson = nlohmann::ordered_json;

OrderedJson same(const std::string& name) { return {{"bulkhead", name}, {"hf", name}}; }

// Every parameter a Decoder of `config` holds, under the names save_pretrained writes.
OrderedJson rules(const DecoderConfig& config) {
  const std::string layer = "model.layers.{layer}.";
  OrderedJson tensors =
      OrderedJson::array({same("model.embed_tokens.weight"), same("model.norm.weight"), same("lm_head.weight"),
                          same(layer + "input_layernorm.weight"), same(layer + "post_attention_layernorm.weight")});
  for (const char* projection : {"q_proj", "k_proj", "v_proj", "o_proj"})
    for (const char* kind : {"weight", "bias"}) tensors.push_back(same(layer + "self_attn." + projection + "." + kind));
  for (const char* norm : {"q_norm", "k_norm"}) tensors.push_back(same(layer + "self_attn." + norm + ".weight"));
  for (const char* projection : {"gate_proj", "up_proj", "down_proj"})
    tensors.push_back(same(layer + "mlp." + projection + ".weight"));  // the dense layers
  const bool mixtral = config.family == Family::Mixtral;
  const std::string block = layer + (mixtral ? "block_sparse_moe." : "mlp.");
  const OrderedJson gateUp = mixtral ? OrderedJson::array({"w1", "w3"}) : OrderedJson::array({"gate_proj", "up_proj"});
  tensors.push_back({{"bulkhead", layer + "mlp.router.weight"}, {"hf", block + "gate.weight"}});
  tensors.push_back({{"bulkhead", layer + "mlp.experts.w13"},
                     {"hf", block + "experts.{expert}.{proj}.weight"},
                     {"split", OrderedJson::array({"expert", {{"proj", gateUp}}})}});
  tensors.push_back({{"bulkhead", layer + "mlp.experts.w2"},
                     {"hf", block + "experts.{expert}." + (mixtral ? "w2" : "down_proj") + ".weight"},
                     {"split", OrderedJson::array({"expert"})}});
  return tensors;
}

// transformers' generation defaults for the model: its bos and eos tokens where the config has them.
std::string generationConfig(const std::string& configText) {
  const OrderedJson config = OrderedJson::parse(configText);
  OrderedJson generation = {{"_from_model_config", true}};
  for (const char* field : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (config.contains(field) && !config.at(field).is_null()) generation[field] = config.at(field);
  if (config.contains("transformers_version")) generation["transformers_version"] = config.at("transformers_version");
  return generation.dump(2) + "\n";
}

}  // namespace

HfExport hfExport(const std::string& configText, const std::string& source) {
  const DecoderConfig config = parseDecoderConfig(configText, source);
  const OrderedJson map = {{"format", "bulkhead-keymap 1"},
                           {"description", "a " + config.modelType + " model under the names save_pretrained writes"},
                           {"tensors", rules(config)}};
  return {.keyMap = map.dump(2),
          .files = {{"config.json", configText}, {"generation_config.json", generationConfig(configText)}}};
}

}  // namespace bulkhead::models
