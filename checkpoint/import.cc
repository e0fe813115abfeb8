// importSafetensors (convert.h): find the files, map every tensor name back to
// its key, reassemble split tensors, save them as a committed checkpoint.

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdlib.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <map>
#include <memory>
#include <set>

#include "checkpoint/checkpointer.h"
#include "checkpoint/convert.h"
#include "checkpoint/fs.h"
#include "checkpoint/key_map.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/safetensors_source.h"
#include "runtime/deadline.h"
#include "runtime/errors.h"
#include "runtime/store/file_store.h"

namespace bulkhead::checkpoint {
namespace {

[[noreturn]] void badSource(const std::string& what) {
  throw CheckpointError(what, {.expected = "safetensors files with every tensor the index names and the map covers"});
}

// The pieces of one Bulkhead tensor.
struct Assembly {
  std::vector<int64_t> splitSizes;
  bool transpose = false;
  std::map<std::vector<int64_t>, std::pair<const SafetensorsFile*, const SafetensorsTensor*>> pieces;
};

at::Tensor assemble(const std::string& key, const Assembly& assembly, int64_t& done, int64_t total,
                    const ProgressFn& progress) {
  const auto& [firstFile, first] = assembly.pieces.begin()->second;
  std::vector<int64_t> sizes = assembly.splitSizes;
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] < 0)
      for (const auto& [index, piece] : assembly.pieces) sizes[d] = std::max(sizes[d], index[d] + 1);
  int64_t expected = 1;
  for (int64_t s : sizes) expected *= s;
  std::vector<int64_t> inner = first->shape;
  if (assembly.transpose) {
    if (inner.size() < 2)
      badSource(fmt::format("key '{}': '{}' has fewer than the 2 dimensions a transpose needs", key, first->name));
    std::swap(inner[inner.size() - 2], inner[inner.size() - 1]);
  }
  for (const auto& [index, piece] : assembly.pieces) {
    if (piece.second->dtype != first->dtype || piece.second->shape != first->shape)
      badSource(fmt::format("key '{}': '{}' ({}, [{}]) does not match '{}' ({}, [{}])", key, piece.second->name,
                            safetensorsDtypeName(piece.second->dtype), fmt::join(piece.second->shape, ", "),
                            first->name, safetensorsDtypeName(first->dtype), fmt::join(first->shape, ", ")));
  }
  if (static_cast<int64_t>(assembly.pieces.size()) != expected) {
    std::vector<int64_t> index(sizes.size(), 0);
    for (int64_t flat = 0; flat < expected; ++flat) {
      int64_t rest = flat;
      for (size_t d = sizes.size(); d-- > 0;) index[d] = rest % sizes[d], rest /= sizes[d];
      if (!assembly.pieces.count(index))
        badSource(fmt::format("key '{}': the piece at index [{}] is missing ({} of {} pieces found, beside '{}')", key,
                              fmt::join(index, ", "), assembly.pieces.size(), expected, first->name));
    }
  }
  std::vector<int64_t> shape = sizes;
  shape.insert(shape.end(), inner.begin(), inner.end());
  at::Tensor whole = at::empty(shape, at::TensorOptions(first->dtype));
  for (const auto& [index, piece] : assembly.pieces) {
    at::Tensor target = whole;
    for (int64_t at : index) target = target.select(0, at);
    if (assembly.transpose) {
      target.copy_(piece.first->read(*piece.second).transpose(-2, -1));
    } else {
      piece.first->readInto(*piece.second, target.data_ptr());  // a leading-index view is contiguous
    }
    done += piece.second->bytes();
    if (progress) progress(done, total);
  }
  return whole;
}

}  // namespace

ImportReport importSafetensors(const ImportOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  if (options.step < 0) throw ConfigError("--step must be >= 0", {.expected = "a step number >= 0"});
  const KeyMap map = options.map.empty() ? KeyMap::identity() : KeyMap::load(options.map);
  SafetensorsSource source = openSafetensorsSource(options.source);
  std::map<std::string, Assembly> assemblies;
  for (const auto& [file, tensor] : source.tensors) {
    // Optimizer state travels under its own keys.
    auto inward =
        tensor->name.rfind("optim.", 0) == 0 ? KeyMap::identity().inward(tensor->name) : map.inward(tensor->name);
    if (!inward)
      badSource(
          fmt::format("tensor '{}' of {} is not covered by the key map {}: pass the map it was exported with, "
                      "or add a rule for it (see docs/checkpoints.md)",
                      tensor->name, file->path(), map.source()));
    Assembly& assembly = assemblies[inward->key];
    if (assembly.pieces.empty()) {
      assembly.splitSizes = inward->splitSizes;
      assembly.transpose = inward->transpose;
    } else if (assembly.splitSizes.size() != inward->splitSizes.size()) {
      badSource(fmt::format("key '{}': '{}' maps to it through another rule than its other pieces", inward->key,
                            tensor->name));
    }
    if (!assembly.pieces.emplace(inward->index, std::make_pair(file, tensor)).second)
      badSource(fmt::format("key '{}': two tensors map to the same piece ('{}' is one)", inward->key, tensor->name));
  }
  StateDict state;
  int64_t done = 0;
  for (const auto& [key, assembly] : assemblies) {
    if (isReservedKey(key)) badSource(fmt::format("'{}' maps to the reserved key '{}'", key, key));
    state.addWhole(key, assemble(key, assembly, done, source.bytes, options.progress));
  }
  source.files.clear();

  const char* tmp = std::getenv("TMPDIR");
  std::string storeDir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/bulkhead-import-XXXXXX";
  if (::mkdtemp(storeDir.data()) == nullptr) fs::raise("creating a temporary folder for the import", errno, -1);
  ImportReport report;
  try {
    auto store = std::make_shared<FileStore>(storeDir, FileStoreOptions{.rank = 0});
    auto checkpointer = Checkpointer::create({.dir = options.dir, .keep = 0, .continueOnFailure = false}, store, 0, 1);
    checkpointer->save(options.step, state);
    SaveResult result = checkpointer->wait(Deadline::after(std::chrono::hours(1)));
    if (!result.ok) throw CheckpointError(fmt::format("saving the imported tensors failed: {}", result.error));
    report.path = result.path;
  } catch (...) {
    fs::removeTree(storeDir);
    throw;
  }
  fs::removeTree(storeDir);
  report.step = options.step;
  report.tensors = static_cast<int64_t>(assemblies.size());
  report.bytes = source.bytes;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

}  // namespace bulkhead::checkpoint
