#pragma once
// NumPy's .npy files (format 1.0, C order, little-endian integers), for the sample indices a dataset caches,
// the samples `bulkhead-data samples` writes and the arrays Megatron-LM's own code produced for the tests.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace bulkhead::data {

struct NpyArray {
  std::string descr;  // "<i2", "<i4", "<i8", "<u2", "<u4" or "<u8"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  int64_t elements() const;
  // Element i widened to int64 (ConfigError for a uint64 above 2^63 - 1).
  int64_t at(int64_t i) const;
  std::vector<int64_t> toInt64() const;
};

// Reads an integer array; ConfigError naming the file when it is not a .npy of a C-order little-endian
// integer array whose data is as long as its shape says, IoError when it cannot be read.
NpyArray readNpy(const std::string& path);

// Writes `data` (descr's element size each) as PATH.partial, then renames it to PATH; IoError naming
// the file when it cannot be written.
void writeNpy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape, const void* data);

template <typename T>
void writeNpy(const std::string& path, std::span<const T> values, std::vector<int64_t> shape = {});

}  // namespace bulkhead::data
