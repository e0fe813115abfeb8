#pragma once
// Helpers of the snapshot tests (snapshot_test.cc, snapshot_gpu_test.cc).

#include <ATen/ATen.h>

#include "launch/snapshot.h"

namespace bulkhead::testing {

// Tensors of the same names, shapes, dtypes and devices, all zero: what a restore fills.
inline launch::NamedTensors zerosLike(const launch::NamedTensors& state) {
  launch::NamedTensors out;
  for (const auto& [name, tensor] : state) out.emplace_back(name, at::zeros_like(tensor));
  return out;
}

// Whether two states hold the same values, wherever their tensors live.
inline bool equalStates(const launch::NamedTensors& a, const launch::NamedTensors& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (a[i].first != b[i].first || !at::equal(a[i].second.cpu(), b[i].second.cpu())) return false;
  return a.size() == b.size();
}

}  // namespace bulkhead::testing
