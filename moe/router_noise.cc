#include "moe/router_noise.h"

#include <ATen/ATen.h>

#include <numbers>

namespace bulkhead::moe {
namespace {

constexpr int64_t kLow32 = 0xFFFFFFFF;

// A 32-bit integer mixer (x ^= x >> 16; x *= 0x45d9f3b, twice) on int64
// tensors holding values below 2^32: every product stays below 2^59, so the
// arithmetic is exact on any device.
at::Tensor mix32(at::Tensor x) {
  x = at::bitwise_and(x, kLow32);
  x = at::bitwise_and(at::bitwise_xor(x, at::bitwise_right_shift(x, 16)) * 0x45d9f3b, kLow32);
  x = at::bitwise_and(at::bitwise_xor(x, at::bitwise_right_shift(x, 16)) * 0x45d9f3b, kLow32);
  return at::bitwise_xor(x, at::bitwise_right_shift(x, 16));
}

// (h + 0.5) / 2^32: a uniform draw in (0, 1), never 0.
at::Tensor unit(const at::Tensor& h) { return (h.to(at::kDouble) + 0.5) / 4294967296.0; }

}  // namespace

at::Tensor selectionNoise(const at::Tensor& keys, int64_t experts, double std, uint64_t seed, at::ScalarType type) {
  const at::Tensor key = keys.reshape({-1, 1}).to(at::kLong);
  const auto seedLow = static_cast<int64_t>(seed & kLow32), seedHigh = static_cast<int64_t>(seed >> 32);
  // The key's two halves, then the seed's, folded in one at a time (an
  // arithmetic shift keeps negative keys distinct too).
  at::Tensor h = mix32(at::bitwise_xor(mix32(at::bitwise_and(key, kLow32) + seedLow),
                                       at::bitwise_and(at::bitwise_right_shift(key, 32), kLow32)));
  h = mix32(at::bitwise_xor(h, seedHigh));
  // Two draws per expert: odd multiples of the golden-ratio constant keep the
  // experts' inputs apart before mixing.
  const at::Tensor expert = at::arange(experts, key.options()).reshape({1, -1});
  const at::Tensor first = mix32(h + (2 * expert + 1) * int64_t{0x9E3779B1});
  const at::Tensor second = mix32(at::bitwise_xor(first, int64_t{0x85EBCA6B}));
  const at::Tensor radius = at::sqrt(-2.0 * at::log(unit(first)));
  return (std * radius * at::cos(2.0 * std::numbers::pi * unit(second))).to(type);
}

}  // namespace bulkhead::moe
