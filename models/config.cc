#include "models/config.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "runtime/errors.h"

namespace bulkhead::models {
namespace {

using Json = nlohmann::json;

// Field access with errors that name the file and the field.
class Fields {
 public:
  Fields(const Json& json, std::string source) : json_(json), source_(std::move(source)) {}

  [[noreturn]] void refuse(const std::string& field, const std::string& problem, const std::string& expected) const {
    throw ConfigError(fmt::format("{}: field {}: {}", source_, field, problem), {.expected = expected});
  }
  bool has(const std::string& field) const { return json_.contains(field) && !json_.at(field).is_null(); }
  const Json* find(const std::string& field) const { return has(field) ? &json_.at(field) : nullptr; }

  // Counts and sizes: at most 2^30 (2^16 layers), so that no product of two overflows.
  int64_t integer(const std::string& field, std::optional<int64_t> fallback, int64_t minimum,
                  int64_t maximum = int64_t{1} << 30) const {
    const std::string range = fmt::format("an integer from {} to {}", minimum, maximum);
    const Json* value = find(field);
    if (!value) {
      if (fallback) return *fallback;
      refuse(field, "missing", range);
    }
    if (!value->is_number_integer()) refuse(field, fmt::format("{} is not an integer", value->dump()), range);
    if (value->is_number_unsigned() && value->get<uint64_t>() > static_cast<uint64_t>(maximum))
      refuse(field, fmt::format("{} is above {}", value->dump(), maximum), range);
    const auto n = value->get<int64_t>();
    if (n < minimum) refuse(field, fmt::format("{} is below {}", n, minimum), range);
    if (n > maximum) refuse(field, fmt::format("{} is above {}", n, maximum), range);
    return n;
  }
  double number(const std::string& field, double fallback, double minimum) const {
    const Json* value = find(field);
    if (!value) return fallback;
    if (!value->is_number()) refuse(field, fmt::format("{} is not a number", value->dump()), "a number");
    const auto x = value->get<double>();
    if (!(x >= minimum)) refuse(field, fmt::format("{} is below {}", x, minimum), fmt::format("at least {}", minimum));
    return x;
  }
  bool boolean(const std::string& field, bool fallback) const {
    const Json* value = find(field);
    if (!value) return fallback;
    if (!value->is_boolean()) refuse(field, fmt::format("{} is not true or false", value->dump()), "true or false");
    return value->get<bool>();
  }
  std::string string(const std::string& field, const std::string& fallback) const {
    const Json* value = find(field);
    if (!value) return fallback;
    if (!value->is_string()) refuse(field, fmt::format("{} is not a string", value->dump()), "a string");
    return value->get<std::string>();
  }
  // A field that must hold `want` (or be absent or null) for the model Bulkhead implements.
  void require(const std::string& field, const Json& want, const std::string& why) const {
    const Json* value = find(field);
    if (value && *value != want)
      refuse(field, fmt::format("{} is not implemented ({})", value->dump(), why),
             fmt::format("{} or no such field", want.dump()));
  }
  const std::string& source() const { return source_; }

