// A Hugging Face folder that does not fit its config is refused before anything is loaded: a truncated
// shard, a tensor of another shape, a missing expert and a tensor the model has no place for, each named,
// with the model's parameters untouched. Mutated shard headers and indexes are loaded whole or refused
// with nothing loaded (the "[fuzz]" case also runs under AddressSanitizer, .ci/sanitize.sh).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_weights.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"
#include "tests/support/parallel_helpers.h"

using namespace bulkhead;
namespace stdfs = std::filesystem;

namespace {

const std::string kModelFixtures = BULKHEAD_MODEL_FIXTURES;

// A copy of a fixture folder in a fresh temporary folder.
std::string copyOf(const std::string& name) {
  const stdfs::path to = stdfs::temp_directory_path() / ("bulkhead_hf_" + std::to_string(::getpid()) + "_" + name);
  stdfs::remove_all(to);
  stdfs::copy(kModelFixtures + "/" + name, to, stdfs::copy_options::recursive);
  return to.string();
}

// Rewrites a safetensors file through `edit`, which may drop, add or replace tensors.
void rewrite(const std::string& path,
             const std::function<void(std::vector<std::pair<std::string, at::Tensor>>&)>& edit) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  {
    const checkpoint::SafetensorsFile file(path);
    for (const auto& t : file.header().tensors) tensors.emplace_back(t.name, file.read(t));
  }
  edit(tensors);
  std::vector<checkpoint::SafetensorsTensor> header;
  for (const auto& [name, t] : tensors)
    header.push_back({.name = name, .dtype = t.scalar_type(), .shape = t.sizes().vec()});
  checkpoint::SafetensorsWriter writer(path, header, {{"format", "pt"}});
  for (const auto& [name, t] : tensors) writer.append(t.data_ptr(), t.numel() * t.element_size());
  writer.finish();
}

// loadHfWeights of `folder` into a fresh model of `name`'s config: the error's text, and whether every
// parameter kept its values.
std::pair<std::string, bool> refusal(const std::string& name, const std::string& folder) {
  const models::DecoderConfig config = models::loadDecoderConfig(kModelFixtures + "/" + name + "/config.json");
  const parallel::ProcessGroups groups = testing::makeGroups({});
  models::Decoder model(config, groups, {.dtype = at::kDouble});
  std::vector<at::Tensor> before;
  for (const auto& p : model.parameters()) before.push_back(p.tensor.detach().clone());
  std::string message;
  try {
    models::loadHfWeights(model, folder);
  } catch (const CheckpointError& error) {
    message = error.what();
  }
  bool untouched = true;
  const auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) untouched = untouched && at::equal(params[i].tensor, before[i]);
  stdfs::remove_all(folder);
  return {message, untouched};
}

}  // namespace

TEST_CASE("a folder that does not fit its config is refused, naming the tensor, and nothing is loaded", "[np1]") {
  SECTION("a truncated shard") {
    const std::string folder = copyOf("mixtral");
    const std::string shard = folder + "/model-00003-of-00009.safetensors";
    stdfs::resize_file(shard, stdfs::file_size(shard) - 64);
    const auto [message, untouched] = refusal("mixtral", folder);
    CHECK_THAT(message, bulkhead::testing::Contains("model-00003-of-00009.safetensors"));
    CHECK(untouched);
  }
  SECTION("a tensor of another shape") {
    const std::string folder = copyOf("qwen3_moe_mixed");
    rewrite(folder + "/model.safetensors", [](auto& tensors) {
      for (auto& [name, t] : tensors)
        if (name == "model.layers.0.self_attn.k_proj.weight") t = t.narrow(0, 0, 16).contiguous();
    });
    const auto [message, untouched] = refusal("qwen3_moe_mixed", folder);
    CHECK_THAT(message, bulkhead::testing::Contains("'model.layers.0.self_attn.k_proj.weight' has shape [16, 32]"));
    CHECK_THAT(message, bulkhead::testing::Contains("num_key_value_heads x head_dim, hidden_size"));
    CHECK(untouched);
  }
  SECTION("a missing expert") {
    const std::string folder = copyOf("qwen3_moe_mixed");
    rewrite(folder + "/model.safetensors", [](auto& tensors) {
      std::erase_if(tensors, [](const auto& t) { return t.first == "model.layers.2.mlp.experts.7.up_proj.weight"; });
    });
    const auto [message, untouched] = refusal("qwen3_moe_mixed", folder);
    CHECK_THAT(message, bulkhead::testing::Contains("'model.layers.2.mlp.experts.7.up_proj.weight' is missing"));
    CHECK_THAT(message, bulkhead::testing::Contains("expert 7 of 8 (num_local_experts)"));
    CHECK(untouched);
  }
  SECTION("a tensor the model has no place for") {
    const std::string folder = copyOf("qwen3_moe_kv1");
    rewrite(folder + "/model.safetensors", [](auto& tensors) {
      tensors.emplace_back("model.layers.0.mlp.gate.weight", at::randn({4, 32}, at::kDouble));
    });
    const auto [message, untouched] = refusal("qwen3_moe_kv1", folder);
    CHECK_THAT(message, bulkhead::testing::Contains("'model.layers.0.mlp.gate.weight'"));
    CHECK_THAT(message, bulkhead::testing::Contains("has no place in a qwen3_moe model"));
    CHECK(untouched);
  }
}

