// Checkpointer::load (checkpointer.h): resolve the step, read the manifest,
// read exactly the chunks of saved slices that overlap each slice this rank
// holds now, and agree with every rank on the outcome.

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>

#include "checkpoint/box.h"
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

// Where a read lands: a CPU tensor written in place; or a CUDA tensor, either
// directly (each chunk's piece one contiguous run: uploaded from the pinned
// buffer it was read into) or through a host copy uploaded at the end.
struct Destination {
  std::string key;
  at::Tensor tensor;             // the target; after planning, what the reads write
  std::vector<int64_t> offsets;  // of the slice in the global tensor
  std::vector<int64_t> shape;    // stored shape ([1] for a scalar)
  std::vector<int64_t> strides;  // of `tensor`, in elements
  bool direct = false;           // a CUDA tensor written chunk by chunk from pinned buffers
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
          ? fmt::format("step {} is not in {} (no folder {}); `bulkhead-ckpt list {}` shows the committed steps", *step,
                        dir, stepFolderName(*step), dir)
          : fmt::format("step {} in {} is partial: only {} exists, a save that was interrupted before its commit; load "
                        "an earlier step (see `bulkhead-ckpt list {}`)",
                        *step, dir, partial, dir),
      {.rank = rank, .expected = "a committed step folder"});
}

// Rank 0 resolves the step and publishes it (or why there is none); the others read it.
int64_t agreeOnStep(commit::Exchange& exchange, const std::string& dir, std::optional<int64_t> asked, int rank,
                    Deadline deadline) {
  if (rank == 0) {
    try {
      const int64_t step = resolveStep(dir, asked, rank);
      exchange.store().set(exchange.key("step"), std::to_string(step), deadline);
      return step;
    } catch (const Error& error) {
      exchange.store().set(exchange.key("step"), commit::Failure::of(error).encode(), deadline);
      throw;
    }
  }
  std::string step = exchange.store().get(exchange.key("step"), deadline);
  if (auto failed = commit::Failure::decode(step))
    throw CheckpointError(fmt::format("rank 0 could not pick the step to load: {}", failed->message),
                          {.rank = rank, .expected = "a committed checkpoint"});
  return std::stoll(step);
}

Manifest readStepManifest(const std::string& folder, int64_t step, int rank) {
  std::string manifestPath = fs::join(folder, kManifestName);
  int error = 0;
  auto text = fs::readFile(manifestPath, &error);
  if (!text)
    throw CheckpointError(fmt::format("cannot read the manifest {}: {}; the step folder is incomplete or was "
                                      "removed: load another step",
                                      manifestPath, std::strerror(error)),
                          {.rank = rank, .expected = "a committed checkpoint with its manifest"});
  Manifest manifest = Manifest::parse(*text, manifestPath, rank);
  if (manifest.step != step)
    throw CheckpointError(fmt::format("the manifest {} is for step {}, not {}: a folder renamed by hand?", manifestPath,
                                      manifest.step, step),
                          {.rank = rank, .expected = "the manifest of the step folder it sits in"});
  return manifest;
}

// What this rank reads: the targets, then its own saved state and the user blob.
struct Destinations {
  std::vector<Destination> list;
  std::vector<int> tensorOf;                              // manifest tensor of each destination
  std::vector<std::pair<std::string, at::Tensor>> blobs;  // (reserved key, its bytes)

  void add(const std::string& key, at::Tensor tensor, std::vector<int64_t> offsets, int index) {
    Destination destination{key, tensor, std::move(offsets), tensor.sizes().vec(), {}};
    // CUDA targets: planned as if contiguous; those that cannot go direct get a host copy later.
    destination.strides = tensor.is_cuda() ? contiguousStrides(destination.shape) : tensor.strides().vec();
    if (destination.shape.empty()) {
      destination.shape = {1};
      destination.strides = {1};
      destination.offsets = {0};
    }
    list.push_back(std::move(destination));
    tensorOf.push_back(index);
  }
};