 private:
  const Json& json_;
  std::string source_;
};

// RoPE: the default (unscaled) kind only; theta from transformers v5's rope_parameters or v4's rope_theta.
double ropeTheta(const Fields& fields, double fallback) {
  fields.require("partial_rotary_factor", 1.0, "RoPE over the whole head_dim");
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    const Json* rope = fields.find(field);
    if (!rope) continue;
    if (!rope->is_object()) fields.refuse(field, fmt::format("{} is not an object", rope->dump()), "an object or null");
    for (const char* kind : {"rope_type", "type"}) {
      if (rope->contains(kind) && rope->at(kind) != "default")
        fields.refuse(fmt::format("{}.{}", field, kind),
                      fmt::format("{} is not implemented (only unscaled RoPE is)", rope->at(kind).dump()),
                      "\"default\", or no scaling");
    }
    if (rope->contains("rope_theta")) {
      const Json& theta = rope->at("rope_theta");
      if (!theta.is_number() || !(theta.get<double>() > 0))
        fields.refuse(fmt::format("{}.rope_theta", field), fmt::format("{} is not a positive number", theta.dump()),
                      "a positive number");
      return theta.get<double>();
    }
  }
  return fields.number("rope_theta", fallback, 1.0);
}

// The fields both families share.
void readCommon(const Fields& fields, DecoderConfig& config) {
  config.vocab = fields.integer("vocab_size", std::nullopt, 1);
  config.hidden = fields.integer("hidden_size", std::nullopt, 1);
  config.layers = static_cast<int>(fields.integer("num_hidden_layers", std::nullopt, 1, 1 << 16));
  config.heads = static_cast<int>(fields.integer("num_attention_heads", std::nullopt, 1));
  config.kvHeads = static_cast<int>(fields.integer("num_key_value_heads", std::nullopt, 1));
  if (config.heads % config.kvHeads != 0)
    fields.refuse("num_key_value_heads",
                  fmt::format("{} does not divide num_attention_heads {}", config.kvHeads, config.heads),
                  "a divisor of num_attention_heads");
  if (fields.has("head_dim")) {
    config.headDim = fields.integer("head_dim", std::nullopt, 2);
  } else {
    if (config.hidden % config.heads != 0)
      fields.refuse("head_dim",
                    fmt::format("absent, and hidden_size {} is no multiple of num_attention_heads {}", config.hidden,
                                config.heads),
                    "head_dim given, or hidden_size a multiple of the heads");
    config.headDim = config.hidden / config.heads;
  }
  if (config.headDim % 2 != 0)
    fields.refuse("head_dim", fmt::format("{} is odd: RoPE rotates halves", config.headDim), "an even head_dim");
  config.maxPositions = fields.integer("max_position_embeddings", int64_t{0}, 0);
  config.tieEmbeddings = fields.boolean("tie_word_embeddings", false);
  config.routerAuxLossCoef = fields.number("router_aux_loss_coef", 0.001, 0.0);
  const std::string act = fields.string("hidden_act", "silu");
  if (act != "silu") fields.refuse("hidden_act", fmt::format("\"{}\" is not implemented", act), "\"silu\"");
  fields.require("attention_dropout", 0.0, "no dropout");
  fields.require("mlp_bias", false, "no MLP biases");
}

void readQwen3Moe(const Fields& fields, DecoderConfig& config) {
  readCommon(fields, config);
  config.ropeTheta = ropeTheta(fields, 10000.0);
  config.rmsEps = fields.number("rms_norm_eps", 1e-6, 0.0);
  config.attentionBias = fields.boolean("attention_bias", false);
  config.intermediate = fields.integer("intermediate_size", std::nullopt, 1);
  if (fields.boolean("use_sliding_window", false))
    fields.refuse("use_sliding_window", "true is not implemented (attention is over the whole causal prefix)", "false");
  if (const Json* types = fields.find("layer_types")) {
    for (const Json& type : *types)
      if (type != "full_attention")
        fields.refuse("layer_types", fmt::format("{} is not implemented", type.dump()), "\"full_attention\" layers");
  }
  const bool old = fields.has("num_experts"), fresh = fields.has("num_local_experts");
  config.expertsField = old ? "num_experts" : "num_local_experts";
  config.experts = static_cast<int>(fields.integer(config.expertsField, int64_t{0}, 0));
  if (old && fresh && fields.integer("num_local_experts", std::nullopt, 0) != config.experts)
    fields.refuse("num_local_experts", "differs from num_experts", "one expert count");
  const int sparseStep = static_cast<int>(fields.integer("decoder_sparse_step", int64_t{1}, 1));
  std::vector<bool> denseOnly(config.layers, false);
  if (const Json* only = fields.find("mlp_only_layers")) {
    if (!only->is_array()) fields.refuse("mlp_only_layers", fmt::format("{} is not a list", only->dump()), "a list");
    for (const Json& layer : *only) {
      if (!layer.is_number_integer() || layer.get<int64_t>() < 0 || layer.get<int64_t>() >= config.layers)
        fields.refuse("mlp_only_layers", fmt::format("{} is no layer of {}", layer.dump(), config.layers),
                      "layer indices below num_hidden_layers");
      denseOnly[layer.get<int64_t>()] = true;
    }
  }
  for (int layer = 0; layer < config.layers; ++layer)
    config.moeLayers.push_back(!denseOnly[layer] && config.experts > 0 && (layer + 1) % sparseStep == 0);
  config.qkNorm = true;
  config.normTopK = fields.boolean("norm_topk_prob", false);
  if (config.experts > 0) {
    config.topK = static_cast<int>(fields.integer("num_experts_per_tok", std::nullopt, 1));
    config.moeIntermediate = fields.integer("moe_intermediate_size", std::nullopt, 1);
  }
}

void readMixtral(const Fields& fields, DecoderConfig& config) {
  readCommon(fields, config);
  config.ropeTheta = ropeTheta(fields, 1e6);
  config.rmsEps = fields.number("rms_norm_eps", 1e-5, 0.0);
  if (const Json* window = fields.find("sliding_window"))
    fields.refuse("sliding_window",
                  fmt::format("{} is not implemented (attention is over the whole causal prefix)", window->dump()),
                  "null");
  fields.require("router_jitter_noise", 0.0, "no router jitter");
  config.experts = static_cast<int>(fields.integer("num_local_experts", std::nullopt, 1));
  config.topK = static_cast<int>(fields.integer("num_experts_per_tok", std::nullopt, 1));
  config.moeIntermediate = fields.integer("intermediate_size", std::nullopt, 1);
  config.intermediate = config.moeIntermediate;
  config.moeLayers.assign(config.layers, true);
  config.qkNorm = false;
  config.normTopK = true;
  config.attentionBias = false;
}

}  // namespace

