#include "data/mapped_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "runtime/errors.h"
#include "runtime/fd.h"

namespace bulkhead::data {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid())
    throw IoError(fmt::format("cannot open {}: {}", path, std::strerror(errno)),
                  {.expected = "a readable dataset file"});
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0)
    throw IoError(fmt::format("cannot measure {}: {}", path, std::strerror(errno)),
                  {.expected = "a readable dataset file"});
  size_ = static_cast<int64_t>(info.st_size);
  if (size_ == 0) return;
  void* base = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED)
    throw IoError(fmt::format("cannot map {} ({} bytes): {}", path, size_, std::strerror(errno)),
                  {.expected = "a dataset file that can be memory-mapped"});
  data_ = static_cast<const uint8_t*>(base);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { unmap(); }

void MappedFile::unmap() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
  data_ = nullptr;
  size_ = 0;
}

}  // namespace bulkhead::data
