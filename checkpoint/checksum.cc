#include "checkpoint/checksum.h"

#include <fmt/format.h>

namespace bulkhead::checkpoint {

// HDF5's algorithm sums big-endian 16-bit words, s1 += w, s2 += s1, folding
// both sums to 16 bits after every 360 words (the most that cannot overflow).
// Within a block of t words the same sums are s1 += sum(w_i) and
// s2 += t*s1 + sum((t-i)*w_i): equal modulo 2^32, hence equal after the folds,
// and free of the serial dependency, so the compiler vectorises the loop.
uint32_t fletcher32(const void* data, size_t bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  size_t words = bytes / 2;
  uint32_t sum1 = 0, sum2 = 0;
  while (words) {
    uint32_t t = static_cast<uint32_t>(words > 360 ? 360 : words);
    words -= t;
    uint32_t a = 0, b = 0;
    for (uint32_t i = 0; i < t; ++i) {
      uint32_t w = (static_cast<uint32_t>(p[2 * i]) << 8) | p[2 * i + 1];
      a += w;
      b += (t - i) * w;
    }
    p += 2 * static_cast<size_t>(t);
    sum2 += t * sum1 + b;
    sum1 += a;
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  if (bytes % 2) {
    sum1 += static_cast<uint32_t>(*p) << 8;
    sum2 += sum1;
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  sum1 = (sum1 & 0xffff) + (sum1 >> 16);
  sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  return (sum2 << 16) | sum1;
}

Hash64& Hash64::add(const void* data, size_t bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    state_ ^= p[i];
    state_ *= 0x100000001b3ull;
  }
  return *this;
}

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

}  // namespace bulkhead::checkpoint
