#pragma once
// Layout-independent initial values and balanced partitions for sharded
// parameters: a global tensor's values depend only on its key and a seed, so
// a model initialised under any tp/ep/dp layout starts from the same global
// weights (layouts compare step for step).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "parallel/parameter.h"

namespace bulkhead::parallel {

// Part `index` of `total` items cut into `parts` contiguous parts; the first
// total % parts parts hold one item more.
struct Range {
  int64_t begin = 0;
  int64_t length = 0;
};
Range partition(int64_t total, int parts, int index);

// This rank's slice (shard.offsets, extent `localShape`) of a global tensor
// of shape shard.globalShape drawn from N(0, std^2) by a generator seeded from
// `key` and `seed`. Draws the global tensor in float64 on the CPU, then casts
// to `options` (dtype, device): memory for one global tensor at init.
at::Tensor seededSlice(const std::string& key, uint64_t seed, const ShardInfo& shard, at::IntArrayRef localShape,
                       double std, at::TensorOptions options);

// A parameter tensor for this rank: seededSlice (or zeros when std == 0),
// requiring grad.
at::Tensor newParameterTensor(const std::string& key, uint64_t seed, const ShardInfo& shard, at::IntArrayRef localShape,
                              double std, at::TensorOptions options);

}  // namespace bulkhead::parallel
