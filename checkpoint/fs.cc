#include "checkpoint/fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

#include "runtime/backoff.h"
#include "runtime/errors.h"
#include "runtime/fd.h"

namespace bulkhead::checkpoint::fs {
namespace {

std::string parentOf(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

void raise(const std::string& what, int error, int rank) {
  const char* advice = error == ENOSPC || error == EDQUOT
                           ? "free space on that file system (or point the checkpoint folder elsewhere)"
                       : error == EACCES || error == EPERM || error == EROFS
                           ? "check the permissions of the checkpoint folder and that it is writable"
                           : "check that the checkpoint folder exists on a file system every rank reaches";
  throw IoError(fmt::format("{} failed: {} (errno {}); {}", what, std::strerror(error), error, advice),
                {.rank = rank, .expected = "a readable, writable checkpoint folder with room"});
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

namespace {
std::string withoutTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}
}  // namespace

std::string parent(const std::string& path) {
  std::string trimmed = withoutTrailingSlashes(path);
  size_t slash = trimmed.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : trimmed.substr(0, slash);
}

std::string baseName(const std::string& path) {
  std::string trimmed = withoutTrailingSlashes(path);
  size_t slash = trimmed.rfind('/');
  return slash == std::string::npos ? trimmed : trimmed.substr(slash + 1);
}

bool exists(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0;
}

bool isDirectory(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

std::optional<int64_t> fileSize(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) return std::nullopt;
  return static_cast<int64_t>(info.st_size);
}

std::optional<double> ageSeconds(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) return std::nullopt;
  return std::difftime(std::time(nullptr), info.st_mtime);
}

void makeDirectories(const std::string& path, int rank) {
  std::string failed;
  if (int error = bulkhead::makeDirectories(path, &failed))
    raise(fmt::format("creating the folder {}", failed), error, rank);
}

std::vector<std::string> list(const std::string& dir, int rank) {
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) raise(fmt::format("listing the folder {}", dir), errno, rank);
  std::vector<std::string> names;
  while (struct dirent* entry = ::readdir(handle)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  ::closedir(handle);
  std::sort(names.begin(), names.end());
  return names;
}

bool removeTree(const std::string& path) {
  if (!exists(path)) return true;
  ::nftw(
      path.c_str(), [](const char* entry, const struct stat*, int, struct FTW*) { return ::remove(entry), 0; }, 16,
      FTW_DEPTH | FTW_PHYS);
  return !exists(path);
}

void sync(const std::string& path, int rank) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) raise(fmt::format("opening {} to fsync it", path), errno, rank);
  // EINVAL: the file system does not sync this kind of file (some do not sync folders).
  if (::fsync(fd.get()) != 0 && errno != EINVAL) raise(fmt::format("fsync of {}", path), errno, rank);
}

bool renameNoReplace(const std::string& from, const std::string& to, int rank) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return true;
  int error = errno;
  if (error == EEXIST || error == ENOTEMPTY) return false;
  if (error != EINVAL && error != ENOSYS) raise(fmt::format("renaming {} to {}", from, to), error, rank);
  // No RENAME_NOREPLACE here: rename(2) cannot replace a non-empty folder, and
  // the check keeps it from replacing anything else.
  if (exists(to)) return false;
  if (::rename(from.c_str(), to.c_str()) == 0) return true;
  error = errno;
  if (error == EEXIST || error == ENOTEMPTY) return false;
  raise(fmt::format("renaming {} to {}", from, to), error, rank);
}

void replaceFile(const std::string& path, const std::string& content, const std::string& tag, int rank) {
  std::string temporary = fmt::format("{}.tmp.{}", path, tag);
  {
    Fd fd(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) raise(fmt::format("creating {}", temporary), errno, rank);
    if (int error = fd.writeAll(content.data(), content.size())) {
      ::unlink(temporary.c_str());
      raise(fmt::format("writing {}", temporary), error, rank);
    }
    if (::fsync(fd.get()) != 0) {
      int error = errno;
      ::unlink(temporary.c_str());
      raise(fmt::format("fsync of {}", temporary), error, rank);
    }
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    int error = errno;
    ::unlink(temporary.c_str());
    raise(fmt::format("renaming {} to {}", temporary, path), error, rank);
  }
  sync(parentOf(path), rank);
}

std::optional<std::string> readFile(const std::string& path, int* error) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (error) *error = errno;
    return std::nullopt;
  }
  std::string content;
  char buffer[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      if (error) *error = errno;
      return std::nullopt;
    }
    if (n == 0) break;
    content.append(buffer, static_cast<size_t>(n));
  }
  return content;
}

FolderLock::FolderLock(const std::string& dir, Deadline deadline, int rank) {
  std::string path = join(dir, ".lock");
  fd_ = Fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd_.valid()) raise(fmt::format("opening the folder lock {}", path), errno, rank);
  auto started = Deadline::Clock::now();
  Backoff backoff(std::chrono::milliseconds(20));
  while (::flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    int error = errno;
    if (error != EWOULDBLOCK && error != EINTR) {
      raise(fmt::format("locking {}", path), error, rank);
    }
    if (deadline.expired()) {
      throw TimeoutError(fmt::format("the checkpoint folder lock {} was held by another process for {:.1f} s; "
                                     "another job may be saving into the same folder: give each job its own folder",
                                     path, secondsSince(started)),
                         {.rank = rank, .expected = "the folder lock within the checkpoint deadline"});
    }
    backoff.pause(deadline);
  }
}

FolderLock::~FolderLock() {
  if (fd_.valid()) ::flock(fd_.get(), LOCK_UN);
}

}  // namespace bulkhead::checkpoint::fs
