#include "models/hf_weights.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "checkpoint/safetensors_source.h"
#include "runtime/errors.h"

namespace bulkhead::models {
namespace {

using checkpoint::SafetensorsFile;
using checkpoint::SafetensorsTensor;

struct Expected {
  std::vector<int64_t> shape;
  std::string fields;  // the config fields behind the shape
};

// One block of a folder's tensor into (a view of) a parameter.
struct Read {
  std::string name;
  std::vector<int64_t> offsets, sizes;
  at::Tensor target;
};

class Folder {
 public:
  explicit Folder(const std::string& path) : path_(path), source_(checkpoint::openSafetensorsSource(path)) {
    for (const auto& [file, tensor] : source_.tensors) byName_[tensor->name] = {file, tensor};
  }
  bool has(const std::string& name) const { return byName_.count(name) > 0; }
  std::pair<const SafetensorsFile*, const SafetensorsTensor*> at(const std::string& name) const {
    return byName_.at(name);
  }
  const std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsTensor*>>& tensors() const {
    return byName_;
  }
  const std::string& path() const { return path_; }
  int64_t bytes() const { return source_.bytes; }

 private:
  std::string path_;
  checkpoint::SafetensorsSource source_;
  std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsTensor*>> byName_;
};

// Where a layer's MoE block lives in the folder, and in which form.
struct ExpertNames {
  std::string prefix;  // "model.layers.3.mlp" or Mixtral's "model.layers.3.block_sparse_moe"
  bool fused = false;
  const char* projections[3];  // gate, up, down

