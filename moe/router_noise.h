#pragma once
// The router's selection noise (RouterOptions::selectionNoise): a standard
// normal value per (token, expert) that is a pure function of the seed, the
// token's key and the expert id, so it does not depend on which rank routes
// the token, in which batch, or on which device. Internal to moe/.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace bulkhead::moe {

// keys: [T] int64 (any values; distinct keys give independent draws).
// Returns [T, experts] of `type` on the keys' device: std * N(0, 1) draws made
// from a 32-bit integer hash of (seed, key, expert) by the Box-Muller transform.
at::Tensor selectionNoise(const at::Tensor& keys, int64_t experts, double std, uint64_t seed, at::ScalarType type);

}  // namespace bulkhead::moe
