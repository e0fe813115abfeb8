#pragma once
// Shared pieces of the optimizer and tensor-parallel tests: process groups
// for a layout, seeded float64 tensors every rank can regenerate, slices,
// relative errors, and assembling / filling sharded state the way a
// checkpoint would (without the checkpoint library).

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "parallel/parameter.h"
#include "parallel/process_groups.h"

namespace bulkhead::testing {

parallel::ProcessGroups makeGroups(const parallel::LayoutOptions& options);

// Normal float64 values from a generator seeded by (a, b, c, name).
at::Tensor seeded(at::IntArrayRef shape, int a, int b = 0, int c = 0, const std::string& name = "");

// max |got - want| / max |want| (got and want as float64).
double relativeError(const at::Tensor& got, const at::Tensor& want);

// The block of `global` at `offsets` with extent `shape`.
at::Tensor sliceOf(const at::Tensor& global, const std::vector<int64_t>& offsets, at::IntArrayRef shape);

// A global tensor described to every rank: its key and shape.
struct GlobalKey {
  std::string key;
  std::vector<int64_t> shape;
};

// The global tensors of `keys` (float64), assembled from every world rank's
// replica-0 pieces in `state` with one world all-reduce per key; CHECKs that
// every element is covered exactly once. Collective over the world.
std::map<std::string, at::Tensor> assemble(const std::vector<parallel::ShardedTensor>& state,
                                           const std::vector<GlobalKey>& keys);

// Fills every target's local tensor from the global tensor of its key (as a
// checkpoint load would); CHECKs that each target's key is present.
void fillFrom(const std::vector<parallel::ShardedTensor>& targets, const std::map<std::string, at::Tensor>& globals);

}  // namespace bulkhead::testing
