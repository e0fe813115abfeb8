#pragma once
// A Store on a directory that every rank can reach (a shared filesystem), for
// jobs that have no network path to rank 0 but share storage.
//
// Layout: one file per key, named by an encoding of the key that is safe on
// any filesystem ("k." then the key with every byte outside [A-Za-z0-9_-]
// written as %XX), plus a lock file.
// - Writes (set, add, compareSet, erase) hold the lock file (flock, polled
//   with LOCK_NB against the deadline, and a process-wide mutex, since on NFS
//   flock does not exclude threads of one process). A value is written to a
//   temporary file and renamed over the key's file, so readers see the old
//   value or the new one, never part of one.
// - Reads (get, tryGet, multiGet, wait) take no lock; get and wait poll with
//   Backoff until the deadline.
// - The deadline bounds waiting for keys and for the lock; the file system
//   calls themselves are bounded by the file system. Values are not fsynced:
//   the store coordinates a running job, it does not outlive it.
// - IoError when the directory cannot be created, read or written; ConfigError
//   for a key whose encoded name is too long for a file name.

#include <chrono>
#include <string>

#include "runtime/store/store.h"

namespace bulkhead {

struct FileStoreOptions {
  // The longest pause between two polls of a get or wait.
  std::chrono::microseconds pollCap{std::chrono::milliseconds(10)};
  // This process's rank, carried by the errors this store raises.
  int rank = -1;
};

class FileStore final : public Store {
 public:
  // Creates `directory` (and its parents) if missing. IoError when it cannot.
  explicit FileStore(std::string directory, FileStoreOptions options = {});

  const std::string& directory() const { return directory_; }

  void set(const std::string& key, const std::string& value, Deadline deadline) override;
  std::string get(const std::string& key, Deadline deadline) override;
  std::optional<std::string> tryGet(const std::string& key, Deadline deadline) override;
  std::vector<std::optional<std::string>> multiGet(const std::vector<std::string>& keys, Deadline deadline) override;
  int64_t add(const std::string& key, int64_t delta, Deadline deadline) override;
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                         Deadline deadline) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool erase(const std::string& key, Deadline deadline) override;
  std::string describe() const override;

  // The file name that holds `key` inside the directory.
  static std::string fileNameOf(const std::string& key);

 private:
  class WriteLock;  // file_store.cc

  std::string pathOf(const std::string& key) const;
  std::optional<std::string> read(const std::string& key) const;
  void write(const std::string& key, const std::string& value);

  std::string directory_;
  FileStoreOptions options_;
};

}  // namespace bulkhead
