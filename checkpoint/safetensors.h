#pragma once
// Hugging Face safetensors files, read and written without any library but
// nlohmann-json for the header. The format: an unsigned 64-bit little-endian
// header length N, N bytes of JSON
//   {"<name>": {"dtype": "BF16", "shape": [4096, 1024], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>"}}
// then the data, each tensor's bytes (row-major, little-endian) at
// [begin, end) counted from the first byte after the header.
//
// A file is checked against its header before anything is read from it: the
// header length within the file and at most 100 MB, the JSON an object of
// entries with a known dtype, a shape of non-negative dimensions, offsets
// within the data whose length is the shape's bytes, and no two tensors
// overlapping. A damaged or hostile file is a CheckpointError that names the
// file, the tensor and the problem; nothing is read outside the file.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/fd.h"

namespace bulkhead::checkpoint {

struct SafetensorsTensor {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // in the data, from the first byte after the header
  int64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // in the header's order
  std::map<std::string, std::string> metadata;
  int64_t dataStart = 0;  // 8 + header length
  int64_t dataBytes = 0;  // the file's size - dataStart
};

// "F32", "BF16", ...: the dtypes both sides know (float64/32/16, bfloat16,
// int64/32/16/8, uint8, bool). ConfigError for another dtype.
std::string safetensorsDtypeName(c10::ScalarType dtype);
std::optional<c10::ScalarType> parseSafetensorsDtype(const std::string& name);

constexpr int64_t kMaxSafetensorsHeader = 100'000'000;

// Parses and checks `json`, the header of `path`, a file of `fileBytes`
// bytes whose header is `json.size()` bytes long.
SafetensorsHeader parseSafetensorsHeader(const std::string& json, int64_t fileBytes, const std::string& path);

// A safetensors file opened for reading; its header checked.
class SafetensorsFile {
 public:
  // IoError when it cannot be opened; CheckpointError when it is not a valid
  // safetensors file.
  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  const SafetensorsTensor* find(const std::string& name) const;
  // The tensor's bytes into `target` (tensor.bytes() of them); IoError on a
  // short read (the file changed since it was opened).
  void readInto(const SafetensorsTensor& tensor, void* target) const;
  at::Tensor read(const SafetensorsTensor& tensor) const;  // a contiguous CPU tensor
  // The block of the tensor at `offsets` with extent `sizes` (one each per dimension), as a contiguous CPU
  // tensor, reading only its bytes: one read per contiguous run. ConfigError for a block outside the shape.
  // `buffer`: a contiguous CPU tensor of the tensor's dtype and at least the block's elements, read into (its
  // first elements, viewed as the block) instead of a new one (else a new one), so that a reader of many
  // blocks allocates once.
  at::Tensor readBlock(const SafetensorsTensor& tensor, const std::vector<int64_t>& offsets,
                       const std::vector<int64_t>& sizes, const at::Tensor& buffer = {}) const;

 private:
  std::string path_;
  Fd fd_;
  SafetensorsHeader header_;
};

// Writes one safetensors file: the header first (offsets assigned in the
// order given), then each tensor's bytes in that order. The file is written
// beside its final name and renamed there by finish(), after an fsync: an
// interrupted export never leaves a file that looks complete. A file of 64 MB
// of data or more is written with O_DIRECT where the file system allows: its
// header padded so that the data starts 4 KiB-aligned, the bytes gathered in
// two aligned buffers of 32 MB, one filled while the other is written (no copy
// through the page cache, and the disk busy while the caller reads on).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsTensor> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();  // removes an unfinished file

  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // The bytes of the next tensor, whole or in parts; ConfigError past its size.
  void append(const void* bytes, int64_t size);
  // ConfigError when a tensor is incomplete; IoError when the file cannot be
  // written. Returns the file's size.
  int64_t finish();

 private:
  struct Aligned {
    void operator()(uint8_t* p) const;
  };
  void put(const char* bytes, int64_t size);
  void flushStaged();
  void settle();  // waits for the write in flight; rethrows its error

  std::string path_, partial_;
  Fd fd_, directFd_;
  std::vector<SafetensorsTensor> tensors_;
  size_t next_ = 0;        // the tensor being written
  int64_t written_ = 0;    // bytes of data appended
  int64_t dataStart_ = 0;  // file offset of the data
  int64_t fileBytes_ = 0;
  std::unique_ptr<uint8_t, Aligned> staging_[2];
  int current_ = 0;
  int64_t staged_ = 0;    // bytes in staging_[current_]
  int64_t stagedAt_ = 0;  // the file offset they go to
  std::future<void> inFlight_;
};

}  // namespace bulkhead::checkpoint
