#include "runtime/store/file_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "runtime/backoff.h"
#include "runtime/errors.h"
#include "runtime/fd.h"

namespace bulkhead {
namespace {

using Clock = Deadline::Clock;

// File names stay well under the usual 255-byte limit, temporary suffix included.
constexpr size_t kMaxFileName = 200;
constexpr const char* kLockFileName = "lock";

// The one conversion of a file system errno into an error.
[[noreturn]] void raiseIoError(const std::string& what, int error, int rank) {
  throw IoError(fmt::format("{} failed: {} (errno {}); check that the store directory exists on a file system "
                            "every rank shares, with room and write permission",
                            what, std::strerror(error), error),
                {.rank = rank, .expected = "a readable and writable store directory"});
}

// Serialises this process's writers: flock does not exclude threads of one
// process on file systems that emulate it with fcntl locks (NFS).
// Polled with try_lock, as flock is, so that the wait is bounded by the deadline
// without pthread_mutex_clocklock (which ThreadSanitizer does not see).
std::mutex processWriters;

}  // namespace

// Holds the store's lock file: first the process-wide mutex, then flock,
// each polled against the deadline.
class FileStore::WriteLock {
 public:
  WriteLock(const FileStore& store, const std::string& subject, Deadline deadline)
      : fd_(::open((store.directory_ + "/" + kLockFileName).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    auto started = Clock::now();
    if (fd_.get() < 0)
      raiseIoError(fmt::format("opening the lock file of store {}", store.describe()), errno, store.options_.rank);
    Backoff backoff(store.options_.pollCap);
    if (deadline.isNever()) processWriters.lock();
    while (!deadline.isNever() && !processWriters.try_lock()) {
      if (deadline.expired()) timeout(store, subject, started);
      backoff.pause(deadline);
    }
    while (::flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
      int error = errno;
      if (error != EWOULDBLOCK && error != EINTR) {
        processWriters.unlock();
        raiseIoError(fmt::format("locking store {}", store.describe()), error, store.options_.rank);
      }
      if (deadline.expired()) {
        processWriters.unlock();
        timeout(store, subject, started);
      }
      backoff.pause(deadline);
    }
  }
  WriteLock(const WriteLock&) = delete;
  WriteLock& operator=(const WriteLock&) = delete;
  ~WriteLock() {
    ::flock(fd_.get(), LOCK_UN);
    processWriters.unlock();
  }

 private:
  [[noreturn]] static void timeout(const FileStore& store, const std::string& subject, Clock::time_point started) {
    throw TimeoutError(fmt::format("{} on store {}: could not take the store's lock within {:.2f} s; another process "
                                   "holds it (a stalled rank, or a stale NFS lock): check the ranks that share this "
                                   "directory, or extend the deadline",
                                   subject, store.describe(), secondsSince(started)),
                       {.rank = store.options_.rank, .expected = "the store's lock file free"});
  }

  Fd fd_;
};

FileStore::FileStore(std::string directory, FileStoreOptions options)
    : directory_(std::move(directory)), options_(options) {
  if (directory_.empty())
    throw ConfigError("FileStore needs a directory; pass a path every rank shares",
                      {.rank = options_.rank, .expected = "a directory path"});
  while (directory_.size() > 1 && directory_.back() == '/') directory_.pop_back();
  std::string failed;
  if (int error = makeDirectories(directory_, &failed))
    raiseIoError(fmt::format("creating the store directory {}", failed), error, options_.rank);
}

std::string FileStore::describe() const { return "file://" + directory_; }

std::string FileStore::fileNameOf(const std::string& key) {
  static const char* hex = "0123456789ABCDEF";
  std::string name = "k.";
  for (unsigned char c : key) {
    bool safe = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (safe) {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += hex[c >> 4];
      name += hex[c & 15];
    }
  }
  return name;
}

std::string FileStore::pathOf(const std::string& key) const {
  requireKey(key, *this, options_.rank);
  std::string name = fileNameOf(key);
  if (name.size() > kMaxFileName)
    throw ConfigError(fmt::format("key '{}' is too long for store {} (its file name would be {} bytes, over {}); "
                                  "use shorter keys",
                                  key.substr(0, 64), describe(), name.size(), kMaxFileName),
                      {.rank = options_.rank, .expected = "a shorter key"});
  return directory_ + "/" + name;
}

std::optional<std::string> FileStore::read(const std::string& key) const {
  std::string path = pathOf(key);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return std::nullopt;
    raiseIoError(fmt::format("opening {}", path), errno, options_.rank);
  }
  std::string value;
  char chunk[64 * 1024];
  while (true) {
    ssize_t got = ::read(fd.get(), chunk, sizeof(chunk));
    if (got == 0) return value;
    if (got < 0) {
      if (errno == EINTR) continue;
      raiseIoError(fmt::format("reading {}", path), errno, options_.rank);
    }
    value.append(chunk, static_cast<size_t>(got));
  }
}

void FileStore::write(const std::string& key, const std::string& value) {
  static std::atomic<uint64_t> counter{0};
  std::string path = pathOf(key);
  // The temporary name is unique across processes (pid) and threads (counter)
  // and starts with '.', so it never reads as a key.
  std::string temporary = fmt::format("{}/.tmp.{}.{}.{}", directory_, ::getpid(), counter++, fileNameOf(key));
  {
    Fd fd(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0) raiseIoError(fmt::format("creating {}", temporary), errno, options_.rank);
    if (int error = fd.writeAll(value.data(), value.size())) {
      ::unlink(temporary.c_str());
      raiseIoError(fmt::format("writing {}", temporary), error, options_.rank);
    }
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    int error = errno;
    ::unlink(temporary.c_str());
    raiseIoError(fmt::format("renaming {} to {}", temporary, path), error, options_.rank);
  }
}

void FileStore::set(const std::string& key, const std::string& value, Deadline deadline) {
  pathOf(key);  // a bad key fails before the lock
  WriteLock lock(*this, fmt::format("set('{}')", key), deadline);
  write(key, value);
}

std::string FileStore::get(const std::string& key, Deadline deadline) {
  auto started = Clock::now();
  Backoff backoff(options_.pollCap);
  while (true) {
    if (std::optional<std::string> value = read(key)) return std::move(*value);
    if (deadline.expired())
      throw TimeoutError(fmt::format("get('{}') on store {}: key '{}' not set within {:.2f} s; check that the rank "
                                     "that sets it is alive and uses the same key (and prefix), or extend the "
                                     "deadline",
                                     key, describe(), key, secondsSince(started)),
                         {.rank = options_.rank, .expected = "keys set by other ranks before the deadline"});
    backoff.pause(deadline);
  }
}

std::optional<std::string> FileStore::tryGet(const std::string& key, Deadline deadline) { return read(key); }

std::vector<std::optional<std::string>> FileStore::multiGet(const std::vector<std::string>& keys, Deadline deadline) {
  std::vector<std::optional<std::string>> values;
  values.reserve(keys.size());
  for (const std::string& key : keys) values.push_back(read(key));
  return values;
}

int64_t FileStore::add(const std::string& key, int64_t delta, Deadline deadline) {
  pathOf(key);
  WriteLock lock(*this, fmt::format("add('{}', {})", key, delta), deadline);
  int64_t current = 0;
  if (std::optional<std::string> value = read(key)) {
    std::optional<int64_t> parsed = parseStoreInteger(*value);
    if (!parsed)
      throw ConfigError(fmt::format("add('{}', {}) on store {}: the key holds a value that is not a decimal integer",
                                    key, delta, describe()),
                        {.rank = options_.rank, .expected = "a key written only by add"});
    current = *parsed;
  }
  int64_t updated = 0;
  if (__builtin_add_overflow(current, delta, &updated))
    throw ConfigError(
        fmt::format("add('{}', {}) on store {}: {} + {} overflows int64", key, delta, describe(), current, delta),
        {.rank = options_.rank});
  write(key, std::to_string(updated));
  return updated;
}

std::string FileStore::compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                                  Deadline deadline) {
  pathOf(key);
  WriteLock lock(*this, fmt::format("compareSet('{}')", key), deadline);
  std::optional<std::string> current = read(key);
  bool matches = current ? (!expected.empty() && *current == expected) : expected.empty();
  if (!matches) return current.value_or("");
  write(key, desired);
  return desired;
}

void FileStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  auto started = Clock::now();
  Backoff backoff(options_.pollCap);
  std::vector<std::string> missing = keys;
  while (true) {
    std::erase_if(missing, [&](const std::string& key) { return read(key).has_value(); });
    if (missing.empty()) return;
    if (deadline.expired())
      throw TimeoutError(fmt::format("wait({}) on store {}: {} {} not set within {:.2f} s; check that the ranks that "
                                     "set them are alive and use the same keys (and prefix), or extend the deadline",
                                     quoteKeys(keys, 4), describe(), missing.size() == 1 ? "key" : "keys",
                                     quoteKeys(missing), secondsSince(started)),
                         {.rank = options_.rank, .expected = "keys set by other ranks before the deadline"});
    backoff.pause(deadline);
  }
}

bool FileStore::erase(const std::string& key, Deadline deadline) {
  std::string path = pathOf(key);
  WriteLock lock(*this, fmt::format("erase('{}')", key), deadline);
  if (::unlink(path.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  raiseIoError(fmt::format("removing {}", path), errno, options_.rank);
}

}  // namespace bulkhead
