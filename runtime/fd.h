#pragma once
// An owned POSIX file descriptor, closed when it goes out of scope (-1: none).

#include <unistd.h>

#include <cerrno>
#include <cstddef>

namespace bulkhead {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Writes all `size` bytes (retrying short and interrupted writes); 0, or
  // the errno of the write that failed.
  int writeAll(const void* data, size_t size) const {
    const char* bytes = static_cast<const char*>(data);
    for (size_t done = 0; done < size;) {
      ssize_t n = ::write(fd_, bytes + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return errno;
      done += static_cast<size_t>(n);
    }
    return 0;
  }

 private:
  int fd_;
};

}  // namespace bulkhead
