// The background part of a save (checkpointer.h, steps 2-4).

#include "checkpoint/save_job.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "checkpoint/checksum.h"
#include "checkpoint/dtype.h"
#include "checkpoint/folder.h"
#include "checkpoint/fs.h"
#include "checkpoint/manifest.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::checkpoint {
namespace {

using commit::Failure;

std::string encodeReport(const std::string& file, int64_t bytes, const std::vector<StagedSlice>& slices) {
  std::string report = fmt::format("file {} {}\n", escape(file), bytes);
  for (const auto& slice : slices)
    report += fmt::format("s {} {} {} {} {} {} {}\n", escape(slice.key), dtypeName(slice.dtype),
                          formatDims(slice.globalShape), escape(slice.dataset), formatDims(slice.offsets),
                          formatDims(slice.shape), hex64(slice.digest));
  return report;
}

// Every rank's report into one manifest; CheckpointError when ranks disagree
// on a key's dtype or global shape, or a report does not parse.
Manifest buildManifest(const std::vector<std::string>& reports, const SaveJob& job) {
  Manifest manifest;
  manifest.step = job.step;
  manifest.job = job.job;
  manifest.worldSize = job.worldSize;
  manifest.created = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  manifest.layout = job.layout;
  std::unordered_map<std::string, int> tensors;
  std::vector<int> firstRank;
  for (int r = 0; r < static_cast<int>(reports.size()); ++r) {
    auto bad = [&](const std::string& line) {
      return CheckpointError(fmt::format("rank {} sent a malformed report line '{}'", r, line.substr(0, 120)),
                             {.rank = job.rank, .expected = "reports written by this version of Bulkhead"});
    };
    size_t start = 0;
    const std::string& text = reports[r];
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      std::string line = text.substr(start, end - start);
      start = end + 1;
      std::vector<std::string> t;
      for (size_t at = 0; at <= line.size();) {
        size_t space = line.find(' ', at);
        if (space == std::string::npos) space = line.size();
        t.push_back(line.substr(at, space - at));
        at = space + 1;
      }
      if (t[0] == "file" && t.size() == 3) {
        manifest.files.push_back({r, unescape(t[1]).value_or(""), std::stoll(t[2])});
        continue;
      }
      if (t[0] != "s" || t.size() != 8) throw bad(line);
      auto key = unescape(t[1]), dataset = unescape(t[4]);
      auto dtype = parseDtype(t[2]);
      auto global = parseDims(t[3]), offsets = parseDims(t[5]), shape = parseDims(t[6]);
      if (!key || !dataset || !dtype || !global || !offsets || !shape) throw bad(line);
      auto [it, fresh] = tensors.emplace(*key, static_cast<int>(manifest.tensors.size()));
      if (fresh) {
        manifest.tensors.push_back({*key, *dtype, *global});
        firstRank.push_back(r);
      } else {
        const TensorRecord& known = manifest.tensors[it->second];
        if (known.dtype != *dtype || known.globalShape != *global)
          throw CheckpointError(
              fmt::format("key '{}': rank {} saved it as {} [{}] but rank {} as {} [{}]; every rank must give a key "
                          "the same dtype and global shape",
                          *key, firstRank[it->second], dtypeName(known.dtype), formatDims(known.globalShape), r,
                          dtypeName(*dtype), formatDims(*global)),
              {.rank = job.rank, .expected = "one dtype and global shape per key"});
      }
      SliceRecord slice{.tensor = it->second, .rank = r, .dataset = *dataset, .offsets = *offsets, .shape = *shape};
      slice.digest = std::stoull(t[7], nullptr, 16);
      manifest.slices.push_back(std::move(slice));
    }
  }
  return manifest;
}

}  // namespace

double commitGraceSeconds(double timeoutSeconds) { return std::clamp(timeoutSeconds * 0.1, 0.5, 10.0); }

