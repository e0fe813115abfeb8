// Layout: validation of the options, the two grids, coordinates and the
// mesh description. The groups of each kind are in layout_groups.cc.
#include "parallel/layout.h"

#include <fmt/format.h>

#include <array>
#include <string_view>

#include "parallel/layout_grid.h"
#include "runtime/errors.h"

namespace bulkhead::parallel {
namespace {

constexpr std::string_view kAxisNames[] = {"tp", "cp", "ep", "dp", "pp"};
// The names of each grid's slots, for messages and describe().
constexpr const char* kDenseNames[4] = {"tp", "cp", "dp", "pp"};
constexpr const char* kExpertNames[4] = {"etp", "ep", "edp", "pp"};
constexpr const char* kOrderHelp =
    "name each of tp, cp, ep, dp, pp exactly once, joined by '-', leftmost fastest (the default is tp-cp-ep-dp-pp)";

// The order string as five axis names, fastest first. ConfigError when it is
// not a permutation of tp, cp, ep, dp, pp.
std::array<std::string_view, 5> parseOrder(const std::string& order) {
  std::array<std::string_view, 5> tokens{};
  std::array<int, 5> seen{};
  std::string_view rest(order);
  int count = 0;
  while (true) {
    size_t dash = rest.find('-');
    std::string_view token = rest.substr(0, dash);
    int axis = -1;
    for (int i = 0; i < 5; ++i)
      if (token == kAxisNames[i]) axis = i;
    if (axis < 0) throw ConfigError(fmt::format("order '{}' names an unknown axis '{}'; {}", order, token, kOrderHelp));
    if (seen[axis]++) throw ConfigError(fmt::format("order '{}' names {} twice; {}", order, token, kOrderHelp));
    tokens[count++] = kAxisNames[axis];
    if (dash == std::string_view::npos) break;
    rest = rest.substr(dash + 1);
  }
  for (int i = 0; i < 5; ++i)
    if (!seen[i]) throw ConfigError(fmt::format("order '{}' does not name {}; {}", order, kAxisNames[i], kOrderHelp));
  return tokens;
}

// A grid from the order tokens: `slotOf` maps an order token to its slot in
// this grid, or -1 for the token the grid drops (ep on the dense grid, cp on
// the expert grid).
template <typename SlotOf>
detail::Grid makeGrid(const std::array<std::string_view, 5>& tokens, const std::array<int, 4>& sizes, SlotOf slotOf) {
  detail::Grid grid{};
  int stride = 1;
  int position = 0;
  for (std::string_view token : tokens) {
    int slot = slotOf(token);
    if (slot < 0) continue;
    grid.size[slot] = sizes[slot];
    grid.stride[slot] = stride;
    grid.position[slot] = position++;
    stride *= sizes[slot];
  }
  return grid;
}

// "tp 3 x cp 1 x pp 2 = 6". A factor is multiplied in only while the product
// has not passed the world (so it cannot overflow); when one was left out the
// text reads "> world" and `exceeds` is set.
struct Product {
  long long value = 1;
  bool exceeds = false;
  std::string text;
};
Product product(std::initializer_list<std::pair<const char*, int>> factors, int world) {
  Product result;
  for (auto [name, size] : factors) {
    result.text += fmt::format("{}{} {}", result.text.empty() ? "" : " x ", name, size);
    if (result.value > world)
      result.exceeds = true;
    else
      result.value *= size;
  }
  result.text += result.exceeds ? fmt::format(" > {}", world) : fmt::format(" = {}", result.value);
  return result;
}

// The slots before pp in a grid, as "tp 2 x cp 2 = 4" (or "nothing" when pp is
// fastest): the stride of pp, which fixes the pp groups.
std::string beforePp(const detail::Grid& grid, const char* const names[4]) {
  std::string text;
  for (int position = 0; position < grid.position[kSlotPp]; ++position)
    for (int slot = 0; slot < 3; ++slot)
      if (grid.position[slot] == position)
        text += fmt::format("{}{} {}", text.empty() ? "" : " x ", names[slot], grid.size[slot]);
  if (text.empty()) return "nothing (pp is fastest)";
  int stride = grid.stride[kSlotPp];
  return fmt::format("{} = {} rank{}", text, stride, stride == 1 ? "" : "s");
}

}  // namespace

const char* toString(GroupKind kind) {
  switch (kind) {
    case GroupKind::Tp:
      return "tp";
    case GroupKind::Cp:
      return "cp";
    case GroupKind::Pp:
      return "pp";
    case GroupKind::Dp:
      return "dp";
    case GroupKind::DpCp:
      return "dp-cp";
    case GroupKind::TpCp:
      return "tp-cp";
    case GroupKind::ModelParallel:
      return "mp";
    case GroupKind::TpDpCp:
      return "tp-dp-cp";
    case GroupKind::Ep:
      return "ep";
    case GroupKind::ExpertTp:
      return "expert-tp";
    case GroupKind::ExpertDp:
      return "expert-dp";
    case GroupKind::ExpertModelParallel:
      return "tp-ep-pp";
    case GroupKind::Embedding:
      return "embedding";
    case GroupKind::ExpertDpIntraInstance:
      return "expert-dp-intra";
    case GroupKind::ExpertDpInterInstance:
      return "expert-dp-inter";
  }
  return "unknown";
}

const std::vector<GroupKind>& allGroupKinds() {
  // Declaration order: dense kinds, expert kinds, then the derived ones. Every
  // rank creates its communicators in this order, so the splits match.
  static const std::vector<GroupKind> kinds = {GroupKind::Tp,
                                               GroupKind::Cp,
                                               GroupKind::Pp,
                                               GroupKind::Dp,
                                               GroupKind::DpCp,
                                               GroupKind::TpCp,
                                               GroupKind::ModelParallel,
                                               GroupKind::TpDpCp,
                                               GroupKind::Ep,
                                               GroupKind::ExpertTp,
                                               GroupKind::ExpertDp,
                                               GroupKind::ExpertModelParallel,
                                               GroupKind::Embedding,
                                               GroupKind::ExpertDpIntraInstance,
                                               GroupKind::ExpertDpInterInstance};
  return kinds;
}

Layout Layout::create(int worldSize, const LayoutOptions& options) {
  if (worldSize < 1)
    throw ConfigError(fmt::format("a world of {} ranks cannot hold a layout; it needs at least 1 rank", worldSize));
  std::string small;
  for (auto [name, size] : {std::pair{"tp", options.tp},
                            {"cp", options.cp},
                            {"pp", options.pp},
                            {"ep", options.ep},
                            {"etp", options.etp},
                            {"optimizerInstances", options.optimizerInstances}})
    if (size < 1) small += fmt::format("{}{} {}", small.empty() ? "" : ", ", name, size);
  if (!small.empty())
    throw ConfigError(
        fmt::format("parallel sizes must be at least 1, got {}; use 1 for an axis that is not split", small));

  auto tokens = parseOrder(options.order);

  Product dense = product({{"tp", options.tp}, {"cp", options.cp}, {"pp", options.pp}}, worldSize);
  if (dense.exceeds || worldSize % dense.value != 0)
    throw ConfigError(
        fmt::format("{} does not divide the world of {} ranks: dp is derived as world / (tp x cp x pp); "
                    "choose tp, cp and pp whose product divides {}",
                    dense.text, worldSize, worldSize));
  Product expert = product({{"etp", options.etp}, {"ep", options.ep}, {"pp", options.pp}}, worldSize);
  if (expert.exceeds || worldSize % expert.value != 0)
    throw ConfigError(
        fmt::format("{} does not divide the world of {} ranks: the expert grid derives expert dp as "
                    "world / (etp x ep x pp); choose etp and ep so that etp x ep x pp divides {}",
                    expert.text, worldSize, worldSize));
  int dp = worldSize / static_cast<int>(dense.value);
  int edp = worldSize / static_cast<int>(expert.value);

  detail::Grid denseGrid = makeGrid(tokens, {options.tp, options.cp, dp, options.pp}, [](std::string_view token) {
    return token == "tp" ? kSlotTp : token == "cp" ? kSlotCp : token == "dp" ? kSlotDp : token == "pp" ? kSlotPp : -1;
  });
  detail::Grid expertGrid = makeGrid(tokens, {options.etp, options.ep, edp, options.pp}, [](std::string_view token) {
    return token == "tp" ? kSlotEtp : token == "ep" ? kSlotEp : token == "dp" ? kSlotEdp : token == "pp" ? kSlotPp : -1;
  });
  // The grids share the pp axis: a rank's pp group must be the same list on
  // both. pp groups are {r + k * stride(pp)}, so they agree exactly when pp
  // has the same stride on both grids; with pp last both strides are world/pp.
  if (options.pp > 1 && denseGrid.stride[kSlotPp] != expertGrid.stride[kSlotPp]) {
    throw ConfigError(fmt::format(
        "order '{}' gives the dense and expert grids different pp groups: before pp come {} on the dense grid "
        "but {} on the expert grid; put pp last in the order (e.g. tp-cp-ep-dp-pp), or choose sizes that make "
        "these two products equal",
        options.order, beforePp(denseGrid, kDenseNames), beforePp(expertGrid, kExpertNames)));
  }
  if (edp % options.optimizerInstances != 0)
    throw ConfigError(
        fmt::format("optimizerInstances {} does not divide expert dp {} (world {} / ({})): each "
                    "instance takes an equal contiguous share of every expert-dp group; "
                    "use a divisor of {}",
                    options.optimizerInstances, edp, worldSize, expert.text.substr(0, expert.text.find(" =")), edp));
  return Layout(worldSize, options, dp, edp, denseGrid, expertGrid);
}

void Layout::checkRank(int rank) const {
  if (rank < 0 || rank >= worldSize_)
    throw ConfigError(
        fmt::format("rank {} is outside the world of {} ranks (valid: 0 to {})", rank, worldSize_, worldSize_ - 1));
}

Coordinates Layout::coordinates(int rank) const {
  checkRank(rank);
  auto d = gridCoordinates(dense_, rank);
  auto e = gridCoordinates(expert_, rank);
  return {.tp = d[kSlotTp],
          .cp = d[kSlotCp],
          .dp = d[kSlotDp],
          .pp = d[kSlotPp],
          .etp = e[kSlotEtp],
          .ep = e[kSlotEp],
          .edp = e[kSlotEdp]};
}

std::string Layout::describe() const {
  // The grids' orders, fastest first, e.g. "tp-cp-dp-pp" and "etp-ep-edp-pp".
  auto orderOf = [](const detail::Grid& grid, const char* const names[4]) {
    std::string text;
    for (int position = 0; position < 4; ++position)
      for (int slot = 0; slot < 4; ++slot)
        if (grid.position[slot] == position) text += fmt::format("{}{}", text.empty() ? "" : "-", names[slot]);
    return text;
  };
  std::string text = fmt::format("layout of {} ranks, order {} (leftmost fastest)\n", worldSize_, options_.order);
  text += fmt::format("  dense  {:<14} tp {} x cp {} x dp {} x pp {}\n", orderOf(dense_, kDenseNames) + ":", tp(), cp(),
                      dp(), pp());
  text += fmt::format("  expert {:<14} etp {} x ep {} x edp {} x pp {}, optimizer instances {}\n",
                      orderOf(expert_, kExpertNames) + ":", etp(), ep(), edp(), pp(), options_.optimizerInstances);
  if (worldSize_ > 64) return text + fmt::format("  (coordinates of each rank shown only for worlds up to 64 ranks)\n");
  text += "  rank   tp cp dp pp | etp ep edp\n";
  for (int rank = 0; rank < worldSize_; ++rank) {
    Coordinates c = coordinates(rank);
    text += fmt::format("  {:>4}  {:>3} {:>2} {:>2} {:>2} | {:>3} {:>2} {:>3}\n", rank, c.tp, c.cp, c.dp, c.pp, c.etp,
                        c.ep, c.edp);
  }
  return text;
}

}  // namespace bulkhead::parallel
