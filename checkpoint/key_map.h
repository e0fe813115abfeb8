#pragma once
// How the keys of a Bulkhead checkpoint map to the tensor names of another
// format (Hugging Face's safetensors), as `bulkhead-ckpt export` and `import`
// apply it. A small JSON file, one rule a family of tensors:
//
//   {"format": "bulkhead-keymap 1",
//    "tensors": [
//      {"bulkhead": "embed.weight", "hf": "model.embed_tokens.weight"},
//      {"bulkhead": "layers.{layer}.moe.experts.w13",
//       "hf": "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
//       "split": ["expert", {"proj": ["gate_proj", "up_proj"]}]},
//      {"bulkhead": "layers.{layer}.proj.weight", "hf": "model.layers.{layer}.proj.weight", "transpose": true}]}
//
// - `{name}` in a pattern stands for a non-negative integer written without
//   leading zeros; the same name takes the same value on both sides. Every
//   name of the Bulkhead pattern appears in the other one.
// - "split" cuts the tensor along its leading dimensions, one entry each, into
//   one tensor per index: a name ("expert") numbers them 0, 1, ...; an object
//   {"proj": ["gate_proj", "up_proj"]} names them (the dimension must have that
//   many entries). Each split name appears in the "hf" pattern only.
// - "transpose": true swaps the last two dimensions of each tensor (for
//   formats whose matrices are stored the other way round).
// - The first rule whose pattern matches decides. Without a map every key
//   keeps its name.
//
// Errors: ConfigError naming the rule and what is wrong with it.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace bulkhead::checkpoint {

class KeyMap {
 public:
  // Every key under its own name.
  static KeyMap identity();
  // `source` names the map in errors.
  static KeyMap parse(const std::string& json, const std::string& source);
  static KeyMap load(const std::string& path);

  // What a Bulkhead tensor becomes: one external tensor per index of the
  // leading `splitDims` dimensions, in row-major order of those indices.
  struct Piece {
    std::string name;
    std::vector<int64_t> index;  // along the split dimensions
  };
  struct Outward {
    int splitDims = 0;
    bool transpose = false;
    std::vector<Piece> pieces;
  };
  // nullopt when no rule covers `key`. ConfigError when the tensor's shape
  // does not fit its rule (too few dimensions, a named split of another size).
  std::optional<Outward> outward(const std::string& key, const std::vector<int64_t>& shape) const;

  // Where an external tensor goes: its Bulkhead key and its index along the
  // split dimensions; splitSizes holds the size of each named split and -1
  // for a numbered one (known once every piece is seen).
  struct Inward {
    std::string key;
    std::vector<int64_t> index;
    std::vector<int64_t> splitSizes;
    bool transpose = false;
  };
  std::optional<Inward> inward(const std::string& name) const;

  bool isIdentity() const { return rules_.empty(); }
  const std::string& source() const { return source_; }

  struct Token {
    bool variable = false;
    std::string text;  // the literal, or the variable's name
  };
  struct Split {
    std::string variable;
    std::vector<std::string> names;  // empty: numbered
  };
  struct Rule {
    std::vector<Token> bulkhead, external;
    std::vector<Split> split;
    bool transpose = false;
  };

 private:
  std::string source_ = "(identity)";
  std::vector<Rule> rules_;
};

}  // namespace bulkhead::checkpoint
