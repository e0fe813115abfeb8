#include "runtime/fd.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace bulkhead {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int Fd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int Fd::close() {
  const int fd = release();
  return fd >= 0 && ::close(fd) != 0 ? errno : 0;
}

int Fd::writeAll(const void* data, size_t size) const {
  const char* bytes = static_cast<const char*>(data);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd_, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    done += static_cast<size_t>(n);
  }
  return 0;
}

int makeDirectories(const std::string& path, std::string* failed) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      const int error = errno;
      if (failed != nullptr) *failed = prefix;
      return error;
    }
    if (slash == std::string::npos) return 0;
  }
}

}  // namespace bulkhead