namespace {
// Temporary folders of other jobs older than this (and twice our deadline) are abandoned.
constexpr double kStaleSeconds = 3600;
// One store round trip (a set, a compare-and-set, a peek), which may come
// after the save's deadline (to report that it passed).
Deadline roundTrip() { return Deadline::afterSeconds(5); }

// The background part leaves the host's cores to the training loop, whose
// steps wait on its kernel launches: `nice` is added to the calling thread's
// niceness (Linux keeps one per thread), and the checksum and write threads
// started from here inherit it. Raising one's niceness needs no privilege.
void yieldToTraining(int nice, int rank) {
  if (nice <= 0) return;
  const auto self = static_cast<id_t>(::gettid());
  errno = 0;
  const int current = ::getpriority(PRIO_PROCESS, self);
  if (errno == 0 && ::setpriority(PRIO_PROCESS, self, std::min(19, current + nice)) == 0) return;
  log::warn("checkpoint",
            "rank {}: the save's background thread keeps the training loop's priority ({}); "
            "BULKHEAD_CHECKPOINT_NICE has no effect",
            rank, std::strerror(errno));
}
}  // namespace

Deadline SaveJob::graceDeadline(int multiple) const {
  auto grace = std::chrono::duration<double>(commitGraceSeconds(timeoutSeconds) * multiple);
  return Deadline::at(deadline.when() + std::chrono::duration_cast<Deadline::Clock::duration>(grace));
}

std::optional<Failure> SaveJob::writeOwn(commit::Exchange& exchange, SaveResult& result) {
  std::string folder = fs::join(dir, temporaryFolderName(step, job));
  std::string name = rankFileName(rank);
  // A rank still writing when the save failed elsewhere (rank 0 has removed the
  // folder by then, or is about to) removes what it wrote itself.
  auto abandonIfFailed = [&]() -> std::optional<Failure> {
    auto verdict = exchange.peekVerdict(roundTrip());
    if (!verdict || *verdict == "commit") return std::nullopt;
    ::unlink(fs::join(folder, name).c_str());
    ::rmdir(folder.c_str());  // the last rank out removes the folder
    return Failure::decode(*verdict).value_or(Failure{"CheckpointError", *verdict});
  };
  try {
    if (early) throw CheckpointError(early->message);  // published below with its own kind
    auto fault = fault::at(rank, step);
    if (fault && fault->action == fault::Action::Stall) {
      log::warn("checkpoint", "BULKHEAD_CHECKPOINT_FAULT: stalling the writer of step {} for {:.1f} s", step,
                fault->stallSeconds);
      std::this_thread::sleep_for(std::chrono::duration<double>(fault->stallSeconds));
    }
    // A save that another rank already gave up is not written at all.
    if (auto failure = abandonIfFailed()) return failure;
    if (deadline.expired())
      throw TimeoutError(fmt::format("the checkpoint deadline ({:.1f} s) passed before rank {} began writing step {}",
                                     timeoutSeconds, rank, step),
                         {.rank = rank, .expected = "the save within BULKHEAD_CHECKPOINT_TIMEOUT"});
    fs::makeDirectories(folder, rank);
    result.bytes =
        writeRankFile(fs::join(folder, name), {job, step, rank, worldSize}, slices, threads, fault::at(rank, step));
    fs::sync(folder, rank);
    if (auto failure = abandonIfFailed()) return failure;
    exchange.publish(encodeReport(name, result.bytes, slices), roundTrip());
    return std::nullopt;
  } catch (const std::exception& error) {
    Failure failure = early ? *early : Failure::of(error);
    try {
      // A failure that follows from another rank's (our folder removed after its
      // verdict) is reported as that one.
      if (auto first = abandonIfFailed()) return first;
      exchange.publishFailure(failure, roundTrip());
    } catch (const std::exception& also) {
      log::warn("checkpoint", "could not report the failure of step {} through the store: {}", step, also.what());
    }
    return failure;
  }
}

