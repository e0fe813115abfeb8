#pragma once
// The POSIX file-system steps of a checkpoint: directories, durable writes
// (fsync of files and of the folders that name them), renames that never
// replace a committed checkpoint, and a folder lock bounded by a deadline.
// POSIX calls rather than std::filesystem: libtorch 2.x exports a broken copy
// of std::filesystem's symbols (see tests/support/temp_dir.h).
//
// Errors: IoError naming the path, the errno text and the rank, and what to do.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/fd.h"

namespace bulkhead::checkpoint::fs {

// The one conversion of an errno into an IoError.
[[noreturn]] void raise(const std::string& what, int error, int rank);

std::string join(const std::string& dir, const std::string& name);
// The folder holding `path` ("." for a bare name, "/" for a top-level entry); trailing slashes are ignored.
std::string parent(const std::string& path);
// The last component of `path`, trailing slashes ignored.
std::string baseName(const std::string& path);
bool exists(const std::string& path);
bool isDirectory(const std::string& path);
// Size in bytes, nullopt when the path does not exist or is not a file.
std::optional<int64_t> fileSize(const std::string& path);
// Seconds since the last modification; nullopt when the path does not exist.
std::optional<double> ageSeconds(const std::string& path);

// mkdir -p. IoError when a component cannot be created.
void makeDirectories(const std::string& path, int rank);
// Names in `dir` (no "." or ".."), sorted. IoError when it cannot be read.
std::vector<std::string> list(const std::string& dir, int rank);
// rm -rf; best effort (returns false and leaves what it could not remove).
bool removeTree(const std::string& path);

// fsync of a file or a directory (a directory's fsync makes the names in it durable).
void sync(const std::string& path, int rank);
// Renames `from` to `to` unless `to` exists: returns false then, never replaces
// it (renameat2 RENAME_NOREPLACE; on file systems without it, a check before a
// plain rename, which cannot replace a non-empty directory either).
bool renameNoReplace(const std::string& from, const std::string& to, int rank);
// Writes `content` to `path` atomically: a temporary file beside it (named with
// `tag`, so two writers never share one), fsync, rename over `path`, fsync of
// the folder. Readers see the old content or the new, never a mix.
void replaceFile(const std::string& path, const std::string& content, const std::string& tag, int rank);
// The whole file, or nullopt with `error` set to errno when it cannot be read.
std::optional<std::string> readFile(const std::string& path, int* error = nullptr);

// An exclusive lock on DIR/.lock (flock, polled against the deadline), held by
// the coordinator while it swaps `latest`, removes old checkpoints and cleans
// stale folders, so two jobs sharing a folder take turns. TimeoutError when
// the deadline passes first.
class FolderLock {
 public:
  FolderLock(const std::string& dir, Deadline deadline, int rank);
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock();

 private:
  Fd fd_;
};

}  // namespace bulkhead::checkpoint::fs
