#include "checkpoint/key_map.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "checkpoint/fs.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

using Bindings = std::map<std::string, std::string>;
using Choices = std::map<std::string, const std::vector<std::string>*>;

[[noreturn]] void badMap(const std::string& source, const std::string& what) {
  throw ConfigError(fmt::format("key map {}: {}", source, what),
                    {.expected = "{\"format\": \"bulkhead-keymap 1\", \"tensors\": [{\"bulkhead\": ..., \"hf\": ...}, "
                                 "...]} (see docs/checkpoints.md)"});
}

bool validName(const std::string& name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

std::vector<KeyMap::Token> tokenize(const std::string& pattern, const std::string& where) {
  std::vector<KeyMap::Token> tokens;
  size_t pos = 0;
  while (pos < pattern.size()) {
    size_t open = pattern.find('{', pos);
    size_t close = pattern.find('}', pos);
    if (close < open) badMap(where, fmt::format("'}}' without '{{' in '{}'", pattern));
    if (open == std::string::npos) {
      tokens.push_back({false, pattern.substr(pos)});
      break;
    }
    if (open > pos) tokens.push_back({false, pattern.substr(pos, open - pos)});
    close = pattern.find('}', open);
    if (close == std::string::npos) badMap(where, fmt::format("'{{' without '}}' in '{}'", pattern));
    std::string name = pattern.substr(open + 1, close - open - 1);
    if (!validName(name)) badMap(where, fmt::format("'{{{}}}' in '{}' is not a placeholder name", name, pattern));
    if (!tokens.empty() && tokens.back().variable)
      badMap(where, fmt::format("two placeholders without text between them in '{}'", pattern));
    tokens.push_back({true, name});
    pos = close + 1;
  }
  if (tokens.empty()) badMap(where, "an empty pattern");
  return tokens;
}

std::set<std::string> variablesOf(const std::vector<KeyMap::Token>& tokens) {
  std::set<std::string> names;
  for (const auto& token : tokens)
    if (token.variable) names.insert(token.text);
  return names;
}

bool matchFrom(const std::vector<KeyMap::Token>& tokens, size_t t, const std::string& text, size_t pos,
               Bindings& bindings, const Choices& choices) {
  if (t == tokens.size()) return pos == text.size();
  const KeyMap::Token& token = tokens[t];
  auto literal = [&](const std::string& value) {
    return text.compare(pos, value.size(), value) == 0 &&
           matchFrom(tokens, t + 1, text, pos + value.size(), bindings, choices);
  };
  if (!token.variable) return literal(token.text);
  if (auto bound = bindings.find(token.text); bound != bindings.end()) return literal(bound->second);
  auto bind = [&](const std::string& value) {
    bindings[token.text] = value;
    if (matchFrom(tokens, t + 1, text, pos + value.size(), bindings, choices)) return true;
    bindings.erase(token.text);
    return false;
  };
  if (auto choice = choices.find(token.text); choice != choices.end() && !choice->second->empty()) {
    for (const auto& value : *choice->second)
      if (text.compare(pos, value.size(), value) == 0 && bind(value)) return true;
    return false;
  }
  size_t end = pos;
  while (end < text.size() && end - pos < 18 && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
  for (size_t stop = end; stop > pos; --stop) {
    if (stop - pos > 1 && text[pos] == '0') continue;  // no leading zeros: one spelling per number
    if (bind(text.substr(pos, stop - pos))) return true;
  }
  return false;
}

std::string substitute(const std::vector<KeyMap::Token>& tokens, const Bindings& bindings) {
  std::string out;
  for (const auto& token : tokens) out += token.variable ? bindings.at(token.text) : token.text;
  return out;
}

KeyMap::Rule parseRule(const nlohmann::json& entry, const std::string& where) {
  if (!entry.is_object()) badMap(where, "not an object");
  auto text = [&](const char* field) {
    auto it = entry.find(field);
    if (it == entry.end() || !it->is_string()) badMap(where, fmt::format("no \"{}\" pattern", field));
    return it->get<std::string>();
  };
  KeyMap::Rule rule;
  rule.bulkhead = tokenize(text("bulkhead"), where);
  rule.external = tokenize(text("hf"), where);
  if (auto t = entry.find("transpose"); t != entry.end()) {
    if (!t->is_boolean()) badMap(where, "\"transpose\" is not true or false");
    rule.transpose = t->get<bool>();
  }
  std::set<std::string> splitNames;
  if (auto s = entry.find("split"); s != entry.end()) {
    if (!s->is_array()) badMap(where, "\"split\" is not a list");
    for (const auto& dim : *s) {
      KeyMap::Split split;
      if (dim.is_string()) {
        split.variable = dim.get<std::string>();
      } else if (dim.is_object() && dim.size() == 1 && dim.begin().value().is_array()) {
        split.variable = dim.begin().key();
        for (const auto& name : dim.begin().value()) {
          if (!name.is_string() || name.get<std::string>().empty())
            badMap(where, fmt::format("split '{}' names an entry that is not a non-empty string", split.variable));
          split.names.push_back(name.get<std::string>());
        }
        std::set<std::string> distinct(split.names.begin(), split.names.end());
        if (split.names.empty() || distinct.size() != split.names.size())
          badMap(where, fmt::format("split '{}' needs a list of distinct names", split.variable));
      } else {
        badMap(where, "a \"split\" entry is neither a name nor {\"name\": [\"first\", \"second\", ...]}");
      }
      if (!validName(split.variable) || !splitNames.insert(split.variable).second)
        badMap(where, fmt::format("split '{}' is not a placeholder name, or appears twice", split.variable));
      rule.split.push_back(std::move(split));
    }
  }
  const std::set<std::string> inner = variablesOf(rule.bulkhead), outer = variablesOf(rule.external);
  for (const auto& name : inner) {
    if (!outer.count(name)) badMap(where, fmt::format("placeholder '{{{}}}' is missing from the \"hf\" pattern", name));
    if (splitNames.count(name))
      badMap(where, fmt::format("split '{}' appears in the \"bulkhead\" pattern; it belongs in \"hf\" only", name));
  }
  for (const auto& name : outer)
    if (!inner.count(name) && !splitNames.count(name))
      badMap(where,
             fmt::format("placeholder '{{{}}}' of the \"hf\" pattern is neither in \"bulkhead\" nor a split", name));
  for (const auto& name : splitNames)
    if (!outer.count(name)) badMap(where, fmt::format("split '{}' does not appear in the \"hf\" pattern", name));
  return rule;
}

}  // namespace

KeyMap KeyMap::identity() { return KeyMap(); }

KeyMap KeyMap::parse(const std::string& json, const std::string& source) {
  nlohmann::json root = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) badMap(source, "not a JSON object");
  auto format = root.find("format");
  if (format == root.end() || *format != "bulkhead-keymap 1") badMap(source, "\"format\" is not \"bulkhead-keymap 1\"");
  auto tensors = root.find("tensors");
  if (tensors == root.end() || !tensors->is_array() || tensors->empty()) badMap(source, "no \"tensors\" rules");
  KeyMap map;
  map.source_ = source;
  for (size_t i = 0; i < tensors->size(); ++i)
    map.rules_.push_back(parseRule((*tensors)[i], fmt::format("{}, rule {}", source, i + 1)));
  return map;
}