Destinations destinationsOf(StateDict& targets, const Manifest& manifest, const LoadOptions& options,
                            LoadResult& result, int rank) {
  Destinations out;
  for (auto& target : targets.tensors) {
    int index = manifest.findTensor(target.key);
    if (index < 0) {
      if (options.allowMissing) {
        result.missingKeys.push_back(target.key);
        continue;
      }
      throw CheckpointError(fmt::format("key '{}' is not in checkpoint step {} ({}, {} tensors); if the model gained "
                                        "it since, load with LoadOptions{{.allowMissing = true}} and initialise it; "
                                        "if a newer version renamed it, resume with the version that saved this step",
                                        target.key, result.step, result.path, manifest.tensors.size()),
                            {.rank = rank, .expected = "every key of the state dict in the checkpoint"});
    }
    const TensorRecord& saved = manifest.tensors[index];
    if (saved.globalShape == target.shard.globalShape && saved.dtype != target.local.scalar_type())
      throw CheckpointError(
          fmt::format("key '{}': the checkpoint holds it in {} but the state dict asks for {}; configure it as it "
                      "was saved (a parameter: the model's dtype; an AdamW moment: AdamWOptions::momentType, "
                      "train_moe's --moment-dtype)",
                      target.key, dtypeName(saved.dtype), dtypeName(target.local.scalar_type())),
          {.rank = rank, .expected = "the saved dtype"});
    if (saved.globalShape != target.shard.globalShape)
      throw CheckpointError(
          fmt::format("key '{}': the checkpoint holds {} [{}] but the state dict asks for {} [{}]; "
                      "the model's configuration differs from the saved one",
                      target.key, dtypeName(saved.dtype), fmt::join(saved.globalShape, ", "),
                      dtypeName(target.local.scalar_type()), fmt::join(target.shard.globalShape, ", ")),
          {.rank = rank, .expected = "the saved global shape"});
    out.add(target.key, target.local, target.shard.offsets, index);
  }
  for (size_t t = 0; t < manifest.tensors.size(); ++t) {
    const std::string& key = manifest.tensors[t].key;
    // This rank's own state (none if the saved world was smaller) and the user blob.
    bool mine = key.rfind(rngKey(rank, ""), 0) == 0 || key == dataPositionKey(rank);
    if (!mine && key.rfind(userKey(""), 0) != 0) continue;
    at::Tensor bytes = at::empty(manifest.tensors[t].globalShape, at::kByte);
    out.blobs.emplace_back(key, bytes);
    out.add(key, bytes, {0}, static_cast<int>(t));
  }
  return out;
}

// The chunks of saved slices that overlap each destination, and where each lands.
struct ReadPlan {
  std::vector<CheckpointReader::Piece> pieces;
  std::vector<int> destinationOf;  // by piece
  std::vector<Box> boxes;          // by piece
};

ReadPlan planReads(CheckpointReader& reader, const Manifest& manifest, const Destinations& destinations,
                   const std::string& path, int rank) {
  ReadPlan plan;
  for (size_t i = 0; i < destinations.list.size(); ++i) {
    const Destination& destination = destinations.list[i];
    size_t dims = destination.shape.size();
    int64_t covered = 0;
    for (int s : manifest.slicesByTensor()[destinations.tensorOf[i]]) {
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
        plan.pieces.push_back({s, chunk});
        plan.destinationOf.push_back(static_cast<int>(i));
      });
    }
    if (covered != volume(destination.shape))
      throw CheckpointError(fmt::format("key '{}': the saved slices cover {} of the {} elements this rank needs; the "
                                        "manifest's coverage is broken: run `bulkhead-ckpt verify {}`",
                                        destination.key, covered, volume(destination.shape), path),
                            {.rank = rank, .expected = "every element covered by exactly one saved slice"});
  }
  plan.boxes.reserve(plan.pieces.size());
  for (size_t p = 0; p < plan.pieces.size(); ++p) {
    const Destination& d = destinations.list[plan.destinationOf[p]];
    plan.boxes.push_back(boxOf(reader.plan(plan.pieces[p].slice), plan.pieces[p].chunk,
                               manifest.slices[plan.pieces[p].slice], {d.offsets, d.shape, d.strides}));
  }
  return plan;
}

// Reads the plan into the destinations. CUDA targets go direct when
// contiguous, on the first one's device, and every piece is one run; the
// others through a host copy (pageable: page-locking gigabytes for one load
// costs more than it saves), uploaded at the end.
void readInto(CheckpointReader& reader, const ReadPlan& plan, Destinations& destinations, int threads,
              Deadline deadline, int rank) {
  std::vector<Destination>& list = destinations.list;
  std::vector<char> direct(list.size(), 0);
  std::optional<int> landingDevice;
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& tensor = list[i].tensor;
    if (!tensor.is_cuda()) continue;
    if (!landingDevice) landingDevice = tensor.device().index();
    direct[i] = tensor.is_contiguous() && tensor.device().index() == *landingDevice;
  }
  for (size_t p = 0; p < plan.pieces.size(); ++p)
    if (!plan.boxes[p].singleRun()) direct[plan.destinationOf[p]] = 0;
  std::unique_ptr<DeviceLanding> landing;
  if (std::find(direct.begin(), direct.end(), 1) != direct.end()) {
    try {
      const size_t buffer = static_cast<size_t>(reader.largestChunk(plan.pieces)) + CheckpointReader::kDirectSlack;
      landing = std::make_unique<DeviceLanding>(*landingDevice, threads, buffer, rank);
    } catch (const IoError& error) {
      log::warn("checkpoint", "{}; loading through pageable host copies instead", error.what());
    }
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> uploads;  // (CUDA target, host copy)
  for (size_t i = 0; i < list.size(); ++i) {
    Destination& destination = list[i];
    if (!destination.tensor.is_cuda()) continue;
    if (direct[i] && landing) {
      destination.direct = true;
      continue;
    }
    at::Tensor host = at::empty(destination.tensor.sizes(), destination.tensor.options().device(at::kCPU));
    uploads.emplace_back(destination.tensor, host);
    destination.tensor = host;
  }
  CheckpointReader::Acquire acquire;
  if (landing) acquire = [&](int worker, size_t) { return landing->acquire(worker, deadline); };
  auto deliver = [&](int worker, const CheckpointReader::Piece& piece, const uint8_t* bytes) {
    size_t p = static_cast<size_t>(&piece - plan.pieces.data());
    const Destination& destination = list[plan.destinationOf[p]];
    const Box& box = plan.boxes[p];
    int64_t elementSize = reader.plan(piece.slice).elementSize;
    auto* target = static_cast<uint8_t*>(destination.tensor.data_ptr());
    if (destination.direct)
      landing->upload(worker, target + box.target * elementSize, bytes + box.source * elementSize,
                      static_cast<size_t>(box.elements() * elementSize));
    else
      copyBox(bytes, target, box, elementSize);
  };
  // A direct piece is uploaded from the buffer it was read into, so every
  // read goes through the landing's buffers when there is one.
  reader.read(plan.pieces, deliver, acquire);
  if (landing) landing->finish(deadline);
  uploadToDevices(uploads, deadline, rank);
}

