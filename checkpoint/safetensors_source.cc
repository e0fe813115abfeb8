#include "checkpoint/safetensors_source.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <map>
#include <set>

#include "checkpoint/fs.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

bool endsWithSuffix(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

[[noreturn]] void badSafetensorsFolder(const std::string& what) {
  throw CheckpointError(what, {.expected = "safetensors files with every tensor the index names and the map covers"});
}

// The file names an index lists for each tensor; names are checked to stay in the folder.
std::map<std::string, std::string> readIndex(const std::string& path) {
  int error = 0;
  auto text = fs::readFile(path, &error);
  if (!text) fs::raise(fmt::format("reading {}", path), error, -1);
  nlohmann::json root = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object() || !root.contains("weight_map") || !root["weight_map"].is_object())
    badSafetensorsFolder(fmt::format("{} is not a safetensors index (a JSON object with a \"weight_map\")", path));
  std::map<std::string, std::string> files;
  for (const auto& [name, file] : root["weight_map"].items()) {
    if (!file.is_string()) badSafetensorsFolder(fmt::format("{}: the file of '{}' is not a string", path, name));
    const std::string value = file.get<std::string>();
    if (value.empty() || value.find('/') != std::string::npos || value == "." || value == ".." ||
        !endsWithSuffix(value, ".safetensors"))
      badSafetensorsFolder(fmt::format("{}: '{}' names file '{}', which is not a .safetensors file in the same folder",
                                       path, name, value));
    files[name] = value;
  }
  return files;
}

}  // namespace

SafetensorsSource openSafetensorsSource(const std::string& source) {
  SafetensorsSource out;
  std::map<std::string, std::string> indexed;  // name -> file, from the indexes
  std::vector<std::string> paths;
  if (!fs::isDirectory(source)) {
    paths.push_back(source);
  } else {
    bool anyIndex = false;
    for (const char* index : {"model.safetensors.index.json", "optimizer.safetensors.index.json"}) {
      const std::string path = fs::join(source, index);
      if (!fs::exists(path)) continue;
      anyIndex = true;
      for (auto& [name, file] : readIndex(path)) indexed[name] = fs::join(source, file);
    }
    std::set<std::string> unique;
    for (const auto& [name, file] : indexed) unique.insert(file);
    // Without an index: model.safetensors alone where there is one (as transformers reads a folder), else
    // every .safetensors file.
    const std::string single = fs::join(source, "model.safetensors");
    if (!anyIndex && fs::exists(single)) {
      unique.insert(single);
    } else if (!anyIndex) {
      for (const auto& name : fs::list(source, -1))
        if (endsWithSuffix(name, ".safetensors")) unique.insert(fs::join(source, name));
    }
    paths.assign(unique.begin(), unique.end());
    if (paths.empty()) badSafetensorsFolder(fmt::format("{} holds no .safetensors files", source));
  }
  std::map<std::string, const SafetensorsFile*> seen;
  for (const auto& path : paths) {
    out.files.push_back(std::make_unique<SafetensorsFile>(path));
    const SafetensorsFile* file = out.files.back().get();
    for (const auto& tensor : file->header().tensors) {
      auto where = indexed.find(tensor.name);
      if (!indexed.empty() && (where == indexed.end() || where->second != path)) continue;  // the index decides
      if (auto [at, fresh] = seen.emplace(tensor.name, file); !fresh)
        badSafetensorsFolder(fmt::format("tensor '{}' is in both {} and {}", tensor.name, at->second->path(), path));
      out.tensors.emplace_back(file, &tensor);
      out.bytes += tensor.bytes();
    }
  }
  for (const auto& [name, file] : indexed)
    if (!seen.count(name))
      badSafetensorsFolder(fmt::format("the index names tensor '{}' in {}, which does not hold it", name, file));
  return out;
}

}  // namespace bulkhead::checkpoint
