#pragma once
// A whole file mapped read-only into memory, unmapped once when it goes out of scope. Nothing is
// read through it beyond size(): the dataset reader checks every offset against it first.

#include <cstddef>
#include <cstdint>
#include <string>

namespace bulkhead::data {

class MappedFile {
 public:
  // IoError naming `path` when it cannot be opened, measured or mapped; an empty file maps to no bytes.
  explicit MappedFile(const std::string& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  void unmap();

  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace bulkhead::data
