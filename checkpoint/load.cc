// Checkpointer::load (checkpointer.h): resolve the step, read the manifest,
// read exactly the chunks of saved slices that overlap each slice this rank
// holds now, and agree with every rank on the outcome.

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>

#include "checkpoint/checkpointer.h"
#include "checkpoint/commit.h"
#include "checkpoint/dtype.h"
#include "checkpoint/folder.h"
#include "checkpoint/fs.h"
#include "checkpoint/manifest.h"
#include "checkpoint/reader.h"
#include "checkpoint/staging.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::checkpoint {
namespace {

// A box copy between two strided layouts (strides in elements), adjacent
// dimensions merged where both sides are contiguous across them, so a box
// that spans whole rows is one memcpy.
void copyBox(const uint8_t* source, std::vector<int64_t> sourceStrides, uint8_t* target,
             std::vector<int64_t> targetStrides, std::vector<int64_t> length, int64_t elementSize) {
  for (size_t d = length.size(); d-- > 1;) {
    if (sourceStrides[d - 1] == sourceStrides[d] * length[d] && targetStrides[d - 1] == targetStrides[d] * length[d]) {
      length[d - 1] *= length[d];
      sourceStrides[d - 1] = sourceStrides[d];
      targetStrides[d - 1] = targetStrides[d];
      length.erase(length.begin() + d);
      sourceStrides.erase(sourceStrides.begin() + d);
      targetStrides.erase(targetStrides.begin() + d);
    }
  }
  size_t inner = length.size() - 1;
  bool runs = sourceStrides[inner] == 1 && targetStrides[inner] == 1;
  std::vector<int64_t> at(length.size(), 0);
  for (;;) {
    int64_t s = 0, t = 0;
    for (size_t d = 0; d < inner; ++d) {
      s += at[d] * sourceStrides[d];
      t += at[d] * targetStrides[d];
    }
    if (runs) {
      std::memcpy(target + t * elementSize, source + s * elementSize, length[inner] * elementSize);
    } else {
      for (int64_t i = 0; i < length[inner]; ++i)
        std::memcpy(target + (t + i * targetStrides[inner]) * elementSize,
                    source + (s + i * sourceStrides[inner]) * elementSize, elementSize);
    }
    size_t d = inner;
    while (d > 0 && ++at[d - 1] == length[d - 1]) at[--d] = 0;
    if (d == 0) return;
  }
}

std::vector<int64_t> contiguousStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (size_t d = dims.size(); d-- > 1;) strides[d - 1] = strides[d] * dims[d];
  return strides;
}

// Where a read lands: a CPU tensor (the target itself, or a host copy of a CUDA target).
struct Destination {
  std::string key;
  at::Tensor tensor;              // CPU, written in place
  std::vector<int64_t> offsets;   // of the slice in the global tensor
  std::vector<int64_t> shape;     // stored shape ([1] for a scalar)
  std::vector<int64_t> strides;   // of `tensor`, in elements
};

// Rank 0: the step to load, or the error that says why there is none.
int64_t resolveStep(const std::string& dir, std::optional<int64_t> asked, int rank) {
  std::optional<int64_t> step = asked;
  if (!step) step = readLatest(dir, rank);
  if (!step)
    throw CheckpointError(fmt::format("no committed checkpoint in {}: `latest` does not exist; start from scratch, or "
                                      "name a step (see `bulkhead-ckpt list {}`)",
                                      dir, dir),
                          {.rank = rank, .expected = "a committed checkpoint"});
  std::string folder = fs::join(dir, stepFolderName(*step));
  if (fs::isDirectory(folder)) return *step;
  std::string partial;
  for (const auto& entry : scanFolder(dir, rank))
    if (entry.step == *step && entry.kind == FolderEntry::Kind::Temporary) partial = entry.name;
  throw CheckpointError(
      partial.empty()
          ? fmt::format("step {} is not in {} (no folder {}); `bulkhead-ckpt list {}` shows the committed steps",
                        *step, dir, stepFolderName(*step), dir)
          : fmt::format("step {} in {} is partial: only {} exists, a save that was interrupted before its commit; load "
                        "an earlier step (see `bulkhead-ckpt list {}`)",
                        *step, dir, partial, dir),
      {.rank = rank, .expected = "a committed step folder"});
}

}  // namespace