KeyMap KeyMap::load(const std::string& path) {
  int error = 0;
  auto text = fs::readFile(path, &error);
  if (!text) fs::raise(fmt::format("reading key map {}", path), error, -1);
  return parse(*text, path);
}

std::optional<KeyMap::Outward> KeyMap::outward(const std::string& key, const std::vector<int64_t>& shape) const {
  if (rules_.empty()) return Outward{0, false, {{key, {}}}};
  for (size_t r = 0; r < rules_.size(); ++r) {
    const Rule& rule = rules_[r];
    Bindings bindings;
    if (!matchFrom(rule.bulkhead, 0, key, 0, bindings, {})) continue;
    const size_t k = rule.split.size();
    if (shape.size() < k + (rule.transpose ? 2 : 0))
      throw ConfigError(fmt::format("key '{}' of shape [{}] has too few dimensions for rule {} of {} ({} split, "
                                    "transpose {})",
                                    key, fmt::join(shape, ", "), r + 1, source_, k, rule.transpose),
                        {.expected = "a rule that fits the tensor"});
    Outward out{static_cast<int>(k), rule.transpose, {}};
    int64_t total = 1;
    for (size_t d = 0; d < k; ++d) {
      const auto& names = rule.split[d].names;
      if (!names.empty() && static_cast<int64_t>(names.size()) != shape[d])
        throw ConfigError(fmt::format("key '{}': dimension {} has {} entries but rule {} of {} names {}", key, d,
                                      shape[d], r + 1, source_, names.size()),
                          {.expected = "a rule that fits the tensor"});
      total *= shape[d];
    }
    for (int64_t flat = 0; flat < total; ++flat) {
      Piece piece;
      piece.index.resize(k);
      int64_t rest = flat;
      for (size_t d = k; d-- > 0;) {
        piece.index[d] = rest % shape[d];
        rest /= shape[d];
      }
      for (size_t d = 0; d < k; ++d) {
        const auto& split = rule.split[d];
        bindings[split.variable] =
            split.names.empty() ? std::to_string(piece.index[d]) : split.names[static_cast<size_t>(piece.index[d])];
      }
      piece.name = substitute(rule.external, bindings);
      out.pieces.push_back(std::move(piece));
    }
    return out;
  }
  return std::nullopt;
}

std::optional<KeyMap::Inward> KeyMap::inward(const std::string& name) const {
  if (rules_.empty()) return Inward{name, {}, {}, false};
  for (const Rule& rule : rules_) {
    Choices choices;
    for (const auto& split : rule.split) choices[split.variable] = &split.names;
    Bindings bindings;
    if (!matchFrom(rule.external, 0, name, 0, bindings, choices)) continue;
    Inward in{substitute(rule.bulkhead, bindings), {}, {}, rule.transpose};
    for (const auto& split : rule.split) {
      const std::string& value = bindings.at(split.variable);
      if (split.names.empty()) {
        in.index.push_back(std::stoll(value));
        in.splitSizes.push_back(-1);
      } else {
        in.index.push_back(std::find(split.names.begin(), split.names.end(), value) - split.names.begin());
        in.splitSizes.push_back(static_cast<int64_t>(split.names.size()));
      }
    }
    return in;
  }
  return std::nullopt;
}

}  // namespace bulkhead::checkpoint
