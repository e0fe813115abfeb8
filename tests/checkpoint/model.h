#pragma once
// A small MoE-like model for checkpoint tests: its global tensors are a pure
// function of a seed, and each rank's slices follow a parallel Layout, the way
// layers and the optimizer slice theirs (expert weights [E, H, F] split by ep
// on dim 0 and by etp on dim 2, replica id = expert-dp rank; column- and
// row-parallel dense weights split by tp, replica id = dp rank; whole tensors
// on every rank, replica id = rank). Every rank regenerates any value alone,
// so each checks what it loaded without communication.

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "checkpoint/state_dict.h"
#include "parallel/layout.h"

namespace bulkhead::testing::ckpt {

struct ModelShape {
  int layers = 2;
  int experts = 8;
  int hidden = 16;
  int ffn = 24;
};

enum class Split { Expert, Column, Row, Whole };

struct Spec {
  std::string key;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  Split split;
};

std::vector<Spec> specs(const ModelShape& shape);
// The global value of a tensor for `seed`: seeded random, never all zeros.
at::Tensor globalValue(const Spec& spec, int seed);
// This rank's state dict under `layout`, holding slices of the values of
// `seed`, plus rng, data position, layout and user blob derived from it.
checkpoint::StateDict build(const ModelShape& shape, const parallel::Layout& layout, int rank, int seed);
// Keys whose local tensor differs (bitwise) from the slice of the value of `seed`.
std::vector<std::string> mismatches(const checkpoint::StateDict& state, const ModelShape& shape, int seed);
bool bitwiseEqual(const at::Tensor& a, const at::Tensor& b);
// The non-tensor state build() puts in for (rank, seed).
std::string dataPositionOf(int rank, int seed);
std::string rngOf(int rank, int seed);
std::string userBlobOf(int seed);

}  // namespace bulkhead::testing::ckpt
