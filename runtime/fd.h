#pragma once
// An owned POSIX file descriptor, closed when it goes out of scope (-1: none).

#include <unistd.h>

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

 private:
  int fd_;
};

}  // namespace bulkhead