// The reserved blobs read: the data position, the user map, the RNG states.
void takeBlobs(const Destinations& destinations, LoadResult& result, int rank) {
  for (const auto& [key, bytes] : destinations.blobs) {
    std::string value(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
    if (key == dataPositionKey(rank)) {
      result.dataPosition = std::move(value);
      result.rankStateFound = true;
    } else if (key.rfind(userKey(""), 0) == 0) {
      result.user[key.substr(userKey("").size())] = std::move(value);
    } else {
      result.rng[key.substr(rngKey(rank, "").size())] = std::move(value);
    }
  }
}

// Every rank learns every rank's outcome: a failure anywhere fails the load everywhere.
void agreeOnOutcome(commit::Exchange& exchange, const std::optional<commit::Failure>& failure,
                    const std::exception_ptr& own, int64_t step, int rank, int worldSize, Deadline deadline) {
  exchange.store().set(exchange.key(fmt::format("result/{}", rank)), failure ? failure->encode() : "ok", deadline);
  if (own) std::rethrow_exception(own);
  std::vector<std::string> keys;
  for (int r = 0; r < worldSize; ++r) keys.push_back(exchange.key(fmt::format("result/{}", r)));
  exchange.store().wait(keys, deadline);
  auto outcomes = exchange.store().multiGet(keys, deadline);
  for (int r = 0; r < worldSize; ++r) {
    if (*outcomes[r] == "ok") continue;
    auto other = commit::Failure::decode(*outcomes[r]).value_or(commit::Failure{"CheckpointError", *outcomes[r]});
    commit::Failure{other.kind, fmt::format("loading step {} failed {}", step, other.message)}.raise(rank);
  }
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
    result.step = agreeOnStep(exchange, options_.dir, options.step, rank_, deadline);
    result.path = fs::join(options_.dir, stepFolderName(result.step));
    Manifest manifest = readStepManifest(result.path, result.step, rank_);
    result.layout = manifest.layout;
    result.savedWorldSize = manifest.worldSize;
    CheckpointReader reader(result.path, manifest, rank_, threads());
    if (rank_ == 0)  // every file, so a deleted or truncated one is caught even if no rank needs it
      for (const auto& file : manifest.files) reader.checkFile(file.rank);
    Destinations destinations = destinationsOf(targets, manifest, options, result, rank_);
    const ReadPlan plan = planReads(reader, manifest, destinations, result.path, rank_);
    readInto(reader, plan, destinations, threads(), deadline, rank_);
    takeBlobs(destinations, result, rank_);
    result.bytesRead = reader.bytesRead();
  } catch (const std::exception& error) {
    failure = commit::Failure::of(error);
    own = std::current_exception();
  }
  agreeOnOutcome(exchange, failure, own, result.step, rank_, worldSize_, deadline);
  result.seconds = secondsSince(started);
  if (rank_ == 0)
    log::info("checkpoint", "loaded step {} from {} in {:.2f} s", result.step, result.path, result.seconds);
  if (rank_ == 0 && options.resume) rememberNewerSteps(result.step);
  return result;
}

void Checkpointer::rememberNewerSteps(int64_t loaded) {
  resumedFrom_ = loaded;
  newerThanResumed_.clear();
  supersedingSave_ = nullptr;
  try {  // the load succeeded on every rank: it must not fail here on one
    for (const auto& entry : scanFolder(options_.dir, rank_))
      if (entry.kind == FolderEntry::Kind::Committed && entry.step > loaded) newerThanResumed_.push_back(entry.step);
  } catch (const std::exception& error) {
    log::warn("checkpoint", "cannot list {} for steps newer than {}; saves of such steps will fail: {}", options_.dir,
              loaded, error.what());
    newerThanResumed_.clear();
  }
}

}  // namespace bulkhead::checkpoint
