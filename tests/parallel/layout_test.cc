// Layout: worked examples derived by hand, the errors a bad layout raises, and
// the mesh description. The property sweep is in layout_property_test.cc.
#include "parallel/layout.h"

#include <algorithm>
#include <string>
#include <vector>

#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/text.h"

using namespace bulkhead;
using namespace bulkhead::parallel;
using Ranks = std::vector<int>;

namespace {
using bulkhead::testing::contains;

std::string errorOf(int world, const LayoutOptions& options) {
  try {
    Layout::create(world, options);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("layout example: world 16, tp 2, pp 2, ep 4 (the design's example)") {
  // Dense grid tp-cp-dp-pp, sizes 2,1,4,2 (dp = 16/(2*1*2)), strides 1,2,2,8.
  // Expert grid etp-ep-edp-pp, sizes 1,4,2,2 (edp = 16/(1*4*2)), strides 1,1,4,8.
  Layout layout = Layout::create(16, {.tp = 2, .pp = 2, .ep = 4});
  CHECK(layout.dp() == 4);
  CHECK(layout.edp() == 2);
  CHECK(layout.groupOf(GroupKind::Tp, 0) == Ranks{0, 1});
  CHECK(layout.groupOf(GroupKind::Dp, 0) == Ranks{0, 2, 4, 6});
  CHECK(layout.groupOf(GroupKind::Pp, 0) == Ranks{0, 8});
  CHECK(layout.groupOf(GroupKind::Ep, 0) == Ranks{0, 1, 2, 3});
  CHECK(layout.groupOf(GroupKind::ExpertDp, 0) == Ranks{0, 4});
  CHECK(layout.groupOf(GroupKind::ExpertModelParallel, 0) == Ranks{0, 1, 2, 3, 8, 9, 10, 11});
  // Rank 13 = 1 + 2*(dp 2) + 8*(pp 1) densely; = 1*(ep 1) + 4*(edp 1) + 8*(pp 1) on the expert grid.
  CHECK(layout.coordinates(13) == Coordinates{.tp = 1, .cp = 0, .dp = 2, .pp = 1, .etp = 0, .ep = 1, .edp = 1});
  // Dp groups are numbered by (tp, cp, pp) fastest first: rank 13 has tp 1, pp 1 -> 1 + 2*1 = 3.
  CHECK(layout.groupIndex(GroupKind::Dp, 13) == 3);
  CHECK(layout.groups(GroupKind::Dp)[3] == Ranks{9, 11, 13, 15});
  // pp 2: both stages are first or last, so embedding groups equal pp groups.
  CHECK(layout.groups(GroupKind::Embedding) == layout.groups(GroupKind::Pp));
}

TEST_CASE("layout example: non-default order tp-dp-cp-ep-pp with cp 2") {
  // World 16, tp 2, cp 2, pp 2, ep 2. Dense grid tp-dp-cp-pp: sizes 2, 2
  // (dp = 16/(2*2*2)), 2, 2; strides tp 1, dp 2, cp 4, pp 8.
  // Rank 5 = 1 + 4*1: tp 1, dp 0, cp 1, pp 0.
  // Expert grid etp-edp-ep-pp: sizes 1, 4 (edp = 16/(1*2*2)), 2, 2; strides
  // etp 1, edp 1, ep 4, pp 8. Rank 5: edp 1, ep 1, pp 0.
  Layout layout = Layout::create(16, {.tp = 2, .cp = 2, .pp = 2, .ep = 2, .order = "tp-dp-cp-ep-pp"});
  CHECK(layout.coordinates(5) == Coordinates{.tp = 1, .cp = 1, .dp = 0, .pp = 0, .etp = 0, .ep = 1, .edp = 1});
  CHECK(layout.groupOf(GroupKind::Tp, 5) == Ranks{4, 5});                     // vary tp: 4 + {0,1}
  CHECK(layout.groupOf(GroupKind::Dp, 5) == Ranks{5, 7});                     // vary dp: 5 + {0,2}
  CHECK(layout.groupOf(GroupKind::Cp, 5) == Ranks{1, 5});                     // vary cp: 1 + {0,4}
  CHECK(layout.groupOf(GroupKind::DpCp, 5) == Ranks{1, 3, 5, 7});             // tp 1, pp 0 fixed
  CHECK(layout.groupOf(GroupKind::TpCp, 5) == Ranks{0, 1, 4, 5});             // dp 0, pp 0 fixed
  CHECK(layout.groupOf(GroupKind::ModelParallel, 5) == Ranks{4, 5, 12, 13});  // cp 1, dp 0 fixed
  CHECK(layout.groupOf(GroupKind::TpDpCp, 5) == Ranks{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(layout.groupOf(GroupKind::Pp, 5) == Ranks{5, 13});
  CHECK(layout.groupOf(GroupKind::Ep, 5) == Ranks{1, 5});                          // edp 1 fixed, vary ep: {0,4}
  CHECK(layout.groupOf(GroupKind::ExpertDp, 5) == Ranks{4, 5, 6, 7});              // ep 1 fixed, vary edp
  CHECK(layout.groupOf(GroupKind::ExpertModelParallel, 5) == Ranks{1, 5, 9, 13});  // edp 1 fixed
  CHECK(layout.groupOf(GroupKind::ExpertTp, 5) == Ranks{5});
  // Dp groups numbered by (tp, cp, pp), fastest first: [0,2] [1,3] [4,6] [5,7] ...; rank 5 is tp 1, cp 1 -> 3.
  CHECK(layout.groupIndex(GroupKind::Dp, 5) == 3);
  CHECK(layout.groups(GroupKind::Dp)[2] == Ranks{4, 6});
}

TEST_CASE("layout example: etp 2 and two optimizer instances") {
  // World 32, tp 4, pp 2, ep 2, etp 2, default order. Dense tp-cp-dp-pp:
  // sizes 4, 1, 4, 2; strides 1, 4, 4, 16. Expert etp-ep-edp-pp: sizes 2, 2,
  // 4 (edp = 32/(2*2*2)), 2; strides 1, 2, 4, 16.
  // Rank 13 = 1 + 4*3 densely (tp 1, dp 3) and = 1*(etp 1) + 4*(edp 3) on the expert grid.
  Layout layout = Layout::create(32, {.tp = 4, .pp = 2, .ep = 2, .etp = 2, .optimizerInstances = 2});
  CHECK(layout.groupOf(GroupKind::Tp, 0) == Ranks{0, 1, 2, 3});
  CHECK(layout.groupOf(GroupKind::Dp, 0) == Ranks{0, 4, 8, 12});
  CHECK(layout.groupOf(GroupKind::Pp, 0) == Ranks{0, 16});
  CHECK(layout.groupOf(GroupKind::ExpertTp, 0) == Ranks{0, 1});
  CHECK(layout.groupOf(GroupKind::Ep, 0) == Ranks{0, 2});
  CHECK(layout.groupOf(GroupKind::ExpertDp, 0) == Ranks{0, 4, 8, 12});
  CHECK(layout.groupOf(GroupKind::ExpertModelParallel, 0) == Ranks{0, 1, 2, 3, 16, 17, 18, 19});
  CHECK(layout.coordinates(13) == Coordinates{.tp = 1, .cp = 0, .dp = 3, .pp = 0, .etp = 1, .ep = 0, .edp = 3});
  // Expert-dp groups, numbered by (etp, ep, pp): [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15] ...
  // Two instances cut each into chunks of 2: intra [0,4] [8,12] [1,5] [9,13] ...;
  // inter takes position p of both chunks: [0,8] [4,12] [1,9] [5,13] ...
  CHECK(layout.groupOf(GroupKind::ExpertDpIntraInstance, 0) == Ranks{0, 4});
  CHECK(layout.groupOf(GroupKind::ExpertDpInterInstance, 0) == Ranks{0, 8});
  CHECK(layout.groupOf(GroupKind::ExpertDp, 13) == Ranks{1, 5, 9, 13});
  CHECK(layout.groupOf(GroupKind::ExpertDpIntraInstance, 13) == Ranks{9, 13});
  CHECK(layout.groupIndex(GroupKind::ExpertDpIntraInstance, 13) == 3);  // edp group 1, chunk 1: 1*2 + 1
  CHECK(layout.groupOf(GroupKind::ExpertDpInterInstance, 13) == Ranks{5, 13});
  CHECK(layout.groupIndex(GroupKind::ExpertDpInterInstance, 13) == 3);  // edp group 1, position 1: 1*2 + 1
  CHECK(layout.groups(GroupKind::ExpertDpIntraInstance).size() == 16);
  CHECK(layout.groups(GroupKind::ExpertDpInterInstance).size() == 16);
}

TEST_CASE("layout example: pp 3 leaves the middle stage out of the embedding groups") {
  // World 12, tp 2, pp 3, ep 2. Dense tp-cp-dp-pp: sizes 2, 1, 2, 3; strides
  // 1, 2, 2, 4. pp groups: [0,4,8] [1,5,9] [2,6,10] [3,7,11]; embedding keeps
  // the first and last stage of each. Expert etp-ep-edp-pp: sizes 1, 2, 2, 3;
  // strides 1, 1, 2, 4, so the same pp groups. Rank 5: ep 1, edp 0, pp 1.
  Layout layout = Layout::create(12, {.tp = 2, .pp = 3, .ep = 2});
  CHECK(layout.groups(GroupKind::Pp) == std::vector<Ranks>{{0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {3, 7, 11}});
  CHECK(layout.groups(GroupKind::Embedding) == std::vector<Ranks>{{0, 8}, {1, 9}, {2, 10}, {3, 11}});
  CHECK(layout.groupOf(GroupKind::Embedding, 9) == Ranks{1, 9});
  CHECK(layout.groupIndex(GroupKind::Embedding, 9) == 1);
  CHECK(layout.groupOf(GroupKind::Embedding, 5).empty());
  CHECK(layout.groupIndex(GroupKind::Embedding, 5) == -1);
  CHECK(layout.groupOf(GroupKind::Ep, 5) == Ranks{4, 5});
  CHECK(layout.groupOf(GroupKind::ExpertDp, 5) == Ranks{5, 7});
}

TEST_CASE("layout example: pp before dp in the order works when both grids give pp the same stride") {
  // World 8, tp 2, pp 2, ep 2, etp 2, order tp-pp-cp-ep-dp. Dense tp-pp-cp-dp:
  // sizes 2, 2, 1, 2; strides 1, 2, 4, 4. Expert etp-pp-ep-edp: sizes 2, 2, 2,
  // 1; strides 1, 2, 4, 8. pp has stride 2 on both, so the pp groups agree.
  // Rank 5 = 1 + 4*1: tp 1, pp 0, dp 1; etp 1, ep 1.
  Layout layout = Layout::create(8, {.tp = 2, .pp = 2, .ep = 2, .etp = 2, .order = "tp-pp-cp-ep-dp"});
  CHECK(layout.groupOf(GroupKind::Pp, 5) == Ranks{5, 7});
  CHECK(layout.groupOf(GroupKind::Dp, 5) == Ranks{1, 5});
  CHECK(layout.groupOf(GroupKind::Ep, 5) == Ranks{1, 5});
  CHECK(layout.groupOf(GroupKind::ExpertDp, 5) == Ranks{5});
  CHECK(layout.groupOf(GroupKind::ExpertModelParallel, 5) == Ranks{0, 1, 2, 3, 4, 5, 6, 7});
  // With etp 1 the expert grid puts pp at stride 1 and the dense grid at 2: refused.
  std::string message = errorOf(8, {.tp = 2, .pp = 2, .ep = 2, .etp = 1, .order = "tp-pp-cp-ep-dp"});
  CHECK(contains(message, "different pp groups"));
  CHECK(contains(message, "tp 2 = 2 ranks on the dense grid but etp 1 = 1 rank on the expert grid"));
  CHECK(contains(message, "put pp last"));
}

TEST_CASE("a layout whose dense sizes do not divide the world is refused, naming them") {
  std::string message = errorOf(16, {.tp = 3, .pp = 2});
  CHECK(contains(message, "ConfigError"));
  CHECK(contains(message, "tp 3 x cp 1 x pp 2 = 6 does not divide the world of 16 ranks"));
  // Sizes too large to multiply in an int still give a readable message.
  message = errorOf(16, {.tp = 1 << 30, .cp = 1 << 30});
  CHECK(contains(message, "tp 1073741824 x cp 1073741824 x pp 1 > 16 does not divide the world of 16 ranks"));
}

TEST_CASE("an expert grid the world cannot satisfy is refused, naming etp, ep and pp") {
  std::string message = errorOf(16, {.pp = 2, .ep = 3});
  CHECK(contains(message, "etp 1 x ep 3 x pp 2 = 6 does not divide the world of 16 ranks"));
  CHECK(contains(message, "expert dp"));
  message = errorOf(16, {.tp = 2, .pp = 2, .ep = 4, .etp = 4});
  CHECK(contains(message, "etp 4 x ep 4 x pp 2 = 32 does not divide the world of 16 ranks"));
}

TEST_CASE("sizes below 1 are refused, all of them named") {
  std::string message = errorOf(8, {.tp = 0, .ep = -1});
  CHECK(contains(message, "tp 0, ep -1"));
  CHECK(contains(errorOf(8, {.optimizerInstances = 0}), "optimizerInstances 0"));
  CHECK(contains(errorOf(0, {}), "a world of 0 ranks"));
}

TEST_CASE("a malformed order string is refused, saying what is wrong with it") {
  CHECK(contains(errorOf(8, {.order = "tp-cp-dp-pp"}), "order 'tp-cp-dp-pp' does not name ep"));
  CHECK(contains(errorOf(8, {.order = "tp-cp-ep-dp-pp-tp"}), "names tp twice"));
  CHECK(contains(errorOf(8, {.order = "tp-cp-xp-dp-pp"}), "unknown axis 'xp'"));
  CHECK(contains(errorOf(8, {.order = "TP-cp-ep-dp-pp"}), "unknown axis 'TP'"));
  CHECK(contains(errorOf(8, {.order = "tp-cp-ep-dp-pp-"}), "unknown axis ''"));
  CHECK(contains(errorOf(8, {.order = ""}), "unknown axis ''"));
  CHECK(contains(errorOf(8, {.order = "tp,cp,ep,dp,pp"}), "joined by '-'"));
}

TEST_CASE("optimizer instances must divide expert dp") {
  // World 16, ep 2, pp 2: edp = 16/(1*2*2) = 4; 3 instances cannot share it.
  std::string message = errorOf(16, {.pp = 2, .ep = 2, .optimizerInstances = 3});
  CHECK(contains(message, "optimizerInstances 3 does not divide expert dp 4 (world 16 / (etp 1 x ep 2 x pp 2))"));
  CHECK(errorOf(16, {.pp = 2, .ep = 2, .optimizerInstances = 4}) == "no error");
}

TEST_CASE("a rank outside the world is refused") {
  Layout layout = Layout::create(8, {.tp = 2});
  CHECK_THROWS_AS(layout.coordinates(8), ConfigError);
  CHECK_THROWS_AS(layout.groupOf(GroupKind::Tp, -1), ConfigError);
  CHECK_THROWS_AS(layout.groupIndex(GroupKind::Embedding, 8), ConfigError);
}

TEST_CASE("every group kind has its name and one creation order") {
  const std::vector<std::string> names = {
      "tp",        "cp",        "pp",       "dp",        "dp-cp",           "tp-cp",          "mp", "tp-dp-cp", "ep",
      "expert-tp", "expert-dp", "tp-ep-pp", "embedding", "expert-dp-intra", "expert-dp-inter"};
  REQUIRE(allGroupKinds().size() == names.size());
  for (size_t i = 0; i < names.size(); ++i) CHECK(toString(allGroupKinds()[i]) == names[i]);
}

TEST_CASE("describe shows the sizes, both grid orders and, for small worlds, each rank") {
  Layout layout = Layout::create(16, {.tp = 2, .pp = 2, .ep = 4});
  std::string text = layout.describe();
  CHECK(contains(text, "layout of 16 ranks, order tp-cp-ep-dp-pp"));
  CHECK(contains(text, "tp-cp-dp-pp:"));
  CHECK(contains(text, "tp 2 x cp 1 x dp 4 x pp 2"));
  CHECK(contains(text, "etp-ep-edp-pp:"));
  CHECK(contains(text, "etp 1 x ep 4 x edp 2 x pp 2"));
  //        rank  tp cp dp pp | etp ep edp  (rank 13: tp 1, dp 2, pp 1 | ep 1, edp 1)
  CHECK(contains(text, "    13    1  0  2  1 |   0  1   1\n"));
  CHECK(std::count(text.begin(), text.end(), '\n') == 4 + 16);

  std::string large = Layout::create(128, {.tp = 8}).describe();
  CHECK(contains(large, "tp 8 x cp 1 x dp 16 x pp 1"));
  CHECK(std::count(large.begin(), large.end(), '\n') == 4);
}
