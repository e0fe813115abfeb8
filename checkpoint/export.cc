// exportSafetensors (convert.h): plan the external tensors and their shards
// from the manifest, then stream each tensor from the checkpoint into them.

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <set>

#include "checkpoint/convert.h"
#include "checkpoint/fs.h"
#include "checkpoint/inspect.h"
#include "checkpoint/key_map.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_reader.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

// One checkpoint tensor and the external tensors it becomes.
struct Item {
  int tensor = 0;
  KeyMap::Outward outward;
  std::vector<int64_t> pieceShape;  // each external tensor's shape
};

// The files of one group (model or optimizer state): its items in order and
// the shard of each external tensor.
struct Group {
  std::string prefix;  // "model" or "optimizer"
  std::vector<Item> items;
  std::vector<std::vector<SafetensorsTensor>> shards;
  std::vector<int> shardOf;  // by external tensor, in order
  int64_t bytes = 0;
};

std::vector<int64_t> pieceShapeOf(const std::vector<int64_t>& shape, const KeyMap::Outward& outward) {
  std::vector<int64_t> piece(shape.begin() + outward.splitDims, shape.end());
  if (outward.transpose) std::swap(piece[piece.size() - 2], piece[piece.size() - 1]);
  return piece;
}

void planShards(Group& group, const Manifest& manifest, int64_t shardBytes) {
  int64_t inShard = 0;
  for (const Item& item : group.items) {
    const auto dtype = manifest.tensors[item.tensor].dtype;
    const int64_t bytes = volume(item.pieceShape) * static_cast<int64_t>(c10::elementSize(dtype));
    for (const auto& piece : item.outward.pieces) {
      if (group.shards.empty() || (inShard > 0 && inShard + bytes > shardBytes)) {
        group.shards.emplace_back();
        inShard = 0;
      }
      group.shards.back().push_back({piece.name, dtype, item.pieceShape, 0, 0});
      group.shardOf.push_back(static_cast<int>(group.shards.size()) - 1);
      inShard += bytes;
      group.bytes += bytes;
    }
  }
}

std::string shardName(const std::string& prefix, size_t shard, size_t shards) {
  return fmt::format("{}-{:05d}-of-{:05d}.safetensors", prefix, shard + 1, shards);
}

std::vector<Group> plan(const Manifest& manifest, const KeyMap& map, const ExportOptions& options) {
  std::vector<Group> groups{{"model"}, {"optimizer"}};
  std::set<std::string> names;
  for (size_t t = 0; t < manifest.tensors.size(); ++t) {
    const TensorRecord& record = manifest.tensors[t];
    if (isReservedKey(record.key)) continue;
    const bool optimizer = record.key.rfind("optim.", 0) == 0;
    if (optimizer && !options.withOptimizer) continue;
    auto outward = optimizer ? KeyMap::identity().outward(record.key, record.globalShape)
                             : map.outward(record.key, record.globalShape);
    if (!outward)
      throw CheckpointError(fmt::format("key '{}' of {} is not covered by the key map {}: add a rule for it (see "
                                        "docs/checkpoints.md)",
                                        record.key, options.dir, map.source()),
                            {.expected = "a rule for every model tensor"});
    for (const auto& piece : outward->pieces)
      if (!names.insert(piece.name).second)
        throw ConfigError(fmt::format("key map {} gives two tensors the name '{}' (the second from '{}')", map.source(),
                                      piece.name, record.key),
                          {.expected = "one external name per tensor"});
    Item item{static_cast<int>(t), *outward, pieceShapeOf(record.globalShape, *outward)};
    groups[optimizer ? 1 : 0].items.push_back(std::move(item));
  }
  for (auto& group : groups) planShards(group, manifest, options.shardBytes);
  return groups;
}

void refuseExisting(const std::string& out) {
  if (!fs::exists(out)) return;
  for (const auto& name : fs::list(out, -1)) {
    const bool safetensors = name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0;
    if (safetensors || name.find(".safetensors.index.json") != std::string::npos)
      throw ConfigError(
          fmt::format("{} already holds an export ({}); export into an empty folder, or remove it first", out, name),
          {.expected = "a new or empty --to folder"});
  }
}

