// Topology checks: which tp/ep placements draw a warning, and what it says.
#include "parallel/topology_checks.h"

#include <string>
#include <vector>

#include "tests/support/catch_compat.h"
#include "tests/support/text.h"

using namespace bulkhead::parallel;

namespace {
using bulkhead::testing::contains;
bool anyContains(const std::vector<std::string>& warnings, const std::string& part) {
  for (const auto& w : warnings)
    if (contains(w, part)) return true;
  return false;
}
// All-to-all NVLink inside a node.
bool fullNvlink(int, int) { return true; }
}  // namespace

TEST_CASE("a well-placed layout draws no warning: tp 4 and ep 8 inside 8-GPU nodes with full NVLink") {
  Layout layout = Layout::create(32, {.tp = 4, .ep = 8});
  CHECK(checkTopology(layout, {.ranksPerNode = 8, .nvlink = fullNvlink}).empty());
}

TEST_CASE("a tp size that is not a power of two is reported with advice") {
  Layout layout = Layout::create(12, {.tp = 3});
  auto warnings = checkTopology(layout, {.ranksPerNode = 12});
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "tp groups have 3 ranks, not a power of two"));
  CHECK(contains(warnings[0], "prefer a tp size of 1, 2, 4 or 8"));
}

TEST_CASE("an ep group spanning two whole nodes is reported, naming the group and its nodes") {
  // ep 16 on 8-GPU nodes: ep[0] = ranks 0..15 = nodes 0 and 1.
  Layout layout = Layout::create(32, {.ep = 16});
  auto warnings = checkTopology(layout, {.ranksPerNode = 8});
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "ep[0] (ranks 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15) spans nodes 0,1"));
  CHECK(contains(warnings[0], "(1 more group does the same)"));
  CHECK(contains(warnings[0], "keep ep within a node (8 ranks per node)"));
}

TEST_CASE("a tp group that takes part of two nodes is reported with the partial nodes") {
  // tp 4 on 6-rank nodes: tp[1] = ranks 4..7 takes 2 ranks of node 0 and 2 of node 1.
  Layout layout = Layout::create(12, {.tp = 4});
  auto warnings = checkTopology(layout, {.ranksPerNode = 6});
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "tp[1] (ranks 4,5,6,7) spans nodes 0,1 and takes only part of nodes 0,1"));
  CHECK(contains(warnings[0], "make tp a divisor of the ranks per node (6)"));
  CHECK_FALSE(anyContains(warnings, "tp[0]"));  // ranks 0..3 fit in node 0
}

TEST_CASE("a tp group strided across nodes by the order string is reported") {
  // Order dp-tp-...: tp has stride dp = 4, so tp[0] = {0, 4} on 4-rank nodes.
  Layout layout = Layout::create(8, {.tp = 2, .order = "dp-tp-cp-ep-pp"});
  REQUIRE(layout.groupOf(GroupKind::Tp, 0) == std::vector<int>{0, 4});
  auto warnings = checkTopology(layout, {.ranksPerNode = 4});
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "tp[0] (ranks 0,4) spans nodes 0,1 and takes only part of nodes 0,1"));
  CHECK(contains(warnings[0], "(3 more groups do the same)"));
}

TEST_CASE("two members of a tp group on one node without NVLink are reported; other nodes' ranks are not asked") {
  // GPUs 0-3 and 4-7 of each 8-GPU node form two NVLink islands.
  std::vector<std::pair<int, int>> asked;
  auto islands = [&asked](int a, int b) {
    asked.emplace_back(a, b);
    return (a % 8) / 4 == (b % 8) / 4;
  };
  Layout layout = Layout::create(16, {.tp = 8});
  auto warnings = checkTopology(layout, {.ranksPerNode = 8, .nvlink = islands});
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "tp[0] (ranks 0,1,2,3,4,5,6,7): ranks 0 and 4 share a node but have no NVLink path"));
  CHECK(contains(warnings[0], "nvidia-smi topo -m"));
  for (auto [a, b] : asked) CHECK(a / 8 == b / 8);

  Layout fits = Layout::create(16, {.tp = 4});
  CHECK(checkTopology(fits, {.ranksPerNode = 8, .nvlink = islands}).empty());
}

TEST_CASE("without ranks per node or an NVLink predicate only the power-of-two check runs") {
  Layout layout = Layout::create(24, {.tp = 3, .ep = 8});
  auto warnings = checkTopology(layout, {});
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "tp groups have 3 ranks"));
  CHECK(checkTopology(layout, {.ranksPerNode = 4}).size() == 3);  // + tp partial, ep spans whole nodes
}

TEST_CASE("checkGroupTopology takes any list of groups: a 6-rank ep group reports size and placement") {
  auto warnings = checkGroupTopology(GroupKind::Ep, {{0, 1, 2, 3, 4, 5}}, {.ranksPerNode = 4});
  REQUIRE(warnings.size() == 2);
  CHECK(contains(warnings[0], "ep groups have 6 ranks, not a power of two"));
  CHECK(contains(warnings[1], "ep[0] (ranks 0,1,2,3,4,5) spans nodes 0,1 and takes only part of node 1"));
}
