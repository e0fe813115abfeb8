#pragma once
// Seeded random inputs that every rank can regenerate for any other rank, so
// each checks results against a reference it computes alone.

#include <ATen/ATen.h>

#include <vector>

namespace bulkhead::testing {

// Random values on which sums, products, min, max and power-of-two averages
// are exact in every supported dtype, so results compare with at::equal:
// quarter steps in [-2, 2) for floats, [-8, 8) for integers ([0, 16) unsigned);
// for products, factors from {-2, -1, -1/2, 1/2, 1, 2} (integers: ±1, ±2).
at::Tensor draw(int rank, int salt, at::IntArrayRef shape, at::ScalarType dtype, bool forProduct = false);

// The dtypes both backends support.
std::vector<at::ScalarType> supportedDtypes();

// A generator seeded the same on every rank, for choices all ranks share.
at::Generator sharedGenerator(int salt);

// Standard normal float64 values from sharedGenerator(salt): continuous, so no two tie.
at::Tensor gaussian(int salt, at::IntArrayRef shape);

}  // namespace bulkhead::testing