namespace {

std::string bytesOf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void writeBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// 1 to 3 edits within the first `span` bytes (a safetensors header, an index): a byte, a JSON token, a
// repeated run, a cut.
std::string mutated(std::string bytes, size_t span, std::mt19937_64& rng) {
  static const std::vector<std::string> tokens{"0",       "-1",      "1e30", "18446744073709551615",
                                               "\"F32\"", "\"I64\"", "[]",   "{}",
                                               "null",    ",",       "]",    "\"model.norm.weight\""};
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int e = 0; e < edits && !bytes.empty(); ++e) {
    const size_t at = rng() % std::min(span, bytes.size());
    switch (rng() % 4) {
      case 0:
        bytes[at] = static_cast<char>(rng());
        break;
      case 1:
        bytes.replace(at, rng() % 6, tokens[rng() % tokens.size()]);
        break;
      case 2:
        bytes.insert(at, bytes.substr(rng() % bytes.size(), rng() % 24));
        break;
      default:
        bytes.resize(at + (rng() % 2 ? 0 : bytes.size() - at - std::min<size_t>(bytes.size() - at, rng() % 4096)));
        break;
    }
  }
  return bytes;
}

}  // namespace

TEST_CASE("mutated shard headers and indexes are loaded whole or refused, with nothing loaded", "[np1][fuzz]") {
  std::mt19937_64 rng(61);
  int loaded = 0, refused = 0;
  for (const std::string name : {"qwen3_moe_kv1", "mixtral"}) {
    const models::DecoderConfig config = models::loadDecoderConfig(kModelFixtures + "/" + name + "/config.json");
    const parallel::ProcessGroups groups = testing::makeGroups({});
    models::Decoder model(config, groups, {.dtype = at::kDouble});
    const std::string folder = copyOf(name);
    // The file the rounds mutate: the single shard, or the index of the sharded folder.
    const std::string target = folder + (name == "mixtral" ? "/model.safetensors.index.json" : "/model.safetensors");
    const std::string pristine = bytesOf(target);
    uint64_t headerEnd = 0;
    for (int i = 7; i >= 0; --i) headerEnd = (headerEnd << 8) | static_cast<unsigned char>(pristine[i]);
    const size_t span = name == "mixtral" ? pristine.size() : static_cast<size_t>(headerEnd) + 8;
    for (int round = 0; round < 300; ++round) {
      writeBytes(target, mutated(pristine, span, rng));
      std::vector<at::Tensor> before;
      for (const auto& p : model.parameters()) before.push_back(p.tensor.detach().clone());
      try {
        models::loadHfWeights(model, folder);
        ++loaded;
      } catch (const Error& error) {  // CheckpointError for what the folder holds, IoError for what cannot be read
        INFO(error.what());
        CHECK((dynamic_cast<const CheckpointError*>(&error) || dynamic_cast<const IoError*>(&error)));
        ++refused;
        const auto params = model.parameters();
        for (size_t i = 0; i < params.size(); ++i) REQUIRE(at::equal(params[i].tensor, before[i]));
      }
    }
    stdfs::remove_all(folder);
  }
  WARN(fmt::format("mutated Hugging Face folders: {} loaded, {} refused with nothing loaded", loaded, refused));
  CHECK(refused > 300);
  CHECK(loaded > 0);
}
