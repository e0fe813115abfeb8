#include "checkpoint/inspect.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "checkpoint/checksum.h"
#include "checkpoint/dtype.h"
#include "checkpoint/folder.h"
#include "checkpoint/fs.h"
#include "checkpoint/reader.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {

std::vector<StepInfo> listCheckpoints(const std::string& dir) {
  std::optional<int64_t> latest;
  try {
    latest = readLatest(dir, -1);
  } catch (const CheckpointError&) {
  }
  std::vector<StepInfo> steps;
  for (const auto& entry : scanFolder(dir, -1)) {
    StepInfo info{.step = entry.step,
                  .name = entry.name,
                  .state = entry.kind == FolderEntry::Kind::Committed    ? "committed"
                           : entry.kind == FolderEntry::Kind::Temporary  ? "partial (in progress or abandoned)"
                           : entry.kind == FolderEntry::Kind::Superseded ? "superseded (left by a resumed run)"
                                                                         : "being removed",
                  .latest = entry.kind == FolderEntry::Kind::Committed && latest && *latest == entry.step,
                  .job = entry.job,
                  .ageSeconds = entry.ageSeconds};
    std::string folder = fs::join(dir, entry.name);
    try {
      for (const std::string& name : fs::list(folder, -1)) {
        if (name.rfind("rank_", 0) != 0) continue;
        ++info.files;
        info.bytes += fs::fileSize(fs::join(folder, name)).value_or(0);
      }
      if (entry.kind == FolderEntry::Kind::Committed || entry.kind == FolderEntry::Kind::Superseded) {
        auto text = fs::readFile(fs::join(folder, kManifestName));
        if (text && text->find("\njob ") != std::string::npos) {
          size_t at = text->find("\njob ") + 5;
          info.job = text->substr(at, text->find('\n', at) - at);
        }
      }
    } catch (const IoError&) {
      // removed while we looked: keep what we have
    }
    steps.push_back(std::move(info));
  }
  return steps;
}

std::optional<std::pair<std::string, int64_t>> asStepFolder(const std::string& dir) {
  auto step = parseStepFolder(fs::baseName(dir));
  if (!step || !fs::isDirectory(dir) || fs::exists(fs::join(dir, kLatestName))) return std::nullopt;
  return std::pair{fs::parent(dir), *step};
}

std::string resolveStepFolder(const std::string& dir, const std::string& which) {
  // A committed step folder stands for its own step; another step is looked up beside it.
  if (auto stepFolder = asStepFolder(dir)) {
    if (which == "latest" || which == std::to_string(stepFolder->second)) return dir;
    return resolveStepFolder(stepFolder->first, which);
  }
  int64_t step = 0;
  if (which == "latest") {
    auto latest = readLatest(dir, -1);
    if (!latest)
      throw CheckpointError(fmt::format("{} has no `latest`: nothing was committed there yet", dir),
                            {.expected = "a committed checkpoint"});
    step = *latest;
  } else {
    try {
      size_t used = 0;
      step = std::stoll(which, &used);
      if (used != which.size()) throw std::invalid_argument(which);
    } catch (const std::logic_error&) {
      throw ConfigError(fmt::format("'{}' is not a step: give a number or 'latest'", which),
                        {.expected = "a step number or latest"});
    }
  }
  std::string folder = fs::join(dir, stepFolderName(step));
  if (fs::isDirectory(folder)) return folder;
  std::string partial;
  for (const auto& entry : scanFolder(dir, -1))
    if (entry.step == step && entry.kind == FolderEntry::Kind::Temporary) partial = entry.name;
  throw CheckpointError(
      fmt::format("step {} is not committed in {} ({}); `bulkhead-ckpt list {}` shows what is there", step, dir,
                  partial.empty() ? "no folder " + stepFolderName(step)
                                  : "only the partial folder " + partial + " of an interrupted save",
                  dir),
      {.expected = "a committed step folder"});
}

Manifest readManifest(const std::string& stepFolder) {
  std::string path = fs::join(stepFolder, kManifestName);
  int error = 0;
  auto text = fs::readFile(path, &error);
  if (!text)
    throw CheckpointError(
        fmt::format("cannot read the manifest {}: {}; the step folder is incomplete", path, std::strerror(error)),
        {.expected = "a committed checkpoint with its manifest"});
  return Manifest::parse(*text, path, -1);
}

VerifyReport verifyCheckpoint(const std::string& stepFolder, int threads,
                              const std::function<void(int64_t, int64_t)>& progress) {
  VerifyReport report;
  Manifest manifest;
  try {
    manifest = readManifest(stepFolder);
  } catch (const Error& error) {
    report.problems.push_back(error.message());
    return report;
  }
  report.step = manifest.step;
  try {
    checkCoverage(manifest, -1);
  } catch (const Error& error) {
    report.problems.push_back(error.message());
  }
  std::string expected = stepFolderName(manifest.step);
  if (stepFolder.size() < expected.size() ||
      stepFolder.compare(stepFolder.size() - expected.size(), expected.size(), expected) != 0)
    report.problems.push_back(fmt::format("the manifest is for step {} but sits in {}", manifest.step, stepFolder));

  CheckpointReader reader(stepFolder, manifest, -1, threads);
  std::set<int> badFiles;
  for (const auto& file : manifest.files) {
    try {
      reader.openFile(file.rank);
    } catch (const Error& error) {
      report.problems.push_back(error.message());
      badFiles.insert(file.rank);
    }
  }
  std::set<std::string> listed;
  for (const auto& file : manifest.files) listed.insert(file.name);
  for (const std::string& name : fs::list(stepFolder, -1))
    if (name.rfind("rank_", 0) == 0 && !listed.count(name))
      report.problems.push_back(fmt::format("{} is in {} but not in its manifest", name, stepFolder));

  int64_t total = 0;
  for (const auto& slice : manifest.slices)
    if (!badFiles.count(slice.rank)) total += volume(slice.shape) * dtypeSize(manifest.tensors[slice.tensor].dtype);
  int64_t done = 0;
  for (size_t s = 0; s < manifest.slices.size(); ++s) {
    const SliceRecord& slice = manifest.slices[s];
    if (badFiles.count(slice.rank)) continue;
    try {
      const ChunkPlan& plan = reader.plan(static_cast<int>(s));
      if (plan.count == 0 && slice.digest != Hash64().value())
        throw CheckpointError(fmt::format("the empty slice '{}' of rank {} has digest {}, not that of no chunks",
                                          slice.dataset, slice.rank, hex64(slice.digest)));
      std::vector<CheckpointReader::Piece> pieces;
      for (int64_t c = 0; c < plan.count; ++c) pieces.push_back({static_cast<int>(s), c});
      reader.read(pieces, [](int, const CheckpointReader::Piece&, const uint8_t*) {});
      report.chunksChecked += plan.count;
      ++report.slicesChecked;
    } catch (const Error& error) {
      report.problems.push_back(error.message());
    }
    done += volume(slice.shape) * dtypeSize(manifest.tensors[slice.tensor].dtype);
    if (progress) progress(done, total);
  }
  report.bytesChecked = reader.bytesRead();
  return report;
}

}  // namespace bulkhead::checkpoint