// Writes the external tensors of `group` from the checkpoint, reading the
// next tensor while the last one is written.
void writeGroup(const Group& group, WholeTensorReader& reader, const ExportOptions& options, ExportReport& report,
                const std::map<std::string, std::string>& metadata, int64_t& written, int64_t total) {
  if (group.items.empty()) return;
  nlohmann::ordered_json index = {{"metadata", {{"total_size", group.bytes}}},
                                  {"weight_map", nlohmann::ordered_json::object()}};
  std::unique_ptr<SafetensorsWriter> writer;
  int open = -1;
  size_t external = 0;
  // Two buffers of the largest tensor, read into in turn and reused.
  int64_t largest = 0;
  for (const Item& item : group.items) {
    const auto& record = reader.manifest().tensors[item.tensor];
    largest = std::max(largest, volume(record.globalShape) * static_cast<int64_t>(c10::elementSize(record.dtype)));
  }
  const std::array<at::Tensor, 2> buffers{at::empty({largest}, at::kByte), at::empty({largest}, at::kByte)};
  std::future<at::Tensor> next =
      std::async(std::launch::async, [&] { return reader.read(group.items[0].tensor, buffers[0]); });
  for (size_t i = 0; i < group.items.size(); ++i) {
    at::Tensor whole = next.get();
    if (i + 1 < group.items.size())
      next = std::async(std::launch::async,
                        [&, t = group.items[i + 1].tensor, b = (i + 1) % 2] { return reader.read(t, buffers[b]); });
    const Item& item = group.items[i];
    for (const auto& piece : item.outward.pieces) {
      const int shard = group.shardOf[external++];
      if (shard != open) {
        if (writer) writer->finish();
        const std::string name = shardName(group.prefix, static_cast<size_t>(shard), group.shards.size());
        writer = std::make_unique<SafetensorsWriter>(fs::join(options.out, name), group.shards[shard], metadata);
        report.files.push_back(name);
        open = shard;
      }
      at::Tensor view = whole;
      for (int64_t at : piece.index) view = view.select(0, at);
      if (item.outward.transpose) view = view.transpose(-2, -1);
      view = view.contiguous();
      writer->append(view.data_ptr(), static_cast<int64_t>(view.nbytes()));
      index["weight_map"][piece.name] = shardName(group.prefix, static_cast<size_t>(shard), group.shards.size());
      written += static_cast<int64_t>(view.nbytes());
      ++report.tensors;
      if (options.progress) options.progress(written, total);
    }
  }
  if (writer) writer->finish();
  const std::string indexName = group.prefix + ".safetensors.index.json";
  fs::replaceFile(fs::join(options.out, indexName), index.dump(2) + "\n", "export", -1);
  report.files.push_back(indexName);
}

}  // namespace

ExportReport exportSafetensors(const ExportOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  if (options.shardBytes <= 0)
    throw ConfigError(fmt::format("a shard size of {} bytes", options.shardBytes), {.expected = "--shard-size > 0"});
  ExportReport report;
  report.folder = resolveStepFolder(options.dir, options.step);
  WholeTensorReader reader(report.folder, options.threads);
  report.step = reader.manifest().step;
  const KeyMap map = !options.map.empty()       ? KeyMap::load(options.map)
                     : !options.mapText.empty() ? KeyMap::parse(options.mapText, "the model's key map")
                                                : KeyMap::identity();
  std::vector<Group> groups = plan(reader.manifest(), map, options);
  refuseExisting(options.out);
  fs::makeDirectories(options.out, -1);
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"bulkhead_step", std::to_string(report.step)}};
  int64_t written = 0;
  const int64_t total = groups[0].bytes + groups[1].bytes;
  for (const auto& group : groups) writeGroup(group, reader, options, report, metadata, written, total);
  for (const auto& [name, content] : options.files) {
    fs::replaceFile(fs::join(options.out, name), content, "export", -1);
    report.files.push_back(fs::join(options.out, name));
  }
  fs::sync(options.out, -1);
  report.bytes = written;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

}  // namespace bulkhead::checkpoint
