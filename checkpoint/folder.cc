#include "checkpoint/folder.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "checkpoint/fs.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::checkpoint {
namespace {

std::optional<int64_t> parseDigits(const std::string& text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  int64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

std::string stepFolderName(int64_t step) { return fmt::format("step_{:06d}", step); }

std::string temporaryFolderName(int64_t step, const std::string& job) {
  return fmt::format("{}.tmp.{}", stepFolderName(step), job);
}

std::string supersededFolderName(int64_t step, const std::string& job) {
  return fmt::format("{}.superseded.{}", stepFolderName(step), job);
}

std::optional<int64_t> parseStepFolder(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return std::nullopt;
  return parseDigits(name.substr(5));
}

std::vector<FolderEntry> scanFolder(const std::string& dir, int rank) {
  std::vector<FolderEntry> entries;
  for (const std::string& name : fs::list(dir, rank)) {
    if (name.rfind("step_", 0) != 0) continue;
    FolderEntry entry;
    entry.name = name;
    size_t dot = name.find('.');
    auto step = parseDigits(name.substr(5, dot == std::string::npos ? std::string::npos : dot - 5));
    if (!step) continue;
    entry.step = *step;
    if (dot != std::string::npos) {
      std::string rest = name.substr(dot + 1);
      if (rest.rfind("tmp.", 0) == 0)
        entry.kind = FolderEntry::Kind::Temporary;
      else if (rest.rfind("deleting.", 0) == 0)
        entry.kind = FolderEntry::Kind::Deleting;
      else if (rest.rfind("superseded.", 0) == 0)
        entry.kind = FolderEntry::Kind::Superseded;
      else
        continue;
      entry.job = rest.substr(rest.find('.') + 1);
    }
    entry.ageSeconds = fs::ageSeconds(fs::join(dir, name)).value_or(0);
    entries.push_back(std::move(entry));
  }
  std::stable_sort(entries.begin(), entries.end(),
                   [](const FolderEntry& a, const FolderEntry& b) { return a.step < b.step; });
  return entries;
}

std::optional<int64_t> readLatest(const std::string& dir, int rank) {
  std::string path = fs::join(dir, kLatestName);
  int error = 0;
  auto text = fs::readFile(path, &error);
  if (!text) {
    if (error == ENOENT) return std::nullopt;
    throw CheckpointError(
        fmt::format("cannot read {}: {} ; check the permissions of the checkpoint folder", path, std::strerror(error)),
        {.rank = rank, .expected = "a readable `latest` file"});
  }
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  auto step = parseStepFolder(name);
  if (!step)
    throw CheckpointError(fmt::format("{} holds '{}', not a step folder name; it was edited by hand: write the "
                                      "folder name of a committed step into it (see `bulkhead-ckpt list {}`), or "
                                      "load a step explicitly",
                                      path, name.substr(0, 80), dir),
                          {.rank = rank, .expected = "`latest` naming a step folder, e.g. step_000100"});
  return step;
}

void writeLatest(const std::string& dir, int64_t step, const std::string& job, int rank) {
  fs::replaceFile(fs::join(dir, kLatestName), stepFolderName(step) + "\n", job, rank);
}

std::vector<std::string> cleanFolder(const std::string& dir, int keep, int64_t justCommitted, const std::string& job,
                                     const std::string& current, double staleSeconds, int rank) {
  std::vector<std::string> doomed;
  try {
    auto entries = scanFolder(dir, rank);
    std::optional<int64_t> latest;
    try {
      latest = readLatest(dir, rank);
    } catch (const CheckpointError& e) {
      log::warn("checkpoint", "keeping every checkpoint: {}", e.what());
      keep = 0;
    }
    std::vector<const FolderEntry*> committed;
    for (const auto& entry : entries)
      if (entry.kind == FolderEntry::Kind::Committed) committed.push_back(&entry);
    if (keep > 0 && static_cast<int>(committed.size()) > keep) {
      for (size_t i = 0; i + keep < committed.size(); ++i) {
        const FolderEntry& old = *committed[i];
        if (old.step == justCommitted || (latest && old.step == *latest)) continue;
        std::string from = fs::join(dir, old.name);
        std::string retired = fs::join(dir, fmt::format("{}.deleting.{}", old.name, job));
        if (!fs::renameNoReplace(from, retired, rank)) continue;
        log::info("checkpoint", "removing {} (keeping the {} newest checkpoints)", from, keep);
        doomed.push_back(retired);
      }
    }
    for (const auto& entry : entries) {
      if (entry.kind == FolderEntry::Kind::Committed || entry.kind == FolderEntry::Kind::Superseded ||
          entry.name == current)
        continue;
      bool ours = entry.job == job, stale = entry.ageSeconds > staleSeconds;
      if (ours && entry.kind == FolderEntry::Kind::Deleting && !stale) continue;  // our earlier removal's
      if (!ours && !stale) continue;  // another job's save may be in progress
      std::string path = fs::join(dir, entry.name);
      log::info("checkpoint", "removing {} ({})", path, ours ? "left by an earlier save of this job" : "stale");
      doomed.push_back(path);
    }
  } catch (const std::exception& e) {
    log::warn("checkpoint", "cleaning the checkpoint folder {} failed: {}", dir, e.what());
  }
  return doomed;
}

void removeFolders(const std::vector<std::string>& folders) {
  for (const auto& folder : folders)
    if (!fs::removeTree(folder)) log::warn("checkpoint", "could not remove all of {}", folder);
}

}  // namespace bulkhead::checkpoint
