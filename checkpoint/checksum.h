#pragma once
// Checksums of a checkpoint.
// - fletcher32: HDF5's Fletcher-32 (H5_checksum_fletcher32, the one the
//   fletcher32 filter stores after each chunk), bit for bit, so chunks written
//   directly (H5Dwrite_chunk) with it are verified by any HDF5 reader (h5py,
//   h5dump), and chunks read directly are verified here, on several threads.
// - Hash64: FNV-1a 64-bit, for the manifest's own checksum and for a slice's
//   digest (the hash of its chunks' Fletcher-32 values, in chunk order).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace bulkhead::checkpoint {

uint32_t fletcher32(const void* data, size_t bytes);

class Hash64 {
 public:
  Hash64& add(const void* data, size_t bytes);
  Hash64& add(std::string_view text) { return add(text.data(), text.size()); }
  Hash64& add(uint64_t value) { return add(&value, sizeof value); }
  uint64_t value() const { return state_; }

 private:
  uint64_t state_ = 0xcbf29ce484222325ull;
};

// The 4 bytes of a chunk's checksum as HDF5 stores them (little-endian).
inline void storeLe32(uint8_t* at, uint32_t value) {
  for (int b = 0; b < 4; ++b) at[b] = static_cast<uint8_t>(value >> (8 * b));
}
inline uint32_t loadLe32(const uint8_t* at) {
  return uint32_t{at[0]} | uint32_t{at[1]} << 8 | uint32_t{at[2]} << 16 | uint32_t{at[3]} << 24;
}

// 16 lower-case hex digits.
std::string hex64(uint64_t value);

}  // namespace bulkhead::checkpoint