void SaveJob::coordinate(commit::Exchange& exchange, SaveResult& result) {
  std::string folder = fs::join(dir, temporaryFolderName(step, job));
  std::string final = fs::join(dir, stepFolderName(step));
  std::vector<std::string> reports;
  std::optional<Failure> failure;
  try {
    failure = exchange.gather(reports, deadline);
  } catch (const std::exception& error) {
    failure = Failure::of(error);
  }
  if (!failure) {
    try {
      Manifest manifest = buildManifest(reports, *this);
      checkCoverage(manifest, rank);
      fs::replaceFile(fs::join(folder, kManifestName), manifest.serialize(), job, rank);
      if (auto fault = fault::at(rank, step); fault && fault->action == fault::Action::CommitExit) {
        log::error("checkpoint", "BULKHEAD_CHECKPOINT_FAULT: exiting after the manifest of step {}, before the rename",
                   step);
        ::_exit(17);
      }
      if (fs::exists(final) && std::find(supersedes.begin(), supersedes.end(), step) == supersedes.end())
        throw CheckpointError(fmt::format("{} already exists (saved by another job, or by an earlier run that this "
                                          "one did not resume from a checkpoint); it is left as it is and this save "
                                          "is dropped: give each job its own checkpoint folder, or remove that step",
                                          final),
                              {.rank = rank, .expected = "a step folder that does not exist yet"});
      if (deadline.expired())
        throw TimeoutError(fmt::format("the checkpoint deadline ({:.1f} s) passed before step {} could be committed",
                                       timeoutSeconds, step),
                           {.rank = rank, .expected = "the save within BULKHEAD_CHECKPOINT_TIMEOUT"});
    } catch (const std::exception& error) {
      failure = Failure::of(error);
    }
  }
  if (!failure) {
    std::string holds = exchange.claim("commit", roundTrip());
    if (holds != "commit") failure = Failure::decode(holds).value_or(Failure{"CheckpointError", holds});
  } else {
    exchange.claim(failure->encode(), roundTrip());
  }
  if (failure) {
    fs::removeTree(folder);
    throw *failure;
  }
  // The commit is claimed: from here the outcome is reported through `committed`.
  const Deadline lockDeadline = graceDeadline(1).when() > roundTrip().when() ? graceDeadline(1) : roundTrip();
  try {
    if (!supersedes.empty()) returnToResumedStep(lockDeadline);
    if (!fs::renameNoReplace(folder, final, rank))
      throw CheckpointError(fmt::format("{} appeared while step {} was being committed (another job saving into the "
                                        "same folder?); this save is dropped, that folder is left as it is",
                                        final, step),
                            {.rank = rank, .expected = "a step folder that does not exist yet"});
    fs::sync(dir, rank);
  } catch (const std::exception& error) {
    fs::removeTree(folder);
    Failure renameFailure = Failure::of(error);
    exchange.setCommitted(renameFailure.encode(), roundTrip());
    throw renameFailure;
  }
  try {
    fs::FolderLock lock(dir, lockDeadline, rank);
    writeLatest(dir, step, job, rank);
    // Another job's save never outlives its own deadline, which may be far longer than ours.
    doomed = cleanFolder(dir, keep, step, job, "", std::max(2 * timeoutSeconds, kStaleSeconds), rank);
  } catch (const std::exception& error) {
    Failure latestFailure{
        Failure::of(error).kind,
        fmt::format("step {} is complete in {}, but `latest` could not be updated: {}", step, final, error.what())};
    exchange.setCommitted(latestFailure.encode(), roundTrip());
    throw latestFailure;
  }
  exchange.setCommitted("ok", roundTrip());
  try {
    exchange.eraseReports(roundTrip());
  } catch (const std::exception& error) {
    log::debug("checkpoint", "could not erase the reports of step {}: {}", step, error.what());
  }
  result.ok = true;
  result.path = final;
}

void SaveJob::returnToResumedStep(Deadline lockDeadline) const {
  fs::FolderLock lock(dir, lockDeadline, rank);
  if (!fs::isDirectory(fs::join(dir, stepFolderName(resumedFrom))))
    throw CheckpointError(fmt::format("step {}, which this run resumed from, is no longer in {}; the later steps are "
                                      "left as they are and this save is dropped",
                                      resumedFrom, dir),
                          {.rank = rank, .expected = "the resumed step's folder in place until the first commit"});
  writeLatest(dir, resumedFrom, job, rank);
  for (int64_t newer : supersedes) {
    try {
      moveAside(newer);
    } catch (const std::exception& error) {
      if (newer == step) throw;  // the commit needs its name
      log::warn("checkpoint", "step {} stays in {}: {}", newer, dir, error.what());
    }
  }
}

