#pragma once
// The POSIX file layer under the store, the sockets and the checkpoints: an
// owned file descriptor and directory creation. Callers turn the errno these
// return into their own typed error (IoError, CommError) with their advice.

#include <cstddef>
#include <string>

namespace bulkhead {

// An owned file descriptor (file, socket, pipe end or epoll instance), closed
// once when it goes out of scope or is reset; -1: none. Movable, not copyable.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership: returns the descriptor and leaves -1.
  int release();
  // Closes the descriptor, if any (close() is not retried on EINTR: on Linux
  // the descriptor is gone either way).
  void reset();
  // Closes the descriptor now, for callers that must know the file's data
  // reached the kernel (a write error can surface only here): 0 or errno.
  int close();
  // Writes all `size` bytes (retrying short and interrupted writes); 0, or
  // the errno of the write that failed.
  int writeAll(const void* data, size_t size) const;

 private:
  int fd_ = -1;
};

// mkdir -p with mode 0755. Returns 0, or the errno of the first component that
// could not be created, with that component in `failed` when given.
int makeDirectories(const std::string& path, std::string* failed = nullptr);

}  // namespace bulkhead