  std::string router() const { return prefix + ".gate.weight"; }
  std::string perExpert(int expert, int projection) const {
    return fmt::format("{}.experts.{}.{}.weight", prefix, expert, projections[projection]);
  }
  std::string gateUp() const { return prefix + ".experts.gate_up_proj"; }
  std::string down() const { return prefix + ".experts.down_proj"; }
};

ExpertNames expertNames(const DecoderConfig& config, const Folder& folder, int layer) {
  ExpertNames names{.prefix = fmt::format("model.layers.{}.mlp", layer),
                    .projections = {"gate_proj", "up_proj", "down_proj"}};
  if (config.family == Family::Mixtral) {
    const std::string mixtral = fmt::format("model.layers.{}.block_sparse_moe", layer);
    if (!folder.has(names.gateUp()) && !folder.has(names.router())) names.prefix = mixtral;
    names.projections[0] = "w1";
    names.projections[1] = "w3";
    names.projections[2] = "w2";
  }
  names.fused = folder.has(names.gateUp());
  return names;
}

void expectAttention(const DecoderConfig& c, const std::string& p, std::map<std::string, Expected>& e) {
  const int64_t q = c.heads * c.headDim, kv = c.kvHeads * c.headDim;
  const std::string qFields = "num_attention_heads x head_dim", kvFields = "num_key_value_heads x head_dim";
  e[p + ".q_proj.weight"] = {{q, c.hidden}, qFields + ", hidden_size"};
  e[p + ".k_proj.weight"] = {{kv, c.hidden}, kvFields + ", hidden_size"};
  e[p + ".v_proj.weight"] = {{kv, c.hidden}, kvFields + ", hidden_size"};
  e[p + ".o_proj.weight"] = {{c.hidden, q}, "hidden_size, " + qFields};
  if (c.attentionBias) {
    e[p + ".q_proj.bias"] = {{q}, qFields + " (attention_bias)"};
    e[p + ".k_proj.bias"] = {{kv}, kvFields + " (attention_bias)"};
    e[p + ".v_proj.bias"] = {{kv}, kvFields + " (attention_bias)"};
    e[p + ".o_proj.bias"] = {{c.hidden}, "hidden_size (attention_bias)"};
  }
  if (c.qkNorm) {
    e[p + ".q_norm.weight"] = {{c.headDim}, "head_dim"};
    e[p + ".k_norm.weight"] = {{c.headDim}, "head_dim"};
  }
}

void expectExperts(const DecoderConfig& c, const ExpertNames& n, std::map<std::string, Expected>& e) {
  const std::string& experts = c.expertsField;
  const std::string ffn = c.family == Family::Mixtral ? "intermediate_size" : "moe_intermediate_size";
  e[n.router()] = {{c.experts, c.hidden}, experts + ", hidden_size"};
  const int64_t f = c.moeIntermediate;
  if (n.fused) {
    e[n.gateUp()] = {{c.experts, 2 * f, c.hidden}, fmt::format("{}, 2 x {}, hidden_size", experts, ffn)};
    e[n.down()] = {{c.experts, c.hidden, f}, fmt::format("{}, hidden_size, {}", experts, ffn)};
    return;
  }
  for (int expert = 0; expert < c.experts; ++expert) {
    const std::string why = fmt::format("expert {} of {} ({})", expert, c.experts, experts);
    e[n.perExpert(expert, 0)] = {{f, c.hidden}, fmt::format("{}, hidden_size; {}", ffn, why)};
    e[n.perExpert(expert, 1)] = {{f, c.hidden}, fmt::format("{}, hidden_size; {}", ffn, why)};
    e[n.perExpert(expert, 2)] = {{c.hidden, f}, fmt::format("hidden_size, {}; {}", ffn, why)};
  }
}

// Every tensor the whole model reads from the folder, with its shape.
std::map<std::string, Expected> expectedTensors(const DecoderConfig& c, const Folder& folder) {
  std::map<std::string, Expected> e;
  e["model.embed_tokens.weight"] = {{c.vocab, c.hidden}, "vocab_size, hidden_size"};
  if (!c.tieEmbeddings) e["lm_head.weight"] = {{c.vocab, c.hidden}, "vocab_size, hidden_size"};
  e["model.norm.weight"] = {{c.hidden}, "hidden_size"};
  for (int layer = 0; layer < c.layers; ++layer) {
    const std::string p = fmt::format("model.layers.{}", layer);
    e[p + ".input_layernorm.weight"] = {{c.hidden}, "hidden_size"};
    e[p + ".post_attention_layernorm.weight"] = {{c.hidden}, "hidden_size"};
    expectAttention(c, p + ".self_attn", e);
    if (c.moeLayers[layer]) {
      expectExperts(c, expertNames(c, folder, layer), e);
    } else {
      const std::string why = "intermediate_size, hidden_size (a dense layer: mlp_only_layers, decoder_sparse_step)";
      e[p + ".mlp.gate_proj.weight"] = {{c.intermediate, c.hidden}, why};
      e[p + ".mlp.up_proj.weight"] = {{c.intermediate, c.hidden}, why};
      e[p + ".mlp.down_proj.weight"] = {
          {c.hidden, c.intermediate},
          "hidden_size, intermediate_size (a dense layer: mlp_only_layers, decoder_sparse_step)"};
    }
  }
  return e;
}

bool ignored(const DecoderConfig& c, const std::string& name) {
  const std::string buffer = ".rotary_emb.inv_freq";  // written by old transformers; recomputed here
  if (name.size() > buffer.size() && name.compare(name.size() - buffer.size(), buffer.size(), buffer) == 0) return true;
  return c.tieEmbeddings && name == "lm_head.weight";  // tied: the embedding is the output layer
}

// The whole folder against the whole model, before anything is read.
void checkFolder(const DecoderConfig& c, const Folder& folder, const std::map<std::string, Expected>& expected) {
  const std::string hint =
      "a folder save_pretrained wrote for this config.json (or the config that matches the weights)";
  for (const auto& [name, want] : expected) {
    if (!folder.has(name))
      throw CheckpointError(fmt::format("{}: tensor '{}' is missing: the config ({} = [{}]) calls for it",
                                        folder.path(), name, want.fields, fmt::join(want.shape, ", ")),
                            {.expected = hint});
    const SafetensorsTensor& got = *folder.at(name).second;
    if (got.shape != want.shape)
      throw CheckpointError(fmt::format("{}: tensor '{}' has shape [{}], but the config gives [{}] ({})", folder.path(),
                                        name, fmt::join(got.shape, ", "), fmt::join(want.shape, ", "), want.fields),
                            {.expected = hint});
    if (!at::isFloatingType(got.dtype))
      throw CheckpointError(fmt::format("{}: tensor '{}' is {}, not a floating-point type", folder.path(), name,
                                        c10::toString(got.dtype)),
                            {.expected = "float64, float32, float16 or bfloat16 weights"});
  }
  for (const auto& [name, where] : folder.tensors())
    if (!expected.count(name) && !ignored(c, name))
      throw CheckpointError(fmt::format("{}: tensor '{}' ({}) has no place in a {} model of this config", folder.path(),
                                        name, where.first->path(), c.modelType),
                            {.expected = hint});
}

int layerOf(const std::string& name) {
  int layer = -1;
  std::sscanf(name.c_str(), "model.layers.%d.", &layer);
  return layer;
}

bool endsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// This rank's reads for one expert tensor: w13 [E, 2, F, H] or w2 [E, H, F] slices.
void expertReads(const parallel::Parameter& p, const ExpertNames& n, int64_t ffn, std::vector<Read>& reads) {
  const bool w13 = endsWith(p.name, ".w13");
  const at::Tensor& local = p.tensor;
  const int64_t firstExpert = p.shard.offsets[0], localExperts = local.size(0);
  // w13 [E, 2, F, H] and w2 [E, H, F] both hold their F slice in dimension 2.
  const int64_t fBegin = p.shard.offsets[2], fLocal = local.size(2), hidden = local.size(w13 ? 3 : 1);
  for (int64_t le = 0; le < localExperts; ++le) {
    const int expert = static_cast<int>(firstExpert + le);
    if (w13) {
      for (int j = 0; j < 2; ++j) {
        const at::Tensor target = local[le][j];
        if (n.fused)
          reads.push_back({n.gateUp(), {expert, j * ffn + fBegin, 0}, {1, fLocal, hidden}, target.unsqueeze(0)});
        else
          reads.push_back({n.perExpert(expert, j), {fBegin, 0}, {fLocal, hidden}, target});
      }
    } else if (n.fused) {
      reads.push_back({n.down(), {expert, 0, fBegin}, {1, hidden, fLocal}, local[le].unsqueeze(0)});
    } else {
      reads.push_back({n.perExpert(expert, 2), {0, fBegin}, {hidden, fLocal}, local[le]});
    }
  }
}

std::vector<Read> readsOf(const Decoder& model, const Folder& folder) {
  std::vector<Read> reads;
  const DecoderConfig& c = model.config();
  for (const parallel::Parameter& p : model.parameters()) {
    const int layer = layerOf(p.name);
    if (layer >= 0 && (endsWith(p.name, ".mlp.experts.w13") || endsWith(p.name, ".mlp.experts.w2"))) {
      expertReads(p, expertNames(c, folder, layer), c.moeIntermediate, reads);
    } else if (layer >= 0 && endsWith(p.name, ".mlp.router.weight")) {
      reads.push_back({expertNames(c, folder, layer).router(), p.shard.offsets, p.tensor.sizes().vec(), p.tensor});
    } else {
      reads.push_back({p.name, p.shard.offsets, p.tensor.sizes().vec(), p.tensor});
    }
  }
  return reads;
}

// One read in pieces of at most kMaxReadBytes of the file's dtype along its outermost dimension of more
// than one row, each read into one staging buffer per dtype and converted into its part of the target: the
// host holds that buffer beside the model, whatever the tensor's size (a whole embedding block would be
// hundreds of MB), and allocates nothing per piece.
constexpr int64_t kMaxReadBytes = 8 << 20;

int64_t readInPieces(const checkpoint::SafetensorsFile& file, const checkpoint::SafetensorsTensor& tensor,
                     const Read& read, std::map<at::ScalarType, at::Tensor>& staging) {
  at::Tensor& buffer = staging[tensor.dtype];
  if (!buffer.defined())
    buffer = at::empty({kMaxReadBytes / static_cast<int64_t>(c10::elementSize(tensor.dtype))},
                       at::TensorOptions(tensor.dtype));
  const at::Tensor target = read.target.view(read.sizes);
  if (read.sizes.empty()) {  // a scalar
    target.copy_(file.readBlock(tensor, read.offsets, read.sizes, buffer));
    return static_cast<int64_t>(c10::elementSize(tensor.dtype));
  }
  size_t dim = 0;
  while (dim + 1 < read.sizes.size() && read.sizes[dim] == 1) ++dim;
  const int64_t extent = read.sizes[dim];
  int64_t rowBytes = static_cast<int64_t>(c10::elementSize(tensor.dtype));
  for (size_t d = dim + 1; d < read.sizes.size(); ++d) rowBytes *= read.sizes[d];
  const int64_t rows = std::max<int64_t>(1, kMaxReadBytes / std::max<int64_t>(rowBytes, 1));
  int64_t bytes = 0;
  for (int64_t begin = 0; begin < extent; begin += rows) {
    std::vector<int64_t> offsets = read.offsets, sizes = read.sizes;
    offsets[dim] += begin;
    sizes[dim] = std::min(rows, extent - begin);
    const at::Tensor piece = file.readBlock(tensor, offsets, sizes, buffer);
    target.narrow(static_cast<int64_t>(dim), begin, sizes[dim]).copy_(piece);
    bytes += piece.numel() * piece.element_size();
  }
  return bytes;
}

}  // namespace

HfLoadReport loadHfWeights(Decoder& model, const std::string& path) {
  const auto start = std::chrono::steady_clock::now();
  const Folder folder(path);
  const std::map<std::string, Expected> expected = expectedTensors(model.config(), folder);
  checkFolder(model.config(), folder, expected);
  const std::vector<Read> reads = readsOf(model, folder);
  for (const Read& read : reads)
    if (!expected.count(read.name))
      throw ConfigError(
          fmt::format("model parameter slice reads '{}', which the model's config does not list", read.name),
          {.expected = "the parameters of a Decoder built from the same config"});
  HfLoadReport report;
  report.folderBytes = folder.bytes();
  const at::NoGradGuard noGrad;
  std::map<at::ScalarType, at::Tensor> staging;
  for (const Read& read : reads) {
    const auto [file, tensor] = folder.at(read.name);
    report.bytesRead += readInPieces(*file, *tensor, read, staging);
    ++report.tensors;
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace bulkhead::models
