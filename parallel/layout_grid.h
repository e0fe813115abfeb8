#pragma once
// Internal to parallel/: the slots of the two grids and the arithmetic that
// maps a rank to its coordinates on one grid. Not part of the public API.

#include <array>

#include "parallel/layout.h"

namespace bulkhead::parallel {

// Dense grid slots.
inline constexpr int kSlotTp = 0, kSlotCp = 1, kSlotDp = 2;
// Expert grid slots.
inline constexpr int kSlotEtp = 0, kSlotEp = 1, kSlotEdp = 2;
// Both grids: pp is slot 3, and the grids share it.
inline constexpr int kSlotPp = 3;

// A rank's coordinate on each slot of `grid`.
inline std::array<int, 4> gridCoordinates(const detail::Grid& grid, int rank) {
  std::array<int, 4> coords{};
  for (int slot = 0; slot < 4; ++slot) coords[slot] = (rank / grid.stride[slot]) % grid.size[slot];
  return coords;
}

}  // namespace bulkhead::parallel