LoadResult Checkpointer::load(StateDict& targets, LoadOptions options) {
  auto started = Deadline::Clock::now();
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(timeoutSeconds()));
  settlePrevious(deadline);  // a save in flight may commit the step `latest` is about to name
  commit::Exchange exchange(store_, fmt::format("{}load/{}/", prefix_, loads_++), rank_, worldSize_);
  LoadResult result;
  std::optional<commit::Failure> failure;
  std::exception_ptr own;
  try {
    validate(targets, rank_);
    if (rank_ == 0) {
      try {
        result.step = resolveStep(options_.dir, options.step, rank_);
        exchange.store().set(exchange.key("step"), std::to_string(result.step), deadline);
      } catch (const Error& error) {
        exchange.store().set(exchange.key("step"), commit::Failure::of(error).encode(), deadline);
        throw;
      }
    } else {
      std::string step = exchange.store().get(exchange.key("step"), deadline);
      if (auto failed = commit::Failure::decode(step))
        throw CheckpointError(fmt::format("rank 0 could not pick the step to load: {}", failed->message),
                              {.rank = rank_, .expected = "a committed checkpoint"});
      result.step = std::stoll(step);
    }
    result.path = fs::join(options_.dir, stepFolderName(result.step));
    std::string manifestPath = fs::join(result.path, kManifestName);
    int error = 0;
    auto text = fs::readFile(manifestPath, &error);
    if (!text)
      throw CheckpointError(fmt::format("cannot read the manifest {}: {}; the step folder is incomplete or was "
                                        "removed: load another step",
                                        manifestPath, std::strerror(error)),
                            {.rank = rank_, .expected = "a committed checkpoint with its manifest"});
    Manifest manifest = Manifest::parse(*text, manifestPath, rank_);
    if (manifest.step != result.step)
      throw CheckpointError(fmt::format("the manifest {} is for step {}, not {}: a folder renamed by hand?",
                                        manifestPath, manifest.step, result.step),
                            {.rank = rank_, .expected = "the manifest of the step folder it sits in"});
    result.layout = manifest.layout;
    result.savedWorldSize = manifest.worldSize;
    CheckpointReader reader(result.path, manifest, rank_, threads());
    if (rank_ == 0)  // every file, so a deleted or truncated one is caught even if no rank needs it
      for (const auto& file : manifest.files) reader.checkFile(file.rank);

    // Destinations: the targets, then this rank's own state and the user blob.
    std::vector<Destination> destinations;
    std::vector<std::pair<at::Tensor, at::Tensor>> uploads;  // (CUDA target, host copy)
    std::vector<int> tensorOf;                                // manifest tensor of each destination
    auto addDestination = [&](const std::string& key, at::Tensor tensor, std::vector<int64_t> offsets, int index) {
      Destination destination{key, tensor, std::move(offsets), tensor.sizes().vec(), {}};
      if (tensor.is_cuda()) {
        // Pageable: page-locking gigabytes for one load costs more than it saves.
        destination.tensor = at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
        uploads.emplace_back(tensor, destination.tensor);
      }
      destination.strides = destination.tensor.strides().vec();
      if (destination.shape.empty()) {
        destination.shape = {1};
        destination.strides = {1};
        destination.offsets = {0};
      }
      destinations.push_back(std::move(destination));
      tensorOf.push_back(index);
    };
    for (auto& target : targets.tensors) {
      int index = manifest.findTensor(target.key);
      if (index < 0) {
        if (options.allowMissing) {
          result.missingKeys.push_back(target.key);
          continue;
        }
        throw CheckpointError(fmt::format("key '{}' is not in checkpoint step {} ({}, {} tensors); if the model gained "
                                          "it since, load with LoadOptions{{.allowMissing = true}} and initialise it",
                                          target.key, result.step, result.path, manifest.tensors.size()),
                              {.rank = rank_, .expected = "every key of the state dict in the checkpoint"});
      }
      const TensorRecord& saved = manifest.tensors[index];
      if (saved.globalShape != target.shard.globalShape || saved.dtype != target.local.scalar_type())
        throw CheckpointError(fmt::format("key '{}': the checkpoint holds {} [{}] but the state dict asks for {} [{}]; "
                                          "the model's configuration differs from the saved one",
                                          target.key, dtypeName(saved.dtype), fmt::join(saved.globalShape, ", "),
                                          dtypeName(target.local.scalar_type()),
                                          fmt::join(target.shard.globalShape, ", ")),
                              {.rank = rank_, .expected = "the saved dtype and global shape"});
      addDestination(target.key, target.local, target.shard.offsets, index);
    }
    std::vector<std::pair<std::string, at::Tensor>> blobs;  // (reserved key, its bytes)
    for (size_t t = 0; t < manifest.tensors.size(); ++t) {
      const std::string& key = manifest.tensors[t].key;
      bool mine = key.rfind(rngKey(rank_, ""), 0) == 0 || key == dataPositionKey(rank_);  // none if the saved world was smaller
      if (!mine && key.rfind(userKey(""), 0) != 0) continue;
      at::Tensor bytes = at::empty(manifest.tensors[t].globalShape, at::kByte);
      blobs.emplace_back(key, bytes);
      addDestination(key, bytes, {0}, static_cast<int>(t));
    }

    // Pieces: the chunks of saved slices that overlap each destination.
    std::vector<CheckpointReader::Piece> pieces;
    std::vector<int> pieceDestination;
    for (size_t i = 0; i < destinations.size(); ++i) {
      const Destination& destination = destinations[i];
      size_t dims = destination.shape.size();
      int64_t covered = 0;
      for (int s : manifest.slicesByTensor()[tensorOf[i]]) {
        const SliceRecord& slice = manifest.slices[s];
        std::vector<int64_t> sliceOffsets = slice.offsets.empty() ? std::vector<int64_t>{0} : slice.offsets;
        std::vector<int64_t> lo(dims), hi(dims);
        int64_t overlap = 1;
        for (size_t d = 0; d < dims; ++d) {
          int64_t sliceEnd = sliceOffsets[d] + (slice.shape.empty() ? 1 : slice.shape[d]);
          lo[d] = std::max(destination.offsets[d], sliceOffsets[d]) - sliceOffsets[d];
          hi[d] = std::min(destination.offsets[d] + destination.shape[d], sliceEnd) - sliceOffsets[d];
          overlap *= std::max<int64_t>(0, hi[d] - lo[d]);
        }
        if (overlap == 0) continue;
        covered += overlap;
        reader.plan(s).forEachOverlapping(lo, hi, [&](int64_t chunk) {
          pieces.push_back({s, chunk});
          pieceDestination.push_back(static_cast<int>(i));
        });
      }
      if (covered != volume(destination.shape))
        throw CheckpointError(fmt::format("key '{}': the saved slices cover {} of the {} elements this rank needs; the "
                                          "manifest's coverage is broken: run `bulkhead-ckpt verify {}`",
                                          destination.key, covered, volume(destination.shape), result.path),
                              {.rank = rank_, .expected = "every element covered by exactly one saved slice"});
    }
    reader.read(pieces, [&](const CheckpointReader::Piece& piece, const uint8_t* bytes) {
      const Destination& destination = destinations[pieceDestination[&piece - pieces.data()]];
      const SliceRecord& slice = manifest.slices[piece.slice];
      const ChunkPlan& plan = reader.plan(piece.slice);
      std::vector<int64_t> chunkLo = plan.offsets(piece.chunk);
      std::vector<int64_t> chunkDims = plan.chunk;
      chunkDims[plan.split] = std::min(chunkDims[plan.split], plan.dims[plan.split] - chunkLo[plan.split]);
      std::vector<int64_t> sliceOffsets = slice.offsets.empty() ? std::vector<int64_t>{0} : slice.offsets;
      size_t dims = chunkDims.size();
      std::vector<int64_t> length(dims), sourceAt(dims), targetAt(dims);
      for (size_t d = 0; d < dims; ++d) {
        int64_t lo = std::max(chunkLo[d] + sliceOffsets[d], destination.offsets[d]);
        int64_t hi = std::min(chunkLo[d] + chunkDims[d] + sliceOffsets[d], destination.offsets[d] + destination.shape[d]);
        length[d] = hi - lo;
        sourceAt[d] = lo - sliceOffsets[d] - chunkLo[d];
        targetAt[d] = lo - destination.offsets[d];
      }
      auto sourceStrides = contiguousStrides(chunkDims);
      int64_t source = 0, target = 0;
      for (size_t d = 0; d < dims; ++d) {
        source += sourceAt[d] * sourceStrides[d];
        target += targetAt[d] * destination.strides[d];
      }
      int64_t elementSize = plan.elementSize;
      copyBox(bytes + source * elementSize, sourceStrides,
              static_cast<uint8_t*>(destination.tensor.data_ptr()) + target * elementSize, destination.strides, length,
              elementSize);
    });
    uploadToDevices(uploads, deadline, rank_);
    for (const auto& [key, bytes] : blobs) {
      std::string value(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
      if (key == dataPositionKey(rank_)) {
        result.dataPosition = std::move(value);
        result.rankStateFound = true;
      } else if (key.rfind(userKey(""), 0) == 0) {
        result.user[key.substr(userKey("").size())] = std::move(value);
      } else {
        result.rng[key.substr(rngKey(rank_, "").size())] = std::move(value);
      }
    }
    result.bytesRead = reader.bytesRead();
  } catch (const std::exception& error) {
    failure = commit::Failure::of(error);
    own = std::current_exception();
  }

  // Every rank learns every rank's outcome: a failure anywhere fails the load everywhere.
  exchange.store().set(exchange.key(fmt::format("result/{}", rank_)), failure ? failure->encode() : "ok", deadline);
  if (own) std::rethrow_exception(own);
  std::vector<std::string> keys;
  for (int r = 0; r < worldSize_; ++r) keys.push_back(exchange.key(fmt::format("result/{}", r)));
  exchange.store().wait(keys, deadline);
  auto outcomes = exchange.store().multiGet(keys, deadline);
  for (int r = 0; r < worldSize_; ++r) {
    if (*outcomes[r] == "ok") continue;
    auto other = commit::Failure::decode(*outcomes[r]).value_or(commit::Failure{"CheckpointError", *outcomes[r]});
    commit::Failure{other.kind, fmt::format("loading step {} failed {}", result.step, other.message)}.raise(rank_);
  }
  result.seconds = secondsSince(started);
  if (rank_ == 0)
    log::info("checkpoint", "loaded step {} from {} in {:.2f} s", result.step, result.path, result.seconds);
  return result;
}

}  // namespace bulkhead::checkpoint
