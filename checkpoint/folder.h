#pragma once
// The checkpoint folder (docs/design.md#checkpoints-layout-and-commit):
//   DIR/step_000100/              a committed checkpoint: rank files + manifest.txt
//   DIR/step_000200.tmp.<job>/    a save in progress, or abandoned by a job that failed or died
//   DIR/step_000050.deleting.<job>/  an old checkpoint being removed (renamed first, so it is
//                                    never seen half-deleted under a committed name)
//   DIR/step_000300.superseded.<job>/  a committed checkpoint newer than the step a job
//                                    resumed from, moved aside by that job's first commit
//                                    (a rollback); kept until the user removes it
//   DIR/latest                    "step_000100": the newest committed step, replaced atomically
//   DIR/.lock                     held while `latest` is swapped and old folders removed
// Two jobs may share a folder: their temporary folders carry their own job
// nonce, a commit never replaces an existing step folder (a resumed run moves
// the steps after the one it resumed from aside first, see checkpointer.h),
// and `latest` always names a complete checkpoint.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace bulkhead::checkpoint {

constexpr const char* kManifestName = "manifest.txt";
constexpr const char* kLatestName = "latest";

std::string stepFolderName(int64_t step);  // step_000100 (at least 6 digits)
std::string temporaryFolderName(int64_t step, const std::string& job);
std::string supersededFolderName(int64_t step, const std::string& job);
// The step of a committed folder's name; nullopt for any other name.
std::optional<int64_t> parseStepFolder(const std::string& name);

struct FolderEntry {
  enum class Kind { Committed, Temporary, Deleting, Superseded };
  std::string name;
  Kind kind = Kind::Committed;
  int64_t step = 0;
  std::string job;  // temporary, deleting and superseded folders
  double ageSeconds = 0;
};

// Every checkpoint folder in `dir`, by step. IoError when it cannot be listed.
std::vector<FolderEntry> scanFolder(const std::string& dir, int rank);
// The step `latest` names; nullopt when there is no `latest`. CheckpointError
// when it cannot be read or does not name a step folder.
std::optional<int64_t> readLatest(const std::string& dir, int rank);
// Replaces `latest` atomically (fs::replaceFile).
void writeLatest(const std::string& dir, int64_t step, const std::string& job, int rank);

// Retires committed checkpoints beyond the `keep` newest (by step), never the
// one `latest` names nor `justCommitted` (keep <= 0 keeps all): each is renamed
// to step_N.deleting.<job>, so it is never seen half-removed under a committed
// name. Returns the folders to remove: those, this job's temporary folders
// other than `current`, and any job's temporary or deleting folders untouched
// for `staleSeconds` (a save never outlives its deadline; the caller allows for
// other jobs' longer ones). This job's deleting folders are left to the removal
// already under way; superseded folders are never removed. Call it holding the
// folder lock; remove the folders with removeFolders after releasing it. Best
// effort: failures are logged, never raised.
std::vector<std::string> cleanFolder(const std::string& dir, int keep, int64_t justCommitted, const std::string& job,
                                     const std::string& current, double staleSeconds, int rank);
// Removes each folder and what it holds; failures are logged.
void removeFolders(const std::vector<std::string>& folders);

}  // namespace bulkhead::checkpoint