void SaveJob::moveAside(int64_t newer) const {
  std::string from = fs::join(dir, stepFolderName(newer));
  if (!fs::isDirectory(from)) return;  // removed since the load
  // A job that went back twice over one step moves two folders of that step aside.
  for (int copy = 1; copy <= 100; ++copy) {
    std::string to = fs::join(dir, supersededFolderName(newer, copy == 1 ? job : fmt::format("{}.{}", job, copy)));
    if (!fs::renameNoReplace(from, to, rank)) continue;
    log::warn("checkpoint",
              "moved {} aside to {}: this run resumed from step {}, so that later step belongs to the run it went "
              "back from; it is kept until you remove it",
              from, to, resumedFrom);
    return;
  }
  throw CheckpointError(fmt::format("cannot move {} aside: 100 superseded copies of it exist", from),
                        {.rank = rank, .expected = "fewer superseded folders of one step"});
}

void SaveJob::follow(commit::Exchange& exchange, SaveResult& result) {
  auto verdict = exchange.verdict(graceDeadline(1));
  if (!verdict) {
    Failure gaveUp{
        "TimeoutError",
        fmt::format("rank {} saw no verdict on step {} from rank 0 within the checkpoint deadline ({:.1f} s) "
                    "plus {:.1f} s: rank 0 may be stalled or dead",
                    rank, step, timeoutSeconds, commitGraceSeconds(timeoutSeconds))};
    verdict = exchange.claim(gaveUp.encode(), roundTrip());
  }
  if (*verdict != "commit") throw Failure::decode(*verdict).value_or(Failure{"CheckpointError", *verdict});
  auto outcome = exchange.committed(graceDeadline(3));
  if (!outcome)
    throw Failure{"TimeoutError", fmt::format("rank 0 claimed the commit of step {} but did not confirm it; check "
                                              "`bulkhead-ckpt list {}` for whether it landed",
                                              step, dir)};
  if (*outcome != "ok") throw Failure::decode(*outcome).value_or(Failure{"CheckpointError", *outcome});
  result.ok = true;
  result.path = fs::join(dir, stepFolderName(step));
}

void SaveJob::run() {
  yieldToTraining(nice, rank);
  SaveResult result;
  result.step = step;
  result.blockingSeconds = blockingSeconds;
  commit::Exchange exchange(store, prefix, rank, worldSize);
  std::optional<Failure> own;
  try {
    own = writeOwn(exchange, result);
    if (rank == 0)
      coordinate(exchange, result);
    else
      follow(exchange, result);
  } catch (const Failure& failure) {
    const Failure& reported = own ? *own : failure;  // this rank's own error is the more precise one
    result.errorKind = reported.kind;
    result.error = reported.message;
  } catch (const std::exception& error) {
    Failure failure = own ? *own : Failure::of(error);
    result.errorKind = failure.kind;
    result.error = failure.message;
  }
  if (result.ok && own) {  // cannot happen: a rank's failure fails the save
    result.ok = false;
    result.errorKind = own->kind;
    result.error = own->message;
  }
  result.totalSeconds = secondsSince(started);
  if (result.ok) {
    if (rank == 0)
      log::info("checkpoint", "step {} saved to {} in {:.2f} s (blocking {:.3f} s)", step, result.path,
                result.totalSeconds, result.blockingSeconds);
  } else {
    log::error("checkpoint", "save of step {} failed: {}. The previous checkpoint and `latest` are untouched.", step,
               result.error);
  }
  buffer.reset();
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->result = std::move(result);
    state->done = true;
    state->changed.notify_all();
  }
  removeFolders(doomed);
  std::lock_guard<std::mutex> lock(state->mutex);
  state->finished = true;
  state->changed.notify_all();
}

}  // namespace bulkhead::checkpoint
