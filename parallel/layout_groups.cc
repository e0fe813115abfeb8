// Layout: the groups of each kind. A kind on one grid names a set of slots
// (its mask); its group of a rank holds the ranks that agree with it on every
// other slot. Groups are numbered by the unmasked coordinates (leftmost in
// the order fastest) and their members ordered by the masked coordinates the
// same way, which is rank order: exactly Megatron-LM's
// generate_masked_orthogonal_rank_groups.
#include <array>

#include "parallel/layout.h"
#include "parallel/layout_grid.h"

namespace bulkhead::parallel {
namespace {

using detail::Grid;

enum class Source { Dense, Expert, Derived };
struct KindSpec {
  Source source;
  unsigned mask;  // one bit per slot of the grid
};

constexpr unsigned bit(int slot) { return 1u << slot; }
constexpr unsigned kAllSlots = 0xFu;

KindSpec specOf(GroupKind kind) {
  switch (kind) {
    case GroupKind::Tp:
      return {Source::Dense, bit(kSlotTp)};
    case GroupKind::Cp:
      return {Source::Dense, bit(kSlotCp)};
    case GroupKind::Pp:
      return {Source::Dense, bit(kSlotPp)};
    case GroupKind::Dp:
      return {Source::Dense, bit(kSlotDp)};
    case GroupKind::DpCp:
      return {Source::Dense, bit(kSlotDp) | bit(kSlotCp)};
    case GroupKind::TpCp:
      return {Source::Dense, bit(kSlotTp) | bit(kSlotCp)};
    case GroupKind::ModelParallel:
      return {Source::Dense, bit(kSlotTp) | bit(kSlotPp)};
    case GroupKind::TpDpCp:
      return {Source::Dense, bit(kSlotTp) | bit(kSlotDp) | bit(kSlotCp)};
    case GroupKind::Ep:
      return {Source::Expert, bit(kSlotEp)};
    case GroupKind::ExpertTp:
      return {Source::Expert, bit(kSlotEtp)};
    case GroupKind::ExpertDp:
      return {Source::Expert, bit(kSlotEdp)};
    case GroupKind::ExpertModelParallel:
      return {Source::Expert, bit(kSlotEtp) | bit(kSlotEp) | bit(kSlotPp)};
    case GroupKind::Embedding:
    case GroupKind::ExpertDpIntraInstance:
    case GroupKind::ExpertDpInterInstance:
      return {Source::Derived, 0};
  }
  return {Source::Derived, 0};
}

// The grid's slots, fastest first.
std::array<int, 4> slotsInOrder(const Grid& grid) {
  std::array<int, 4> slots{};
  for (int slot = 0; slot < 4; ++slot) slots[grid.position[slot]] = slot;
  return slots;
}

int groupSize(const Grid& grid, unsigned mask) {
  int size = 1;
  for (int slot = 0; slot < 4; ++slot)
    if (mask & bit(slot)) size *= grid.size[slot];
  return size;
}

// The mixed-radix number the coordinates on `slots` spell, fastest first.
int indexOver(const Grid& grid, const std::array<int, 4>& coords, unsigned slots) {
  int index = 0, scale = 1;
  for (int slot : slotsInOrder(grid)) {
    if (!(slots & bit(slot))) continue;
    index += coords[slot] * scale;
    scale *= grid.size[slot];
  }
  return index;
}

// The inverse: coordinates on `slots` from their number; other slots stay 0.
std::array<int, 4> coordsFrom(const Grid& grid, int index, unsigned slots) {
  std::array<int, 4> coords{};
  for (int slot : slotsInOrder(grid)) {
    if (!(slots & bit(slot))) continue;
    coords[slot] = index % grid.size[slot];
    index /= grid.size[slot];
  }
  return coords;
}

// The group of `mask` through the point `coords`: the unmasked coordinates
// fixed, the masked ones counted through, in rank order.
std::vector<int> membersThrough(const Grid& grid, unsigned mask, const std::array<int, 4>& coords) {
  int base = 0;
  for (int slot = 0; slot < 4; ++slot)
    if (!(mask & bit(slot))) base += coords[slot] * grid.stride[slot];
  // The masked slots, fastest first: member j spells j in their mixed radix.
  int count = 0;
  std::array<int, 4> sizes{}, strides{};
  for (int slot : slotsInOrder(grid))
    if (mask & bit(slot)) sizes[count] = grid.size[slot], strides[count++] = grid.stride[slot];
  int size = groupSize(grid, mask);
  std::vector<int> members;
  members.reserve(size);
  for (int j = 0; j < size; ++j) {
    int rank = base, rest = j;
    for (int i = 0; i < count; ++i) {
      rank += (rest % sizes[i]) * strides[i];
      rest /= sizes[i];
    }
    members.push_back(rank);
  }
  return members;
}

std::vector<std::vector<int>> allGroups(const Grid& grid, unsigned mask, int worldSize) {
  int count = worldSize / groupSize(grid, mask);
  std::vector<std::vector<int>> groups;
  groups.reserve(count);
  for (int index = 0; index < count; ++index)
    groups.push_back(membersThrough(grid, mask, coordsFrom(grid, index, kAllSlots & ~mask)));
  return groups;
}

// Embedding: the first and last stage of a pp group (the one rank when pp == 1).
std::vector<int> embeddingOf(const std::vector<int>& ppGroup) {
  if (ppGroup.size() == 1) return ppGroup;
  return {ppGroup.front(), ppGroup.back()};
}

// Expert-dp instances: chunk `k` (contiguous) and position `p` (strided) of
// an expert-dp group cut into `instances` chunks of `chunk` ranks.
std::vector<int> intraChunk(const std::vector<int>& edpGroup, int chunk, int k) {
  return {edpGroup.begin() + k * chunk, edpGroup.begin() + (k + 1) * chunk};
}
std::vector<int> interPosition(const std::vector<int>& edpGroup, int chunk, int instances, int p) {
  std::vector<int> members;
  for (int k = 0; k < instances; ++k) members.push_back(edpGroup[k * chunk + p]);
  return members;
}

}  // namespace

std::vector<std::vector<int>> Layout::groups(GroupKind kind) const {
  KindSpec spec = specOf(kind);
  if (spec.source == Source::Dense) return allGroups(dense_, spec.mask, worldSize_);
  if (spec.source == Source::Expert) return allGroups(expert_, spec.mask, worldSize_);
  std::vector<std::vector<int>> result;
  int instances = options_.optimizerInstances;
  int chunk = edp_ / instances;
  switch (kind) {
    case GroupKind::Embedding:
      for (const auto& ppGroup : groups(GroupKind::Pp)) result.push_back(embeddingOf(ppGroup));
      break;
    case GroupKind::ExpertDpIntraInstance:
      for (const auto& edpGroup : groups(GroupKind::ExpertDp))
        for (int k = 0; k < instances; ++k) result.push_back(intraChunk(edpGroup, chunk, k));
      break;
    case GroupKind::ExpertDpInterInstance:
      for (const auto& edpGroup : groups(GroupKind::ExpertDp))
        for (int p = 0; p < chunk; ++p) result.push_back(interPosition(edpGroup, chunk, instances, p));
      break;
    default:
      break;
  }
  return result;
}

int Layout::groupIndex(GroupKind kind, int rank) const {
  checkRank(rank);
  KindSpec spec = specOf(kind);
  if (spec.source == Source::Dense) return indexOver(dense_, gridCoordinates(dense_, rank), kAllSlots & ~spec.mask);
  if (spec.source == Source::Expert) return indexOver(expert_, gridCoordinates(expert_, rank), kAllSlots & ~spec.mask);
  Coordinates c = coordinates(rank);
  int chunk = edp_ / options_.optimizerInstances;
  switch (kind) {
    case GroupKind::Embedding:
      // One embedding group per pp group, in pp-group order; middle stages are in none.
      if (c.pp != 0 && c.pp != pp() - 1) return -1;
      return groupIndex(GroupKind::Pp, rank);
    case GroupKind::ExpertDpIntraInstance:
      return groupIndex(GroupKind::ExpertDp, rank) * options_.optimizerInstances + c.edp / chunk;
    case GroupKind::ExpertDpInterInstance:
      return groupIndex(GroupKind::ExpertDp, rank) * chunk + c.edp % chunk;
    default:
      return -1;
  }
}

std::vector<int> Layout::groupOf(GroupKind kind, int rank) const {
  checkRank(rank);
  KindSpec spec = specOf(kind);
  if (spec.source == Source::Dense) return membersThrough(dense_, spec.mask, gridCoordinates(dense_, rank));
  if (spec.source == Source::Expert) return membersThrough(expert_, spec.mask, gridCoordinates(expert_, rank));
  Coordinates c = coordinates(rank);
  int chunk = edp_ / options_.optimizerInstances;
  switch (kind) {
    case GroupKind::Embedding:
      if (c.pp != 0 && c.pp != pp() - 1) return {};
      return embeddingOf(groupOf(GroupKind::Pp, rank));
    case GroupKind::ExpertDpIntraInstance:
      return intraChunk(groupOf(GroupKind::ExpertDp, rank), chunk, c.edp / chunk);
    case GroupKind::ExpertDpInterInstance:
      return interPosition(groupOf(GroupKind::ExpertDp, rank), chunk, options_.optimizerInstances, c.edp % chunk);
    default:
      return {};
  }
}

}  // namespace bulkhead::parallel