DecoderConfig parseDecoderConfig(const std::string& text, const std::string& source) {
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::parse_error& error) {
    throw ConfigError(fmt::format("{}: not JSON: {}", source, error.what()),
                      {.expected = "a Hugging Face config.json (what save_pretrained writes)"});
  }
  if (!json.is_object())
    throw ConfigError(fmt::format("{}: not a JSON object", source), {.expected = "a Hugging Face config.json"});
  const Fields fields(json, source);
  DecoderConfig config;
  config.modelType = fields.string("model_type", "");
  if (config.modelType == "qwen3_moe") {
    config.family = Family::Qwen3Moe;
    readQwen3Moe(fields, config);
  } else if (config.modelType == "mixtral") {
    config.family = Family::Mixtral;
    readMixtral(fields, config);
  } else {
    fields.refuse("model_type",
                  config.modelType.empty() ? "missing" : fmt::format("\"{}\" is not implemented", config.modelType),
                  "\"qwen3_moe\" or \"mixtral\"");
  }
  if (config.experts > 0 && config.topK > config.experts)
    fields.refuse("num_experts_per_tok", fmt::format("{} exceeds the {} experts", config.topK, config.experts),
                  "at most the expert count");
  config.text = text;
  return config;
}

DecoderConfig loadDecoderConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw IoError(fmt::format("cannot read the model config {}", path),
                  {.expected = "a readable config.json (a Hugging Face model folder holds one)"});
  std::stringstream text;
  text << in.rdbuf();
  return parseDecoderConfig(text.str(), path);
}

int64_t parameterCount(const DecoderConfig& c) {
  const int64_t attention = c.hidden * c.headDim * (2 * c.heads + 2 * c.kvHeads) +
                            (c.attentionBias ? c.headDim * (c.heads + 2 * c.kvHeads) + c.hidden : 0) +
                            (c.qkNorm ? 2 * c.headDim : 0) + 2 * c.hidden;
  int64_t total = c.vocab * c.hidden * (c.tieEmbeddings ? 1 : 2) + c.hidden;
  for (bool moe : c.moeLayers)
    total +=
        attention + (moe ? c.experts * (3 * c.hidden * c.moeIntermediate + c.hidden) : 3 * c.hidden * c.intermediate);
  return total;
}

int64_t activeParameterCount(const DecoderConfig& c) {
  DecoderConfig active = c;
  active.experts = c.topK;
  int64_t count = parameterCount(active);
  for (bool moe : c.moeLayers)
    if (moe) count += static_cast<int64_t>(c.experts - c.topK) * c.hidden;  // every router row is used
  return count;
}

}  // namespace bulkhead::models
