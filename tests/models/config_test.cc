// The Hugging Face config reader: the published Qwen3-30B-A3B and Mixtral-8x7B shapes (as transformers'
// config classes write them, fixtures/hf/configs), each refusal naming its field, and 5,000 mutated
// config.json texts each read or refused with a ConfigError.
#include <fmt/format.h>

#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "models/config.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

namespace {

const std::string kFixtures = BULKHEAD_MODEL_FIXTURES;

std::string readText(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// `text` with the first `"field": value` replaced (or, with an empty value, removed).
std::string withField(std::string text, const std::string& field, const std::string& value) {
  const std::string key = "\"" + field + "\":";
  const size_t at = text.find(key);
  if (at == std::string::npos) {
    REQUIRE(!value.empty());
    return "{" + key + " " + value + ", " + text.substr(text.find('{') + 1);
  }
  size_t end = at + key.size(), depth = 0;
  for (; end < text.size(); ++end) {
    const char c = text[end];
    if (c == '{' || c == '[') ++depth;
    if ((c == '}' || c == ']') && depth-- == 0) break;
    if (c == ',' && depth == 0) break;
  }
  if (value.empty()) return text.substr(0, at) + text.substr(text[end] == ',' ? end + 1 : end);
  return text.substr(0, at) + key + " " + value + text.substr(end);
}

std::string refusal(const std::string& text) {
  try {
    models::parseDecoderConfig(text, "config.json");
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST_CASE("the published Qwen3-30B-A3B and Mixtral-8x7B configs read with their shapes and sizes") {
  const auto qwen = models::loadDecoderConfig(kFixtures + "/configs/qwen3_30b_a3b.json");
  CHECK(qwen.family == models::Family::Qwen3Moe);
  CHECK((qwen.vocab == 151936 && qwen.hidden == 2048 && qwen.layers == 48));
  CHECK((qwen.heads == 32 && qwen.kvHeads == 4 && qwen.headDim == 128));  // head_dim != hidden / heads
  CHECK((qwen.experts == 128 && qwen.topK == 8 && qwen.moeIntermediate == 768 && qwen.normTopK));
  CHECK((qwen.qkNorm && !qwen.tieEmbeddings && !qwen.attentionBias && qwen.ropeTheta == 1e6));
  CHECK(std::count(qwen.moeLayers.begin(), qwen.moeLayers.end(), true) == 48);
  // Published: 30.5B parameters, 3.3B active.
  CHECK(std::abs(models::parameterCount(qwen) / 1e9 - 30.5) < 0.1);
  CHECK(std::abs(models::activeParameterCount(qwen) / 1e9 - 3.3) < 0.1);

  const auto mixtral = models::loadDecoderConfig(kFixtures + "/configs/mixtral_8x7b.json");
  CHECK(mixtral.family == models::Family::Mixtral);
  CHECK((mixtral.experts == 8 && mixtral.topK == 2 && mixtral.moeIntermediate == 14336 && mixtral.normTopK));
  CHECK((!mixtral.qkNorm && mixtral.kvHeads == 8 && mixtral.headDim == 128));
  // Published: 46.7B parameters, 12.9B active.
  CHECK(std::abs(models::parameterCount(mixtral) / 1e9 - 46.7) < 0.1);
  CHECK(std::abs(models::activeParameterCount(mixtral) / 1e9 - 12.9) < 0.1);
}

TEST_CASE("the fixtures' configs: dense layers where mlp_only_layers and decoder_sparse_step say") {
  const auto mixed = models::loadDecoderConfig(kFixtures + "/qwen3_moe_mixed/config.json");
  CHECK(mixed.moeLayers == std::vector<bool>{true, false, true});
  CHECK((mixed.headDim == 16 && mixed.hidden / mixed.heads == 8));
  const auto kv1 = models::loadDecoderConfig(kFixtures + "/qwen3_moe_kv1/config.json");
  CHECK(kv1.moeLayers == std::vector<bool>{false, true});
  CHECK((kv1.kvHeads == 1 && kv1.tieEmbeddings && kv1.attentionBias && !kv1.normTopK));
}

TEST_CASE("what the model does not implement is a ConfigError naming the field") {
  const std::string qwen = readText(kFixtures + "/qwen3_moe_mixed/config.json");
  const std::string mixtral = readText(kFixtures + "/mixtral/config.json");
  struct Case {
    const std::string* base;
    std::string field, value, named;
  };
  const std::vector<Case> cases{
      {&qwen, "model_type", "\"llama\"", "field model_type: \"llama\" is not implemented"},
      {&qwen, "rope_parameters", "{\"rope_type\": \"yarn\", \"rope_theta\": 10000.0, \"factor\": 4.0}",
       "field rope_parameters.rope_type"},
      {&qwen, "rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}", "field rope_scaling.type"},
      {&qwen, "use_sliding_window", "true", "field use_sliding_window"},
      {&mixtral, "sliding_window", "4096", "field sliding_window: 4096"},
      {&mixtral, "router_jitter_noise", "0.01", "field router_jitter_noise"},
      {&qwen, "hidden_act", "\"gelu\"", "field hidden_act"},
      {&qwen, "attention_dropout", "0.1", "field attention_dropout"},
      {&qwen, "hidden_size", "", "field hidden_size: missing"},
      {&qwen, "num_key_value_heads", "3", "field num_key_value_heads: 3 does not divide"},
      {&qwen, "num_experts_per_tok", "9", "field num_experts_per_tok: 9 exceeds the 8 experts"},
      {&qwen, "mlp_only_layers", "[5]", "field mlp_only_layers: 5 is no layer of 3"},
      {&qwen, "head_dim", "15", "field head_dim: 15 is odd"},
      {&qwen, "vocab_size", "\"151\"", "field vocab_size: \"151\" is not an integer"},
  };
  for (const Case& c : cases) {
    INFO(c.field << " = " << c.value);
    const std::string message = refusal(withField(*c.base, c.field, c.value));
    CHECK_THAT(message, bulkhead::testing::Contains(c.named));
  }
  CHECK_THAT(refusal("{\"model_type\": \"qwen3_moe\", "), bulkhead::testing::Contains("config.json: not JSON"));
  CHECK_THAT(refusal("[1, 2]"), bulkhead::testing::Contains("not a JSON object"));
  CHECK(refusal(qwen).empty());
  CHECK(refusal(mixtral).empty());
}

TEST_CASE("5,000 mutated config.json texts are each read or refused with a ConfigError") {
  const std::string base = readText(kFixtures + "/qwen3_moe_mixed/config.json");
  std::mt19937_64 rng(61);
  const std::string alphabet = "{}[]\":,.-0123456789eE truefalsnul";
  int refused = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string text = base;
    for (int edits = 1 + static_cast<int>(rng() % 4); edits > 0; --edits) {
      const size_t at = rng() % text.size();
      switch (rng() % 3) {
        case 0:
          text[at] = alphabet[rng() % alphabet.size()];
          break;
        case 1:
          text.insert(at, 1, alphabet[rng() % alphabet.size()]);
          break;
        default:
          text.erase(at, 1 + rng() % 8);
          break;
      }
    }
    try {
      const models::DecoderConfig config = models::parseDecoderConfig(text, "mutated.json");
      CHECK(config.layers == static_cast<int>(config.moeLayers.size()));
      CHECK(config.headDim % 2 == 0);
    } catch (const ConfigError&) {
      ++refused;
    }
  }
  CHECK(refused > 1000);
}
