// Layout properties over many layouts, up to 1,024 ranks. Each accepted
// layout is checked against the contract, computed here independently of
// parallel/: groups partition the world, a group is exactly the ranks that
// agree on the coordinates its kind does not name, sizes are the products of
// the named axes, groupOf and groupIndex agree with groups(), coordinates map
// back to the rank through the order string, and the pp groups of the dense
// and expert grids are equal. Each refused layout must be one the contract
// refuses. Pure arithmetic: the whole sweep takes a few seconds.
#include <array>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/layout.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;
using namespace bulkhead::parallel;

namespace {

// Collects the first problems found, each naming the layout it came from.
struct Problems {
  std::vector<std::string> list;
  std::string layout;
  void add(const std::string& what) {
    if (list.size() < 20) list.push_back(layout + ": " + what);
  }
};

std::string describeCase(int world, const LayoutOptions& o) {
  std::ostringstream text;
  text << "world " << world << " tp " << o.tp << " cp " << o.cp << " pp " << o.pp << " ep " << o.ep << " etp " << o.etp
       << " instances " << o.optimizerInstances << " order " << o.order;
  return text.str();
}

std::vector<std::string> split(const std::string& order) {
  std::vector<std::string> tokens;
  std::stringstream in(order);
  for (std::string token; std::getline(in, token, '-');) tokens.push_back(token);
  return tokens;
}

// One axis of a grid as the contract defines it: the token in the order
// string, its size, and a rank's coordinate on it.
struct Axis {
  int size;
  int coordinate;
};
// The dense grid drops ep; the expert grid drops cp and renames tp, dp to etp, edp.
bool denseAxis(const std::string& token, const LayoutOptions& o, int dp, const Coordinates& c, Axis* axis) {
  if (token == "tp")
    *axis = {o.tp, c.tp};
  else if (token == "cp")
    *axis = {o.cp, c.cp};
  else if (token == "dp")
    *axis = {dp, c.dp};
  else if (token == "pp")
    *axis = {o.pp, c.pp};
  else
    return false;
  return true;
}
bool expertAxis(const std::string& token, const LayoutOptions& o, int edp, const Coordinates& c, Axis* axis) {
  if (token == "tp")
    *axis = {o.etp, c.etp};
  else if (token == "ep")
    *axis = {o.ep, c.ep};
  else if (token == "dp")
    *axis = {edp, c.edp};
  else if (token == "pp")
    *axis = {o.pp, c.pp};
  else
    return false;
  return true;
}

// The rank a grid's coordinates spell, leftmost fastest; -1 for a coordinate out of range.
template <typename AxisOf>
int rankFrom(const std::vector<std::string>& order, AxisOf axisOf) {
  int rank = 0, stride = 1;
  for (const std::string& token : order) {
    Axis axis;
    if (!axisOf(token, &axis)) continue;
    if (axis.coordinate < 0 || axis.coordinate >= axis.size) return -1;
    rank += axis.coordinate * stride;
    stride *= axis.size;
  }
  return rank;
}

// The product of the sizes before pp in a grid: the stride of pp.
template <typename SizeOf>
int strideOfPp(const std::vector<std::string>& order, SizeOf sizeOf) {
  int stride = 1;
  for (const std::string& token : order) {
    if (token == "pp") break;
    stride *= sizeOf(token);
  }
  return stride;
}

// Whether the contract accepts a layout (the order strings here are well formed).
bool accepted(int world, const LayoutOptions& o) {
  if (world % (o.tp * o.cp * o.pp) != 0 || world % (o.etp * o.ep * o.pp) != 0) return false;
  int dp = world / (o.tp * o.cp * o.pp), edp = world / (o.etp * o.ep * o.pp);
  if (edp % o.optimizerInstances != 0) return false;
  auto order = split(o.order);
  int dense = strideOfPp(order, [&](const std::string& t) {
    return t == "tp" ? o.tp : t == "cp" ? o.cp : t == "dp" ? dp : 1;
  });
  int expert = strideOfPp(order, [&](const std::string& t) {
    return t == "tp" ? o.etp : t == "ep" ? o.ep : t == "dp" ? edp : 1;
  });
  return o.pp == 1 || dense == expert;
}

// What the members of one group share (every coordinate its kind does not
// name), and a member's place in it. Pp groups also share every expert
// coordinate but pp: that is "the pp groups of both grids are equal".
using Key = std::array<int, 6>;
Key keyOf(GroupKind kind, const Coordinates& c, int chunk) {
  switch (kind) {
    case GroupKind::Tp:
      return {c.cp, c.dp, c.pp, -1, -1, -1};
    case GroupKind::Cp:
      return {c.tp, c.dp, c.pp, -1, -1, -1};
    case GroupKind::Pp:
      return {c.tp, c.cp, c.dp, c.etp, c.ep, c.edp};
    case GroupKind::Dp:
      return {c.tp, c.cp, c.pp, -1, -1, -1};
    case GroupKind::DpCp:
      return {c.tp, c.pp, -1, -1, -1, -1};
    case GroupKind::TpCp:
      return {c.dp, c.pp, -1, -1, -1, -1};
    case GroupKind::ModelParallel:
      return {c.cp, c.dp, -1, -1, -1, -1};
    case GroupKind::TpDpCp:
      return {c.pp, -1, -1, -1, -1, -1};
    case GroupKind::Ep:
      return {c.etp, c.edp, c.pp, -1, -1, -1};
    case GroupKind::ExpertTp:
      return {c.ep, c.edp, c.pp, -1, -1, -1};
    case GroupKind::ExpertDp:
      return {c.etp, c.ep, c.pp, -1, -1, -1};
    case GroupKind::ExpertModelParallel:
      return {c.edp, -1, -1, -1, -1, -1};
    case GroupKind::ExpertDpIntraInstance:
      return {c.etp, c.ep, c.pp, c.edp / chunk, -1, -1};
    case GroupKind::ExpertDpInterInstance:
      return {c.etp, c.ep, c.pp, c.edp % chunk, -1, -1};
    case GroupKind::Embedding:
      break;
  }
  return {};
}
// A member's position in its group, where the contract fixes it (-1 otherwise: rank order is checked instead).
int positionOf(GroupKind kind, const Coordinates& c, int chunk) {
  switch (kind) {
    case GroupKind::Tp:
      return c.tp;
    case GroupKind::Cp:
      return c.cp;
    case GroupKind::Pp:
      return c.pp;
    case GroupKind::Dp:
      return c.dp;
    case GroupKind::Ep:
      return c.ep;
    case GroupKind::ExpertTp:
      return c.etp;
    case GroupKind::ExpertDp:
      return c.edp;
    case GroupKind::ExpertDpIntraInstance:
      return c.edp % chunk;
    case GroupKind::ExpertDpInterInstance:
      return c.edp / chunk;
    default:
      return -1;
  }
}
int expectedSize(GroupKind kind, const Layout& l) {
  int instances = l.options().optimizerInstances;
  switch (kind) {
    case GroupKind::Tp:
      return l.tp();
    case GroupKind::Cp:
      return l.cp();
    case GroupKind::Pp:
      return l.pp();
    case GroupKind::Dp:
      return l.dp();
    case GroupKind::DpCp:
      return l.dp() * l.cp();
    case GroupKind::TpCp:
      return l.tp() * l.cp();
    case GroupKind::ModelParallel:
      return l.tp() * l.pp();
    case GroupKind::TpDpCp:
      return l.tp() * l.dp() * l.cp();
    case GroupKind::Ep:
      return l.ep();
    case GroupKind::ExpertTp:
      return l.etp();
    case GroupKind::ExpertDp:
      return l.edp();
    case GroupKind::ExpertModelParallel:
      return l.etp() * l.ep() * l.pp();
    case GroupKind::ExpertDpIntraInstance:
      return l.edp() / instances;
    case GroupKind::ExpertDpInterInstance:
      return instances;
    case GroupKind::Embedding:
      break;
  }
  return -1;
}

bool isGridKind(GroupKind kind) {
  return kind != GroupKind::Embedding && kind != GroupKind::ExpertDpIntraInstance &&
         kind != GroupKind::ExpertDpInterInstance;
}

void checkLayout(const Layout& layout, Problems& problems) {
  const int world = layout.worldSize();
  const LayoutOptions& o = layout.options();
  const int chunk = layout.edp() / o.optimizerInstances;
  if (layout.dp() * layout.tp() * layout.cp() * layout.pp() != world) problems.add("dp is not world / (tp cp pp)");
  if (layout.edp() * layout.etp() * layout.ep() * layout.pp() != world) problems.add("edp is not world / (etp ep pp)");

  auto order = split(o.order);
  std::vector<Coordinates> coords(world);
  for (int rank = 0; rank < world; ++rank) {
    Coordinates c = coords[rank] = layout.coordinates(rank);
    int dense = rankFrom(order, [&](const std::string& t, Axis* a) { return denseAxis(t, o, layout.dp(), c, a); });
    int expert = rankFrom(order, [&](const std::string& t, Axis* a) { return expertAxis(t, o, layout.edp(), c, a); });
    if (dense != rank) problems.add("dense coordinates of rank " + std::to_string(rank) + " map back elsewhere");
    if (expert != rank) problems.add("expert coordinates of rank " + std::to_string(rank) + " map back elsewhere");
  }

  // groupOf copies a whole group per rank; on large worlds check it on the
  // first and last member of each group and every 61st rank.
  auto checkGroupOf = [&](int rank, const std::vector<int>& group) {
    return world <= 128 || rank == group.front() || rank == group.back() || rank % 61 == 0;
  };
  for (GroupKind kind : allGroupKinds()) {
    const std::string name = toString(kind);
    auto groups = layout.groups(kind);
    if (kind == GroupKind::Embedding) {
      auto pipelines = layout.groups(GroupKind::Pp);
      if (groups.size() != pipelines.size()) problems.add("one embedding group per pp group");
      for (size_t i = 0; i < groups.size() && i < pipelines.size(); ++i) {
        std::vector<int> ends = {pipelines[i].front(), pipelines[i].back()};
        if (layout.pp() == 1) ends.pop_back();
        if (groups[i] != ends) problems.add("embedding group " + std::to_string(i) + " is not the ends of pp group");
        for (int rank : pipelines[i]) {
          bool isEnd = rank == pipelines[i].front() || rank == pipelines[i].back();
          if (layout.groupIndex(kind, rank) != (isEnd ? static_cast<int>(i) : -1) ||
              layout.groupOf(kind, rank) != (isEnd ? groups[i] : std::vector<int>{}))
            problems.add("embedding groupOf/groupIndex of rank " + std::to_string(rank));
        }
      }
      continue;
    }
    std::vector<int> owner(world, -1);
    std::set<Key> keys;
    for (size_t index = 0; index < groups.size(); ++index) {
      const auto& group = groups[index];
      if (static_cast<int>(group.size()) != expectedSize(kind, layout)) problems.add(name + " group size");
      if (group.empty()) continue;
      Key key = keyOf(kind, coords[group.front()], chunk);
      if (!keys.insert(key).second) problems.add(name + " groups " + std::to_string(index) + " repeats a key");
      if (isGridKind(kind) && index > 0 && group.front() <= groups[index - 1].front())
        problems.add(name + " groups not ordered by lowest rank");
      for (size_t position = 0; position < group.size(); ++position) {
        int rank = group[position];
        if (rank < 0 || rank >= world) {
          problems.add(name + " rank out of range");
          continue;
        }
        if (owner[rank] >= 0) problems.add(name + ": rank " + std::to_string(rank) + " is in two groups");
        owner[rank] = static_cast<int>(index);
        if (keyOf(kind, coords[rank], chunk) != key) problems.add(name + ": members disagree off the kind's axes");
        int expected = positionOf(kind, coords[rank], chunk);
        if (expected >= 0 && expected != static_cast<int>(position)) problems.add(name + " position != coordinate");
        if (position > 0 && isGridKind(kind) && rank <= group[position - 1]) problems.add(name + " not in rank order");
      }
    }
    for (int rank = 0; rank < world; ++rank) {
      if (owner[rank] < 0) {
        problems.add(name + ": rank " + std::to_string(rank) + " is in no group");
        continue;
      }
      if (layout.groupIndex(kind, rank) != owner[rank]) problems.add(name + " groupIndex of " + std::to_string(rank));
      if (checkGroupOf(rank, groups[owner[rank]]) && layout.groupOf(kind, rank) != groups[owner[rank]])
        problems.add(name + " groupOf of " + std::to_string(rank));
    }
  }
}

std::vector<int> divisorsFrom(int world, const std::vector<int>& candidates) {
  std::vector<int> result;
  for (int d : candidates)
    if (d <= world && world % d == 0) result.push_back(d);
  return result;
}
std::vector<int> allDivisors(int world) {
  std::vector<int> result;
  for (int d = 1; d <= world; ++d)
    if (world % d == 0) result.push_back(d);
  return result;
}

struct SweepResult {
  int accepted = 0;
  int refused = 0;
};

// Every (tp, cp, pp, ep, etp) from `sizes(world)` on each world and order;
// every `stride`-th combination only, to bound the time on large worlds. The
// instance count cycles through the divisors of edp.
template <typename Sizes>
SweepResult sweep(const std::vector<int>& worlds, const std::vector<std::string>& orders, Sizes sizes, int stride,
                  Problems& problems) {
  SweepResult result;
  long long counter = 0;
  for (int world : worlds) {
    auto d = sizes(world);
    for (const std::string& order : orders)
      for (int tp : d)
        for (int cp : d)
          for (int pp : d)
            for (int ep : d)
              for (int etp : d) {
                if (world % (tp * cp * pp) != 0 || world % (etp * ep * pp) != 0) continue;
                if (counter++ % stride != 0) continue;
                auto instanceChoices = allDivisors(world / (etp * ep * pp));
                int instances = instanceChoices[counter % instanceChoices.size()];
                LayoutOptions options{.tp = tp,
                                      .cp = cp,
                                      .pp = pp,
                                      .ep = ep,
                                      .etp = etp,
                                      .order = order,
                                      .optimizerInstances = instances};
                problems.layout = describeCase(world, options);
                bool expectAccepted = accepted(world, options);
                try {
                  Layout layout = Layout::create(world, options);
                  if (!expectAccepted) problems.add("accepted a layout the contract refuses");
                  ++result.accepted;
                  checkLayout(layout, problems);
                } catch (const ConfigError& e) {
                  ++result.refused;
                  if (expectAccepted) problems.add(std::string("refused: ") + e.what());
                }
              }
  }
  return result;
}

void report(const Problems& problems) {
  for (const auto& problem : problems.list) UNSCOPED_INFO(problem);
  CHECK(problems.list.empty());
}

// pp last (the default), pp first, and three orders with pp in the middle,
// where only layouts whose grids agree on pp's stride are accepted.
const std::vector<std::string> kOrders = {"tp-cp-ep-dp-pp", "pp-dp-ep-cp-tp", "tp-pp-cp-ep-dp", "ep-dp-pp-tp-cp",
                                          "cp-tp-pp-dp-ep"};

}  // namespace

TEST_CASE("layout properties hold for every layout of small worlds, in five orders") {
  Problems problems;
  SweepResult result =
      sweep({1, 2, 3, 4, 6, 8, 12, 16, 24, 30, 32, 36, 48, 60, 64}, {kOrders[0]}, allDivisors, 1, problems);
  report(problems);
  // Every combination that divides is accepted in the default order (the counts come from enumerating the same sizes).
  CHECK(result.refused == 0);
  CHECK(result.accepted == 16438);

  result = sweep({1, 2, 4, 6, 8, 12, 16, 24}, kOrders, allDivisors, 1, problems);
  report(problems);
  CHECK(result.accepted > 0);
  CHECK(result.refused > 0);
}

TEST_CASE("layout properties hold on large worlds, up to 1,024 ranks") {
  Problems problems;
  auto sizes = [](int world) { return divisorsFrom(world, {1, 2, 3, 4, 5, 8}); };
  SweepResult result = sweep({128, 256, 512, 1024, 96, 384, 768, 1000}, kOrders, sizes, 29, problems);
  report(problems);
  CHECK(result.accepted > 1000);
  CHECK(result.refused > 0);
}
